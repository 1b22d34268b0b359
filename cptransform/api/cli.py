"""The ``cptransform`` command: debug passes the way ``mlir-opt`` does.

Jaxprs have no text parser, so a program comes from a Python entry point ``FILE.py:NAME``
(:mod:`~cptransform.api.entry_points`): either a ``make()``-style function (no required
parameters) returning ``(fn, example_args)``, or a function whose argument shapes are given
with ``--args 'f32[2,64,4,16] i32[2,64]'``. ``FILE.py`` is imported and executed, as pytest
does with test files: keep its script part under ``if __name__ == "__main__":``.

Subcommands (one ``_cmd_*`` function and one ``_add_*`` parser builder each):

* ``cptransform passes`` lists the passes, what each requires and ensures, and options;
* ``cptransform opt FILE.py:NAME -p PIPELINE`` runs a pipeline with printing, dumping,
  timing and verification instruments; ``--cp N`` (with ``--schedule``, ``--load-balance``,
  ``--kernel``; ``--axis uly,ring --mesh U,R`` for a two-axis hybrid mesh) gives the
  program a CP mesh and, without ``-p``, runs the whole context-parallel pipeline;
  ``--grad`` also prints the differentiated program;
* ``cptransform plan FILE.py:NAME --cp N`` shows each attention's schedule and draws it
  (ring: devices × steps; all-gather: devices × key shards; Ulysses: query × key shards;
  hybrid: both levels; blocks full / partial / skipped), then the work per rank under
  every candidate layout, one chart per distinct attention (identical layers once);
  ``--verbose`` adds the notes, ``--json`` prints only the typed plan
  (:class:`~cptransform.api.plan.Plan`) as JSON; ``--png FILE`` draws the charts with
  matplotlib (extra ``plot``), checked before anything is printed.

Bad input (unknown pass, option or name, missing file, malformed shapes, an empty axis name,
a ``--print-ir-after`` pass the pipeline does not run, an unwritable dump directory) prints
one line on stderr and exits with status 2; a failed verification exits with status 1. Only
:class:`~cptransform.ir.errors.CPTransformError` and the command's own input errors are
caught: anything else is a bug and keeps its traceback.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import AxisType

from cptransform.api.entry_points import CLIError, load_program, trace_program
from cptransform.api.instruments import (DumpIR, PrintIR, TimePasses, VerificationError,
                                         VerifyEach, render)
from cptransform.ir.errors import CPTransformError, did_you_mean
from cptransform.ir.module import Module
from cptransform.ir.pipeline import Pipeline
from cptransform.passes import get_all_passes

USAGE_ERROR = 2
FAILURE = 1


# -- cptransform passes ---------------------------------------------------------------------

def _type_name(field: dataclasses.Field) -> str:
    return field.type if isinstance(field.type, str) else getattr(field.type, "__name__", "?")


def _add_passes(sub) -> None:
    p = sub.add_parser("passes", help="list the passes, their requirements and options")
    p.set_defaults(handler=_cmd_passes)


def _cmd_passes(args: argparse.Namespace) -> int:
    for name, factory in get_all_passes().items():
        cls = factory()
        print(f"{name:<24} {cls.summary}")
        for label, facts in (("requires", cls.requires), ("ensures", cls.ensures)):
            if facts:
                print(f"    {label}: {', '.join(f.name.lower() for f in facts)}")
        for field in dataclasses.fields(cls):
            default = field.default if field.default is not dataclasses.MISSING else "required"
            print(f"    {field.name}: {_type_name(field)} = {default}")
    return 0


# -- cptransform opt ------------------------------------------------------------------------

def add_entry_arguments(parser: argparse.ArgumentParser) -> None:
    """``FILE.py:NAME`` and ``--args``, shared by every subcommand that loads a program."""
    parser.add_argument("entry", metavar="FILE.py:NAME",
                        help="a make() returning (fn, example_args), or a function "
                             "with --args")
    parser.add_argument("--args", dest="arg_shapes", metavar="SHAPES", default=None,
                        help="argument shapes, e.g. 'f32[2,64,4,16] i32[2,64]'")


def _add_opt(sub) -> None:
    p = sub.add_parser("opt", help="run a pass pipeline on a program and print its IR")
    add_entry_arguments(p)
    p.add_argument("-p", "--pipeline", default=None,
                   help="passes, e.g. 'canonicalize,match-attention{strict=true}' (default: "
                        "canonicalize, or the whole CP pipeline with --cp)")
    p.add_argument("--print-ir-after-all", action="store_true")
    p.add_argument("--print-ir-before-all", action="store_true")
    p.add_argument("--print-ir-after", action="append", default=[], metavar="NAME",
                   help="print IR after pass NAME (repeatable)")
    p.add_argument("--print-ir-after-change", action="store_true",
                   help="print IR only after passes that changed it")
    p.add_argument("--ir-dump-dir", metavar="DIR", default=None,
                   help="write 00-input.txt, 01-<pass>.txt, ... into DIR")
    p.add_argument("--time-passes", action="store_true", help="print a per-pass timing table")
    p.add_argument("--no-verify", action="store_true",
                   help="skip type-checking and pass invariants after each pass")
    p.add_argument("--match-stats", action="store_true",
                   help="print the attention matcher's statistics and matches")
    p.add_argument("--grad", action="store_true",
                   help="also print the program of jax.grad (w.r.t. the first argument) of "
                        "the result: the backward schedule's collectives and kernels")
    add_cp_arguments(p)
    p.set_defaults(handler=_cmd_opt)


def add_cp_arguments(parser: argparse.ArgumentParser) -> None:
    """``--cp`` and the ``context_parallel`` options, shared by ``opt`` and ``plan``: one flag
    per option of :data:`~cptransform.api.options.OPTIONS` that has one (name, choices,
    default and help from there; a bad value is one line naming the allowed ones), and
    ``--axis`` / ``--mesh``, which spell ``axis`` and ``mesh`` as comma-separated names and
    sizes."""
    from cptransform.api.options import OPTIONS

    g = parser.add_argument_group("context parallelism")
    for spec in OPTIONS.values():
        if spec.flag:
            # argparse %-formats help texts.
            g.add_argument(spec.flag_name, type=_option_value(spec),
                           choices=spec.choices() if spec.choices else None,
                           default=spec.default, metavar=spec.metavar,
                           help=spec.help.replace("%", "%%"))
    g.add_argument("--axis", default=OPTIONS["axis"].default, metavar="NAMES",
                   help="CP mesh axis name, or two comma-separated names (ulysses,ring) for "
                        "the hybrid schedule, e.g. --axis uly,ring --mesh 2,4")
    g.add_argument("--mesh", default=None, metavar="SIZES",
                   help="comma-separated size of each --axis (default: --cp on one axis)")


def _option_value(spec) -> Callable[[str], Any]:
    """The argparse ``type`` of option ``spec``'s flag: its text parsed and checked, a bad
    value an :class:`argparse.ArgumentTypeError` carrying the option's own message (argparse
    alone would print "invalid choice" without the closest name)."""
    def value(text: str):
        try:
            parsed = spec.parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"invalid {spec.parse.__name__} value: {text!r}") from None
        try:
            spec.check(parsed)
        except (CPTransformError, NotImplementedError) as err:
            raise argparse.ArgumentTypeError(str(err)) from None
        return parsed
    return value


def cp_options(args: argparse.Namespace):
    """The :class:`~cptransform.api.options.Options` of the command line."""
    from cptransform.api.options import OPTIONS, Options

    axes = axis_names(args.axis)
    mesh = None
    if args.mesh is not None:
        sizes = mesh_sizes(args.mesh, axes)
        devices = jax.devices()
        if math.prod(sizes) > len(devices):
            raise CLIError(f"--mesh {args.mesh} needs {math.prod(sizes)} devices; "
                           f"{len(devices)} are visible")
        mesh = jax.make_mesh(sizes, axes, axis_types=(AxisType.Auto,) * len(axes),
                             devices=devices[:math.prod(sizes)])
    flags = {spec.name: getattr(args, spec.name) for spec in OPTIONS.values() if spec.flag}
    options = Options(mesh=mesh, axis=axes[0] if len(axes) == 1 else axes, **flags)
    options.check()
    return options


def axis_names(text: str) -> tuple[str, ...]:
    """``--axis uly,ring`` → ``("uly", "ring")``; a CLI error for an empty name."""
    axes = tuple(a.strip() for a in text.split(","))
    if not all(axes):
        raise CLIError(f"--axis {text!r}: an empty mesh axis name; give one name, or two "
                       "comma-separated names (ulysses,ring), e.g. --axis cp")
    return axes


def mesh_sizes(text: str, axes: Sequence[str]) -> tuple[int, ...]:
    """``--mesh 2,4`` → ``(2, 4)``, one positive size per ``--axis`` name."""
    try:
        sizes = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise CLIError(f"--mesh {text!r}: give comma-separated sizes, e.g. --mesh 2,4") \
            from None
    if len(sizes) != len(axes) or min(sizes) < 1:
        raise CLIError(f"--mesh {text!r} must give one positive size per --axis name "
                       f"{','.join(axes)}")
    return sizes


def prepare_cp(module: Module, args: argparse.Namespace):
    """``(module with the CP mesh attached, options)``; a CLI error for bad options."""
    from cptransform.api.context_parallel import prepare

    options = cp_options(args)
    return prepare(module, options), options


def _opt_instruments(args: argparse.Namespace) -> tuple[list, TimePasses | None]:
    known = get_all_passes()
    for name in args.print_ir_after:
        if name not in known:
            raise CLIError(f"--print-ir-after: unknown pass {name!r}"
                           f"{did_you_mean(name, known)}; known passes: {', '.join(known)}")
    instruments: list = []
    if (args.print_ir_after_all or args.print_ir_before_all or args.print_ir_after
            or args.print_ir_after_change):
        instruments.append(PrintIR(before_all=args.print_ir_before_all,
                                   after_all=args.print_ir_after_all,
                                   after_passes=tuple(args.print_ir_after),
                                   only_on_change=args.print_ir_after_change,
                                   stream=sys.stdout))
    if args.ir_dump_dir:
        instruments.append(DumpIR(writable_directory(args.ir_dump_dir)))
    timing = TimePasses(stream=sys.stdout) if args.time_passes else None
    if timing is not None:
        instruments.append(timing)
    if not args.no_verify:
        instruments.append(VerifyEach())
    return instruments, timing


def writable_directory(text: str) -> Path:
    """``--ir-dump-dir``: created if missing; a CLI error when it cannot be written.

    Writability is tried with a file, not ``os.access``: a read-only mount, or root on a
    directory without write bits, answers ``os.access`` with yes and fails the write."""
    path = Path(text)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise CLIError(f"--ir-dump-dir {text}: cannot create it ({err.strerror})") from None
    try:
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as err:
        raise CLIError(f"--ir-dump-dir {text}: the directory is not writable "
                       f"({err.strerror})") from None
    return path


def match_stats_text(module: Module) -> str:
    """The ``--match-stats`` report from ``module.facts`` (filled by match-attention)."""
    stats = module.facts.match_stats
    matches = module.facts.matches
    if stats is None and matches is None:
        return "# no match statistics (run match-attention)\n"
    lines = ["# ----- match statistics -----"]
    rows = sorted((stats or {}).items())
    width = max([len(str(rule)) for rule, _ in rows] + [len("rule")])
    lines.append(f"# {'rule':<{width}}  {'attempts':>8}  {'hits':>6}  {'ms':>9}")
    for rule, row in rows:
        lines.append(f"# {str(rule):<{width}}  {row.get('attempts', 0):>8}  "
                     f"{row.get('hits', 0):>6}  {row.get('seconds', 0.0) * 1e3:9.1f}")
    lines.append(f"# matches: {len(matches or ())}")
    lines.extend(f"#   {report}" for report in (matches or ()))
    return "\n".join(lines) + "\n"


def _cmd_opt(args: argparse.Namespace) -> int:
    from cptransform.api.context_parallel import cp_pipeline

    instruments, _ = _opt_instruments(args)
    fn, example_args, name = load_program(args.entry, args.arg_shapes)
    module = trace_program(fn, example_args, name)
    text = args.pipeline or "canonicalize"
    if args.cp is not None or args.mesh is not None:
        module, options = prepare_cp(module, args)
        text = args.pipeline or cp_pipeline(module, options).spelled()
    pipeline = Pipeline.parse(text, instruments, available=get_all_passes())
    ran = [p.name for p in pipeline.passes]
    for name in args.print_ir_after:
        if name not in ran:
            raise CLIError(f"--print-ir-after {name}: the pipeline does not run that pass"
                           f"{did_you_mean(name, ran)}; it runs {', '.join(ran)}")
    if args.grad:
        check_grad_arguments(example_args)
    try:
        result = run_pipeline(pipeline, module)
    except VerificationError as err:
        print(f"cptransform: error: {err}", file=sys.stderr)
        return FAILURE
    printed = any(isinstance(i, PrintIR) for i in instruments)
    if not printed:
        sys.stdout.write(render("after", pipeline.spelled(), result.module,
                                changed=result.changed))
    if args.match_stats:
        sys.stdout.write(match_stats_text(result.module))
    if args.grad:
        sys.stdout.write(grad_text(result.module, example_args))
    return 0


def run_pipeline(pipeline: Pipeline, module: Module):
    """Run; the passes' input errors (a schedule that cannot run, an ambiguous sequence
    axis, a strict refusal: all ``CPTransformError``s naming the fix) become one line in
    :func:`main`, anything else (a bug) keeps its traceback."""
    return pipeline.run(module)


def check_grad_arguments(example_args: Sequence[Any]) -> None:
    """``--grad`` differentiates w.r.t. the first argument: it must hold floats."""
    if not example_args:
        raise CLIError("--grad differentiates w.r.t. the first argument; the function takes none")
    leaves = jax.tree_util.tree_leaves(example_args[0])
    bad = [x for x in leaves if not jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
    if not leaves or bad:
        found = jnp.result_type(bad[0]).name if bad else "no array"
        raise CLIError(f"--grad differentiates w.r.t. the first argument, which holds "
                       f"{found}; it needs float arrays (put the parameters first)")


def grad_text(module: Module, example_args: Sequence[Any]) -> str:
    """The jaxpr of ``jax.grad`` of the program w.r.t. its first argument."""
    outs = module.out_avals
    if len(outs) != 1 or outs[0].shape != () or not jnp.issubdtype(outs[0].dtype, jnp.floating):
        raise CLIError("--grad needs a function returning one float scalar (a loss)")
    abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), x.dtype),
                                      tuple(example_args))
    grad = jax.make_jaxpr(jax.grad(module.as_function()))(*abstract)
    return f"# ----- IR of jax.grad (w.r.t. argument 0) -----\n{grad}\n"


def _add_plan(sub) -> None:
    p = sub.add_parser("plan", help="show each attention's schedule, its chart and the balance")
    add_entry_arguments(p)
    add_cp_arguments(p)
    p.add_argument("--json", action="store_true",
                   help="print the plan as JSON only (cptransform.api.plan.Plan.from_json "
                        "reads it back)")
    p.add_argument("--verbose", action="store_true",
                   help="also list the softmaxes left alone, excluded schedules, every "
                        "candidate's cost and every layout")
    p.add_argument("--png", default=None, metavar="FILE",
                   help="also draw the charts into FILE with matplotlib (in a source "
                        "checkout: .venv/bin/pip install matplotlib, or pip install -e "
                        "'.[plot]')")
    p.set_defaults(handler=_cmd_plan)


def _cmd_plan(args: argparse.Namespace) -> int:
    from cptransform.api.context_parallel import cp_pipeline
    from cptransform.api.explain import explain_module
    from cptransform.api.plan import build_plan
    from cptransform.api.plan_chart import balance_table, charts_for, render_png, \
        render_text, require_matplotlib
    from cptransform.op.layouts import SequenceLayout, padded_length

    if args.cp is None and args.mesh is None:
        raise CLIError("plan needs --cp N (or --axis and --mesh)")
    if args.png:
        require_matplotlib()
    fn, example_args, name = load_program(args.entry, args.arg_shapes)
    module, options = prepare_cp(trace_program(fn, example_args, name), args)
    ran = run_pipeline(cp_pipeline(module, options, lower=False), module)
    result = ran.module
    plan = build_plan(result, ran.timings)
    if args.json:
        print(plan.to_json(indent=1))
        return 0
    print(explain_module(result, options, verbose=args.verbose))
    drawn = []
    steps = {step.index: step for step in result.facts.plan or ()}
    # One chart per distinct attention: identical layers are drawn once.
    for group in plan.attentions:
        step = steps[group.indices[0]]
        heading = f"{group.label} ({step.schedule})"
        print(f"\n{heading}:")
        if step.shape.kv_len != step.shape.seq_len:
            print("cross-attention: the charts draw self-attention only")
            continue
        cp = step.shape.cp
        lay = SequenceLayout(step.layout, padded_length(step.shape.seq_len, step.layout, cp), cp)
        charts = charts_for(step, lay)
        if isinstance(charts, str):
            print(charts)
            continue
        print("\n".join(render_text(chart) for chart in charts))
        drawn += [(heading, chart) for chart in charts]
    if result.facts.balance:
        print("\n" + balance_table(result.facts.balance))
    if args.png:
        render_png(args.png, drawn, result.facts.balance)
        print(f"\nwrote {args.png}")
    return 0


# -- main -----------------------------------------------------------------------------------

#: Most CPU devices the CLI simulates (each is a thread pool; far more only exhausts memory).
MAX_SIMULATED_DEVICES = 1024


def _devices_wanted(args: argparse.Namespace) -> int:
    """Devices the command's CP mesh needs (0 without ``--cp`` / ``--mesh``), checked before
    any device is created."""
    if getattr(args, "mesh", None) is not None:
        wanted = math.prod(mesh_sizes(args.mesh, axis_names(args.axis)))
        flag = f"--mesh {args.mesh}"
    else:
        wanted = getattr(args, "cp", None)
        flag = f"--cp {wanted}"
        if wanted is None:
            return 0
    if wanted < 1:
        raise CLIError(f"{flag}: the CP size must be at least 1")
    if wanted > MAX_SIMULATED_DEVICES and jax.config.jax_platforms in (None, "", "cpu"):
        raise CLIError(f"{flag}: at most {MAX_SIMULATED_DEVICES} devices can be simulated on "
                       "the CPU; use a smaller CP size (the plan scales: --cp 8 shows it)")
    return wanted


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line on stderr and exit status 2, like every
    other bad input of the command."""

    def error(self, message: str):
        self.exit(USAGE_ERROR, f"cptransform: error: {message} (see {self.prog} --help)\n")


def simulate_cpu_devices(count: int) -> None:
    """Simulate ``count`` CPU devices. That must happen before any JAX computation starts
    the backend (loading the program may already compute); once it has started (``main``
    called from a running program), the devices it has must do."""
    try:
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:  # the backend is already up: its devices are fixed
        if len(jax.devices()) < count:
            raise CLIError(f"the CP mesh needs {count} devices but JAX already started "
                           f"with {len(jax.devices())}; run the command in a fresh "
                           "process") from None


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand."""
    parser = OneLineParser(
        prog="cptransform", description="Automatic context parallelism for JAX: "
                                        "pass-debugging tools.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                parser_class=OneLineParser)
    _add_passes(sub)
    _add_opt(sub)
    _add_plan(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Console-script entry point; returns the exit status."""
    from cptransform.api.context_parallel import IdleDevicesWarning

    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else USAGE_ERROR
    try:
        wanted = _devices_wanted(args)
        simulated = wanted and jax.config.jax_platforms in (None, "", "cpu")
        if simulated:
            simulate_cpu_devices(max(wanted, 8))
        with warnings.catch_warnings():
            if simulated:  # the devices the CLI simulated beyond --cp are its own choice
                warnings.simplefilter("ignore", IdleDevicesWarning)
            return args.handler(args)
    except (CLIError, CPTransformError) as err:
        print(f"cptransform: error: {err}", file=sys.stderr)
        return USAGE_ERROR


if __name__ == "__main__":
    sys.exit(main())
