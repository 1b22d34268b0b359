"""Double ring (LoongTrain's two-level ring): an inner ring inside each group, an outer
ring across the groups.

``axes = (inner_axis, outer_axis)`` with ``cp = U·R``; device ``(u, r)`` holds sequence
shard ``r·U + u`` (the entry point shards the sequence outer-major, as for hybrid). At
outer step ``j`` (``0 … R-1``) each device keeps the KV block that started on ``(u, r-j)``
and sends it on over the outer axis at once, so that one transfer over the slow links
overlaps the whole inner ring; the inner ring then passes copies of the kept blocks around
the group: at inner step ``i`` (``0 … U-1``) device ``(u, r)`` computes with the block of
shard ``((r - j) mod R)·U + (u - i) mod U`` (:func:`source_shards`). Both levels are the
ring's loop (:func:`~cptransform.lowering.ring.around_the_ring`), each step one kernel call
merged exactly in float32; positions, segment ids, dense-mask columns and top-k indices are
handled as in :mod:`cptransform.lowering.ring` (the shard index above is the layout-order
slot of the block).

Backward: the float32 dK/dV accumulators travel with the inner copies (``U`` inner hops,
home at the device that kept the block) and are then added to an outer accumulator that
travels with the kept block (``R`` outer hops, home at its owner).

Communication per device (``Tkv_loc`` local keys; ``kv`` the bytes of one KV block with
its travelling positions / segment ids, as for the ring): forward ``R·(U-1)`` inner hops
and ``R-1`` outer hops of ``kv``; backward the same again plus ``R·U`` inner and ``R``
outer hops of the float32 dK/dV. Every hop is sent ahead of the compute it feeds
(``overlapped``). Compared with the ring over all ``cp`` devices the outer axis carries
``R-1`` transfers instead of ``cp-1`` crossing its links.
"""
from __future__ import annotations

from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from cptransform.analysis.attention_shape import AttentionShape
from cptransform.analysis.block_work import rank_positions
from cptransform.analysis.cost_model import Transfer, metadata, operands
from cptransform.analysis.schedule_statement import Statement, rotated
from cptransform.lowering.block import Block
from cptransform.lowering.kernels import row_delta
from cptransform.lowering.ring import accumulator_zeros, arrived, around_the_ring, ring_step, \
    rotate, travelling
from cptransform.lowering.schedule import InnerAxis, Schedule, any_length, differentiable, \
    finished, register_schedule


def source_shards(inner: int, outer: int) -> np.ndarray:
    """``[cp, cp]`` int: the shard whose KV block shard ``s`` computes with at step ``t``
    (``s = r·inner + u``, ``t = j·inner + i``): ``((r - j) mod outer)·inner + (u - i) mod
    inner``. The rotation the lowering runs, the work and the plan chart read."""
    s, t = np.meshgrid(np.arange(inner * outer), np.arange(inner * outer), indexing="ij")
    return ((s // inner - t // inner) % outer) * inner + (s % inner - t % inner) % inner


def _source(j, i, axes):
    """The shard of the block this device computes with at outer step ``j``, inner ``i``."""
    inner, outer = axes
    n = lax.axis_size(inner)
    return ((lax.axis_index(outer) - j) % lax.axis_size(outer)) * n \
        + (lax.axis_index(inner) - i) % n


def _forward(block: Block, spec, axes, kernel):
    inner, outer = axes
    b, tq, h, _ = block.q.shape
    tkv, dv = block.k.shape[1], block.v.shape[3]

    def outer_step(j, acc, kept):
        def step(i, acc, keys):
            keys_block = arrived(block, keys, _source(j, i, axes), tkv, spec)
            return kernel.forward(keys_block, spec, running=acc)
        return around_the_ring(step, acc, kept, (inner,), lax.axis_size(inner))

    empty = (accumulator_zeros(block.q, (b, tq, h, dv)),
             accumulator_zeros(block.q, (b, h, tq), -jnp.inf))
    o, lse = around_the_ring(outer_step, empty, travelling(spec, block), (outer,),
                             lax.axis_size(outer))
    o = o.astype(block.q.dtype)
    return (o, lse), (block, o, lse)


def _backward(spec, axes, kernel, residuals, cotangents):
    block, o, lse = residuals
    do, dlse = cotangents
    inner, outer = axes
    n_inner = lax.axis_size(inner)
    q, k, v, bias = block.q, block.k, block.v, block.bias
    tkv = k.shape[1]
    delta = row_delta(o, do, dlse)
    no_kv = (accumulator_zeros(q, k.shape), accumulator_zeros(q, v.shape))

    def outer_step(j, state, kept):
        def step(i, state, keys):
            dq, (dk, dv), dbias = state
            source = _source(j, i, axes)
            dq, dk, dv, g_b = kernel.backward(arrived(block, keys, source, tkv, spec), o,
                                              lse, do, spec, delta=delta, dq=dq, dk=dk, dv=dv)
            if dbias is not None:
                dbias = lax.dynamic_update_slice_in_dim(dbias, g_b, source * tkv, axis=3)
            return dq, rotate((dk, dv), (inner,), n_inner), dbias

        dq, dkv_out, dbias = state
        # The group's dK/dV of the kept block arrive here after U inner hops; they then
        # travel home with it over the outer axis.
        dq, dkv_in, dbias = around_the_ring(step, (dq, no_kv, dbias), kept, (inner,),
                                            n_inner)
        dkv_out = jax.tree.map(jnp.add, dkv_out, dkv_in)
        return dq, rotate(dkv_out, (outer,), lax.axis_size(outer)), dbias

    zeros = (accumulator_zeros(q, q.shape), no_kv,
             None if bias is None else accumulator_zeros(q, bias.shape))
    dq, (dk, dv), dbias = around_the_ring(outer_step, zeros, travelling(spec, block),
                                          (outer,), lax.axis_size(outer))
    return dq, dk, dv, dbias


#: The double ring's attention, ``(block, spec, axes, kernel) -> (o, lse)`` like
#: :func:`~cptransform.lowering.ring.ring_attention`, over ``axes = (inner, outer)``.
double_ring_attention = differentiable(_forward, _backward)


def double_ring(block: Block, *, spec, axes, kernel):
    """The ``double_ring`` schedule over ``axes = (inner_axis, outer_axis)``: its attention,
    then the sinks and ``empty_rows``."""
    axes = tuple(axes)
    o, lse = double_ring_attention(block.replace(sinks=None), spec, axes, kernel)
    return finished(block, spec, o, lse, axes)


def double_ring_transfers(shape: AttentionShape) -> tuple[Transfer, ...]:
    """Inner hops (axis 0) and outer hops (axis 1) of K, V and their metadata forward and
    backward, and of the float32 dK/dV backward (see the module doc)."""
    u, r = shape.ulysses, shape.cp // shape.ulysses
    rows = shape.batch * shape.kv_padded // shape.cp
    meta = replace(shape, positions=shape.positions and shape.explicit_positions)
    hop = dict(kind="collective_permute", overlapped=True)
    transfers = []
    for backward in (False, True):
        for axis, hops in ((0, r * (u - 1)), (1, r - 1)):
            transfers += operands(shape, ("k", "v"), rows=rows, times=hops, axis=axis,
                                  backward=backward, **hop)
            transfers += metadata(meta, ("kv",), times=hops, axis=axis, backward=backward,
                                  **hop)
    for axis, hops in ((0, r * u), (1, r)):
        transfers += operands(shape, ("k", "v"), rows=rows, element=shape.grad_bytes,
                              prefix="d", times=hops, axis=axis, backward=True, **hop)
    return tuple(transfers)


def double_ring_statement(shape: AttentionShape) -> Statement:
    """Its hops (:func:`double_ring_transfers`), its rotation (:func:`source_shards`) and
    its step: the local queries against one KV block, with four float32 dK/dV accumulators
    (inner and outer, each held and in flight)."""
    u = shape.ulysses
    grid = rotated(f"double_ring over {shape.cp} devices, {{layout}} layout", "device",
                   rank_positions(shape), source_shards(u, shape.cp // u), shape.heads)
    return Statement(double_ring_transfers(shape), (grid,),
                     replace(ring_step(shape), accumulators=4))


DOUBLE_RING = register_schedule(Schedule(
    "double_ring", mesh_axes=2, run=double_ring, statement=double_ring_statement,
    feasible=any_length, order=5, automatic=False,
    inner=InnerAxis("inner ring size", "outer ring", ("inner", "outer"))))
