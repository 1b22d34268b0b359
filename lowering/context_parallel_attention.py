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
from cptransform.ir.errors import ContextParallelError, KernelError, unknown_name
from cptransform.lowering.block import Block
from cptransform.op.attention_spec import ROLES
from cptransform.op.operand_roles import Side
from cptransform.lowering.kernels import ProfiledKernel, kernels
from cptransform.lowering.kernels.capabilities import choose_kernel, warn_passed_over
from cptransform.lowering.padding import pad_block
from cptransform.lowering.schedule import mesh_axes_hint, schedules
from cptransform.lowering.seq_permute import converted
from cptransform.op.attention import attention_p
from cptransform.op.attention_reference import flatten_batch, from_canonical, split_operands, \
    to_canonical
from cptransform.op.attention_spec import AttentionSpec, Layout
from cptransform.op.layouts import LAYOUTS, SequenceLayout, layout_multiple, padded_length

_CANONICAL = Layout.parse("BTHD")


def sequence_mesh_axes(axes: Sequence[str]) -> tuple[str, ...]:
    """The mesh axes the sequence dim is sharded over, major first (``axes`` reversed)."""
    return tuple(reversed(tuple(axes)))


def permute_block(block: Block, q_layout: SequenceLayout, kv_layout: SequenceLayout,
                  mesh, seq: tuple[str, ...]) -> Block:
    """``block``'s token and dense operands from natural order to layout order: queries
    by ``q_layout``, keys by ``kv_layout``; the sharded dims by collectives
    (:func:`~cptransform.lowering.seq_permute.converted`)."""
    def move(x, role):
        lay = kv_layout if role.side is Side.KEY else q_layout
        x = converted(x, layout=lay, dim=role.token_axis, inverse=False, mesh=mesh, seq=seq)
        # Rows are sharded with the queries; every device holds all key columns. (Top-k
        # picks name global key positions: only their rows move.)
        return kv_layout.permute(x, axis=3) if role.columns else x

    return block.by_role(lambda x, r: x if r.side is Side.HEADS else move(x, r))


def _checked_schedule(schedule: str, axes: tuple[str, ...], layout: str):
    """The :class:`~cptransform.lowering.schedule.Schedule` record named ``schedule``, once
    its name, its number of mesh axes and ``layout`` are checked."""
    known = schedules()
    if schedule not in known:
        raise ContextParallelError(
            unknown_name("schedule", schedule, sorted(known)))
    record = known[schedule]
    want = record.mesh_axes
    if len(axes) != want:
        raise ContextParallelError(
            f"schedule {schedule!r} runs over {want} mesh {'axes' if want > 1 else 'axis'}, "
            f"got {axes}; {mesh_axes_hint(want)}")
    if layout not in LAYOUTS:
        raise ContextParallelError(unknown_name("layout", layout, LAYOUTS))
    return record


def resolve_kernel(spec: AttentionSpec, requested: str, operands) -> ProfiledKernel:
    """The local-step kernel of this attention: the one ``plan-context-parallel`` wrote on
    the spec (``spec.kernel``), else, for a spec that was never planned (a direct call),
    the one :func:`choose_kernel` picks for ``requested`` here (a warning names the ones
    ``"auto"`` passed over)."""
    known = kernels()
    if spec.kernel is not None:
        if spec.kernel not in known:
            raise KernelError(unknown_name("kernel", spec.kernel, sorted(known)))
        return ProfiledKernel(known[spec.kernel])
    local_kernel, reason = choose_kernel(
        requested, spec, operands[0].dtype,
        (operands[0].shape[spec.q.feature], operands[2].shape[spec.v.feature]), known)
    warn_passed_over(reason)
    return ProfiledKernel(local_kernel)


def _check_mesh_and_operands(mesh, axes: tuple[str, ...], spec: AttentionSpec, operands):
    """One clear error for CP axes the mesh lacks, or operands ``attention_p`` refuses."""
    missing = [a for a in axes if a not in mesh.axis_names]
    if missing or not axes:
        raise ContextParallelError(
            f"CP axes {axes} must be non-empty names of the mesh axes {mesh.axis_names}")
    jax.eval_shape(lambda *xs: attention_p.bind(*xs, spec=spec), *operands)


def _natural_block(a: dict, q, k, v, nb: int, batch_shape, q_layout: SequenceLayout,
                   kv_layout: SequenceLayout, in_layout_order: bool) -> Block:
    """The global :class:`Block` of canonical ``q, k, v`` and the split operands ``a``,
    batch dims flattened; positions the program gave none of are built (in natural order,
    or of the layout's slots when the operands are ``in_layout_order``)."""
    tq, tkv = q.shape[1], k.shape[1]

    def flat(x):
        return flatten_batch(x, nb, batch_shape)

    def positions(given, lay, length):
        if given is not None:
            return flat(given).astype(jnp.int32)
        slots = jnp.arange(length, dtype=jnp.int32)[None]
        return lay.position_of_slot(slots) if in_layout_order else slots

    def operand(role):
        x = a[role.operand]
        return None if x is None else flat(x).astype(jnp.int32) if role.integer else flat(x)

    fields = {name: operand(role) for name, role in ROLES.items() if role.operand}
    return Block(**dict(fields, q=q, k=k, v=v,
                        q_pos=positions(a["q_positions"], q_layout, tq),
                        kv_pos=positions(a["kv_positions"], kv_layout, tkv)))


def _sharded(record, block: Block, spec: AttentionSpec, *, mesh, axes: tuple[str, ...],
             layout: str, kv_layout: SequenceLayout, given_positions: bool,
             local_kernel) -> jax.Array:
    """``record.run`` under ``shard_map`` on the global layout-order ``block``; the output
    ``[B, Tq, H, Dv]`` sharded on its sequence dim over ``axes``."""
    seq = sequence_mesh_axes(axes)
    # Operands are sharded on their token dim (a row's query dim); the per-head ones (sinks,
    # dropout seed) have none: every device holds them all.
    sharding = block.by_role(lambda x, r: P() if r.token_axis is None else
                             P(*(None,) * r.token_axis, seq))
    # Positions built here (the program gave none) are, padded or not, those of the
    # layout-order slots of kv_layout: schedules may derive them rather than move them.
    # Positions the caller gave (in layout order too: reorder-sequence passes the
    # program's own through) are data and travel.
    local_spec = spec.replace(q=_CANONICAL, k=_CANONICAL, v=_CANONICAL, positions=True,
                              layout=layout,
                              kv_positions_layout=None if given_positions else kv_layout)

    def run(local):
        # The per-head operands are the same on every device. Marked device-varying here,
        # the backward sums the sinks' per-device gradients once at their own [B|1, H]
        # size, not at the size of the first per-row value they are broadcast into.
        local = local.by_role(lambda x, r: lax.pcast(x, axes, to="varying")
                              if r.side is Side.HEADS else x)
        return record.run(local, spec=local_spec, axes=axes, kernel=local_kernel)

    return jax.shard_map(run, mesh=mesh, in_specs=(sharding,), out_specs=P(None, seq),
                         axis_names=set(axes))(block)


def context_parallel_attention(*operands, spec: AttentionSpec, mesh, axes,
                               schedule: str = "ring", layout: str = "contiguous",
                               kernel: str = "xla", in_layout_order: bool = False):
    """``attention_p(*operands, spec=spec)`` computed with a context-parallel schedule.

    Args:
      operands: global operands exactly as ``attention_p`` takes them (any layouts in
        ``spec``, any number of batch dims, optional positions / segment ids / mask / bias).
      spec: the attention's :class:`AttentionSpec`.
      mesh: a :class:`jax.sharding.Mesh` holding the CP axes (it may have others).
      axes: the CP mesh axis name, or a tuple of names (a two-axis schedule: ``(inner,
        outer)``; hybrid's ``(ulysses, ring)``).
      schedule: a name in :func:`~cptransform.lowering.schedule.schedules`.
      layout: a name in :data:`~cptransform.op.layouts.LAYOUTS` (which positions each rank
        holds).
      kernel: local-step kernel, a name in :func:`~cptransform.lowering.kernels.kernels` or
        ``auto``; read only when ``spec.kernel`` is ``None`` (a planned spec carries the
        planner's choice, which wins).
      in_layout_order: the sequence axes of the operands (and of the output) are already in
        layout order; positions, if given, are then the positions of that order. The
        lengths must then be divisible by the layout's multiple.

    Queries and keys may differ in length (cross-attention); each is laid out by its own
    :class:`SequenceLayout`. A length the layout does not divide (``cp``, zigzag ``2·cp``)
    is padded at the end with masked positions (:mod:`cptransform.lowering.padding`) and
    the output is cut back to the real queries.

    Returns the output in q's layout, dtype and (unless ``in_layout_order``) order.
    Differentiable and jit-able.
    """
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    record = _checked_schedule(schedule, axes, layout)
    local_kernel = resolve_kernel(spec, kernel, operands)
    _check_mesh_and_operands(mesh, axes, spec, operands)

    a = split_operands(spec, operands)
    given_positions = spec.positions
    q, k, v = to_canonical(spec, a["q"], a["k"], a["v"])
    nb = len(spec.q.batch)
    batch_shape = q.shape[:nb]
    q, k, v = (flatten_batch(x, nb, batch_shape) for x in (q, k, v))
    tq, tkv = q.shape[1], k.shape[1]
    cp = math.prod(mesh.shape[name] for name in axes)
    tq_pad, tkv_pad = padded_length(tq, layout, cp), padded_length(tkv, layout, cp)
    if in_layout_order and (tq_pad, tkv_pad) != (tq, tkv):
        raise ContextParallelError(
            f"operands in {layout} order must have lengths divisible by "
            f"{layout_multiple(layout, cp)} (got {tq} queries, {tkv} keys): a program is "
            "only reordered for lengths its layout divides; lower it in natural order")
    q_layout = SequenceLayout(layout, tq_pad, cp)
    kv_layout = SequenceLayout(layout, tkv_pad, cp)
    # Checked here, outside shard_map, so the error names the mesh axes and their sizes.
    ulysses = mesh.shape[axes[0]] if record.inner is not None else 1
    shape = attention_shape(spec, a["q"], a["k"], a["v"], cp=cp, ulysses=ulysses,
                            layout=layout)
    # Positions handed over in layout order are the layout's own (what reorder-sequence
    # writes); only positions in natural order come from the caller's program.
    problem = record.feasible(replace(shape, explicit_positions=spec.positions
                                      and not in_layout_order))
    if problem:
        sizes = ", ".join(f"{name!r} of size {mesh.shape[name]}" for name in axes)
        raise ContextParallelError(f"{schedule}: {problem} (mesh axes {sizes})")

    # In natural order (the operands' own order) the block is padded at the end; then it
    # is brought to layout order, unless it already is (then it needs no padding).
    block = _natural_block(a, q, k, v, nb, batch_shape, q_layout, kv_layout, in_layout_order)
    if not in_layout_order:
        block, spec = pad_block(block, spec, tq_pad, tkv_pad)
        block = permute_block(block, q_layout, kv_layout, mesh, sequence_mesh_axes(axes))
    o = _sharded(record, block, spec, mesh=mesh, axes=axes, layout=layout,
                 kv_layout=kv_layout, given_positions=given_positions,
                 local_kernel=local_kernel)
    if not in_layout_order:
        o = converted(o, layout=q_layout, dim=1, inverse=True, mesh=mesh,
                      seq=sequence_mesh_axes(axes))[:, :tq]
    o = o.reshape(tuple(batch_shape) + o.shape[1:]) if nb else o[0]
    return from_canonical(spec, o).astype(a["q"].dtype)


__all__ = ["context_parallel_attention", "ContextParallelError", "sequence_mesh_axes"]
