"""``attention_p``: one attention as a single JAX primitive, and the public ``attention``.

The matcher rewrites attention subgraphs into this primitive; the CP lowering replaces it
with a schedule. Outside those passes it evaluates, differentiates and vmaps like the plain
``jax.numpy`` code in :mod:`cptransform.op.attention_reference`.
"""
from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp

from cptransform.ir import compat
from cptransform.op.attention_reference import attention_reference, split_operands
from cptransform.op.attention_spec import ROLES, AttentionSpec, Layout, MaskSpec
from cptransform.op.operand_roles import Side
from cptransform.ir.errors import AttentionShapeError


def _check_shapes(spec: AttentionSpec, avals) -> None:
    a = split_operands(spec, avals)
    q, k, v = a["q"], a["k"], a["v"]
    for name, x, layout in (("q", q, spec.q), ("k", k, spec.k), ("v", v, spec.v)):
        if x.ndim != layout.ndim:
            raise AttentionShapeError(
                f"{name} has shape {x.shape} but its layout {layout.letters()} needs "
                f"{layout.ndim} dims")
    dim = lambda x, layout, d: x.shape[d] if d is not None else 1  # noqa: E731
    batch = lambda x, layout: tuple(x.shape[d] for d in layout.batch)  # noqa: E731
    if not (batch(q, spec.q) == batch(k, spec.k) == batch(v, spec.v)):
        raise AttentionShapeError(
            f"batch dims differ: q {batch(q, spec.q)}, k {batch(k, spec.k)}, v {batch(v, spec.v)}")
    if dim(q, spec.q, spec.q.feature) != dim(k, spec.k, spec.k.feature):
        raise AttentionShapeError(
            f"q and k head dims differ: {q.shape[spec.q.feature]} vs {k.shape[spec.k.feature]}")
    if k.shape[spec.k.seq] != v.shape[spec.v.seq]:
        raise AttentionShapeError(
            f"k and v sequence lengths differ: {k.shape[spec.k.seq]} vs {v.shape[spec.v.seq]}")
    hq, hk, hv = dim(q, spec.q, spec.q.heads), dim(k, spec.k, spec.k.heads), \
        dim(v, spec.v, spec.v.heads)
    if hk != hv:
        raise AttentionShapeError(f"k has {hk} heads but v has {hv}")
    if hq % hk or hq // hk != spec.groups:
        raise AttentionShapeError(
            f"{hq} query heads over {hk} KV heads does not give groups={spec.groups}; "
            "query heads must be a multiple of KV heads")
    nb = len(spec.q.batch)
    tq, tkv = q.shape[spec.q.seq], k.shape[spec.k.seq]
    bq = batch(q, spec.q)

    def expect(name, shape, tail):
        x = a[name]
        if x is None:
            return
        ok = x.ndim == nb + len(tail) and all(
            xd in (1, want) for xd, want in zip(x.shape, bq + tail) if want is not None)
        if not ok:
            raise AttentionShapeError(
                f"{name} has shape {x.shape}; expected {shape} = "
                f"{tuple(bq) + tuple('1|%d' % t if t else '*' for t in tail)} "
                "(size-1 dims broadcast)")

    per_token = [role for role in ROLES.values() if role.operand and role.per_token]
    for role in per_token:
        name, t = role.operand, tq if role.side is Side.QUERY else tkv
        x = a[name]
        if x is not None and x.shape[-1] != t:
            raise AttentionShapeError(f"{name} has length {x.shape[-1]}, the sequence has {t}")
        expect(name, "(*batch, T)", (t,))
    for name in (role.operand for role in ROLES.values() if role.columns):
        x = a[name]
        if x is not None and tuple(x.shape[-2:]) != (tq, tkv):
            raise AttentionShapeError(
                f"{name} has shape {x.shape}; its last two dims must be (q length {tq}, "
                f"kv length {tkv})")
        expect(name, "(*batch, heads|1, Tq, Tkv)", (hq, tq, tkv))
    sinks = a["sinks"]
    if sinks is not None:
        if not jnp.issubdtype(sinks.dtype, jnp.floating):
            raise AttentionShapeError(f"sinks must be floating point, got {sinks.dtype}")
        if sinks.shape[-1:] != (hq,):
            raise AttentionShapeError(
                f"sinks has shape {sinks.shape}; its last dim must be the {hq} query heads")
        expect("sinks", "(*batch, heads)", (hq,))
    for name in (role.operand for role in ROLES.values() if role.boolean):
        if a[name] is not None and a[name].dtype != jnp.bool_:
            raise AttentionShapeError(f"{name} must be boolean, got {a[name].dtype}")
    _check_index_operands(a, expect, hq, tq)


def _check_index_operands(a: dict, expect, hq: int, tq: int) -> None:
    """The integer operands: top-k indices, the terms' integer per-token operands, the
    dropout seed."""
    topk = a["topk_indices"]
    if topk is not None:
        if topk.ndim < 2 or topk.shape[-2] != tq:
            raise AttentionShapeError(
                f"topk_indices has shape {topk.shape}; its last two dims must be (q length "
                f"{tq}, k)")
        expect("topk_indices", "(*batch, heads|1, Tq, k)", (hq, tq, None))
        if not jnp.issubdtype(topk.dtype, jnp.integer):
            raise AttentionShapeError(f"topk_indices must be integer, got {topk.dtype}")
    for name in (role.operand for role in ROLES.values() if role.per_token and role.integer):
        x = a[name]
        if x is not None and not jnp.issubdtype(x.dtype, jnp.integer):
            raise AttentionShapeError(f"{name} must be integer, got {x.dtype}")
    seed = a["dropout_seed"]
    if seed is not None:
        if seed.dtype != jnp.uint32 or seed.shape[-2:] != (hq, 4):
            raise AttentionShapeError(
                f"dropout_seed has {seed.dtype}{list(seed.shape)}; expected uint32 "
                f"(*batch, {hq} heads, 4)")
        expect("dropout_seed", "(*batch, heads, 4)", (hq, 4))


def _abstract_eval(*avals, spec: AttentionSpec):
    _check_shapes(spec, avals)
    q, v = avals[0], avals[2]
    shape = list(q.shape)
    shape[spec.q.feature] = v.shape[spec.v.feature]
    return compat.ShapedArray(tuple(shape), q.dtype)


def _impl(*operands, spec: AttentionSpec):
    # Eager calls reach the impl without abstract evaluation: check shapes here too.
    _check_shapes(spec, operands)
    return attention_reference(*operands, spec=spec)


def _differentiable(spec: AttentionSpec) -> tuple[int, ...]:
    names = spec.operand_names()
    return tuple(i for i, n in enumerate(names) if n in ("q", "k", "v", "bias", "sinks"))


def _jvp(primals, tangents, *, spec: AttentionSpec):
    diff = _differentiable(spec)
    out = attention_p.bind(*primals, spec=spec)

    def on_diff(*xs):
        full = list(primals)
        for i, x in zip(diff, xs):
            full[i] = x
        return attention_reference(*full, spec=spec)

    tans = [compat.instantiate_zeros(tangents[i]) for i in diff]
    _, t_out = jax.jvp(on_diff, [primals[i] for i in diff], tans)
    return out, t_out


def _batch(args, dims, *, spec: AttentionSpec):
    size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
    moved = []
    for i, (x, d) in enumerate(zip(args, dims)):
        if d is not None:
            x = jnp.moveaxis(x, d, 0)
        elif i < 3:
            x = jnp.broadcast_to(x[None], (size,) + x.shape)
        else:
            x = x[None]
        moved.append(x)
    new_spec = spec.replace(q=spec.q.with_leading_batch(), k=spec.k.with_leading_batch(),
                            v=spec.v.with_leading_batch())
    return attention_p.bind(*moved, spec=new_spec), 0


attention_p = compat.define_primitive(
    "attention", multiple_results=False, impl=_impl, abstract_eval=_abstract_eval,
    jvp=_jvp, batch=_batch)
compat.register_pp_rule(attention_p, lambda params: f"attention[{params['spec'].describe()}]")


def attention(q, k, v, *, mask=None, bias=None, causal: bool = False,
              window: tuple[int | None, int | None] | None = None,
              segment_ids=None, scale: float | None = None, softcap: float | None = None,
              layout: str | None = None, positions=None, empty_rows: str = "zero",
              sinks=None, topk_indices=None, chunk_size: int | None = None, valid=None):
    """Attention over ``q``, ``k``, ``v`` as one ``attention_p`` equation.

    Args:
      q, k, v: arrays in ``layout`` (default ``"BTHD"``, or ``"THD"`` for 3-d inputs); K/V may
        have fewer heads than Q (GQA/MQA: the query head count must be a multiple).
      mask: boolean, broadcastable to ``[batch, heads, q_len, kv_len]`` (True = attend).
      bias: float, same shape rules, added to the logits.
      causal: key position ≤ query position.
      window: ``(left, right)``: ``q - left ≤ kv ≤ q + right``; ``None`` leaves a side open.
      segment_ids: ``[batch, seq]`` ids for self-attention, or a ``(q_ids, kv_ids)`` pair;
        tokens attend only within their segment.
      scale: logit scale, default ``1/sqrt(head_dim)``.
      softcap: ``c`` for ``c * tanh(logits / c)``.
      positions: ``[batch, seq]`` token positions (or a ``(q_pos, kv_pos)`` pair) for
        causal/window masks; default ``arange(seq)``.
      empty_rows: what a query that sees no key returns, ``"zero"``, ``"uniform"`` (mean
        of V) or ``"nan"`` (see :class:`MaskSpec`).
      sinks: float ``[heads]`` (or ``[batch, heads]``): one extra logit per query head in
        each row's softmax whose value is 0 (gpt-oss attention sinks; see
        :class:`AttentionSpec`).
      topk_indices: int, broadcastable to ``[batch, heads, q_len, k]``: the key positions
        each query may see (a sparse-attention indexer's top-k; and-ed with the rest).
      chunk_size: ``C`` for Llama-4 chunked attention: a token sees only the keys of its
        own chunk of ``C`` positions, ``q_pos // C == kv_pos // C`` (with ``causal``, the
        earlier ones).
      valid: boolean ``[batch, seq]`` (or a ``(q_valid, kv_valid)`` pair): which tokens are
        no padding (``tokens != pad``); a padded query sees no key and a padded key is seen
        by no query (the query and key padding terms: ``[batch, seq]`` operands, never an
        ``S×S`` mask).
    """
    if layout is None:
        layout = {4: "BTHD", 3: "THD"}.get(jnp.ndim(q))
        if layout is None:
            raise AttentionShapeError(
                f"q has {jnp.ndim(q)} dims; pass layout= (e.g. 'BTHD', 'BHTD')")
    lay = Layout.parse(layout)
    if lay.heads is None:
        raise AttentionShapeError("attention() needs a heads dim in its layout (e.g. 'BTHD')")
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[lay.feature])
    operands = [q, k, v] + _side_operands(len(lay.batch), positions, segment_ids, valid,
                                          mask, bias, sinks, topk_indices)
    hq = q.shape[lay.heads]
    hk = k.shape[lay.heads]
    if hq % hk:
        raise AttentionShapeError(
            f"{hq} query heads is not a multiple of {hk} KV heads (GQA needs it)")
    win = None if window is None else tuple(None if w is None else int(w) for w in window)
    spec = AttentionSpec(
        q=lay, k=lay, v=lay, scale=float(scale),
        softcap=None if softcap is None else float(softcap), groups=hq // hk,
        mask=MaskSpec(causal=bool(causal), window=win, segments=segment_ids is not None,
                      dense=mask is not None, bias=bias is not None, empty_rows=empty_rows,
                      topk=topk_indices is not None,
                      chunk=None if chunk_size is None else int(chunk_size),
                      q_padding=valid is not None, kv_padding=valid is not None),
        positions=positions is not None, sinks=sinks is not None)
    return attention_p.bind(*operands, spec=spec)


def _side_operands(nb: int, positions, segment_ids, valid, mask, bias, sinks, topk) -> list:
    """:func:`attention`'s optional operands in ``attention_p``'s order, each given the
    ``nb`` leading batch dims it lacks (size 1) and its dtype; positions, segment ids and
    validity may be one array for both sides or a ``(q, kv)`` pair."""
    def pair(x, what):
        if isinstance(x, (tuple, list)):
            if len(x) != 2:
                raise AttentionShapeError(f"{what} must be an array or a (q, kv) pair")
            return list(x)
        return [x, x]

    def lead(x, tail_ndim):
        x = jnp.asarray(x)
        while x.ndim < nb + tail_ndim:
            x = x[None]
        return x

    out: list = []
    if positions is not None:
        out += [lead(p, 1).astype(jnp.int32) for p in pair(positions, "positions")]
    if segment_ids is not None:
        out += [lead(s, 1) for s in pair(segment_ids, "segment_ids")]
    if valid is not None:
        out += [lead(x, 1).astype(bool) for x in pair(valid, "valid")]
    if mask is not None:
        out.append(lead(mask, 3).astype(bool))
    if bias is not None:
        out.append(lead(bias, 3))
    if sinks is not None:
        out.append(lead(sinks, 1))
    if topk is not None:
        out.append(lead(topk, 3).astype(jnp.int32))
    return out


def attention_specs(jaxpr) -> Sequence[AttentionSpec]:
    """The specs of the ``attention_p`` equations at the top level of a jaxpr."""
    return [e.params["spec"] for e in compat.open_jaxpr(jaxpr).eqns
            if e.primitive is attention_p]


__all__ = ["attention", "attention_p", "AttentionShapeError", "attention_specs"]
