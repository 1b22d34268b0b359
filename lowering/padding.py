"""Padding a sequence to its layout's multiple, with masked positions.

A layout splits a sequence into ``cp`` (zigzag: ``2·cp``) equal parts, so a length it does
not divide is padded at the end (natural order) before the layout permutes it; the user's
program never sees the padding. :func:`pad_block` pads one attention's canonical operands
so that the result, cut back to the real queries, is exactly the unpadded attention:

* **pad keys are invisible to every real query**: they get a segment id that no real
  query has (the segment mask is switched on with all-zero ids when the attention had
  none; with the user's ids, the sentinel is the smallest non-negative int that no real
  query uses, which exists among ``0 … n`` for ``n`` query ids). K and V of pad keys are
  zero, so the ``"uniform"`` fill, which sums V and divides by ``spec.real_keys``, and the
  ``0·V`` an empty row adds, stay those of the real keys;
* **pad queries see a real key** (key 0, or under key padding the first valid key): their
  positions are that key's position minus ``d`` with ``d`` inside the mask's band, and
  every term gives its own operands' values at them
  (:meth:`~cptransform.op.mask_terms.Segments.padding` and its siblings: the key's segment
  id, an all-True dense-mask row, the key's position as every top-k index, …), so no pad row
  is empty and none turns into NaN under ``empty_rows="nan"``; their outputs are dropped
  and their cotangents are zero, so they add nothing to any gradient.

Dense masks are padded with True (the segment mask hides pad keys), biases with 0, pad
keys' validity with False.
"""
from __future__ import annotations

import jax.numpy as jnp

from cptransform.lowering.block import Block
from cptransform.op.attention_spec import ROLES, AttentionSpec
from cptransform.op import mask_terms
from cptransform.op.mask_terms import offset_within
from cptransform.op.operand_roles import Role, Side


def _extend(x, to: int, fill):
    """``x [N, T, …]`` followed by ``fill`` (broadcast to ``[N, to - T, …]``) on dim 1."""
    extra = to - x.shape[1]
    if extra == 0:
        return x
    tail = jnp.broadcast_to(fill, (x.shape[0], extra) + x.shape[2:]).astype(x.dtype)
    return jnp.concatenate([x, tail], axis=1)


def _pad_dense(x, tq: int, tkv: int, fill):
    """A ``[B|1, H|1, Tq, Tkv]`` mask or bias padded to ``[…, tq, tkv]`` with ``fill``."""
    if x is None:
        return None
    widths = ((0, 0), (0, 0), (0, tq - x.shape[2]), (0, tkv - x.shape[3]))
    return jnp.pad(x, widths, constant_values=fill)


def _pad_rows(x, tq: int, fill):
    """Top-k indices ``[B|1, H|1, Tq, k]`` padded to ``tq`` rows of ``fill`` (``[N, 1]``)."""
    if x is None or x.shape[2] == tq:
        return x
    n = max(x.shape[0], fill.shape[0])
    x = jnp.broadcast_to(x, (n,) + x.shape[1:])
    tail = jnp.broadcast_to(fill.reshape(-1, 1, 1, 1), (n, x.shape[1], tq - x.shape[2], x.shape[3]))
    return jnp.concatenate([x, tail.astype(x.dtype)], axis=2)


def unused_id(ids):
    """The smallest non-negative id not in ``ids`` (traced; at most ``ids.size``)."""
    flat = ids.reshape(-1).astype(jnp.int32)
    n = flat.shape[0]
    seen = jnp.zeros((n + 2,), bool).at[jnp.where((flat >= 0) & (flat <= n), flat, n + 1)] \
        .set(True)
    return jnp.argmin(seen[:n + 1]).astype(ids.dtype)


def _batch_of(*xs) -> int:
    return max(x.shape[0] for x in xs)


def pad_block(block: Block, spec: AttentionSpec, tq: int, tkv: int) -> tuple[Block, AttentionSpec]:
    """``block`` (canonical operands in natural order, positions given) padded to ``tq``
    queries and ``tkv`` keys as the module doc says, and the spec that reads it (segments
    on, ``real_keys`` set). A block that needs no padding is returned unchanged."""
    real_q, real_kv = block.q.shape[1], block.k.shape[1]
    if (real_q, real_kv) == (tq, tkv):
        return block, spec
    if spec.mask.fill is not None:
        raise NotImplementedError(
            f"this attention's masked logits take the finite value {spec.mask.fill:g} (each "
            f"masked key keeps a share of its row), and its {real_q} queries / {real_kv} keys "
            f"need padding to {tq} / {tkv} for the layout: a pad key would take that share "
            "too. Use sequence lengths the layout divides (a multiple of cp; of 2·cp under "
            "load_balance='zigzag')")
    padded_spec = spec.replace(mask=spec.mask.replace(segments=True), real_keys=real_kv)
    if spec.mask.segments:
        q_seg, kv_seg = block.q_seg, block.kv_seg
        hidden = unused_id(q_seg)
    else:
        q_seg = jnp.zeros((1, real_q), jnp.int32)
        kv_seg = jnp.zeros((1, real_kv), jnp.int32)
        hidden = jnp.ones((), jnp.int32)
    n = _batch_of(q_seg, kv_seg)
    q_seg, kv_seg = (jnp.broadcast_to(x, (n, x.shape[1])) for x in (q_seg, kv_seg))
    aim = _aimed_keys(block)
    n = _batch_of(block.q_pos, block.kv_pos, *(x for x in (aim,) if x is not None))
    q_pos, kv_pos = (jnp.broadcast_to(x, (n, x.shape[1])) for x in (block.q_pos, block.kv_pos))
    last = kv_pos[:, -1:]
    first = _first_key(kv_pos, kv_seg, aim)
    padded = block.replace(
        q=_extend(block.q, tq, 0), k=_extend(block.k, tkv, 0), v=_extend(block.v, tkv, 0),
        q_pos=_extend(q_pos, tq, first["kv_pos"] - offset_within(*_aimed_band(spec.mask))),
        # Pad keys continue after the last real one: position ranges (and so the kernels'
        # skipping of empty chunk pairs) stay as tight as the real keys allow.
        kv_pos=_extend(kv_pos, tkv,
                       last + 1 + jnp.arange(tkv - real_kv, dtype=last.dtype)[None, :]),
        q_seg=q_seg, kv_seg=_extend(kv_seg, tkv, hidden),
        bias=_pad_dense(block.bias, tq, tkv, 0),
        **{name: _extend(getattr(block, name), tkv, False) for name in _KEY_TESTS
           if getattr(block, name) is not None})
    for term in padded_spec.mask.terms():
        for name, fill in term.padding(first).items():
            padded = padded.replace(**{name: _pad_queries(
                getattr(padded, name), ROLES[name], fill, tq, tkv, first["kv_pos"])})
    return padded, padded_spec


#: The boolean key operands of the terms (validity, region tests): False at pad keys.
_KEY_TESTS = tuple(name for name, role in ROLES.items()
                   if role.side is Side.KEY and role.boolean)


def _aimed_keys(block: Block):
    """Bool ``[B|1, Tkv]`` of the keys a pad query may be aimed at (``None``: any): valid
    ones whose region padding's inside test holds."""
    aim = None
    for x in (block.kv_valid, block.kv_inside):
        if x is not None:
            aim = x if aim is None else aim & x
    return aim


def _aimed_band(mask) -> tuple:
    """Bounds on ``d = kv_pos - q_pos`` a pad query takes to its key: the mask's band, and
    inside the region of its region padding (where the aimed key's inside test holds)."""
    bands = [mask_terms.Band(*mask.band())]
    if mask.region_padding is not None:
        bands.append(mask_terms.Band(*mask.region_padding))
    return mask_terms.band_of(bands)


def _first_key(kv_pos, kv_seg, kv_valid) -> dict:
    """``kv_pos`` and ``kv_seg`` (``[N, 1]``) of the key a pad query is aimed at: key 0, or
    under key padding (or a region padding) each row's first key that passes (key 0 in a
    row with none: a pad query placed there may see no key, and its output is dropped)."""
    if kv_valid is None:
        return {"kv_pos": kv_pos[:, :1], "kv_seg": kv_seg[:, :1]}
    n = _batch_of(kv_pos, kv_seg, kv_valid)
    at = jnp.argmax(jnp.broadcast_to(kv_valid, (n, kv_valid.shape[1])), axis=1)[:, None]
    return {name: jnp.take_along_axis(jnp.broadcast_to(x, (n, x.shape[1])), at, axis=1)
            for name, x in (("kv_pos", kv_pos), ("kv_seg", kv_seg))}


def _pad_queries(x, role: Role, fill, tq: int, tkv: int, first):
    """A term's operand padded to ``tq`` queries with ``fill`` (and, for a pair mask, to
    ``tkv`` keys): per query ``[B|1, Tq]``, per row ``[B|1, H|1, Tq, k]`` or per pair."""
    if x is None:
        return None
    if role.columns:
        return _pad_dense(x, tq, tkv, fill)
    if role.side is Side.ROWS:
        return _pad_rows(x, tq, jnp.broadcast_to(fill, first.shape))
    return _extend(jnp.broadcast_to(x, (_batch_of(x, first), x.shape[1])), tq, fill)
