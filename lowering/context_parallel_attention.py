"""``attention_p`` computed context-parallel: the entry point.

:func:`context_parallel_attention` takes the global operands of an ``attention_p`` and
returns exactly what ``attention_p`` returns, computed by a *schedule* under
``jax.shard_map`` over the CP mesh axes only (other mesh axes stay automatic).

The schedules are :class:`~cptransform.lowering.schedule.Schedule` records (see
:mod:`cptransform.lowering.schedule` for what a schedule's local function receives); this
module checks the request against the record, brings the operands to the canonical layout
and layout order, and runs the record's function under ``shard_map``.

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
from dataclasses import replace
from typing import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from cptransform.analysis.attention_shape import attention_shape
from cptransform.ir.errors import ContextParallelError
from cptransform.lowering.block import Block
from cptransform.lowering.kernels import get_kernel
from cptransform.lowering.schedule import MESH_AXES_HINT, schedules
from cptransform.op.attention import attention_p
from cptransform.op.attention_reference import flatten_batch, from_canonical, split_operands, \
    to_canonical
from cptransform.op.attention_spec import AttentionSpec, Layout
from cptransform.op.layouts import LAYOUTS, LayoutError, SequenceLayout

_CANONICAL = Layout.parse("BTHD")


def sequence_mesh_axes(axes: Sequence[str]) -> tuple[str, ...]:
    """The mesh axes the sequence dim is sharded over, major first (``axes`` reversed)."""
    return tuple(reversed(tuple(axes)))


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
      schedule: a name in :func:`~cptransform.lowering.schedule.schedules` (``ring``,
        ``ulysses``, ``allgather``, ``hybrid``).
      layout: ``contiguous``, ``zigzag`` or ``striped`` (which positions each rank holds).
      kernel: local-step kernel, ``xla``, ``pallas`` or ``auto`` (``xla`` for a top-k
        mask, which the Pallas kernels refuse).
      in_layout_order: the sequence axes of the operands (and of the output) are already in
        layout order; positions, if given, are then the positions of that order.

    Returns the output in q's layout, dtype and (unless ``in_layout_order``) order.
    Differentiable and jit-able.
    """
    known = schedules()
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    if schedule not in known:
        raise ContextParallelError(
            f"unknown schedule {schedule!r}; use one of {', '.join(sorted(known))}")
    record = known[schedule]
    want = record.mesh_axes
    if len(axes) != want:
        raise ContextParallelError(
            f"schedule {schedule!r} runs over {want} mesh {'axes' if want > 1 else 'axis'}, "
            f"got {axes}; {MESH_AXES_HINT[want]}")
    if layout not in LAYOUTS:
        raise ContextParallelError(f"unknown layout {layout!r}; use one of {', '.join(LAYOUTS)}")
    # "auto" means the fastest kernel that computes this mask: the Pallas kernels do not
    # read top-k indices, the chunked XLA kernel does.
    local_kernel = get_kernel("xla" if kernel == "auto" and spec.mask.topk else kernel)
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
    # Checked here, outside shard_map, so the error names the mesh axes and their sizes.
    ulysses = mesh.shape[axes[0]] if len(axes) == 2 else 1
    shape = attention_shape(spec, a["q"], a["k"], a["v"], cp=cp, ulysses=ulysses,
                            layout=layout)
    # Positions handed over in layout order are the layout's own (what reorder-sequence
    # writes); only positions in natural order come from the caller's program.
    problem = record.feasible(replace(shape, explicit_positions=spec.positions
                                      and not in_layout_order))
    if problem:
        sizes = ", ".join(f"{name!r} of size {mesh.shape[name]}" for name in axes)
        raise ContextParallelError(f"{schedule}: {problem} (mesh axes {sizes})")

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

    def query_rows(x):
        # Top-k indices are global key positions: only their rows follow the queries'
        # layout; the values are compared with the keys' positions, whatever the layout.
        x = flatten_batch(x, nb, batch_shape)
        if x is None or in_layout_order:
            return x
        return q_layout.permute(x.astype(jnp.int32), axis=2)

    block = Block(
        q=in_order(q, q_layout), k=in_order(k, kv_layout), v=in_order(v, kv_layout),
        q_pos=positions(a["q_positions"], q_layout),
        kv_pos=positions(a["kv_positions"], kv_layout),
        q_seg=in_order(flatten_batch(a["q_segment_ids"], nb, batch_shape), q_layout),
        kv_seg=in_order(flatten_batch(a["kv_segment_ids"], nb, batch_shape), kv_layout),
        mask=dense(a["mask"]), bias=dense(a["bias"]),
        sinks=flatten_batch(a["sinks"], nb, batch_shape), topk=query_rows(a["topk_indices"]))
    seq = sequence_mesh_axes(axes)
    # Token operands are sharded on their sequence dim (1), per-pair ones on their rows (2);
    # the sinks have no sequence dim: every device holds them all.
    sharding = block.replace(**{
        name: P() if name == "sinks" else
        P(None, None, seq) if name in ("mask", "bias", "topk") else P(None, seq)
        for name, x in vars(block).items() if x is not None})
    local_spec = spec.replace(q=_CANONICAL, k=_CANONICAL, v=_CANONICAL, positions=True,
                              layout=layout)

    def run(local):
        if local.sinks is not None:
            # The sinks are the same on every device. Marked device-varying here, the
            # backward sums their per-device gradients once at their own [B|1, H] size,
            # not at the size of the first per-row value they are broadcast into.
            local = local.replace(sinks=lax.pcast(local.sinks, axes, to="varying"))
        return record.run(local, spec=local_spec, axes=axes, kernel=local_kernel)

    o = jax.shard_map(run, mesh=mesh, in_specs=(sharding,), out_specs=P(None, seq),
                      axis_names=set(axes))(block)
    if not in_layout_order:
        o = q_layout.unpermute(o, axis=1)
    o = o.reshape(tuple(batch_shape) + o.shape[1:]) if nb else o[0]
    return from_canonical(spec, o).astype(a["q"].dtype)


__all__ = ["context_parallel_attention", "ContextParallelError", "sequence_mesh_axes"]
