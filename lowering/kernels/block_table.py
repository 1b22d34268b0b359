"""Block classification for the Pallas kernels: which (query block, key block) tiles to skip,
which are fully visible and which need the per-element mask.

Computed in plain JAX outside the kernels by the mask's terms (position and segment ranges
per block, ``any``/``all`` of dense tiles), then passed in: scalar-prefetched on TPU, an int32 input on
GPU. The kernels build the element mask from positions and segment ids themselves, so no
``Tq × Tkv`` array exists unless the user passed a dense mask.

:func:`loop_bounds` condenses each row of a table into the ranges a GPU program's loop walks
(a run of full tiles without mask or branch, the rest of the visited span table-driven), and
:func:`fetch_order` names the tile each TPU grid step fetches.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from cptransform.op import mask_terms
from cptransform.op.mask_terms import BlockKind
from cptransform.op.attention_spec import MaskSpec


def block_table(mask_spec: MaskSpec, q_pos, kv_pos, block_q: int, block_kv: int, **operands):
    """int32 ``[Bt, Ht, nq, nk]`` of :class:`~cptransform.op.mask_terms.BlockKind`
    (``SKIP`` / ``FULL`` / ``PARTIAL``).

    Positions ``[B|1, T]`` and the mask terms' ``operands`` by field name, as
    :func:`~cptransform.op.attention_reference.visible` takes them, cut into
    ``block_q × block_kv`` tiles (the last ones padded). ``Bt``/``Ht`` are 1 unless an operand
    varies along batch/heads. The mask's terms classify the tiles
    (:func:`~cptransform.op.mask_terms.meet`): ``SKIP`` is a proof that no pair is visible;
    ``FULL`` a proof that every pair is (tiles holding padding are never full, so the
    kernels can drop the padding check there); ``PARTIAL`` may be conservative (segment
    ranges that overlap without a common id, a band whose position ranges straddle it).
    """
    tq, tkv = q_pos.shape[-1], kv_pos.shape[-1]
    nq, nk = -(-tq // block_q), -(-tkv // block_kv)
    may, full = mask_terms.meet(mask_spec.terms(), mask_terms.Blocks.cut(
        q_pos, kv_pos, block_q, block_kv, **operands))
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


#: The columns of :func:`loop_bounds`.
LO, FULL_LO, FULL_HI, HI = range(4)


def loop_bounds(table):
    """Int32 ``[..., 4]``: for each row of ``table`` (along its last axis) the tile ranges a
    program walks, ``(lo, full_lo, full_hi, hi)`` with ``lo <= full_lo <= full_hi <= hi``.

    * every tile of ``[full_lo, full_hi)`` is ``FULL``: the longest run of consecutive full
      tiles (the first of equally long ones), so that loop needs no mask and no branch;
    * every tile that is not ``SKIP`` lies in ``[lo, hi)`` (the first visited tile to one past
      the last), so tiles outside it are never visited; the *edge* tiles ``[lo, full_lo)``
      and ``[full_hi, hi)`` are walked by the table (skip / full / partial per tile).

    A row without a full tile has ``full_lo = full_hi = hi``; a row without a visited tile
    is all zeros. For a causal mask over contiguous positions a row is ``(0, 0, i, i + 1)``:
    the tiles below the diagonal unmasked, the diagonal one masked. Plain XLA ops on the
    small table (cumulative max, argmax), run once per call outside the kernels.
    """
    n, axis = table.shape[-1], table.ndim - 1
    at = jnp.arange(n, dtype=jnp.int32)
    visited = table != BlockKind.SKIP
    full = table == BlockKind.FULL
    lo = jnp.min(jnp.where(visited, at, n), axis=-1)
    hi = jnp.max(jnp.where(visited, at + 1, 0), axis=-1)
    lo = jnp.minimum(lo, hi)  # a row with nothing visited: (0, 0, 0, 0)
    # Length of the run of full tiles ending at each tile (0 at a tile that is not full).
    start = lax.cummax(jnp.where(full, 0, at + 1), axis=axis)
    run = jnp.where(full, at + 1 - start, 0)
    longest = jnp.max(run, axis=-1)
    end = jnp.argmax(run, axis=-1).astype(jnp.int32) + 1
    full_hi = jnp.where(longest > 0, end, hi)
    full_lo = full_hi - longest
    return jnp.stack([lo, full_lo, full_hi, hi], axis=-1).astype(jnp.int32)
