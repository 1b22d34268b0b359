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
from dataclasses import replace
from functools import partial

import jax.numpy as jnp
from jax import lax

from cptransform.analysis.attention_shape import AttentionShape
from cptransform.analysis.block_work import rank_positions
from cptransform.analysis.cost_model import Transfer, metadata, operands
from cptransform.analysis.schedule_statement import Calls, LocalStep, Statement, shard_grid
from cptransform.lowering.block import Block
from cptransform.op.operand_roles import Side
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
    """A token operand ``[B|1, T/n, …]`` → ``[B|1, T, …]`` in layout order."""
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
    """The sinks ``[B|1, H]`` (or dropout seeds ``[B|1, H, 4]``) of the query heads this
    device holds after :func:`sequence_to_heads` over ``axis`` (device ``j``: heads
    ``[j·H/n, (j+1)·H/n)``)."""
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
    regroup = {Side.QUERY: lambda x: gather_sequence(x, axis),
               Side.KEY: lambda x: gather_sequence(x, axis),
               Side.ROWS: lambda x: dense_to_heads(x, axis, n),
               Side.HEADS: lambda x: heads_of(x, axis, n)}
    heads_sharded = block.replace(k=k, v=v).by_role(
        lambda x, r: sequence_to_heads(x, axis) if r.heavy else regroup[r.side](x))
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


def ulysses_transfers(shape: AttentionShape) -> tuple[Transfer, ...]:
    """Ulysses over ``shape.cp`` devices: all-to-alls of q, k, v, o (K/V with their heads
    repeated, see :func:`kv_head_repeats`) and all-gathers of positions / segment ids
    forward; the transposed all-to-alls of dq, dk, dv, do backward."""
    cp = shape.cp
    kv = shape.kv_heads * kv_head_repeats(shape.kv_heads, cp)
    a2a = dict(kind="all_to_all", group=cp, kv_heads=kv)
    q_rows, kv_rows = (shape.batch * n // cp for n in (shape.q_padded, shape.kv_padded))
    forward = (operands(shape, ("q",), rows=q_rows, **a2a)
               + operands(shape, ("k", "v"), rows=kv_rows, **a2a)
               + operands(shape, ("o",), rows=q_rows, **a2a))
    gathered = metadata(shape, ("q", "kv"), "all_gather", group=cp)
    return tuple(forward + gathered
                 + [replace(t, name="d" + t.name, backward=True) for t in forward])


def ulysses_statement(shape: AttentionShape) -> Statement:
    """Its all-to-alls (:func:`ulysses_transfers`); every device: the whole sequence in
    layout order against itself, ``H/cp`` heads (K/V heads repeated), in one call."""
    n = shape.cp
    heads = shape.heads // n
    grid = shard_grid(f"ulysses over {n} devices, {{layout}} layout: every device runs this "
                      f"grid for its {heads} of {shape.heads} heads (equal work)",
                      "query shard", rank_positions(shape), Calls.WHOLE_GRID, heads)
    kv_heads = shape.kv_heads * kv_head_repeats(shape.kv_heads, n) // n
    return Statement(ulysses_transfers(shape), (grid,),
                     LocalStep(shape.q_padded, shape.kv_padded, heads, kv_heads))


def ulysses_feasible(shape: AttentionShape) -> str | None:
    """The query heads must split over ``shape.cp`` devices (any length: the entry point
    pads it)."""
    return heads_problem(shape.heads, shape.cp)


ULYSSES = register_schedule(Schedule("ulysses", mesh_axes=1, run=ulysses,
                                     statement=ulysses_statement, feasible=ulysses_feasible,
                                     order=1))
