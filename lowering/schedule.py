"""What a context-parallel schedule is: one :class:`Schedule` record each, and the registry.

A schedule module of this package (``ring.py``, ``ulysses.py``, …) defines its local
function, its statement (transfers, kernel calls, local step) and its feasibility check,
and registers them as one record with :func:`register_schedule`. :func:`schedules`
imports every module of the package on first use, so adding a schedule is one new module
(and its tests): the entry point, the planner, ``context_parallel``'s options and the CLI
all read :func:`schedules`.

The local function, ``run(block, *, spec, axes, kernel) -> o``, runs under ``shard_map``
and receives:

* ``block``: a :class:`~cptransform.lowering.block.Block` of the per-device canonical
  operands; positions are the global positions of the local tokens; ``mask``/``bias`` rows
  are the local queries, columns *all* keys in layout order (the order in which the KV
  shards are concatenated, rank by rank);
* ``spec``: the :class:`AttentionSpec` with canonical ``BTHD`` layouts,
  ``positions=True`` and ``layout`` the sequence layout (read scale, softcap, groups, mask
  and ``mask.empty_rows`` from it);
* ``axes``: the CP mesh axis names, ``mesh_axes`` of them (hybrid:
  ``(ulysses_axis, ring_axis)``);
* ``kernel``: a :class:`~cptransform.lowering.kernels.Kernel` for the local step;

and returns ``o [B, Tq_loc, H, Dv]`` in ``q.dtype``, with the sinks merged once
(:func:`with_sinks`) and then ``empty_rows`` honoured (see :func:`fill_empty_rows_sharded`).
"""
from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from cptransform.analysis.attention_shape import AttentionShape
from cptransform.analysis.block_work import Work
from cptransform.analysis.cost_model import CommVolume
from cptransform.analysis.hardware import Hardware
from cptransform.analysis.prediction import Prediction, predict
from cptransform.analysis.schedule_statement import Statement
from cptransform.lowering.block import Block
from cptransform.op.accumulation import accumulator_dtype
from cptransform.op.attention_reference import added_fill_term, fill_empty_rows, merge_sinks
from cptransform.op.attention_spec import AttentionSpec


@dataclass(frozen=True)
class InnerAxis:
    """How a schedule over two mesh axes splits the CP devices: an inner axis of ``U``
    consecutive devices (the fastest links) and an outer one of ``cp / U``.

    * ``degree``: what ``U`` is called in plans and errors (``"Ulysses degree"``);
    * ``outer``: what the outer axis runs (``"ring"``);
    * ``names``: the mesh axis names (inner, outer) of the mesh the planner builds when
      the schedule is asked for with one CP axis (``cp`` only);
    * ``divides_kv_heads``: ``U`` must divide every attention's KV heads to be chosen
      (so none is repeated).
    """

    degree: str
    outer: str
    names: tuple[str, str]
    divides_kv_heads: bool = False


@dataclass(frozen=True)
class Schedule:
    """One context-parallel schedule.

    * ``name``: what users pass as ``schedule=``;
    * ``mesh_axes``: how many CP mesh axes it runs over;
    * ``run``: the local function run under ``shard_map`` (see the module doc);
    * ``statement(shape)``: what it does for ``shape``, stated once
      (:class:`~cptransform.analysis.schedule_statement.Statement`: its transfers, the
      blocks each device's kernel calls meet, its local step); its volume, work, memory,
      steps, prediction and plan chart are read off it;
    * ``feasible(shape)``: why it cannot run ``shape``, or ``None`` when it can;
    * ``order``: its place in listings (plans, ``explain``, CLI choices);
    * ``automatic``: the planner's ``auto`` may choose it (otherwise only on request);
    * ``inner``: for a schedule over two mesh axes, how it splits them (:class:`InnerAxis`):
      the first of its ``axes`` is the inner one, of ``shape.ulysses`` devices. What a
      schedule does is read off its record, never off how many axes a mesh has.

    :meth:`predict` prices it on a :class:`~cptransform.analysis.hardware.Hardware` row.
    """

    name: str
    mesh_axes: int
    run: Callable
    statement: Callable[[AttentionShape], Statement]
    feasible: Callable[[AttentionShape], str | None]
    order: int = 0
    automatic: bool = True
    inner: InnerAxis | None = None

    def volume(self, shape: AttentionShape) -> CommVolume:
        """Its per-device :class:`CommVolume` for ``shape``, forward and backward."""
        return _stated(self, shape).volume(self.name)

    def work(self, shape: AttentionShape) -> Work:
        """The :class:`~cptransform.analysis.block_work.Work` of its local steps (executed
        FLOPs of the slowest device after block skipping, load balance)."""
        return _worked(self, shape)

    def peak_memory(self, shape: AttentionShape) -> int:
        """Peak bytes per device of its local step."""
        return _stated(self, shape).memory(shape)

    def overlaps(self, shape: AttentionShape) -> bool:
        """Its transfers overlap the compute (``Transfer.overlapped``); the planner prefers
        it between schedules predicted within 1% of each other."""
        return _stated(self, shape).overlaps()

    def predict(self, shape: AttentionShape, hardware: Hardware,
                spans: tuple[int, ...] | None = None, kernel: str | None = None) -> Prediction:
        """Its :class:`Prediction` for ``shape`` on ``hardware``; ``spans[i]``: how many
        consecutive devices a group of its mesh axis ``i`` spans (default: Ulysses groups
        of consecutive devices, the ring across them); ``kernel``: the local step's kernel,
        whose measured rates on ``hardware`` are used where the row has them."""
        if spans is None:
            spans = (shape.ulysses, shape.cp) if self.inner is not None else (shape.cp,)
        said = _stated(self, shape)
        masked = "full" if shape.band == (None, None) else "causal"
        return predict(self.name, said.volume(self.name), _worked(self, shape),
                       said.memory(shape), said.steps(), shape.q_padded,
                       shape.dtype_bytes, hardware, spans,
                       None if kernel is None else (kernel, masked), devices=shape.cp)


# The planner asks every schedule about every attention several times (volume, work,
# memory, prediction under each layout), and a loop's layers are equal attentions; the work
# counts the block pairs of every device's kernel calls, which made plan-context-parallel
# the slowest pass of a Python-loop model. Both are pure functions of the (frozen) records.
@lru_cache(maxsize=4096)
def _stated(schedule: Schedule, shape: AttentionShape) -> Statement:
    return schedule.statement(shape)


@lru_cache(maxsize=4096)
def _worked(schedule: Schedule, shape: AttentionShape) -> Work:
    return _stated(schedule, shape).work(shape)


#: Registered schedules by name; read them through :func:`schedules`.
SCHEDULES: dict[str, Schedule] = {}


def register_schedule(schedule: Schedule) -> Schedule:
    """Register ``schedule`` under its name; returns it."""
    SCHEDULES[schedule.name] = schedule
    return schedule


def schedules() -> dict[str, Schedule]:
    """Every schedule by name, in listing order, after importing the modules of
    ``cptransform.lowering`` (the schedule modules register themselves)."""
    package = importlib.import_module("cptransform.lowering")
    for module in pkgutil.iter_modules(package.__path__):
        if not module.ispkg:
            importlib.import_module(f"{package.__name__}.{module.name}")
    return dict(sorted(SCHEDULES.items(), key=lambda item: (item[1].order, item[0])))


def any_length(shape: AttentionShape) -> str | None:
    """``None``: the feasibility of a schedule that runs every shape. No length is refused,
    since the entry point pads both sequences to their layout's multiple (and queries and
    keys may differ in length)."""
    return None


def key_count(spec: AttentionSpec, padded: int) -> int:
    """The number of real keys of an attention whose keys were padded to ``padded``: what
    the ``"uniform"`` fill divides the sum of V by (pad V rows are zero)."""
    return padded if spec.real_keys is None else spec.real_keys


def mesh_axes_hint(want: int) -> str:
    """How to fix a schedule given the wrong number of CP mesh axes, ``want`` the number it
    needs: the registered schedules that run over the other number."""
    def over(count: int) -> str:
        return " or ".join(repr(n) for n, s in schedules().items() if s.mesh_axes == count)
    if want == 1:
        return (f"put the CP devices on one mesh axis, or use a two-axis schedule ({over(2)}) "
                "with axes=(inner_axis, outer_axis)")
    return f"give axes=(inner_axis, outer_axis), or use {over(1)} over one axis"


def differentiable(forward: Callable, backward: Callable) -> Callable:
    """A schedule's attention as a ``custom_vjp``, wired once (tokamax's ``Op``).

    ``forward(block, *static) -> (outputs, residuals)`` and
    ``backward(*static, residuals, cotangents) -> (dq, dk, dv, dbias)`` are the schedule's
    bodies (``static``: hashable arguments such as the spec, mesh axes and kernel;
    ``dbias`` is ``None`` without a bias; gradients in any float dtype, the float32 of
    the accumulators). The returned ``attend(block, *static) -> outputs`` differentiates
    w.r.t. the block's q, k, v and bias, each gradient cast to its operand's dtype here.
    """
    @partial(jax.custom_vjp, nondiff_argnums=(1, 2))
    def op(block, dtypes, static):
        return forward(tied(block), *static)[0]

    def op_fwd(block, dtypes, static):
        return forward(tied(block), *static)

    def op_bwd(dtypes, static, residuals, cotangents):
        dq, dk, dv, dbias = backward(*static, residuals, cotangents)
        q, k, v, bias = dtypes
        return (Block(q=dq.astype(q), k=dk.astype(k), v=dv.astype(v),
                      bias=None if bias is None else dbias.astype(bias)),)

    op.defvjp(op_fwd, op_bwd)

    def attend(block, *static):
        bias = None if block.bias is None else block.bias.dtype
        return op(block, (block.q.dtype, block.k.dtype, block.v.dtype, bias), static)

    return attend


def tied(block: Block) -> Block:
    """``block`` with all its operands passed through one ``optimization_barrier``, so
    nothing the schedule derives from them is loop-invariant to JAX.

    Under ``jax.grad`` of a ``lax.scan`` over layers, JAX hoists what the scan body computes
    from its loop-invariant inputs alone out of the loop and saves it for the backward. The
    positions, segment ids and masks are such inputs, and the kernels derive per-pair tiles
    from them (the visible mask of every query chunk × key chunk of every ring step): saved,
    they are ``S_loc × S`` per head. Tied to the queries (which vary per layer), they are
    recomputed per pair as the flash kernels intend: a 1-layer Llama scan at 16K tokens
    over cp=8 held 1589 MiB of temp memory per device and holds what the unrolled model does.
    """
    leaves, tree = jax.tree_util.tree_flatten(block)
    return jax.tree_util.tree_unflatten(tree, lax.optimization_barrier(leaves))


def finished(block, spec: AttentionSpec, o, lse, axes: tuple[str, ...]):
    """The epilogue every schedule shares: ``(o, lse)`` of the local query rows over all
    keys with the sinks merged (:func:`with_sinks`), then ``empty_rows`` honoured from V
    sharded over ``axes`` (``()``: this device holds every key;
    :func:`fill_empty_rows_sharded`); ``o`` in ``q.dtype``."""
    o, lse = with_sinks(block, o, lse)
    kv_len = block.k.shape[1] * (lax.axis_size(axes) if axes else 1)
    return fill_empty_rows_sharded(spec, o, lse, block, axes, kv_len).astype(block.q.dtype)


def with_sinks(block, o, lse):
    """``(o, lse)`` of the local query rows over all keys, with ``block.sinks`` merged in
    (unchanged without sinks).

    Call it once, after the schedule has merged every key block of the rows, on the device
    that holds them (the sink is one logit per row: merging it per key block would count it
    once per block). It is plain JAX after the schedule's ``custom_vjp``, so the sink's
    gradient, ``-Σ_rows exp(sink - lse')·rowsum(dO∘O')``, comes from autodiff, and the
    cotangent it sends to ``lse`` reaches the kernels' backward as ``dlse``. The sinks are
    replicated over the CP axes (the entry point marks them device-varying), so the backward
    sums their per-device gradients with one all-reduce of ``[B|1, H]`` floats.
    """
    if block.sinks is None:
        return o, lse
    return merge_sinks(o, lse, block.sinks)


def fill_empty_rows_sharded(spec: AttentionSpec, o, lse, block, axes, kv_len: int):
    """``spec.mask.empty_rows`` for a schedule whose K/V (``block``'s) are sharded over
    ``axes``; ``o`` and ``lse`` are those of ``block``'s queries.

    Empty rows (:func:`~cptransform.op.attention_reference.empty_rows_of`) take the mean of
    V over all ``kv_len`` keys (a psum of the local sums; padded keys, whose V is zero, are
    not counted: :func:`key_count`) for ``"uniform"``, NaN times it for ``"nan"``; with
    ``"zero"`` ``o`` is returned unchanged. An added fill (``spec.mask.added_fill``) also
    gets the logits' gradient of one device (:func:`~cptransform.op.attention_reference.
    added_fill_term`, from psums of the local K/V sums). Pass ``axes=()`` when ``block``
    already holds every key.
    """
    if spec.mask.empty_rows == "zero":
        return o
    total = _key_sum(axes)(jnp.sum(block.v.astype(accumulator_dtype(block.v.dtype)), axis=1,
                                   keepdims=True))
    return fill_empty_rows(spec, o, lse, total / key_count(spec, kv_len),
                           added_fill_sharded(spec, block, axes, kv_len)).astype(o.dtype)


def added_fill_sharded(spec: AttentionSpec, block, axes, kv_len: int):
    """:func:`~cptransform.op.attention_reference.added_fill_term` of ``block``'s queries
    over all ``kv_len`` keys, ``block``'s K/V sharded over ``axes``; ``None`` unless
    ``spec.mask.added_fill``."""
    if not spec.mask.added_fill:
        return None
    return added_fill_term(spec, block.q, block.k, block.v, key_count(spec, kv_len),
                           _key_sum(axes))


def _key_sum(axes):
    """A sum over this device's keys completed to all keys: a psum over ``axes``."""
    return (lambda x: lax.psum(x, tuple(axes))) if axes else (lambda x: x)
