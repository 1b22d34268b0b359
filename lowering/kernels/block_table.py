"""Block classification for the Pallas kernels: which (query block, key block) tiles to skip,
which are fully visible and which need the per-element mask.

Computed in plain JAX outside the kernels, from position and segment ranges per block (and
``any``/``all`` of dense tiles), then passed in: scalar-prefetched on TPU, an int32 input on
GPU. The kernels build the element mask from positions and segment ids themselves, so no
``Tq × Tkv`` array exists unless the user passed a dense mask.
"""
from __future__ import annotations

import jax.numpy as jnp

from cptransform.op.attention_spec import MaskSpec

#: Table entries: no pair visible (the kernel does nothing), every pair visible (no mask is
#: computed), some pairs visible (the kernel computes the element mask).
SKIP, FULL, PARTIAL = 0, 1, 2


def _ranges(x, length: int, block: int):
    """Per-block ``(min, max)`` of ``x [N, T]`` over its first ``length`` (real) entries,
    after padding ``T`` up to ``nblocks · block``; shapes ``[N, nblocks]``."""
    n, t = x.shape
    nblocks = -(-length // block)
    pad = nblocks * block - t
    real = jnp.arange(nblocks * block) < length
    x = jnp.pad(x.astype(jnp.int32), ((0, 0), (0, pad)))
    big = jnp.iinfo(jnp.int32).max
    lo = jnp.where(real, x, big).reshape(n, nblocks, block).min(-1)
    hi = jnp.where(real, x, -big).reshape(n, nblocks, block).max(-1)
    return lo, hi


def block_table(mask: MaskSpec, q_pos, kv_pos, q_seg, kv_seg, dense, block_q: int,
                block_kv: int):
    """int32 ``[Bt, Ht, nq, nk]`` of :data:`SKIP` / :data:`FULL` / :data:`PARTIAL`.

    Arguments as in :func:`~cptransform.op.attention_reference.visible` (positions and
    segment ids ``[B|1, T]``, ``dense`` bool ``[B|1, H|1, Tq, Tkv]`` or ``None``), cut into
    ``block_q × block_kv`` tiles (the last ones padded). ``Bt``/``Ht`` are 1 unless an operand
    varies along batch/heads. ``SKIP`` is a proof that no pair is visible; ``FULL`` a proof
    that every pair is (tiles holding padding are never full, so the kernels can drop the
    padding check there); ``PARTIAL`` may be conservative (segment ranges that overlap
    without a common id, a band whose position ranges straddle it).
    """
    tq, tkv = q_pos.shape[-1], kv_pos.shape[-1]
    nq, nk = -(-tq // block_q), -(-tkv // block_kv)
    may = every = jnp.ones((1, 1, nq, nk), dtype=bool)
    lo, hi = mask.band()
    if lo is not None or hi is not None:
        q_lo, q_hi = _ranges(q_pos, tq, block_q)
        kv_lo, kv_hi = _ranges(kv_pos, tkv, block_kv)
        # d = kv - q over a tile ranges over [kv_lo - q_hi, kv_hi - q_lo] (both attained).
        d_min = (kv_lo[:, None, :] - q_hi[:, :, None])[:, None]
        d_max = (kv_hi[:, None, :] - q_lo[:, :, None])[:, None]
        if lo is not None:
            may, every = may & (d_max >= lo), every & (d_min >= lo)
        if hi is not None:
            may, every = may & (d_min <= hi), every & (d_max <= hi)
    if mask.segments:
        qs_lo, qs_hi = _ranges(q_seg, tq, block_q)
        ks_lo, ks_hi = _ranges(kv_seg, tkv, block_kv)
        overlap = (ks_hi[:, None, :] >= qs_lo[:, :, None]) & (qs_hi[:, :, None] >= ks_lo[:, None, :])
        one_id = ((qs_lo == qs_hi)[:, :, None] & (ks_lo == ks_hi)[:, None, :]
                  & (qs_lo[:, :, None] == ks_lo[:, None, :]))
        may, every = may & overlap[:, None], every & one_id[:, None]
    if mask.dense:
        pad = ((0, 0), (0, 0), (0, nq * block_q - tq), (0, nk * block_kv - tkv))
        tiles = jnp.pad(dense, pad).reshape(*dense.shape[:2], nq, block_q, nk, block_kv)
        may = may & jnp.any(tiles, axis=(3, 5))
        # Padding is False, so `all` over a padded tile is False: right, it is not full.
        every = every & jnp.all(tiles, axis=(3, 5))
    ragged_q = (jnp.arange(nq) == nq - 1) & (tq % block_q != 0)
    ragged_kv = (jnp.arange(nk) == nk - 1) & (tkv % block_kv != 0)
    every = every & ~(ragged_q[:, None] | ragged_kv[None, :])
    return jnp.where(may, jnp.where(every, FULL, PARTIAL), SKIP).astype(jnp.int32)
