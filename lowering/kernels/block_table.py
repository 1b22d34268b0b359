"""Block classification for the Pallas kernels: which (query block, key block) tiles to skip,
which are fully visible and which need the per-element mask.

Computed in plain JAX outside the kernels by the mask's terms (position and segment ranges
per block, ``any``/``all`` of dense tiles), then passed in: scalar-prefetched on TPU, an int32 input on
GPU. The kernels build the element mask from positions and segment ids themselves, so no
``Tq × Tkv`` array exists unless the user passed a dense mask.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from cptransform.op import mask_terms
from cptransform.op.mask_terms import BlockKind
from cptransform.op.attention_spec import MaskSpec

def block_table(mask: MaskSpec, q_pos, kv_pos, q_seg, kv_seg, dense, block_q: int,
                block_kv: int, topk=None, q_coord=None):
    """int32 ``[Bt, Ht, nq, nk]`` of :class:`~cptransform.op.mask_terms.BlockKind`
    (``SKIP`` / ``FULL`` / ``PARTIAL``).

    Arguments as in :func:`~cptransform.op.attention_reference.visible` (positions and
    segment ids ``[B|1, T]``, ``dense`` bool ``[B|1, H|1, Tq, Tkv]`` or ``None``, ``topk``
    the global key positions ``[B|1, H|1, Tq, k]`` of a top-k mask or ``None``, ``q_coord``
    the queries' coordinates ``[B|1, Tq]`` of a coordinate band or ``None``), cut into
    ``block_q × block_kv`` tiles (the last ones padded). ``Bt``/``Ht`` are 1 unless an operand
    varies along batch/heads. The mask's terms classify the tiles
    (:func:`~cptransform.op.mask_terms.meet`): ``SKIP`` is a proof that no pair is visible;
    ``FULL`` a proof that every pair is (tiles holding padding are never full, so the
    kernels can drop the padding check there); ``PARTIAL`` may be conservative (segment
    ranges that overlap without a common id, a band whose position ranges straddle it).
    """
    tq, tkv = q_pos.shape[-1], kv_pos.shape[-1]
    nq, nk = -(-tq // block_q), -(-tkv // block_kv)
    may, full = mask_terms.meet(mask.terms(), mask_terms.Blocks.cut(
        q_pos, kv_pos, q_seg, kv_seg, dense, topk, block_q, block_kv, q_coord))
    ragged_q = (jnp.arange(nq) == nq - 1) & (tq % block_q != 0)
    ragged_kv = (jnp.arange(nk) == nk - 1) & (tkv % block_kv != 0)
    grid = jnp.ones((1, 1, nq, nk), bool)
    full = full & ~(ragged_q[:, None] | ragged_kv[None, :])
    return BlockKind.of(grid & may, full)


def fetch_order(table):
    """Int32 like ``table``: the tile whose operands each grid step fetches, along the last
    axis (the reduction the TPU grid walks innermost).

    A visited tile fetches itself; a ``SKIP`` tile names the last visited tile before it
    in its row, or else the first one after it (0 in a row with none). The Pallas TPU
    pipeline issues a DMA only when a block index changes from one grid step to the next,
    so a skipped step then costs no K/V transfer — splash attention's ``data_next``.
    """
    n = table.shape[-1]
    at = jnp.arange(n, dtype=jnp.int32)
    visited = table != BlockKind.SKIP
    before = lax.cummax(jnp.where(visited, at, -1), axis=table.ndim - 1)
    after = lax.cummin(jnp.where(visited, at, n), axis=table.ndim - 1, reverse=True)
    return jnp.where(before >= 0, before, jnp.where(after < n, after, 0)).astype(jnp.int32)
