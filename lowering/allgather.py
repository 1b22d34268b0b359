"""All-gather (Llama-3 style): gather K, V and their positions; local queries see everything.

Forward, per device over a mesh axis of ``n`` devices: all-gathers of K, V, kv positions
(and kv segment ids), ``(n-1)·B·Tkv_loc`` rows each; then one local kernel call of the
local queries against all keys. Dense masks and biases already hold every key column
(in layout order, the order of the gathered keys), so they stay local; so do top-k
indices, which name the global positions that the gathered keys carry.

Backward (a ``custom_vjp``): the kernel backward gives dQ (local) and dK, dV for *all*
keys from the local queries; a reduce-scatter (``psum_scatter``) sums them over the
devices and leaves each device its own shard. The reduce-scatter runs in float32 (the
accumulation precision), ``(n-1)/n·B·Tkv·Hkv·(D + Dv)·4`` bytes per device.

Residuals are q, the gathered K and V (``Tkv·Hkv·(D + Dv)`` elements per device, the price
of a backward without a second all-gather), the mask operands, o and lse; never the
probabilities.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from cptransform.analysis.attention_shape import AttentionShape
from cptransform.analysis.block_work import rank_positions
from cptransform.analysis.cost_model import metadata, operands
from cptransform.analysis.schedule_statement import Calls, LocalStep, Statement, shard_grid
from cptransform.lowering.block import Block
from cptransform.op.operand_roles import Side
from cptransform.lowering.schedule import (Schedule, added_fill_sharded, any_length,
                                           differentiable, key_count, register_schedule,
                                           with_sinks)
from cptransform.lowering.ulysses import gather_sequence
from cptransform.op.accumulation import accumulator_dtype
from cptransform.op.attention_reference import fill_empty_rows


def _forward(block: Block, spec, axis, kernel):
    gathered = block.by_role(lambda x, r: gather_sequence(x, axis) if r.side is Side.KEY else x)
    o, lse = kernel.forward(gathered, spec)
    # Pad keys' V is zero: the sum over all keys divided by the real ones is their mean.
    v_mean = jnp.sum(gathered.v.astype(o.dtype), axis=1, keepdims=True) \
        / key_count(spec, gathered.v.shape[1])
    return (o, lse, v_mean), (gathered, o, lse)


def _bwd(spec, axis, kernel, residuals, cotangents):
    gathered, o, lse = residuals
    do, dlse, dv_mean = cotangents
    dq, dk_all, dv_all, dbias = kernel.backward(gathered, o, lse, do, spec, dlse)
    dv_all = dv_all + dv_mean / key_count(spec, gathered.v.shape[1])
    dk, dv = (lax.psum_scatter(g.astype(accumulator_dtype(g.dtype)), axis, scatter_dimension=1, tiled=True)
              for g in (dk_all, dv_all))
    return dq, dk, dv, dbias


#: Local queries against K/V gathered over ``axis``, ``(block, spec, axis, kernel) ->
#: (o, lse, v_mean)``: ``o`` (float32) and ``lse`` are the kernel's; ``v_mean``
#: ``[B, 1, Hkv, Dv]`` float32 is the mean of V over all keys (for
#: ``empty_rows="uniform"``: the gathered V gives it without the psum of
#: :func:`~cptransform.lowering.schedule.finished`). Differentiable w.r.t. q, k, v and
#: bias; the backward reduce-scatters dK and dV.
gathered_attention = differentiable(_forward, _bwd)


def allgather(block: Block, *, spec, axes, kernel):
    """The ``allgather`` schedule over one mesh axis (see the module doc)."""
    o, lse, v_mean = gathered_attention(block.replace(sinks=None), spec, axes[0], kernel)
    o, lse = with_sinks(block, o, lse)
    added = added_fill_sharded(spec, block, axes, block.k.shape[1] * lax.axis_size(axes[0]))
    return fill_empty_rows(spec, o, lse, v_mean, added).astype(block.q.dtype)


def allgather_statement(shape: AttentionShape) -> Statement:
    """All-gathers of K, V (and kv positions / segment ids) over ``shape.cp`` devices
    forward, reduce-scatters of dK and dV in ``grad_bytes`` backward; each device's local
    queries against every gathered key shard in one call, which keeps the whole K and V (its
    residuals) and the float32 dK/dV of every key before the reduce-scatter."""
    cp = shape.cp
    gather = dict(kind="all_gather", group=cp)
    transfers = (operands(shape, ("k", "v"), rows=shape.batch * shape.kv_padded // cp, **gather)
                 + metadata(shape, ("kv",), **gather)
                 + operands(shape, ("k", "v"), "reduce_scatter", shape.batch * shape.kv_padded,
                            element=shape.grad_bytes, prefix="d", group=cp, backward=True))
    grid = shard_grid(f"allgather over {cp} devices, {{layout}} layout (one kernel call per "
                      "device)", "device", rank_positions(shape), Calls.EACH_ROW, shape.heads)
    return Statement(tuple(transfers), (grid,),
                     LocalStep(shape.q_padded // cp, shape.kv_padded, shape.heads,
                               shape.kv_heads))


ALLGATHER = register_schedule(Schedule("allgather", mesh_axes=1, run=allgather,
                                       statement=allgather_statement, feasible=any_length,
                                       order=2))
