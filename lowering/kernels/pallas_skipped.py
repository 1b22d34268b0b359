"""What the tiles a Pallas kernel skips would have added: the ``0·x`` terms of
docs/contract.md ("NaN and Inf").

A dense softmax multiplies every masked probability (an exact 0) with V, so a NaN or ±Inf
anywhere in V reaches every query row of its head, and the backward likewise carries ``0·K``,
``0·Q`` and ``0·dO`` (NaN rows: NaN) into dQ, dK and dV. The kernels skip ``SKIP`` tiles
without loading them; these functions add their terms afterwards from per-tile column sums,
in plain JAX on ``[B, H, n_tiles, D]`` arrays — no matmul, and exact zeros when everything is
finite. Both variants use them (the GPU variant may also mask such a tile in the kernel:
adding ``0·x`` twice changes nothing).
"""
from __future__ import annotations

import jax.numpy as jnp

from cptransform.lowering.kernels import zero_times
from cptransform.lowering.kernels.pallas_operands import Operands
from cptransform.op.mask_terms import BlockKind


def _tile_sums(x, size: int):
    """``[B, H, T, D]`` (``T`` a multiple of ``size``) → ``[B, H, T/size, D]`` sums of ``0·x``
    per tile of ``size`` rows."""
    b, h, t, d = x.shape
    return jnp.sum(zero_times(x).reshape(b, h, t // size, size, d), axis=3)


def _to_rows(x, size: int):
    """Per-tile ``[B, H, n, D]`` → per-row ``[B, H, n·size, D]``."""
    return jnp.repeat(x, size, axis=2)


def _query_heads(x, groups: int):
    """KV-head ``[B, Hkv, …]`` → query-head ``[B, Hkv·groups, …]`` (head ``h`` reads ``h // g``)."""
    return jnp.repeat(x, groups, axis=1) if groups > 1 else x


def _kv_heads(x, groups: int):
    """Query-head ``[B, H, …]`` → KV-head sums ``[B, H/groups, …]``."""
    if groups == 1:
        return x
    b, h = x.shape[:2]
    return jnp.sum(x.reshape(b, h // groups, groups, *x.shape[2:]), axis=2)


def _along_keys(skip, per_key_tile):
    """``Σ_j skip[i, j] · t[j]`` with ``where`` (a NaN in an unskipped tile adds nothing)."""
    return jnp.sum(jnp.where(skip[..., None], per_key_tile[..., None, :, :], 0.0), axis=3)


def _along_queries(skip, per_query_tile):
    """``Σ_i skip[i, j] · t[i]``."""
    return jnp.sum(jnp.where(skip[..., None], per_query_tile[..., :, None, :], 0.0), axis=2)


def skipped_forward(ops: Operands):
    """Float32 ``[B, H, Tqp, Dv]`` to add to the kernel's ``o``: ``Σ 0·V`` over skipped tiles."""
    v_tiles = _query_heads(_tile_sums(ops.v, ops.bk), ops.groups)
    return _to_rows(_along_keys(ops.table == BlockKind.SKIP, v_tiles), ops.bq)


def skipped_backward(ops: Operands, do, lse):
    """Float32 ``(dq [B, H, Tqp, D], dk [B, Hkv, Tkvp, D], dv [B, Hkv, Tkvp, Dv])`` to add to the
    kernel's gradients: ``Σ 0·K``, ``Σ 0·Q`` and ``Σ (0·dO + NaN rows)`` over skipped tiles.
    ``do`` heads-major padded, ``lse`` ``[B, H, Tqp]`` as the kernels receive them."""
    skip = ops.table == BlockKind.SKIP
    k_tiles = _query_heads(_tile_sums(ops.k, ops.bk), ops.groups)
    dq = _to_rows(_along_keys(skip, k_tiles), ops.bq)
    q_tiles = _tile_sums(ops.q, ops.bq)
    nan_rows = jnp.where(jnp.isnan(lse), jnp.nan, 0.0)[..., None]
    do_tiles = _tile_sums(do.astype(jnp.float32) + nan_rows, ops.bq)
    dk = _to_rows(_kv_heads(_along_queries(skip, q_tiles), ops.groups), ops.bk)
    dv = _to_rows(_kv_heads(_along_queries(skip, do_tiles), ops.groups), ops.bk)
    return dq, dk, dv
