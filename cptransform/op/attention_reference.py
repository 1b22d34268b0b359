"""The meaning of ``attention_p`` in plain ``jax.numpy``.

:func:`attend` is the block computation every schedule is built from: queries at some
positions against keys at some positions, returning the output and its log-sum-exp so
partial results can be merged exactly. :func:`attention_reference` is the whole
(unsharded) attention, used as ``attention_p``'s implementation and as the test oracle.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from cptransform.op.accumulation import accumulator_dtype
from cptransform.op import dropout, mask_terms
from cptransform.op.attention_spec import OPERAND_NAMES, AttentionSpec, MaskSpec
from cptransform.op.mask_terms import TERM_ROLES


def visible(mask_spec: MaskSpec, q_pos, kv_pos, *, mask=None, topk=None, **per_token):
    """Boolean ``[B|1, H|1, Tq, Tkv]``: which pairs the mask lets through.

    ``q_pos``/``kv_pos`` are ``[B|1, T]`` global positions, and so are the mask terms'
    other per-token operands ``per_token`` (by field name, e.g. ``q_seg``, ``kv_seg``;
    ``None`` when absent); ``mask`` is a boolean ``[B|1, H|1, Tq, Tkv]`` tile or ``None``;
    ``topk`` int ``[B|1, H|1, Tq, k]`` selected key positions or ``None``.
    """
    tile = mask_terms.Tile.of(dict(per_token, q_pos=q_pos, kv_pos=kv_pos),
                              lambda x: jnp.expand_dims(x, (1, 3)),
                              lambda x: jnp.expand_dims(x, (1, 2)), dense=mask,
                              picked=None if topk is None else selected(topk, kv_pos))
    out = jnp.ones((1, 1, q_pos.shape[-1], kv_pos.shape[-1]), dtype=bool)
    return out & mask_terms.visible(mask_spec.terms(), tile)


def selected(topk, kv_pos):
    """Boolean ``[B|1, H|1, Tq, Tkv]``: key ``j`` is one of the query's top-k positions.

    Each query's indices are sorted and every key position looked up in them (a binary
    search), so the memory is the tile plus the indices (never ``Tq·Tkv·k``); a repeated
    index selects its key once, as a scatter of True would.
    """
    srt = jnp.sort(topk, axis=-1)
    b = max(srt.shape[0], kv_pos.shape[0])
    srt = jnp.broadcast_to(srt, (b, *srt.shape[1:]))
    kv = jnp.broadcast_to(kv_pos, (b, kv_pos.shape[-1])).astype(srt.dtype)
    last = srt.shape[-1] - 1

    def row(indices, keys):
        at = jnp.minimum(jnp.searchsorted(indices, keys), last)
        return indices[at] == keys

    per_query = jax.vmap(row, in_axes=(0, None))          # over Tq
    per_head = jax.vmap(per_query, in_axes=(0, None))     # over H|1
    return jax.vmap(per_head)(srt, kv)                    # over B


def capped_logits(spec: AttentionSpec, scaled, bias=None):
    """``(s, tanh)``: the logits ``softcap(scaled) + bias`` from the scaled products
    ``scaled = scale · q·kᵀ`` (in their dtype), and the soft-cap's ``tanh`` (``None``
    without soft-cap), which a backward needs for ``ds · (1 - tanh²)``.

    The one definition of the logits after the product: the reference, the XLA kernels and
    both Pallas kernels call it (the product itself is each one's own: its operand layout,
    and whether the scale goes on ``q`` or on the product, are how each computes it fastest
    and most exactly). Plain ``jnp`` arithmetic on an array, so it traces inside a Pallas
    kernel body too.
    """
    dtype = np.dtype(scaled.dtype).type
    tanh = None
    if spec.softcap is not None:
        cap = dtype(spec.softcap)
        tanh = jnp.tanh(scaled / cap)
        scaled = tanh * cap
    if bias is not None:
        scaled = scaled + bias.astype(scaled.dtype)
    return scaled, tanh


def logits(spec: AttentionSpec, q, k, bias=None):
    """``[B, H, Tq, Tkv]`` logits (:func:`accumulator_dtype`) from canonical
    ``q [B,Tq,H,D]``, ``k [B,Tkv,Hkv,D]``: :func:`capped_logits` of the scaled product."""
    return logits_and_tanh(spec, q, k, bias)[0]


def logits_and_tanh(spec: AttentionSpec, q, k, bias=None):
    """:func:`logits` and the soft-cap's ``tanh`` (see :func:`capped_logits`)."""
    b, tq, h, d = q.shape
    hkv = k.shape[2]
    acc = accumulator_dtype(q.dtype, k.dtype)
    qg = q.reshape(b, tq, hkv, h // hkv, d)
    s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k, preferred_element_type=acc)
    s = s.reshape(b, h, tq, k.shape[1]).astype(acc) * acc.type(spec.scale)
    return capped_logits(spec, s, bias)


def attend(spec: AttentionSpec, q, k, v, q_pos, kv_pos, *, bias=None, seed=None, **operands):
    """One block of attention in canonical layout; returns ``(o, lse)``.

    ``q [B,Tq,H,D]``, ``k [B,Tkv,Hkv,D]``, ``v [B,Tkv,Hkv,Dv]``; positions ``[B|1, T]``;
    ``operands``: the mask terms' operands by field name, as :func:`visible` takes them;
    ``bias`` ``[B|1, H|1, Tq, Tkv]`` or ``None``; ``seed`` the dropout seed
    ``[B|1, H, 4]`` (with ``spec.dropout``). ``o`` is float32
    ``[B,Tq,H,Dv]`` normalised within this block; ``lse`` is float32 ``[B,H,Tq]``.
    ``spec.mask.empty_rows`` is not applied: that is a property of the whole row, see
    :func:`fill_empty_rows`.

    Non-finite values behave as in the dense single-device softmax (docs/contract.md,
    "NaN and Inf"):

    * a row with no visible key here has ``lse = -inf`` (so does a row whose visible logits
      are all ``-inf``: it receives no probability mass either); its ``o`` is ``0·ΣV``;
    * a NaN or ``+inf`` visible logit makes the row's ``o`` and ``lse`` NaN;
    * a masked probability is an exact 0 and ``0·NaN = NaN``: a NaN or Inf in V (even at a
      key nobody sees) makes that (batch, head, feature) column of ``o`` NaN in every row.
    """
    s = logits(spec, q, k, bias)
    ok = visible(spec.mask, q_pos, kv_pos, **operands)
    s = masked_logits(spec.mask, ok, s)
    m = jnp.max(s, axis=-1, keepdims=True)
    # Only the no-mass case (-inf) is shifted by 0; a NaN or +inf maximum stays and turns
    # the row into NaN, as ``exp(x - max(x))`` does on one device.
    m_safe = lax.stop_gradient(jnp.where(m == -jnp.inf, 0.0, m))
    p = jnp.exp(s - m_safe)
    if spec.mask.fill is None:
        p = jnp.where(ok, p, 0.0)
    l = jnp.sum(p, axis=-1, keepdims=True)
    # ``l == 0`` exactly when the row got no mass; a NaN ``l`` must not count as empty.
    l_safe = jnp.where(l == 0, 1.0, l)
    b, tkv, hkv, dv = v.shape
    h = q.shape[2]
    if spec.dropout is not None:
        p = dropout.applied(spec.dropout, p, dropout.multiplier(spec.dropout, seed, q_pos, kv_pos))
    pg = (p / l_safe).reshape(b, hkv, h // hkv, q.shape[1], tkv)
    o = jnp.einsum("bhgqk,bkhd->bqhgd", pg, v.astype(s.dtype),
                   preferred_element_type=s.dtype).reshape(b, q.shape[1], h, dv)
    lse = jnp.where(l[..., 0] == 0, -jnp.inf, jnp.log(l_safe[..., 0]) + m_safe[..., 0])
    return o, lse


def masked_logits(mask_spec: MaskSpec, ok, s):
    """The logits ``s`` with the pairs ``ok`` does not let through set to what the mask
    gives them: ``-inf`` (hidden), or its finite ``fill`` (a constant: no gradient reaches
    ``s`` there). Plain ``jnp``, so every kernel body shares it."""
    fill = -jnp.inf if mask_spec.fill is None else mask_spec.fill
    return jnp.where(ok, s, jnp.asarray(fill, s.dtype))


def empty_rows_of(lse):
    """Boolean, like ``lse``: the rows that received no probability mass.

    The one test of row emptiness every schedule and kernel uses. Kernels set ``lse`` to
    exactly ``-inf`` only for a row with no visible key (decided from the mask) or whose
    visible logits are all ``-inf``; a NaN ``lse`` is a NaN row, never an empty one.
    """
    return lse == -jnp.inf


def merge(o1, lse1, o2, lse2):
    """Exactly combine two partial results over disjoint key sets (float32).

    ``-inf`` safe: two empty partials give ``lse = -inf`` and ``o = 0·o1 + 0·o2`` (finite
    unless a partial carries a NaN, which then propagates as ``0·NaN`` does on one device).
    NaN propagating: a NaN (or ``+inf``) ``lse`` makes the merged row NaN; it is never
    weighted 0.
    """
    lse = jnp.logaddexp(lse1, lse2)
    lse_safe = jnp.where(empty_rows_of(lse), 0.0, lse)
    w1 = jnp.exp(lse1 - lse_safe)
    w2 = jnp.exp(lse2 - lse_safe)
    t = lambda w: jnp.swapaxes(w, 1, 2)[..., None]  # noqa: E731  [B,H,Tq] -> [B,Tq,H,1]
    return t(w1) * o1 + t(w2) * o2, lse


def merge_sinks(o, lse, sinks):
    """Merge the sinks into a row's result over *all* its keys (float32; once per row).

    ``sinks`` ``[B|1, H]``: a sink is a partial result over no keys whose ``lse`` is the sink
    and whose output is 0, so :func:`merge` adds it exactly: ``lse' = logaddexp(lse, sink)``,
    ``o' = exp(lse - lse')·o``. A row without visible keys gets ``o' = 0·o`` and
    ``lse' = sink`` (empty only when the sink is ``-inf``); a ``+inf`` or NaN sink makes the
    row NaN (``0·exp(inf - inf)``), as a softmax over the extra column does on one device.
    """
    sink = sinks.astype(o.dtype)[..., None]
    # A row with no mass from its keys nor its sink stays empty. ``logaddexp(-inf, -inf)``
    # has a NaN derivative (one device's softmax gives the ``-inf`` sink a 0 gradient), so
    # such rows merge stand-in zeros (``o`` is ``0·ΣV`` there: halving it changes nothing)
    # and get their ``-inf`` back.
    empty = empty_rows_of(lse) & empty_rows_of(sink)
    o, total = merge(o, jnp.where(empty, 0.0, lse), jnp.zeros((), o.dtype),
                     jnp.where(empty, 0.0, sink))
    return o, jnp.where(empty, -jnp.inf, total)


def fill_empty_rows(spec: AttentionSpec, o, lse, v_mean, added=None):
    """Apply ``spec.mask.empty_rows`` to the rows :func:`empty_rows_of` names.

    ``"zero"`` keeps ``o`` (0, up to NaN from V); ``"uniform"`` gives ``v_mean``, the mean of
    V over *all* keys (``[B, 1, Hkv, Dv]`` float32); ``"nan"`` gives ``NaN·v_mean``: NaN,
    and, like softmax over an all ``-inf`` row on one device, a NaN gradient for every V.
    ``added``: :func:`added_fill_term` of these rows, for ``spec.mask.added_fill``.
    """
    if spec.mask.empty_rows == "zero":
        return o
    b, tq, h, dv = o.shape
    hkv = v_mean.shape[2]
    mean = jnp.repeat(v_mean, h // hkv, axis=2)
    empty = jnp.swapaxes(empty_rows_of(lse), 1, 2)[..., None]
    if spec.mask.empty_rows == "nan":
        # NaN only in the empty rows: a NaN factor on every row would turn the zero
        # cotangent that ``where`` sends the other rows into NaN (0·NaN) in dV.
        mean = mean * jnp.where(empty, jnp.nan, 1.0)
    if added is not None:
        mean = mean + added
    return jnp.where(empty, mean, o)


def added_fill_term(spec: AttentionSpec, q, k, v, keys: int, key_sum=lambda x: x):
    """Zero, carrying the gradient one device's softmax gives an empty row whose finite fill
    was added to its scores (``spec.mask.added_fill``): ``[B, Tq, H, Dv]`` float32.

    There every score of the row is ``s_ij + fill``, which rounds to ``fill``: the softmax
    is uniform (``p = 1/n`` over the ``n`` keys), yet its derivative still reaches
    ``s_ij = scale·q_i·k_j``: ``do_i = (1/n) Σ_j (ds_ij − mean_j ds_ij) v_j``. With
    ``K̄V = (1/n) Σ_j k_j v_jᵀ`` and the means ``k̄``, ``v̄`` that is the derivative of
    ``t_i = scale·(q_i·K̄V − (q_i·k̄) v̄)`` with V held constant (its own gradient, ``1/n``
    per row, comes from the mean of V). The term is ``t − stop_gradient(t)``: nothing is
    added to the output, and no key is visited, so block skipping is unchanged.

    ``q [B,Tq,H,D]``, ``k [B,Tkv,Hkv,D]``, ``v [B,Tkv,Hkv,Dv]`` in canonical layout, the
    keys this device holds; ``key_sum`` completes a sum over them to all ``keys`` keys (a
    ``psum`` over the CP axes when they are sharded). Padded keys (zero K and V) add nothing.
    """
    acc = accumulator_dtype(q.dtype)
    kf, vs = k.astype(acc), lax.stop_gradient(v).astype(acc)
    kv_mean = key_sum(jnp.einsum("bkhd,bkhe->bhde", kf, vs)) / keys
    k_mean = key_sum(jnp.sum(kf, axis=1)) / keys
    v_mean = key_sum(jnp.sum(vs, axis=1)) / keys
    b, tq, h, d = q.shape
    hkv = k.shape[2]
    qg = q.astype(acc).reshape(b, tq, hkv, h // hkv, d)
    t = jnp.einsum("bqhgd,bhde->bqhge", qg, kv_mean) \
        - jnp.einsum("bqhgd,bhd->bqhg", qg, k_mean)[..., None] * v_mean[:, None, :, None, :]
    t = (spec.scale * t).reshape(b, tq, h, -1)
    return t - lax.stop_gradient(t)


def to_canonical(spec: AttentionSpec, q, k, v):
    """Transpose q/k/v to ``(*batch, T, H, D)`` (adding a size-1 heads dim if absent)."""
    def canon(x, layout):
        x = jnp.transpose(x, layout.canonical_perm())
        if layout.heads is None:
            x = x[..., None, :]
        return x
    return canon(q, spec.q), canon(k, spec.k), canon(v, spec.v)


def from_canonical(spec: AttentionSpec, o):
    """Inverse of :func:`to_canonical` for the output (q's layout)."""
    if spec.q.heads is None:
        o = o[..., 0, :]
    perm = spec.q.canonical_perm()
    inverse = [perm.index(i) for i in range(len(perm))]
    return jnp.transpose(o, inverse)


def split_operands(spec: AttentionSpec, operands):
    """Name the flat operand list of ``attention_p`` (missing ones are ``None``)."""
    named = dict(zip(spec.operand_names(), operands))
    return {name: named.get(name) for name in OPERAND_NAMES}


def flatten_batch(x, nb: int, batch_shape):
    """Bring an operand's ``nb`` leading batch dims to one dim: 1 when they are all 1
    (broadcast), else q's ``batch_shape`` flattened. ``None`` stays ``None``."""
    if x is None:
        return None
    if nb == 0:
        return x[None]
    if all(d == 1 for d in x.shape[:nb]):
        return x.reshape((1,) + x.shape[nb:])
    x = jnp.broadcast_to(x, tuple(batch_shape) + x.shape[nb:])
    return x.reshape((-1,) + x.shape[nb:])


def attention_reference(*operands, spec: AttentionSpec):
    """The unsharded attention ``attention_p`` stands for (float32 softmax)."""
    a = split_operands(spec, operands)
    q, k, v = to_canonical(spec, a["q"], a["k"], a["v"])
    nb = len(spec.q.batch)
    batch_shape = q.shape[:nb]
    tq, tkv = q.shape[nb], k.shape[nb]

    def bcast(x):
        return flatten_batch(x, nb, batch_shape)

    q, k, v = (x.reshape((-1,) + x.shape[nb:]) if nb else x[None] for x in (q, k, v))
    q_pos = a["q_positions"]
    kv_pos = a["kv_positions"]
    q_pos = bcast(q_pos) if q_pos is not None else jnp.arange(tq, dtype=jnp.int32)[None]
    kv_pos = bcast(kv_pos) if kv_pos is not None else jnp.arange(tkv, dtype=jnp.int32)[None]
    o, lse = attend(spec, q, k, v, q_pos, kv_pos, bias=bcast(a["bias"]),
                    seed=bcast(a["dropout_seed"]),
                    **{name: bcast(a[role.operand]) for name, role in TERM_ROLES.items()})
    if spec.sinks:
        o, lse = merge_sinks(o, lse, bcast(a["sinks"]))
    v_mean = jnp.mean(v.astype(accumulator_dtype(q.dtype)), axis=1, keepdims=True)
    added = added_fill_term(spec, q, k, v, tkv) if spec.mask.added_fill else None
    o = fill_empty_rows(spec, o, lse, v_mean, added)
    o = o.reshape(batch_shape + o.shape[1:]).astype(a["q"].dtype)
    return from_canonical(spec, o)
