"""All-gather (Llama-3 style): gather K, V and their positions; local queries see everything.

Forward, per device over a mesh axis of ``n`` devices: all-gathers of K, V, kv positions
(and kv segment ids), ``(n-1)·B·Tkv_loc`` rows each; then one local kernel call of the
local queries against all keys. Dense masks and biases already hold every key column
(in layout order, the order of the gathered keys), so they stay local.

Backward (a ``custom_vjp``): the kernel backward gives dQ (local) and dK, dV for *all*
keys from the local queries; a reduce-scatter (``psum_scatter``) sums them over the
devices and leaves each device its own shard. The reduce-scatter runs in float32 (the
accumulation precision), ``(n-1)/n·B·Tkv·Hkv·(D + Dv)·4`` bytes per device.

Residuals are q, the gathered K and V (``Tkv·Hkv·(D + Dv)`` elements per device, the price
of a backward without a second all-gather), the mask operands, o and lse; never the
probabilities.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from cptransform.op.attention_reference import fill_empty_rows
from cptransform.lowering.context_parallel_attention import register_schedule
from cptransform.lowering.ulysses import gather_sequence


@partial(jax.custom_vjp, nondiff_argnums=(9, 10, 11))
def gathered_attention(q, k, v, q_pos, kv_pos, q_seg, kv_seg, mask, bias, spec, axis, kernel):
    """Local queries against K/V gathered over ``axis``; returns ``(o, lse, v_mean)``.

    ``o`` (float32) and ``lse`` are the kernel's; ``v_mean`` ``[B, 1, Hkv, Dv]`` float32 is
    the mean of V over all keys (for ``empty_rows="uniform"``). Differentiable w.r.t. q, k,
    v and bias; the backward reduce-scatters dK and dV.
    """
    return _forward(q, k, v, q_pos, kv_pos, q_seg, kv_seg, mask, bias, spec, axis,
                    kernel)[0]


def _forward(q, k, v, q_pos, kv_pos, q_seg, kv_seg, mask, bias, spec, axis, kernel):
    k_all, v_all = (lax.all_gather(x, axis, axis=1, tiled=True) for x in (k, v))
    kv_pos_all, kv_seg_all = gather_sequence(kv_pos, axis), gather_sequence(kv_seg, axis)
    o, lse = kernel.forward(q, k_all, v_all, q_pos, kv_pos_all, q_seg, kv_seg_all, mask, bias,
                            spec)
    v_mean = jnp.mean(v_all.astype(jnp.float32), axis=1, keepdims=True)
    residuals = (q, k_all, v_all, q_pos, kv_pos_all, q_seg, kv_seg_all, mask, bias, o, lse)
    return (o, lse, v_mean), residuals


def _fwd(q, k, v, q_pos, kv_pos, q_seg, kv_seg, mask, bias, spec, axis, kernel):
    return _forward(q, k, v, q_pos, kv_pos, q_seg, kv_seg, mask, bias, spec, axis, kernel)


def _bwd(spec, axis, kernel, residuals, cotangents):
    q, k_all, v_all, q_pos, kv_pos, q_seg, kv_seg, mask, bias, o, lse = residuals
    do, dlse, dv_mean = cotangents
    dq, dk_all, dv_all, dbias = kernel.backward(q, k_all, v_all, q_pos, kv_pos, q_seg, kv_seg,
                                                mask, bias, o, lse, do, spec, dlse)
    dv_all = dv_all + dv_mean / v_all.shape[1]
    dk, dv = (lax.psum_scatter(g.astype(jnp.float32), axis, scatter_dimension=1, tiled=True)
              for g in (dk_all, dv_all))
    dbias = None if bias is None else dbias.astype(bias.dtype)
    return (dq.astype(q.dtype), dk.astype(k_all.dtype), dv.astype(v_all.dtype), None, None,
            None, None, None, dbias)


gathered_attention.defvjp(_fwd, _bwd)


@register_schedule("allgather", mesh_axes=1)
def allgather(q, k, v, q_pos, kv_pos, q_seg, kv_seg, mask, bias, *, spec, axes, kernel):
    """The ``allgather`` schedule over one mesh axis (see the module doc)."""
    o, lse, v_mean = gathered_attention(q, k, v, q_pos, kv_pos, q_seg, kv_seg, mask, bias,
                                        spec, axes[0], kernel)
    return fill_empty_rows(spec, o, lse, v_mean).astype(q.dtype)
