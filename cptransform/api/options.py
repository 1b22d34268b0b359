"""The options of :func:`~cptransform.api.context_parallel.context_parallel`, declared once.

:data:`OPTIONS` holds one :class:`OptionSpec` per keyword: its type, default, allowed values
(read off the registry that defines them: :func:`~cptransform.lowering.schedule.schedules`,
:func:`~cptransform.lowering.kernels.kernels`, :data:`~cptransform.op.layouts.LAYOUTS`,
:data:`~cptransform.analysis.hardware.HARDWARE`), a one-line help text, the pass whose field
of the same name it sets, and whether the ``cptransform`` command has a flag for it. From it
come the :class:`Options` record and its checks (one error naming the bad value and the
allowed ones), the CLI's flags (:func:`cptransform.api.cli.add_cp_arguments`) and the pass
arguments of :func:`~cptransform.api.context_parallel.cp_pipeline`; the README's options
table and ``docs/cli.md``'s flag table are tested against it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from cptransform.analysis.hardware import HARDWARE, memory_limit_problem
from cptransform.api.arguments import CallArguments
from cptransform.ir.errors import ContextParallelOptionError, unknown_name
from cptransform.lowering.kernels import kernel_choices
from cptransform.lowering.schedule import schedules
from cptransform.passes.plan_context_parallel import LOAD_BALANCES, RECURRENCE_CHOICES, \
    REFUSED_LOAD_BALANCES, PlanContextParallel, schedule_choices
from cptransform.passes.reorder_sequence import ReorderSequence

PLAN = PlanContextParallel.name
REORDER = ReorderSequence.name


@dataclass(frozen=True)
class OptionSpec:
    """One option of ``context_parallel``.

    ``choices``: the allowed values, computed on use (the registries fill as their modules
    import), ``None`` for an open value; ``refused``: values naming a real scheme that is
    refused, and why (a ``NotImplementedError``, not an unknown name); ``problem``: why a
    value of an open option is bad (``None`` when it is fine); ``consumer``: the pass whose
    field of the same name the option sets (``None``: the API itself reads it); ``flag``:
    the ``cptransform`` command takes it as ``--name-with-dashes``, its text read by
    ``parse``."""

    name: str
    type: str
    default: Any
    help: str
    choices: Callable[[], tuple[str, ...]] | None = None
    refused: Mapping[str, str] = field(default_factory=dict)
    problem: Callable[[Any], str | None] | None = None
    consumer: str | None = None
    flag: bool = False
    metavar: str | None = None
    parse: Callable[[str], Any] = str

    @property
    def flag_name(self) -> str:
        """The command-line spelling: ``load_balance`` → ``--load-balance``."""
        return "--" + self.name.replace("_", "-")

    def check(self, value: Any) -> None:
        """Raise for a value the option does not take: ``NotImplementedError`` for a refused
        one, :class:`ContextParallelOptionError` naming the allowed ones otherwise. ``None``
        is the default of every option whose default is ``None``."""
        if value is None and self.default is None:
            return
        if isinstance(value, str) and value in self.refused:
            raise NotImplementedError(self.refused[value])
        if self.choices is not None and value not in self.choices():
            raise ContextParallelOptionError(unknown_name(self.name, value, self.choices(), "="))
        problem = self.problem(value) if self.problem is not None else None
        if problem:
            raise ContextParallelOptionError(problem)


def memory_limit_text(text: str) -> int | str:
    """``--memory-limit`` as the option takes it: an int of bytes, or the ``"N%"`` string."""
    return int(text) if text.isdigit() else text


#: Every option of ``context_parallel``, in the order of its documentation.
OPTIONS: dict[str, OptionSpec] = {spec.name: spec for spec in (
    OptionSpec("cp", "int | None", None, "devices the sequence is sharded over (default: "
               "every visible one)", flag=True, metavar="N", parse=int),
    OptionSpec("mesh", "Any", None, "an existing mesh holding the CP axes; its other axes "
               "(data, ...) keep their sharding"),
    OptionSpec("axis", "str | tuple[str, ...]", "cp", "the mesh's CP axis name, or two "
               "(inner, outer) for a two-axis schedule"),
    OptionSpec("schedule", "str", "auto", "per attention: auto prices every feasible "
               "schedule on the hardware row and takes the fastest",
               choices=schedule_choices, consumer=PLAN, flag=True),
    OptionSpec("load_balance", "str", "auto", "sequence layout: auto keeps the one with the "
               "least predicted time over all attentions; none is contiguous",
               choices=lambda: tuple(LOAD_BALANCES), refused=REFUSED_LOAD_BALANCES,
               consumer=PLAN, flag=True),
    OptionSpec("kernel", "str", "auto", "local step: auto takes per attention the fastest "
               "kernel that runs it", choices=kernel_choices, consumer=PLAN, flag=True),
    OptionSpec("seq_axes", "Any", None, "per positional argument its sequence dims (an int, "
               "a tuple, None, or a pytree prefix of it; dims merged into one sequence as a "
               "tuple inside: ((1, 2),)), overriding the inferred ones"),
    OptionSpec("strict", "bool", False, "refuse ops that are not order-safe along the "
               "sequence instead of wrapping them, and an attention left unsharded",
               consumer=REORDER),
    OptionSpec("allow_unsharded", "bool", False, "run a function in which no attention is "
               "found as it is, on every device, with an UnshardedWarning, instead of "
               "raising"),
    OptionSpec("keep_permuted", "bool", False, "leave sequence outputs in the load-balanced "
               "order", consumer=REORDER),
    OptionSpec("static_argnums", "int | tuple[int, ...]", (), "as in jax.jit"),
    OptionSpec("static_argnames", "str | tuple[str, ...]", (), "as in jax.jit"),
    OptionSpec("hardware", "str | None", None, "the hardware row the planner prices "
               "schedules on (default: the devices' own)", choices=lambda: tuple(HARDWARE),
               consumer=PLAN, flag=True),
    OptionSpec("memory_limit", "int | str | None", None, "per-device memory an auto "
               "choice's local step may use: bytes, or N% of the hardware's memory",
               problem=memory_limit_problem, consumer=PLAN, flag=True, metavar="BYTES|N%",
               parse=memory_limit_text),
    OptionSpec("recurrences", "str", "auto", "per recurrence along the sequence: auto "
               "prices passing state against gathering and takes the faster; pass always "
               "passes state where exact; gather runs each on the whole sequence",
               choices=lambda: RECURRENCE_CHOICES,
               consumer=PLAN, flag=True),
)}


def _default(name: str) -> Any:
    return OPTIONS[name].default


@dataclass(frozen=True)
class Options:
    """The public options of :func:`context_parallel` (names are the public API; each
    field's type and default are those of its :data:`OPTIONS` entry)."""

    cp: int | None = _default("cp")
    mesh: Any = _default("mesh")
    axis: str | tuple[str, ...] = _default("axis")
    schedule: str = _default("schedule")
    load_balance: str = _default("load_balance")
    kernel: str = _default("kernel")
    seq_axes: Any = _default("seq_axes")
    strict: bool = _default("strict")
    allow_unsharded: bool = _default("allow_unsharded")
    keep_permuted: bool = _default("keep_permuted")
    static_argnums: int | tuple[int, ...] = _default("static_argnums")
    static_argnames: str | tuple[str, ...] = _default("static_argnames")
    hardware: str | None = _default("hardware")
    memory_limit: int | str | None = _default("memory_limit")
    recurrences: str = _default("recurrences")

    def check(self) -> None:
        """Raise for a value an option does not take, or CP axes the schedule cannot run
        over."""
        for spec in OPTIONS.values():
            spec.check(getattr(self, spec.name))
        axes = self.axes
        if not 1 <= len(axes) <= 2:
            raise ContextParallelOptionError(
                f"axis={self.axis!r}: give one mesh axis name, or two (inner, outer) for a "
                f"two-axis schedule ({two_axis_names()})")
        record = schedules().get(self.schedule)
        want = len(axes) if record is None else record.mesh_axes
        if want == 2 and len(axes) != 2 and self.mesh is not None:
            # Without a mesh the planner builds the two axes from cp (inner degree chosen
            # by the cost model); a given mesh must have them.
            raise ContextParallelOptionError(
                f"schedule={self.schedule!r} over mesh= needs two mesh axes: "
                f"axis={record.inner.names} with a mesh that has both (or pass only cp= and "
                "the planner builds them)")
        if len(axes) == 2 and want != 2:
            raise ContextParallelOptionError(
                f"two CP axes {axes} need a two-axis schedule ({two_axis_names()}); "
                f"schedule={self.schedule!r} runs over one axis")

    @property
    def axes(self) -> tuple[str, ...]:
        """The CP mesh axes: ``axis`` as a tuple."""
        return (self.axis,) if isinstance(self.axis, str) else tuple(self.axis)

    def pass_arguments(self, consumer: str) -> dict[str, Any]:
        """The fields of pass ``consumer`` these options set: every option it consumes."""
        return {spec.name: getattr(self, spec.name) for spec in OPTIONS.values()
                if spec.consumer == consumer}

    def split(self, args: tuple, kwargs: dict) -> CallArguments:
        """This call's arguments split into traced and static ones."""
        nums = (self.static_argnums,) if isinstance(self.static_argnums, int) \
            else tuple(self.static_argnums)
        names = (self.static_argnames,) if isinstance(self.static_argnames, str) \
            else tuple(self.static_argnames)
        return CallArguments.split(args, kwargs, nums, names)


def two_axis_names() -> str:
    """The registered schedules that run over two CP mesh axes, for messages."""
    return " or ".join(n for n, s in schedules().items() if s.mesh_axes == 2)
