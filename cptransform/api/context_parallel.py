"""``context_parallel``: the transform users apply to ordinary single-device code."""
from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import math
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from cptransform.api.argument_writes import returning_argument_writes, write_back
from cptransform.api.arguments import CallArguments
from cptransform.api.forward_mode import with_forward_mode
from cptransform.api.options import OPTIONS, Options
from cptransform.ir import compat
from cptransform.ir.errors import ContextParallelError, ContextParallelOptionError, \
    UnshardedError, did_you_mean
from cptransform.ir.gc_pause import gc_paused
from cptransform.ir.module import Module, iter_eqns, trace
from cptransform.ir.pipeline import PassTiming, Pipeline
from cptransform.passes.canonicalize import Canonicalize
from cptransform.passes.infer_seq_axes import InferSeqAxes
from cptransform.passes.lower_context_parallel import LowerContextParallel
from cptransform.passes.match_attention import MatchAttention
from cptransform.op.recurrence import Method
from cptransform.passes.match_recurrences import MatchRecurrences
from cptransform.passes.match_windows import MatchWindows
from cptransform.passes.plan_context_parallel import PlanContextParallel
from cptransform.passes.reorder_sequence import ReorderSequence

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TransformStats:
    """What one transform of a function cost: tracing it (``trace_s``) and each pass of the
    pipeline (``passes``), in seconds of wall time."""

    function: str
    trace_s: float
    passes: tuple[PassTiming, ...]

    @property
    def total_s(self) -> float:
        """Tracing and every pass."""
        return self.trace_s + sum(p.seconds for p in self.passes)

    def describe(self) -> str:
        """One line: the total, the tracing and each pass in milliseconds."""
        parts = ", ".join(f"{p.name} {p.seconds * 1e3:.1f}" for p in self.passes)
        return (f"{self.function}: transformed in {self.total_s * 1e3:.1f} ms (trace "
                f"{self.trace_s * 1e3:.1f}; {parts} ms)")


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
    if cp < len(devices):
        report_idle_devices(cp, len(devices), axes[0])
    return jax.make_mesh((cp,), axes, axis_types=(AxisType.Auto,), devices=devices[:cp])


class IdleDevicesWarning(UserWarning):
    """``cp`` without ``mesh=`` uses fewer devices than are visible; the rest stay idle."""


def report_idle_devices(cp: int, visible: int, axis: str) -> None:
    """Warn that ``cp`` of ``visible`` devices run the program, naming the mesh that uses
    the others (a data axis beside the CP axis) as the fix."""
    data = visible // cp
    warnings.warn(
        f"cp={cp} uses {cp} of the {visible} visible devices; {visible - cp} stay idle. "
        f"To use them, pass mesh= with a data axis beside the CP axis, e.g. "
        f"mesh=jax.make_mesh(({data}, {cp}), ('data', {axis!r})), axis={axis!r}, and shard "
        f"the batch over 'data' (or pass cp={visible})", IdleDevicesWarning, stacklevel=6)


def auto_axes(mesh):
    """``mesh`` with every axis ``Auto``: the program outside attention is partitioned by
    XLA's SPMD partitioner from sharding constraints, which Explicit axes (the default of
    ``jax.make_mesh``) do not take; the devices and axis names stay the same."""
    if all(t == AxisType.Auto for t in mesh.axis_types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def _seq_axis_overrides(seq_axes: Any, args: tuple, traced: list[int]) -> dict[int, tuple]:
    """``seq_axes`` → flat input index → sequence dims.

    ``seq_axes`` has one entry per positional argument, as ``jax.vmap``'s ``in_axes``: a
    pytree prefix of the argument whose leaves are ``None`` (no sequence axis), an int dim
    or a tuple of dims (several), where a dim may itself be a tuple of two or more ints:
    dims merged into one sequence, major first (``((1, 2),)`` for the ``H·W`` patches of
    ``[B, H, W, C]``; such a tuple is always a leaf). A leaf applies to every array leaf of
    the subtree it stands for, so ``(None, 1)`` gives every array of the second argument
    dim 1 and ``(None, {"tokens": 1, "mask": None})`` names them one by one. Static
    arguments (positions not in ``traced``) hold no arrays and are skipped; keyword
    arguments are left to inference. A merged entry comes back as a
    :data:`~cptransform.analysis.dim_rules.Group`.
    """
    if seq_axes is None:
        return {}
    entries = seq_axes if isinstance(seq_axes, (tuple, list)) and len(seq_axes) == len(args) \
        else None
    if entries is None:
        raise ContextParallelOptionError(
            f"seq_axes must have one entry per positional argument ({len(args)} here): an "
            "int dim, a tuple of dims, None, or a pytree prefix of the argument with those "
            "as leaves (as jax.vmap's in_axes), e.g. seq_axes=(None, 1) for (params, tokens)")
    out, index = {}, 0
    for position, (entry, arg) in enumerate(zip(entries, args)):
        if position not in traced:
            continue
        for dims, leaf in _entry_leaves(entry, arg, position):
            ndim = np.ndim(leaf)
            flat = [d for dim in dims for d in (dim if isinstance(dim, tuple) else (dim,))]
            if any(not -ndim <= d < ndim for d in flat) or len(flat) != len(set(flat)):
                raise ContextParallelOptionError(
                    f"seq_axes entry {dims if len(dims) > 1 else dims[0]} of argument "
                    f"{position} does not fit an array of shape {np.shape(leaf)}")
            out[index] = tuple(tuple((d % ndim, 1) for d in dim) if isinstance(dim, tuple)
                               else dim % ndim for dim in dims)
            index += 1
    return out


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _is_merged(x: Any) -> bool:
    """Dims merged into one sequence: a tuple of two or more ints."""
    return isinstance(x, tuple) and len(x) > 1 and all(_is_int(d) for d in x)


def _is_dims(entry: Any) -> bool:
    """A leaf of a ``seq_axes`` prefix: ``None``, an int, or a tuple of ints and merged
    dims (tuples of two or more ints) holding at least one int or one merged tuple."""
    return entry is None or _is_int(entry) or (
        isinstance(entry, tuple) and all(_is_int(d) or _is_merged(d) for d in entry)
        and (any(_is_merged(d) for d in entry) or all(_is_int(d) for d in entry)))


def _entry_leaves(entry: Any, arg: Any, position: int) -> list[tuple[tuple[int, ...], Any]]:
    """``(dims, array leaf)`` for every array leaf of ``arg``, ``entry`` broadcast over the
    subtrees it is a prefix of."""
    def broadcast(dims, subtree):
        dims = () if dims is None else (int(dims),) if not isinstance(dims, tuple) \
            else tuple(tuple(int(i) for i in d) if isinstance(d, tuple) else int(d)
                       for d in dims)
        return _PrefixLeaf([(dims, leaf) for leaf in jax.tree_util.tree_leaves(subtree)])
    try:
        spread = jax.tree_util.tree_map(broadcast, entry, arg, is_leaf=_is_dims)
    except (TypeError, ValueError):
        bad = [x for x in jax.tree_util.tree_leaves(entry, is_leaf=_is_dims) if not _is_dims(x)]
        what = f"holds {bad[0]!r}, which is not a dim" if bad else \
            f"is not a pytree prefix of the argument ({jax.tree_util.tree_structure(arg)})"
        raise ContextParallelOptionError(
            f"seq_axes entry {entry!r} of argument {position} {what}; give None, an int "
            "dim, a tuple of dims, or a pytree prefix of the argument with those as "
            "leaves") from None
    parts = jax.tree_util.tree_leaves(spread, is_leaf=lambda x: isinstance(x, _PrefixLeaf))
    return [pair for part in parts for pair in part.pairs]


@dataclass(frozen=True)
class _PrefixLeaf:
    """The ``(dims, array)`` pairs one leaf of a ``seq_axes`` prefix stands for."""

    pairs: list


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
    passes = [Canonicalize(), MatchAttention(), MatchWindows(), MatchRecurrences(),
              InferSeqAxes(),
              PlanContextParallel(**options.pass_arguments(PlanContextParallel.name)),
              ReorderSequence(**options.pass_arguments(ReorderSequence.name))]
    if lower:
        passes.append(LowerContextParallel())
    return Pipeline(passes)


def report_unsharded(module: Module, options: Options) -> None:
    """A transform that shards less than asked never passes for success. With ``cp > 1``,
    no attention rewritten and no recurrence passing state, nothing is sharded: raise,
    naming each softmax and recurrence seen and why it was left (``allow_unsharded=True``:
    warn and run unchanged). With attentions
    rewritten, each attention left whole (a softmax over a q·k product refused: its
    probabilities multiplied by data, a softmax combined with a non-softmax) runs its whole
    S×S work on every device: a :class:`PartlyShardedWarning` names each (``strict=True``:
    raise)."""
    if module.facts.cp <= 1:
        return
    for r in module.facts.recurrences:
        if r.crash:
            warnings.warn(f"{module.name}: {r.describe()}", PartlyShardedWarning,
                          stacklevel=4)
    if module.facts.plan or any(r.method not in (None, Method.GATHER)
                                for r in module.facts.recurrences):
        whole = [m for m in module.facts.matches or () if m.runs_unsharded]
        if not whole:
            return
        message = (f"{module.name}: {len(whole)} attention(s) run unsharded, their whole "
                   f"S×S work on every device of cp={module.facts.cp}:\n"
                   + "\n".join(f"  {m.source}: left alone: {m.reason}" for m in whole)
                   + "\nUse cptransform.attention(q, k, v, ...) for them to be sharded.")
        if options.strict:
            raise UnshardedError(message + " (strict=True refuses this)")
        warnings.warn(message, PartlyShardedWarning, stacklevel=4)
        return
    refused = [f"  {m}" for m in module.facts.matches or () if not m.rewritten]
    refused += [f"  {r.describe()}" for r in module.facts.recurrences]
    message = (f"{module.name}: no attention found and no recurrence sharded, so nothing "
               f"is sharded over cp={module.facts.cp}; the function would run as on one "
               "device"
               + (":\n" + "\n".join(refused) if refused else " (no softmax either)")
               + "\nUse cptransform.attention(q, k, v, ...) for an attention the matcher "
                 "cannot see, or pass allow_unsharded=True to run the function unsharded "
                 "(with an UnshardedWarning).")
    if options.strict or not options.allow_unsharded:
        raise UnshardedError(message)
    warnings.warn(message, UnshardedWarning, stacklevel=4)


class UnshardedWarning(UserWarning):
    """A transformed function runs (partly) unsharded: no attention found (only with
    ``allow_unsharded=True``; otherwise an error), or, as :class:`PartlyShardedWarning`,
    some attention left whole."""


class PartlyShardedWarning(UnshardedWarning):
    """Some attention of a transformed function was left whole: it runs unsharded, its
    S×S work on every device, while the others are sharded; or a recurrence is gathered
    because this JAX's compiler crashes on passing its state
    (``compat.scan_compiler_crash``)."""


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


_TRACING: contextvars.ContextVar[str | None] = contextvars.ContextVar("cp_tracing", default=None)
"""The name of the transformed function whose program is being traced, if any: a transformed
function called inside it runs inline, as part of that program and under its plan."""


@contextlib.contextmanager
def _tracing(name: str):
    token = _TRACING.set(name)
    try:
        yield
    finally:
        _TRACING.reset(token)


def _on_mesh(leaves: list, mesh) -> tuple[list, Any]:
    """``(leaves on mesh, home)``: arrays committed to devices outside ``mesh``
    (``jax.device_put(x, jax.devices()[3])``) copied onto it, replicated, and arrays typed
    with Explicit mesh axes moved to ``mesh`` (Auto axes); the program shards them from
    there. ``home`` (:func:`_home_device`): the one device the committed arrays share, where
    the undecorated function would run and leave its outputs; they are moved there
    (:func:`_at_home`). (The gradient of an argument left uncommitted stays on the mesh,
    where the program computed it; one device's would be on ``home``.)
    Under ``grad`` / ``jvp`` of an eager call the copy is of the tracer whose primal is so
    committed: ``device_put`` is differentiable, and its transpose brings the gradient back
    to the input's device, as on one device. (Under an outer ``jax.jit`` the arrays are
    tracers with no device: JAX itself pins that jit to a committed argument's device and
    refuses the mesh's shardings inside it.)"""
    devices = set(mesh.devices.flat)
    replicated = NamedSharding(mesh, PartitionSpec())
    home = _home_device(leaves, mesh)

    def explicit(x):
        """The spec of ``x``'s Explicit sharding type (``2@data``) on ``mesh``'s Auto
        axes, or ``None`` when its type has no Explicit axes."""
        try:
            sharding = jax.typeof(x).sharding
        except (TypeError, AttributeError):
            return None
        kinds = dict(zip(sharding.mesh.axis_names, getattr(sharding.mesh, "axis_types", ())))
        named = [a for part in sharding.spec if part is not None
                 for a in (part if isinstance(part, tuple) else (part,))]
        if not named or all(kinds.get(a) == AxisType.Auto for a in named):
            return None
        return sharding.spec if set(named) <= set(mesh.axis_names) else PartitionSpec()

    def placed(x):
        # An input typed with Explicit axes (sharded over a data axis of the mesh
        # jax.make_mesh builds) moves to the same spec on the Auto CP mesh: the program is
        # built there, and under grad device_put's transpose gives the cotangent the
        # input's own type back.
        spec = explicit(x)
        if spec is not None:
            return jax.device_put(x, NamedSharding(mesh, spec))
        value = compat.concrete_primal(x)
        if isinstance(value, jax.Array) and value.committed \
                and value.sharding.device_set != devices:
            return jax.device_put(x, replicated)
        return x

    return [placed(x) for x in leaves], home


def _home_device(leaves: list, mesh):
    """The one device every array committed outside ``mesh`` is on (None when no array
    is, or they are on several devices, which one device would refuse)."""
    devices = set(mesh.devices.flat)
    homes = set()
    for x in leaves:
        value = compat.concrete_primal(x)
        if isinstance(value, jax.Array) and value.committed \
                and value.sharding.device_set != devices:
            homes.add(frozenset(value.sharding.device_set))
    (home,) = homes if len(homes) == 1 else ((),)
    return next(iter(home)) if len(home) == 1 else None


def _at_home(flat_out: list, home) -> list:
    """The outputs committed to ``home``, the device the inputs were committed to (as the
    undecorated function's would be), or left on the mesh (``home`` None)."""
    return flat_out if home is None else [jax.device_put(o, home) for o in flat_out]


def _is_transform_mesh(abstract, options: Options) -> bool:
    """Whether the abstract mesh ``abstract`` has the axis names and sizes of the mesh the
    transform builds for ``options`` (the one given, or ``cp`` devices on its one axis)."""
    if options.mesh is not None:
        names, sizes = options.mesh.axis_names, options.mesh.devices.shape
    else:
        names, sizes = options.axes, (options.cp or len(jax.devices()),)
    return (tuple(abstract.axis_names), tuple(abstract.axis_sizes)) == \
        (tuple(names), tuple(sizes))


def refuse_set_mesh_gradients(name: str, leaves: list, mesh) -> None:
    """Raise when differentiated inside a ``jax.set_mesh`` context whose mesh has Explicit
    axes and is not the transform's mesh: JAX builds the cotangents of the transformed
    program's outputs with the program's shardings (over its CP mesh) under that context,
    which it refuses. On the transform's own mesh the call runs with the context's axes
    made Auto (:meth:`ContextParallelFunction._call_typed`); the forward call alone works
    under any mesh."""
    explicit = compat.context_mesh_explicit_axes()
    if explicit and compat.differentiated(leaves):
        raise ContextParallelError(
            f"{name} is differentiated inside `with jax.set_mesh(...)` whose mesh has "
            f"Explicit axes {explicit} and is not the transform's mesh {dict(mesh.shape)}: "
            "the gradient's cotangents would be built over the transform's mesh under "
            "that context, which JAX refuses. Give the transform the context's mesh, "
            "context_parallel(..., mesh=mesh, axis=<its CP axis>), or apply jax.grad / "
            "jax.value_and_grad / jax.jvp outside the `with jax.set_mesh(...)` block")


def refuse_forward_over_reverse(name: str, leaves: list) -> None:
    """Raise for a forward-mode derivative of a reverse-mode one (``jax.jvp`` of
    ``jax.grad``, ``jax.hessian``): the schedules define reverse mode, and forward mode is
    their VJP transposed, which cannot itself be differentiated forward again."""
    if compat.forward_over_reverse(leaves):
        raise ContextParallelError(
            f"{name} is differentiated in reverse mode inside a forward-mode derivative "
            "(jax.jvp of jax.grad, jax.hessian, jax.jacfwd of jax.jacrev), which the "
            "context-parallel schedules do not support. Differentiate in reverse mode "
            "twice instead: a Hessian-vector product as "
            "jax.grad(lambda p: jnp.vdot(jax.grad(f)(p), v))(p), a Hessian as "
            "jax.jacrev(jax.jacrev(f))")


class _Program:
    """The transformed program, jitted, in the two forms its derivatives need.

    ``reverse``: the program as lowered, whose schedules are ``custom_vjp``s (``grad``,
    ``vjp``, no derivative). ``forward``: the same with a JVP rule built from its VJP
    (:func:`~cptransform.api.forward_mode.with_forward_mode`), built on first use for
    forward-mode tangents only: under reverse mode that rule would trace the transpose of
    every schedule's backward, several times the cost of tracing the program."""

    def __init__(self, flat_call: Callable):
        self.reverse = jax.jit(flat_call)
        self._flat_call = flat_call
        self._forward = None

    def for_arguments(self, flat: list) -> Callable:
        """The form to call on ``flat`` (forward mode when any carries a JVP tangent)."""
        if not compat.forward_differentiated(flat):
            return self.reverse
        if self._forward is None:
            self._forward = jax.jit(with_forward_mode(self._flat_call))
        return self._forward


class ContextParallelFunction:
    """The result of :func:`context_parallel`: call it like the original function."""

    def __init__(self, fn: Callable, options: Options):
        options.check()
        self.fn = fn
        self.options = options
        self._built: dict = {}
        self._stats: dict = {}
        #: The output types of the undecorated function inside ``jax.set_mesh`` of an
        #: Explicit-axes mesh, by argument types (:meth:`_call_typed`).
        self._types: dict = {}
        #: The :class:`TransformStats` of the most recent transform (``None`` before the
        #: first call): per-pass wall times, for programs and profiles to read.
        self.last_transform_stats: TransformStats | None = None
        functools.update_wrapper(self, fn)

    # -- building --
    def module(self, *args, **kwargs) -> Module:
        """The transformed program for these arguments (arrays or ShapeDtypeStructs); its
        output is ``(fn's output, new values of the argument leaves fn writes)``."""
        return self._build(args, kwargs)[0]

    def _build(self, args, kwargs):
        split = self.options.split(args, kwargs)
        key = self._key(split)
        if key not in self._built:
            with compat.no_mesh_context(), gc_paused():
                self._built[key], self._stats[key] = self._transform(split, args, key[-1])
            self.last_transform_stats = self._stats[key]
        final, written, call = self._built[key]
        return final, written, call, split

    def _key(self, split: CallArguments) -> tuple:
        """One program per signature, static arguments and caller's mesh context (last:
        the context's mesh when it is the transform's own, whose axes its model's
        annotations may name; a context of another mesh is not traced under, as the
        program the transform builds runs on its own mesh)."""
        context = compat.context_mesh()
        if context is not None and not _is_transform_mesh(context, self.options):
            context = None
        return (_signature(split.args, split.kwargs), split.static_key, context)

    def _transform(self, split: CallArguments, args: tuple, context):
        abstract = jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct(np.shape(x), jax.numpy.result_type(x)),
            (split.args, split.kwargs))
        name, written = getattr(self.fn, "__name__", "fn"), []
        log.info("%s: tracing", name)
        start = time.perf_counter()
        # Traced under the caller's mesh context (Auto axes), as the function itself would
        # be: the model's own annotations (Flax's logical constraints, a PartitionSpec
        # without a mesh) resolve against it; lowering re-expresses them on the CP mesh.
        with _tracing(name), compat.mesh_context(context):
            module = trace(returning_argument_writes(split.bind(self.fn), name, written),
                           *abstract[0], name=name, **abstract[1])
        traced = time.perf_counter() - start
        refuse_gradients(module)
        overrides = _seq_axis_overrides(self.options.seq_axes, args, split.traced_positions())
        module = prepare(module, self.options, overrides)
        result = cp_pipeline(module, self.options).run(module)
        final = result.module
        report_unsharded(final, self.options)
        stats = TransformStats(name, traced, result.timings)
        log.info("%s", stats.describe())
        return (final, tuple(written), _Program(final.flat_call)), stats

    # -- calling --
    def __call__(self, *args, **kwargs):
        if _TRACING.get() is not None:
            return self.fn(*args, **kwargs)
        final, written, call, split = self._build(args, kwargs)
        arguments = (split.args, split.kwargs)
        leaves = jax.tree_util.tree_leaves(arguments)
        refuse_forward_over_reverse(final.name, leaves)
        mesh = final.facts.mesh
        traced = any(isinstance(x, jax.core.Tracer) for x in leaves)
        # Traced (under an outer jit or grad) this binds the program, and JAX linearizes
        # it here; called on arrays it runs it, which needs no pause.
        with gc_paused() if traced else contextlib.nullcontext():
            if compat.context_mesh_explicit_axes() and compat.context_mesh_is(mesh):
                flat_out = self._call_typed(call, split, leaves)
            else:
                refuse_set_mesh_gradients(final.name, leaves, mesh)
                flat, home = _on_mesh(leaves, mesh)
                with compat.no_mesh_context():
                    flat_out = _at_home(call.for_arguments(flat)(*flat), home)
        out, writes = jax.tree_util.tree_unflatten(final.out_tree, flat_out)
        write_back(arguments, written, writes)
        return out

    def _call_typed(self, call: _Program, split: CallArguments, leaves: list) -> list:
        """The program called inside ``jax.set_mesh`` of its own mesh with Explicit axes
        (``jax.make_mesh``'s default): run with the context's axes made Auto, as the
        program's mesh has them, its outputs given the types the undecorated function's
        outputs have there (``jax.sharding.auto_axes``; the types come from
        ``jax.eval_shape`` of the function, once per argument types). Differentiated there,
        the cotangents are built with those types, which the context accepts."""
        key = (_signature(split.args, split.kwargs), split.static_key,
               tuple(jax.typeof(x) for x in leaves))
        if key not in self._types:
            typed = jax.tree_util.tree_map(
                lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype,
                                               sharding=jax.typeof(x).sharding),
                (split.args, split.kwargs))
            name = getattr(self.fn, "__name__", "fn")
            with _tracing(name):
                out = jax.eval_shape(returning_argument_writes(split.bind(self.fn), name, []),
                                     *typed[0], **typed[1])
            self._types[key] = [PartitionSpec() if t.sharding is None else t.sharding.spec
                                for t in jax.tree_util.tree_leaves(out)]
        program = jax.sharding.auto_axes(lambda *flat: call.for_arguments(flat)(*flat),
                                         out_sharding=self._types[key])
        if not compat.forward_differentiated(leaves):
            leaves = [compat.typed_cotangent(x) for x in leaves]
        return program(*leaves)

    def lower(self, *args, **kwargs):
        """``jax.jit(...).lower`` of the transformed program (ShapeDtypeStructs allowed)."""
        _, _, call, split = self._build(args, kwargs)
        with compat.no_mesh_context():
            return call.reverse.lower(*jax.tree_util.tree_leaves((split.args, split.kwargs)))

    def explain(self, *args, leaks: bool = False, verbose: bool = False, **kwargs) -> str:
        """A readable account of what the transform does for these arguments: the plan,
        identical attentions once, each at the nearest line of the user's code.

        ``verbose=True`` adds the notes about what was not asked for (softmaxes left alone,
        schedules excluded, every candidate's cost, every layout). ``leaks=True`` also
        compiles the transformed program for them and lists its sharding leaks
        (all-gathers of the whole sequence outside the attention schedules). It is opt-in
        because compiling costs seconds on the demo, far more than the rest of the report.
        (Keyword arguments of the function named ``leaks`` or ``verbose`` go positionally.)"""
        from cptransform.api.explain import explain_module
        hlo = self.lower(*args, **kwargs).compile().as_text() if leaks else None
        return explain_module(self.module(*args, **kwargs), self.options, hlo,
                              verbose=verbose)

    def plan(self, *args, **kwargs):
        """The typed :class:`~cptransform.api.plan.Plan` for these arguments (arrays or
        ShapeDtypeStructs): per distinct attention its schedule, layout, kernel, bytes and
        predicted times, the layouts' balance, the conversions and the pass timings."""
        from cptransform.api.plan import build_plan
        final, _, _, split = self._build(args, kwargs)
        return build_plan(final, self._stats[self._key(split)].passes)


def context_parallel(fn: Callable | None = None, **options) -> Any:
    """Run ``fn`` with its sequence sharded over ``cp`` devices; same results.

    Usable as ``@context_parallel`` or ``@context_parallel(cp=8, schedule="ring", ...)``.

    Options (:data:`~cptransform.api.options.OPTIONS` declares each: type, default, allowed
    values, help): ``cp`` (devices; default all), ``mesh`` (an existing mesh) and ``axis``
    (its CP axis name, or ``(inner, outer)`` for a two-axis schedule: hybrid's
    ``(ulysses_axis, ring_axis)``), ``schedule`` (a registered schedule, or ``auto``: price
    each feasible one, halo included, and take the fastest), ``load_balance`` (a sequence
    layout, ``none`` for contiguous, or ``auto``: the layout with the least predicted time
    over all attentions; "documents" is refused), ``kernel`` (a registered local-step
    kernel, or ``auto``: per attention the fastest that runs it), ``seq_axes`` (override: a
    tuple mirroring the positional arguments with an int dim, a tuple of dims, or None per
    argument, or a pytree prefix of the argument with those as leaves, as ``jax.vmap``'s
    ``in_axes``), ``strict`` (refuse non-equivariant ops instead of wrapping them, and a
    function with no attention), ``keep_permuted`` (leave outputs in the load-balanced
    order), ``static_argnums`` / ``static_argnames`` (as ``jax.jit``; arguments holding no
    array — Python bools, ints, floats, strings — are static too), ``hardware`` (a row of
    :data:`~cptransform.analysis.hardware.HARDWARE` the planner prices schedules on;
    default: the devices' own row), ``memory_limit`` (per-device bytes the local step of an
    ``auto`` choice may use: an int, or ``"80%"`` of the hardware's memory; default all of
    it). ``schedule="hybrid"`` with only ``cp`` lets the planner choose the Ulysses degree
    and build the two-axis mesh.
    """
    known = set(OPTIONS)
    unknown = sorted(set(options) - known)
    if unknown:
        raise ContextParallelOptionError(
            f"unknown option(s) {', '.join(u + did_you_mean(u, known) for u in unknown)}; "
            f"context_parallel takes {', '.join(sorted(known))}")
    opts = Options(**options)
    if fn is None:
        return lambda f: ContextParallelFunction(f, opts)
    return ContextParallelFunction(fn, opts)
