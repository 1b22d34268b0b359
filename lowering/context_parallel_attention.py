"""``attention_p`` computed context-parallel: the entry point and the schedule registry.

:func:`context_parallel_attention` takes the global operands of an ``attention_p`` and
returns exactly what ``attention_p`` returns, computed by a *schedule* under
``jax.shard_map`` over the CP mesh axes only (other mesh axes stay automatic).

A schedule is a local function registered with :func:`register_schedule`::

    fn(q, k, v, q_pos, kv_pos, q_seg, kv_seg, mask, bias, *, spec, axes, kernel) -> o

It receives per-device canonical arrays:

* ``q [B, Tq_loc, H, D]``, ``k [B, Tkv_loc, Hkv, D]``, ``v [B, Tkv_loc, Hkv, Dv]`` (``B`` =
  all batch dims flattened; a heads dim is always present);
* ``q_pos``/``kv_pos`` int32 ``[B|1, T_loc]``: global positions of the local tokens;
* ``q_seg``/``kv_seg`` ``[B|1, T_loc]`` or ``None``;
* ``mask`` bool and ``bias`` float ``[B|1, H|1, Tq_loc, Tkv_global]`` or ``None``: rows are
  the local queries, columns *all* keys in layout order (the order in which the KV shards
  are concatenated, rank by rank);
* ``spec``: the :class:`AttentionSpec` with canonical ``BTHD`` layouts and
  ``positions=True`` (read scale, softcap, groups, mask and ``mask.empty_rows`` from it);
* ``axes``: the CP mesh axis names (one for ring / ulysses / allgather; two,
  ``(ulysses_axis, ring_axis)``, for hybrid);
* ``kernel``: a :class:`~cptransform.lowering.kernel.LocalKernel` for the local step.

and returns ``o [B, Tq_loc, H, Dv]`` in ``q.dtype``, with ``empty_rows="uniform"`` honoured
(see :func:`fill_empty_rows_sharded`).

**Sequence sharding.** The sequence dims (in layout order) are split into
``prod(axes)`` contiguous shards, sharded over ``axes`` *reversed* — the last axis is the
major one. With one axis, rank ``r`` holds shard ``r``. For hybrid, ``axes = (u_axis,
r_axis)`` of sizes ``U`` and ``R``: device ``(u, r)`` holds shard ``r * U + u``, so a
Ulysses group (fixed ``r``) holds the contiguous layout-order range of shards
``r*U … r*U+U-1``, and ring step over ``r_axis`` moves such ``U``-shard groups; its mask
columns for ring source ``s`` are the contiguous range ``[s*U*Tkv_loc, (s+1)*U*Tkv_loc)``.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from cptransform.op.attention import attention_p
from cptransform.op.attention_reference import fill_empty_rows, flatten_batch, from_canonical, \
    split_operands, to_canonical
from cptransform.op.attention_spec import AttentionSpec, Layout
from cptransform.lowering.kernel import get_kernel
from cptransform.op.layouts import LAYOUTS, LayoutError, SequenceLayout
from cptransform.ir.errors import ContextParallelError

#: Schedules by name: local functions run under ``shard_map`` (see the module doc).
SCHEDULES: dict[str, Callable] = {}

_CANONICAL = Layout.parse("BTHD")


#: How many CP mesh axes each schedule runs over (absent: any number).
SCHEDULE_AXES: dict[str, int] = {}

_AXES_HINT = {1: "put the CP devices on one mesh axis, or use schedule='hybrid' with "
                 "axes=(ulysses_axis, ring_axis)",
              2: "give axes=(ulysses_axis, ring_axis), or use 'ring' or 'ulysses' over one "
                 "axis"}


def register_schedule(name: str, *, mesh_axes: int | None = None):
    """Decorator: register a local schedule function under ``name`` in :data:`SCHEDULES`;
    ``mesh_axes`` is the number of CP mesh axes it needs (checked before ``shard_map``)."""
    def register(fn):
        SCHEDULES[name] = fn
        if mesh_axes is not None:
            SCHEDULE_AXES[name] = mesh_axes
        return fn
    return register


def sequence_mesh_axes(axes: Sequence[str]) -> tuple[str, ...]:
    """The mesh axes the sequence dim is sharded over, major first (``axes`` reversed)."""
    return tuple(reversed(tuple(axes)))


def fill_empty_rows_sharded(spec: AttentionSpec, o, lse, v, axes, kv_len: int):
    """``empty_rows="uniform"`` for a schedule whose V is sharded over ``axes``.

    Rows with ``lse == -inf`` take the mean of V over all ``kv_len`` keys (a psum of the
    local sums); with ``empty_rows="zero"`` ``o`` is returned unchanged. Pass ``axes=()``
    when ``v`` already holds every key.
    """
    if spec.mask.empty_rows != "uniform":
        return o
    total = jnp.sum(v.astype(jnp.float32), axis=1, keepdims=True)
    if axes:
        total = lax.psum(total, tuple(axes))
    return fill_empty_rows(spec, o, lse, total / kv_len).astype(o.dtype)


def _ensure_schedules_registered() -> None:
    """Import the schedule modules (they register themselves); missing ones are skipped."""
    import importlib

    for module in ("ring", "ulysses", "allgather", "hybrid"):
        try:
            importlib.import_module(f"cptransform.lowering.{module}")
        except ModuleNotFoundError as err:
            if err.name != f"cptransform.lowering.{module}":
                raise


def context_parallel_attention(*operands, spec: AttentionSpec, mesh, axes,
                               schedule: str = "ring", layout: str = "contiguous",
                               kernel: str = "xla", in_layout_order: bool = False):
    """``attention_p(*operands, spec=spec)`` computed with a context-parallel schedule.

    Args:
      operands: global operands exactly as ``attention_p`` takes them (any layouts in
        ``spec``, any number of batch dims, optional positions / segment ids / mask / bias).
      spec: the attention's :class:`AttentionSpec`.
      mesh: a :class:`jax.sharding.Mesh` holding the CP axes (it may have others).
      axes: the CP mesh axis name, or a tuple of names (hybrid: ``(ulysses, ring)``).
      schedule: a name in :data:`SCHEDULES` (``ring``, ``ulysses``, ``allgather``, ``hybrid``).
      layout: ``contiguous``, ``zigzag`` or ``striped`` (which positions each rank holds).
      kernel: local-step kernel, ``xla``, ``pallas`` or ``auto``.
      in_layout_order: the sequence axes of the operands (and of the output) are already in
        layout order; positions, if given, are then the positions of that order.

    Returns the output in q's layout, dtype and (unless ``in_layout_order``) order.
    Differentiable and jit-able.
    """
    _ensure_schedules_registered()
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    if schedule not in SCHEDULES:
        raise ContextParallelError(
            f"unknown schedule {schedule!r}; use one of {', '.join(sorted(SCHEDULES))}")
    want = SCHEDULE_AXES.get(schedule)
    if want is not None and len(axes) != want:
        raise ContextParallelError(
            f"schedule {schedule!r} runs over {want} mesh {'axes' if want > 1 else 'axis'}, "
            f"got {axes}; {_AXES_HINT[want]}")
    if layout not in LAYOUTS:
        raise ContextParallelError(f"unknown layout {layout!r}; use one of {', '.join(LAYOUTS)}")
    local_kernel = get_kernel(kernel)
    missing = [a for a in axes if a not in mesh.axis_names]
    if missing or not axes:
        raise ContextParallelError(
            f"CP axes {axes} must be non-empty names of the mesh axes {mesh.axis_names}")
    jax.eval_shape(lambda *xs: attention_p.bind(*xs, spec=spec), *operands)

    a = split_operands(spec, operands)
    q, k, v = to_canonical(spec, a["q"], a["k"], a["v"])
    nb = len(spec.q.batch)
    batch_shape = q.shape[:nb]
    q, k, v = (flatten_batch(x, nb, batch_shape) for x in (q, k, v))
    tq, tkv = q.shape[1], k.shape[1]
    cp = math.prod(mesh.shape[name] for name in axes)
    try:
        q_layout = SequenceLayout(layout, tq, cp)
        kv_layout = SequenceLayout(layout, tkv, cp)
    except LayoutError as err:
        raise ContextParallelError(f"{err} (schedule {schedule!r} over mesh axes {axes})") \
            from None

    def positions(given, lay):
        if given is not None:
            pos = flatten_batch(given, nb, batch_shape).astype(jnp.int32)
            return pos if in_layout_order else lay.permute(pos, axis=1)
        return jnp.asarray(lay.permutation(), dtype=jnp.int32)[None]

    def in_order(x, lay):
        return x if x is None or in_layout_order else lay.permute(x, axis=1)

    def dense(x):
        x = flatten_batch(x, nb, batch_shape)
        if x is None or in_layout_order:
            return x
        return kv_layout.permute(q_layout.permute(x, axis=2), axis=3)

    local = {
        "q": in_order(q, q_layout), "k": in_order(k, kv_layout), "v": in_order(v, kv_layout),
        "q_pos": positions(a["q_positions"], q_layout),
        "kv_pos": positions(a["kv_positions"], kv_layout),
        "q_seg": in_order(flatten_batch(a["q_segment_ids"], nb, batch_shape), q_layout),
        "kv_seg": in_order(flatten_batch(a["kv_segment_ids"], nb, batch_shape), kv_layout),
        "mask": dense(a["mask"]),
        "bias": dense(a["bias"]),
    }
    present = {name: x for name, x in local.items() if x is not None}
    seq = sequence_mesh_axes(axes)
    sharding = {"q": P(None, seq), "k": P(None, seq), "v": P(None, seq),
                "q_pos": P(None, seq), "kv_pos": P(None, seq), "q_seg": P(None, seq),
                "kv_seg": P(None, seq), "mask": P(None, None, seq), "bias": P(None, None, seq)}
    local_spec = spec.replace(q=_CANONICAL, k=_CANONICAL, v=_CANONICAL, positions=True)
    fn = SCHEDULES[schedule]

    def run(xs):
        args = {name: xs.get(name) for name in local}
        return fn(*args.values(), spec=local_spec, axes=axes, kernel=local_kernel)

    o = jax.shard_map(run, mesh=mesh, in_specs=({n: sharding[n] for n in present},),
                      out_specs=P(None, seq), axis_names=set(axes))(present)
    if not in_layout_order:
        o = q_layout.unpermute(o, axis=1)
    o = o.reshape(tuple(batch_shape) + o.shape[1:]) if nb else o[0]
    return from_canonical(spec, o).astype(a["q"].dtype)


__all__ = ["SCHEDULES", "register_schedule", "context_parallel_attention",
           "ContextParallelError", "fill_empty_rows_sharded", "sequence_mesh_axes"]
