"""The math of one tile, shared by the TPU and GPU Pallas kernels (they differ only in how
they walk the tiles: a grid with scratch accumulators vs a loop inside the program).

Every function takes loaded values, never refs. A tile is ``rows × cols``: queries × keys in
the forward and dQ kernels, keys × queries in the dK/dV kernel (the transposed tile). The
mask is built here from positions, segment ids and the dense tile: positions arrive as a
column ``[rows, 1]`` for the row side and a row ``[1, cols]`` for the column side, so the
same code serves both orientations.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp
from jax import lax

from cptransform.op import mask_terms
from cptransform.op.attention_reference import capped_logits
from cptransform.op.attention_spec import AttentionSpec

F32 = jnp.float32


@dataclass(frozen=True)
class TileSides:
    """One tile's mask inputs, already oriented (row side ``[rows, 1]``, column side
    ``[1, cols]``); ``transposed`` says the rows are keys. ``None`` for absent operands."""

    row_pos: object
    col_pos: object
    row_seg: object = None
    col_seg: object = None
    dense: object = None          # int8 [rows, cols], nonzero = visible
    picked: object = None         # int8 [rows, cols], nonzero = a top-k index
    row_valid: object = None      # bool [rows, 1]: not padding
    col_valid: object = None      # bool [1, cols]
    transposed: bool = False


def as_column(x):
    """``[..., T]`` → ``[..., T, 1]``: the row side of a tile."""
    return x[..., :, None]


def as_row(x):
    """``[..., T]`` → ``[..., 1, T]``: the column side of a tile."""
    return x[..., None, :]


def valid_range(start, size: int, limit: int, axis: int):
    """``start + iota < limit`` (not padding) as a ``[size, 1]`` column (``axis=0``) or a
    ``[1, size]`` row (``axis=1``)."""
    shape = (size, 1) if axis == 0 else (1, size)
    return start + lax.broadcasted_iota(jnp.int32, shape, axis) < limit


def visible_tile(spec: AttentionSpec, t: TileSides):
    """Bool ``[rows, cols]``: the pairs the mask lets through (what
    :func:`~cptransform.op.attention_reference.visible` says for this tile), padding
    excluded."""
    dense = None if t.dense is None else t.dense != 0
    picked = None if t.picked is None else t.picked != 0
    if t.transposed:
        tile = mask_terms.Tile(q_pos=t.col_pos, kv_pos=t.row_pos, q_seg=t.col_seg,
                               kv_seg=t.row_seg, dense=dense, picked=picked)
    else:
        tile = mask_terms.Tile(q_pos=t.row_pos, kv_pos=t.col_pos, q_seg=t.row_seg,
                               kv_seg=t.col_seg, dense=dense, picked=picked)
    return t.row_valid & t.col_valid & mask_terms.visible(spec.mask.terms(), tile)


def dot_nt(a, b):
    """``a @ bᵀ`` with float32 accumulation (contract the last dims; no transpose copy)."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=F32)


def dot_nn(a, b):
    """``a @ b`` with float32 accumulation."""
    return jnp.dot(a, b, preferred_element_type=F32)


def tile_logits(spec: AttentionSpec, rows, cols, bias=None):
    """``(s, tanh)``: float32 logits ``softcap(scale · rows·colsᵀ) + bias`` of one tile and the
    soft-cap's ``tanh`` (``None`` without soft-cap), which the backward needs."""
    return capped_logits(spec, dot_nt(rows, cols) * F32(spec.scale), bias)


def online_softmax(state, s, ok, v):
    """One key tile of the forward's running softmax.

    ``state = (m, l, acc, seen)``: running max and sum ``[rows, 1]``, unnormalised output
    ``[rows, Dv]``, and whether the mask let any key through so far (``[rows, 1]``, 0/1).
    ``ok`` is ``None`` for a full tile. ``seen`` decides empty rows later, from the mask
    alone: NaN or Inf logits then propagate as in a plain softmax.
    """
    m, l, acc, seen = state
    if ok is None:
        seen = jnp.ones_like(seen)
    else:
        s = jnp.where(ok, s, -jnp.inf)
        seen = jnp.maximum(seen, jnp.max(ok.astype(F32), axis=1, keepdims=True))
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
    # Exponent base: the max, or 0 while no key is visible yet (then every s is -inf and
    # exp(-inf - 0) = 0, where exp(-inf - -inf) would be NaN).
    base = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp(m - base)
    p = jnp.exp(s - base)
    l = alpha * l + jnp.sum(p, axis=1, keepdims=True)
    acc = alpha * acc + dot_nn(p.astype(v.dtype), v)
    return m_new, l, acc, seen


def finish_softmax(state):
    """``(o, lse)`` from the final state: ``o [rows, Dv]`` float32, ``lse [rows, 1]``;
    rows the mask left empty get ``o = 0``, ``lse = -inf``."""
    m, l, acc, seen = state
    empty = seen == 0
    base = jnp.where(m == -jnp.inf, 0.0, m)
    o = jnp.where(empty, 0.0, acc / jnp.where(empty, 1.0, l))
    lse = jnp.where(empty, -jnp.inf, base + jnp.log(jnp.where(empty, 1.0, l)))
    return o, lse


def initial_state(rows: int, dv: int):
    """The running-softmax state before the first key tile."""
    return (jnp.full((rows, 1), -jnp.inf, F32), jnp.zeros((rows, 1), F32),
            jnp.zeros((rows, dv), F32), jnp.zeros((rows, 1), F32))


def grad_logits(spec: AttentionSpec, s, tanh, ok, lse, delta, dp):
    """``(ds, dbias)`` of one tile from the *merged* ``lse`` and ``delta = rowsum(dO∘O) -
    dlse`` (both oriented like the tile's query side) and ``dp = dO·Vᵀ``.

    ``P = exp(s - lse)`` on visible pairs, ``dbias = P ∘ (dp - delta)`` and ``ds`` is that
    through the soft-cap and the scale (the gradient w.r.t. ``rows·colsᵀ``).
    """
    p = jnp.exp(s - lse)
    if ok is not None:
        p = jnp.where(ok, p, 0.0)
    dbias = p * (dp - delta)
    if ok is not None:  # a masked logit's gradient is an exact 0, even in a NaN row
        dbias = jnp.where(ok, dbias, 0.0)
    ds = dbias if tanh is None else dbias * (1.0 - tanh * tanh)
    # A NaN row (NaN lse) has NaN probabilities at masked keys too, as a dense softmax: dV
    # sees them (the returned p is what dV is built from).
    p = p + jnp.where(lse != lse, jnp.nan, 0.0)
    return ds * F32(spec.scale), dbias, p
