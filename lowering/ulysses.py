"""Ulysses: all-to-all from sequence sharding to head sharding, local attention, and back.

Four all-to-alls over one mesh axis of size ``n`` (q, k, v in; o out) turn each device's
``[B, T/n, H, D]`` shard into ``[B, T, H/n, D]``: the whole sequence (in layout order) for
``H/n`` heads. Attention is then ordinary local attention; the mask follows from the
gathered positions, so every layout works unchanged.

KV heads: device ``j`` holds query heads ``[j·H/n, (j+1)·H/n)`` and needs the KV heads
they read (query head ``h`` reads KV head ``h // groups``). When ``n`` does not divide the
KV heads, each KV head is repeated ``f = n / gcd(Hkv, n)`` times before the all-to-all
(``f`` divides ``groups`` whenever ``n`` divides the query heads), so device ``j`` receives
exactly ``Hkv·f/n`` KV heads. The K/V all-to-alls then carry ``f`` times the bytes: for MQA
over ``n`` devices that is ``(n-1)·T/n`` tokens of K and of V per device, the same as an
all-gather of K and V.

Dense masks and biases ``[B, H|1, Tq/n, Tkv]`` become ``[B, H/n|1, Tq, Tkv]`` (an all-to-all
over heads, or an all-gather of the query rows when the heads dim is 1); they are the
largest thing Ulysses moves when present (``Tq·Tkv`` per head).

Backward: JAX transposes the all-to-alls into all-to-alls (the same four volumes); the
local attention is a ``custom_vjp`` over the kernel whose residuals are q, k, v, o and lse,
never the probabilities.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from cptransform.analysis.cost_model import kv_head_repeats
from cptransform.lowering.context_parallel_attention import ContextParallelError, \
    fill_empty_rows_sharded, register_schedule


def check_heads(heads: int, n: int, axis: str, schedule: str) -> None:
    """Raise a clear error unless ``n`` divides the query heads."""
    if heads % n:
        raise ContextParallelError(
            f"{schedule}: {heads} query heads cannot be split over mesh axis {axis!r} of "
            f"size {n} (Ulysses needs heads % {n} == 0); use schedule='hybrid' with a "
            f"Ulysses axis whose size divides {heads}, or schedule='ring' / 'allgather'")


def sequence_to_heads(x, axis: str):
    """``[B, T/n, H, …]`` → ``[B, T, H/n, …]``: all-to-all over ``axis``."""
    return lax.all_to_all(x, axis, split_axis=2, concat_axis=1, tiled=True)


def heads_to_sequence(x, axis: str):
    """``[B, T, H/n, …]`` → ``[B, T/n, H, …]``: the inverse all-to-all."""
    return lax.all_to_all(x, axis, split_axis=1, concat_axis=2, tiled=True)


def gather_sequence(x, axis: str):
    """``[B|1, T/n]`` positions or segment ids → ``[B|1, T]`` in layout order."""
    return None if x is None else lax.all_gather(x, axis, axis=1, tiled=True)


def dense_to_heads(x, axis: str, n: int):
    """A mask or bias ``[B|1, H|1, Tq/n, Tkv]`` → ``[B|1, H/n|1, Tq, Tkv]``."""
    if x is None:
        return None
    if x.shape[1] == 1:
        return lax.all_gather(x, axis, axis=2, tiled=True)
    return lax.all_to_all(x, axis, split_axis=1, concat_axis=2, tiled=True)


def ulysses_around(inner, q, k, v, q_pos, kv_pos, q_seg, kv_seg, mask, bias, *, spec,
                   axis: str, schedule: str = "ulysses"):
    """Switch to head sharding over ``axis``, run ``inner``, switch back.

    ``inner(q, k, v, q_pos, kv_pos, q_seg, kv_seg, mask, bias, spec)`` sees the head-sharded
    operands (the whole sequence along ``axis``, ``H/n`` heads) and a spec whose ``groups``
    matches them; it returns ``o [B, T, H/n, Dv]`` in ``q.dtype``.
    """
    n = lax.axis_size(axis)
    heads, kv_heads = q.shape[2], k.shape[2]
    check_heads(heads, n, axis, schedule)
    repeats = kv_head_repeats(kv_heads, n)
    if repeats > 1:
        k, v = (jnp.repeat(x, repeats, axis=2) for x in (k, v))
    spec = spec.replace(groups=heads // (kv_heads * repeats))
    o = inner(sequence_to_heads(q, axis), sequence_to_heads(k, axis),
              sequence_to_heads(v, axis), gather_sequence(q_pos, axis),
              gather_sequence(kv_pos, axis), gather_sequence(q_seg, axis),
              gather_sequence(kv_seg, axis), dense_to_heads(mask, axis, n),
              dense_to_heads(bias, axis, n), spec)
    return heads_to_sequence(o.astype(q.dtype), axis)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _kernel_attention(kernel, spec, q, k, v, q_pos, kv_pos, q_seg, kv_seg, mask, bias):
    return kernel.forward(q, k, v, q_pos, kv_pos, q_seg, kv_seg, mask, bias, spec)


def _kernel_attention_fwd(kernel, spec, q, k, v, q_pos, kv_pos, q_seg, kv_seg, mask, bias):
    o, lse = kernel.forward(q, k, v, q_pos, kv_pos, q_seg, kv_seg, mask, bias, spec)
    return (o, lse), (q, k, v, q_pos, kv_pos, q_seg, kv_seg, mask, bias, o, lse)


def _kernel_attention_bwd(kernel, spec, residuals, cotangents):
    q, k, v, q_pos, kv_pos, q_seg, kv_seg, mask, bias, o, lse = residuals
    do, dlse = cotangents
    dq, dk, dv, dbias = kernel.backward(q, k, v, q_pos, kv_pos, q_seg, kv_seg, mask, bias,
                                        o, lse, do, spec, dlse)
    dbias = None if bias is None else dbias.astype(bias.dtype)
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None,
            None, None, dbias)


_kernel_attention.defvjp(_kernel_attention_fwd, _kernel_attention_bwd)


def local_attention(kernel, q, k, v, q_pos, kv_pos, q_seg, kv_seg, mask, bias, spec):
    """Attention over keys that are all on this device; ``o`` in ``q.dtype``.

    A ``custom_vjp`` over the kernel (residuals q, k, v, o, lse), with
    ``empty_rows="uniform"`` applied from the local V.
    """
    o, lse = _kernel_attention(kernel, spec, q, k, v, q_pos, kv_pos, q_seg, kv_seg, mask,
                               bias)
    return fill_empty_rows_sharded(spec, o, lse, v, (), k.shape[1]).astype(q.dtype)


@register_schedule("ulysses", mesh_axes=1)
def ulysses(q, k, v, q_pos, kv_pos, q_seg, kv_seg, mask, bias, *, spec, axes, kernel):
    """The Ulysses schedule over one mesh axis (see the module doc)."""
    return ulysses_around(partial(local_attention, kernel), q, k, v, q_pos, kv_pos, q_seg,
                          kv_seg, mask, bias, spec=spec, axis=axes[0])
