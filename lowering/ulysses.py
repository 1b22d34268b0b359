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
largest thing Ulysses moves when present (``Tq·Tkv`` per head). Top-k indices
``[B, H|1, Tq/n, k]`` move the same way (``Tq·k`` per head): they are key positions, which
the gathered keys still carry.

Backward: JAX transposes the all-to-alls into all-to-alls (the same four volumes); the
local attention is a ``custom_vjp`` over the kernel whose residuals are q, k, v, o and lse,
never the probabilities.
"""
from __future__ import annotations

import math
from functools import partial

import jax.numpy as jnp
from jax import lax

from cptransform.analysis.attention_shape import AttentionShape
from cptransform.analysis.block_work import Work, rank_positions, work_of
from cptransform.analysis.cost_model import CommVolume, Transfer, kv_elements, metadata
from cptransform.analysis.local_memory import kv_bytes, query_state_bytes, shard_bytes, \
    tile_bytes
from cptransform.lowering.block import Block
from cptransform.lowering.schedule import Schedule, differentiable, finished, \
    register_schedule


def kv_head_repeats(kv_heads: int, n: int) -> int:
    """How often Ulysses over ``n`` devices repeats each KV head so the devices can split
    them (see the module doc)."""
    return n // math.gcd(kv_heads, n)


def heads_problem(heads: int, n: int) -> str | None:
    """Why ``heads`` query heads cannot be split over a Ulysses group of ``n`` devices."""
    if heads % n:
        return (f"Ulysses splits the {heads} query heads over cp={n} devices (a Ulysses "
                f"group of size {n}), which needs heads % {n} == 0; use schedule='hybrid' "
                f"with a Ulysses degree that divides {heads}, or schedule='ring'")
    return None


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
    """A mask or bias ``[B|1, H|1, Tq/n, Tkv]`` → ``[B|1, H/n|1, Tq, Tkv]`` (top-k indices
    ``[.., Tq/n, k]`` likewise)."""
    if x is None:
        return None
    if x.shape[1] == 1:
        return lax.all_gather(x, axis, axis=2, tiled=True)
    return lax.all_to_all(x, axis, split_axis=1, concat_axis=2, tiled=True)


def heads_of(sinks, axis: str, n: int):
    """The sinks ``[B|1, H]`` of the query heads this device holds after
    :func:`sequence_to_heads` over ``axis`` (device ``j``: heads ``[j·H/n, (j+1)·H/n)``)."""
    if sinks is None:
        return None
    width = sinks.shape[1] // n
    return lax.dynamic_slice_in_dim(sinks, lax.axis_index(axis) * width, width, axis=1)


def ulysses_around(inner, block: Block, *, spec, axis: str):
    """Switch to head sharding over ``axis``, run ``inner``, switch back.

    ``inner(block, spec)`` sees the head-sharded block (the whole sequence along ``axis``,
    ``H/n`` heads, the sinks of those heads) and a spec whose ``groups`` matches it; it returns ``o [B, T, H/n, Dv]``
    in ``q.dtype``. The query heads must divide over ``axis`` (the entry point checks it
    with :func:`heads_problem`).
    """
    n = lax.axis_size(axis)
    heads, kv_heads = block.q.shape[2], block.k.shape[2]
    repeats = kv_head_repeats(kv_heads, n)
    k, v = block.k, block.v
    if repeats > 1:
        k, v = (jnp.repeat(x, repeats, axis=2) for x in (k, v))
    spec = spec.replace(groups=heads // (kv_heads * repeats))
    heads_sharded = Block(
        q=sequence_to_heads(block.q, axis), k=sequence_to_heads(k, axis),
        v=sequence_to_heads(v, axis), q_pos=gather_sequence(block.q_pos, axis),
        kv_pos=gather_sequence(block.kv_pos, axis), q_seg=gather_sequence(block.q_seg, axis),
        kv_seg=gather_sequence(block.kv_seg, axis), mask=dense_to_heads(block.mask, axis, n),
        bias=dense_to_heads(block.bias, axis, n), sinks=heads_of(block.sinks, axis, n),
        topk=dense_to_heads(block.topk, axis, n))
    o = inner(heads_sharded, spec)
    return heads_to_sequence(o.astype(block.q.dtype), axis)


def _kernel_forward(block: Block, kernel, spec):
    o, lse = kernel.forward(block, spec)
    return (o, lse), (block, o, lse)


def _kernel_backward(kernel, spec, residuals, cotangents):
    block, o, lse = residuals
    do, dlse = cotangents
    return kernel.backward(block, o, lse, do, spec, dlse)


#: One kernel call over keys all on this device, ``(block, kernel, spec) -> (o, lse)``,
#: differentiable (residuals the block, o and lse).
_kernel_attention = differentiable(_kernel_forward, _kernel_backward)


def local_attention(kernel, block: Block, spec):
    """Attention over keys that are all on this device; ``o`` in ``q.dtype``.

    A ``custom_vjp`` over the kernel (residuals the block, o and lse), then the sinks of
    the local heads and ``empty_rows`` applied from the local V.
    """
    o, lse = _kernel_attention(block.replace(sinks=None), kernel, spec)
    return finished(block, spec, o, lse, ())


def ulysses(block: Block, *, spec, axes, kernel):
    """The Ulysses schedule over one mesh axis (see the module doc)."""
    return ulysses_around(partial(local_attention, kernel), block, spec=spec, axis=axes[0])


def ulysses_volume(shape: AttentionShape) -> CommVolume:
    """Ulysses over ``shape.cp`` devices: all-to-alls of q, k, v, o (K/V with their heads
    repeated, see :func:`kv_head_repeats`) and all-gathers of positions / segment ids
    forward; the transposed all-to-alls of dq, dk, dv, do backward."""
    cp = shape.cp
    kv = kv_elements(shape, shape.kv_heads * kv_head_repeats(shape.kv_heads, cp))

    def a2a(length, elements):
        return shape.batch * length // cp * elements * shape.dtype_bytes * (cp - 1) // cp

    q_len, kv_len = shape.q_padded, shape.kv_padded
    payload = [("q", a2a(q_len, shape.heads * shape.head_dim)), ("k", a2a(kv_len, kv["k"])),
               ("v", a2a(kv_len, kv["v"])), ("o", a2a(q_len, shape.heads * shape.dv))]
    transfers = [Transfer(name, "all_to_all", b) for name, b in payload]
    transfers += [Transfer(name, "all_gather", b * (cp - 1), payload=False)
                  for name, b in metadata(shape, ("q", "kv"))]
    transfers += [Transfer("d" + name, "all_to_all", b, backward=True) for name, b in payload]
    return CommVolume("ulysses", tuple(transfers))


def ulysses_work(shape: AttentionShape) -> Work:
    """Every device: the whole sequence in layout order against itself, ``H/cp`` heads."""
    everything = rank_positions(shape).reshape(-1)
    return work_of(shape, [[(everything, everything)]], shape.heads // shape.cp)


def ulysses_memory(shape: AttentionShape) -> int:
    """Its shards, the head-sharded q, k, v, o (K/V heads repeated), their float32 state
    and gradients, and one score tile over ``H/cp`` heads."""
    n = shape.cp
    heads, kv = shape.heads // n, shape.kv_heads * kv_head_repeats(shape.kv_heads, n) // n
    s = shape.q_padded
    gathered = shape.batch * s * heads * (shape.head_dim + shape.dv) * shape.dtype_bytes
    return (shard_bytes(shape) + gathered + kv_bytes(shape, s, kv, shape.dtype_bytes)
            + query_state_bytes(shape, s, heads) + kv_bytes(shape, s, kv, shape.grad_bytes)
            + tile_bytes(shape, heads, s, s))


def ulysses_feasible(shape: AttentionShape) -> str | None:
    """The query heads must split over ``shape.cp`` devices (any length: the entry point
    pads it)."""
    return heads_problem(shape.heads, shape.cp)


ULYSSES = register_schedule(Schedule("ulysses", mesh_axes=1, run=ulysses,
                                     volume=ulysses_volume, feasible=ulysses_feasible,
                                     order=1, work=ulysses_work, memory=ulysses_memory))
