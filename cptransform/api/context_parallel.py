"""``context_parallel``: the transform users apply to ordinary single-device code."""
from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from cptransform.analysis.hardware import HARDWARE, memory_limit_problem
from cptransform.api.argument_writes import returning_argument_writes, write_back
from cptransform.api.arguments import CallArguments
from cptransform.ir import compat
from cptransform.ir.errors import ContextParallelError, ContextParallelOptionError
from cptransform.ir.module import Module, iter_eqns, trace
from cptransform.ir.pipeline import Pipeline
from cptransform.lowering.schedule import schedules
from cptransform.passes.canonicalize import Canonicalize
from cptransform.passes.infer_seq_axes import InferSeqAxes
from cptransform.passes.lower_context_parallel import LowerContextParallel
from cptransform.passes.match_attention import MatchAttention
from cptransform.passes.plan_context_parallel import LOAD_BALANCES, REFUSED_LOAD_BALANCES, \
    PlanContextParallel
from cptransform.passes.reorder_sequence import ReorderSequence

KERNELS = ("auto", "xla", "pallas")


@dataclass(frozen=True)
class Options:
    """The public options of :func:`context_parallel` (names are the public API)."""

    cp: int | None = None
    mesh: Any = None
    axis: str | tuple[str, ...] = "cp"
    schedule: str = "auto"
    load_balance: str = "auto"
    kernel: str = "auto"
    seq_axes: Any = None
    strict: bool = False
    keep_permuted: bool = False
    static_argnums: int | tuple[int, ...] = ()
    static_argnames: str | tuple[str, ...] = ()
    hardware: str | None = None
    memory_limit: int | str | None = None

    def check(self) -> None:
        if self.load_balance in REFUSED_LOAD_BALANCES:
            raise NotImplementedError(REFUSED_LOAD_BALANCES[self.load_balance])
        for name, value, allowed in (("schedule", self.schedule, schedule_names()),
                                     ("load_balance", self.load_balance, LOAD_BALANCES),
                                     ("kernel", self.kernel, KERNELS)):
            if value not in allowed:
                raise ContextParallelOptionError(
                    f"unknown {name}={value!r}; use one of {', '.join(allowed)}")
        if self.hardware is not None and self.hardware not in HARDWARE:
            raise ContextParallelOptionError(
                f"unknown hardware={self.hardware!r}; use one of {', '.join(HARDWARE)}")
        problem = memory_limit_problem(self.memory_limit)
        if problem:
            raise ContextParallelOptionError(problem)
        axes = self.axes
        if not 1 <= len(axes) <= 2:
            raise ContextParallelOptionError(
                f"axis={self.axis!r}: give one mesh axis name, or two (ulysses, ring) for hybrid")
        want = schedules()[self.schedule].mesh_axes if self.schedule != "auto" else len(axes)
        if want == 2 and len(axes) != 2 and self.mesh is not None:
            # Without a mesh the planner builds the two axes from cp (Ulysses degree chosen
            # by the cost model); a given mesh must have them.
            raise ContextParallelOptionError(
                f"schedule={self.schedule!r} over mesh= needs two mesh axes: "
                "axis=('uly', 'ring') with a mesh that has both (or pass only cp= and the "
                "planner builds them)")
        if len(axes) == 2 and want != 2:
            two = " or ".join(n for n, s in schedules().items() if s.mesh_axes == 2)
            raise ContextParallelOptionError(
                f"two CP axes {axes} mean the {two} schedule; schedule={self.schedule!r} "
                "runs over one axis")

    @property
    def axes(self) -> tuple[str, ...]:
        return (self.axis,) if isinstance(self.axis, str) else tuple(self.axis)

    def split(self, args: tuple, kwargs: dict) -> CallArguments:
        """This call's arguments split into traced and static ones."""
        nums = (self.static_argnums,) if isinstance(self.static_argnums, int) \
            else tuple(self.static_argnums)
        names = (self.static_argnames,) if isinstance(self.static_argnames, str) \
            else tuple(self.static_argnames)
        return CallArguments.split(args, kwargs, nums, names)


def schedule_names() -> tuple[str, ...]:
    """The values of the ``schedule`` option: ``auto`` and every registered schedule."""
    return ("auto", *schedules())


def build_mesh(options: Options):
    """The CP mesh: the given one (checked), or ``cp`` devices on one axis."""
    axes = options.axes
    if options.mesh is not None:
        missing = [a for a in axes if a not in options.mesh.axis_names]
        if missing:
            raise ContextParallelOptionError(
                f"mesh axes are {options.mesh.axis_names}; the CP axis {missing} is not among "
                "them — pass axis= naming the mesh's sequence axis")
        size = math.prod(options.mesh.shape[a] for a in axes)
        if options.cp is not None and options.cp != size:
            raise ContextParallelOptionError(
                f"cp={options.cp} but the mesh's CP axes {axes} hold {size} devices")
        return auto_axes(options.mesh)
    devices = jax.devices()
    cp = options.cp if options.cp is not None else len(devices)
    if len(axes) != 1:
        raise ContextParallelOptionError("for two CP axes pass mesh= with both axes")
    if cp < 1 or cp > len(devices):
        raise ContextParallelOptionError(
            f"cp={cp} but only {len(devices)} devices are visible; use cp <= {len(devices)} "
            "(on CPU, simulate more with XLA_FLAGS=--xla_force_host_platform_device_count=N "
            "set before importing jax)")
    return jax.make_mesh((cp,), axes, axis_types=(AxisType.Auto,), devices=devices[:cp])


def auto_axes(mesh):
    """``mesh`` with every axis ``Auto``: the program outside attention is partitioned by
    XLA's SPMD partitioner from sharding constraints, which Explicit axes (the default of
    ``jax.make_mesh``) do not take; the devices and axis names stay the same."""
    if all(t == AxisType.Auto for t in mesh.axis_types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def _seq_axis_overrides(seq_axes: Any, args: tuple, traced: list[int]) -> dict[int, tuple]:
    """``seq_axes`` → flat input index → sequence dims.

    ``seq_axes`` has one entry per positional argument: ``None`` (no sequence axis), an
    int dim, or a tuple of dims; an entry applies to every array leaf of its argument.
    Static arguments (positions not in ``traced``) hold no arrays and are skipped; keyword
    arguments are left to inference.
    """
    if seq_axes is None:
        return {}
    entries = seq_axes if isinstance(seq_axes, (tuple, list)) and len(seq_axes) == len(args) \
        else None
    if entries is None:
        raise ContextParallelOptionError(
            f"seq_axes must have one entry per positional argument ({len(args)} here): an "
            "int dim, a tuple of dims, or None, e.g. seq_axes=(None, 1) for (params, tokens)")
    out, index = {}, 0
    for position, (entry, arg) in enumerate(zip(entries, args)):
        if position not in traced:
            continue
        for leaf in jax.tree_util.tree_leaves(arg):
            dims = () if entry is None else (entry,) if isinstance(entry, int) else tuple(entry)
            ndim = np.ndim(leaf)
            if any(not -ndim <= d < ndim for d in dims):
                raise ContextParallelOptionError(
                    f"seq_axes entry {entry} does not fit an argument of shape {np.shape(leaf)}")
            out[index] = tuple(d % ndim for d in dims)
            index += 1
    return out


def _signature(args, kwargs):
    leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
    return tree, tuple((np.shape(x), str(jax.numpy.result_type(x))) for x in leaves)


def prepare(module: Module, options: Options, overrides: dict | None = None) -> Module:
    """Attach the CP mesh, its axes and the ``seq_axes`` overrides to a traced module."""
    options.check()
    mesh = build_mesh(options)
    return module.with_facts(mesh=mesh, cp_axes=options.axes,
                             seq_axes_overrides=overrides or {})


def cp_pipeline(module: Module, options: Options, *, lower: bool = True) -> Pipeline:
    """The context-parallel pass pipeline for a prepared module, as pass objects (the CLI
    prints it with ``spelled()``); ``lower=False`` stops before lowering (for plans)."""
    schedule = "hybrid" if len(module.facts.cp_axes) == 2 else options.schedule
    passes = [Canonicalize(), MatchAttention(), InferSeqAxes(),
              PlanContextParallel(schedule=schedule, load_balance=options.load_balance,
                                  hardware=options.hardware,
                                  memory_limit=options.memory_limit, kernel=options.kernel),
              ReorderSequence(strict=options.strict, keep_permuted=options.keep_permuted)]
    if lower:
        passes.append(LowerContextParallel(kernel=options.kernel))
    return Pipeline(passes)


def report_unsharded(module: Module, options: Options) -> None:
    """With ``cp > 1`` and no attention found, nothing is sharded: warn with each refused
    softmax's reason and source line (``strict=True``: raise)."""
    if module.facts.plan or module.facts.cp <= 1:
        return
    refused = [f"  {m}" for m in module.facts.matches or () if not m.rewritten]
    message = (f"{module.name}: no attention found, so nothing is sharded over cp="
               f"{module.facts.cp}; the function runs as on one device"
               + (":\n" + "\n".join(refused) if refused else " (no softmax either)")
               + "\nUse cptransform.attention(q, k, v, ...) for an attention the matcher "
                 "cannot see.")
    if options.strict:
        raise ContextParallelError(message)
    warnings.warn(message, UnshardedWarning, stacklevel=4)


class UnshardedWarning(UserWarning):
    """A transformed function found no attention and runs unsharded."""


def refuse_gradients(module: Module) -> None:
    """Raise when the traced function already differentiates (the decorator sits on a train
    step): the transform must see the forward program; gradients go outside."""
    for eqn in iter_eqns(module.jaxpr):
        if "transpose(" in compat.name_stack(eqn):
            raise ContextParallelError(
                f"{module.name} already computes gradients (e.g. at "
                f"{compat.source_line(eqn)}): put @context_parallel on the loss function "
                f"and apply jax.grad / jax.value_and_grad outside it:\n"
                f"    loss = context_parallel(loss_fn, cp=...)\n"
                f"    grads = jax.grad(loss)(params, batch)")


class ContextParallelFunction:
    """The result of :func:`context_parallel`: call it like the original function."""

    def __init__(self, fn: Callable, options: Options):
        options.check()
        self.fn = fn
        self.options = options
        self._built: dict = {}
        functools.update_wrapper(self, fn)

    # -- building --
    def module(self, *args, **kwargs) -> Module:
        """The transformed program for these arguments (arrays or ShapeDtypeStructs); its
        output is ``(fn's output, new values of the argument leaves fn writes)``."""
        return self._build(args, kwargs)[0]

    def _build(self, args, kwargs):
        split = self.options.split(args, kwargs)
        key = (_signature(split.args, split.kwargs), split.static)
        if key not in self._built:
            self._built[key] = self._transform(split, args)
        final, written, call = self._built[key]
        return final, written, call, split

    def _transform(self, split: CallArguments, args: tuple):
        abstract = jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct(np.shape(x), jax.numpy.result_type(x)),
            (split.args, split.kwargs))
        name, written = getattr(self.fn, "__name__", "fn"), []
        module = trace(returning_argument_writes(split.bind(self.fn), name, written),
                       *abstract[0], name=name, **abstract[1])
        refuse_gradients(module)
        overrides = _seq_axis_overrides(self.options.seq_axes, args, split.traced_positions())
        module = prepare(module, self.options, overrides)
        final = cp_pipeline(module, self.options).run(module).module
        report_unsharded(final, self.options)
        return final, tuple(written), jax.jit(lambda *flat: final.flat_call(*flat))

    # -- calling --
    def __call__(self, *args, **kwargs):
        final, written, call, split = self._build(args, kwargs)
        arguments = (split.args, split.kwargs)
        out, writes = jax.tree_util.tree_unflatten(
            final.out_tree, call(*jax.tree_util.tree_leaves(arguments)))
        write_back(arguments, written, writes)
        return out

    def lower(self, *args, **kwargs):
        """``jax.jit(...).lower`` of the transformed program (ShapeDtypeStructs allowed)."""
        _, _, call, split = self._build(args, kwargs)
        return call.lower(*jax.tree_util.tree_leaves((split.args, split.kwargs)))

    def explain(self, *args, leaks: bool = False, **kwargs) -> str:
        """A readable account of what the transform does for these arguments.

        ``leaks=True`` also compiles the transformed program for them and lists its sharding
        leaks (all-gathers of the whole sequence outside the attention schedules). It is
        opt-in because compiling costs seconds on the demo, far more than the rest of the
        report. (A keyword argument of the function named ``leaks`` goes positionally.)"""
        from cptransform.api.explain import explain_module
        hlo = self.lower(*args, **kwargs).compile().as_text() if leaks else None
        return explain_module(self.module(*args, **kwargs), self.options, hlo)


def context_parallel(fn: Callable | None = None, **options) -> Any:
    """Run ``fn`` with its sequence sharded over ``cp`` devices; same results.

    Usable as ``@context_parallel`` or ``@context_parallel(cp=8, schedule="ring", ...)``.

    Options: ``cp`` (devices; default all), ``mesh`` (an existing mesh) and ``axis`` (its CP
    axis name, or ``(ulysses_axis, ring_axis)`` for hybrid), ``schedule`` (ring | ulysses |
    allgather | hybrid | halo | auto; auto prices each feasible schedule, halo included, and
    takes the fastest), ``load_balance`` (zigzag | striped | none | auto: the layout with
    the least predicted time over all attentions; "documents" is refused), ``kernel``
    (pallas | xla | auto), ``seq_axes`` (override: a tuple
    mirroring the positional arguments with an int dim, a tuple of dims, or None per
    argument), ``strict`` (refuse non-equivariant ops instead of wrapping them, and a
    function with no attention), ``keep_permuted`` (leave outputs in the load-balanced
    order), ``static_argnums`` / ``static_argnames`` (as ``jax.jit``; arguments holding no
    array — Python bools, ints, floats, strings — are static too), ``hardware`` (a row of
    :data:`~cptransform.analysis.hardware.HARDWARE` the planner prices schedules on;
    default: the devices' own row, ``cpu-sim`` on CPU), ``memory_limit`` (per-device bytes
    the local step of an ``auto`` choice may use: an int, or ``"80%"`` of the hardware's
    memory; default all of it). ``schedule="hybrid"`` with only ``cp`` lets the planner
    choose the Ulysses degree and build the two-axis mesh.
    """
    known = {f.name for f in dataclasses.fields(Options)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ContextParallelOptionError(
            f"unknown option(s) {', '.join(unknown)}; context_parallel takes "
            f"{', '.join(sorted(known))}")
    opts = Options(**options)
    if fn is None:
        return lambda f: ContextParallelFunction(f, opts)
    return ContextParallelFunction(fn, opts)
