"""One matched attention as a frozen record, and its ``AttentionSpec``.

A :class:`Candidate` is built from the two products once both are read: who q, k and v
are (after stripping scalar scales and a ``repeat`` of KV heads), every operand dim by
label, the visible form of the logits (scale, soft-cap, biases), how masked rows end up,
and the mask parts. :mod:`~cptransform.passes.match_attention.emit` turns it into the
replacement equation.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from cptransform.analysis.dim_rules import unit_reshape_dims
from cptransform.analysis.mask_parts import MaskParts, classify
from cptransform.analysis.mask_values import And, Dense, Pred, as_dense, conjuncts
from cptransform.ir import compat
from cptransform.ir.graph import Graph
from cptransform.op.attention_spec import AttentionSpec, Layout, MaskSpec
from cptransform.passes.match_attention import dropout
from cptransform.passes.match_attention.anchor import Split
from cptransform.passes.match_attention.logits import (empty_rows, fill_added, fills_in_biases,
                                                      visible_form)
from cptransform.passes.match_attention.qk_product import QKProduct
from cptransform.passes.match_attention.sink import SinkColumn, sink_source
from cptransform.passes.match_attention.stats import NotAttention, Rule, RuleStats
from cptransform.passes.match_attention.value_product import ValueProduct
from cptransform.passes.match_attention.walk import UNIT_RESHAPES, strip_scale, unrepeat

#: Labels of the feature dims of q, k and v (the q·k dims are labelled by integers).
Q_FEATURE, K_FEATURE, V_FEATURE = "qd", "kd", "dv"


@dataclass(frozen=True)
class Operand:
    """An operand of the attention and the label of each of its dims (None: size 1; for
    the sink, a tuple of labels per dim, ``()`` for size 1)."""

    atom: Any
    labels: tuple


@dataclass(frozen=True)
class Candidate:
    """What one match found, every dim named by its label.

    ``root``/``out``: the equation replaced and its output; ``batch``: batch labels, in
    order; ``q_seq``/``kv_seq``: the sequence labels; ``kv_head``: the KV-heads label (None
    for a single KV head); ``group``: query-only head labels; ``out_labels``: the labels of
    ``out``'s dims, in order; ``biases``: ``(operand, coefficient)`` pairs; ``band``:
    bounds on ``kv - q`` (or None); ``segments``: ``(q ids, kv ids)`` or ``()``;
    ``q_pads``/``kv_pads``: keep-masks of one sequence only (the query and key padding
    terms' operands, and-ed);
    ``dense``: the rest of the mask, as data; ``topk``: the top-k indices selecting the
    keys (an :class:`Opaque` whose ``k`` dim is labelled ``TOPK_DIM``) or None;
    ``added_fill``: the finite fill is added to the scores (``MaskSpec.added_fill``);
    ``mask_kinds``: the parts found, for reports; ``sink``: the array the sink logits come
    from (None without a sink column); ``visible``: the visibility predicates of the
    logits' masks (a pair is visible where all hold), as the mask analysis read them;
    ``coordinates``: the query coordinates of a coordinate band (an :class:`Opaque`) and
    ``coordinate_band`` its bounds (or None); ``dropout``: the dropout on the probabilities
    (a :class:`~cptransform.passes.match_attention.dropout.DropoutPlan`) or None;
    ``after``: the moves from the product's arrangement (``out_labels``) to ``out``'s, where
    the division by the row sum comes after them;
    ``factors``: ``(operand, exponent)`` of the data factors on the logits (a temperature
    per head or per query), folded into q (the operand's labels are tuples, as the sink's);
    ``fill``: the finite logit masked pairs keep (``MaskSpec.fill``) or None.
    ``region``: a key test that depends on the pair's region (``MaskParts.region``:
    ``((lo, hi), inside, outside)``, the region padding term's bounds and tests) or None.
    """

    root: Any
    out: Any
    q: Operand
    k: Operand
    v: Operand
    batch: tuple
    q_seq: Any
    kv_seq: Any
    kv_head: Any
    group: tuple
    sizes: dict
    out_labels: tuple
    scale: float
    softcap: float | None
    biases: tuple
    empty_rows: str
    added_fill: bool
    band: tuple | None
    segments: tuple
    q_pads: tuple
    kv_pads: tuple
    dense: tuple
    groups: int
    mask_kinds: tuple
    sink: Operand | None = None
    topk: Any = None
    chunk: int | None = None
    visible: tuple = ()
    coordinates: Any = None
    coordinate_band: tuple | None = None
    dropout: dropout.DropoutPlan | None = None
    after: tuple = ()
    factors: tuple = ()
    fill: float | None = None
    region: tuple | None = None

    @property
    def heads(self) -> tuple:
        """The query-heads labels, merged in this order: KV heads, then groups."""
        return ((self.kv_head,) if self.kv_head is not None else ()) + self.group

    @property
    def kinds(self) -> tuple:
        """The mask parts for the match report."""
        return tuple(k for k in self.mask_kinds if (k != "dense" or self.dense)
                     and (k != "topk" or self.topk is not None)) \
            + (("query_padding",) if self.q_pads else ()) \
            + (("key_padding",) if self.kv_pads else ()) \
            + (("bias",) if self.biases else ()) + (("sinks",) if self.sink else ()) \
            + (("dropout",) if self.dropout else ()) + (("factor",) if self.factors else ())

    def spec(self) -> AttentionSpec:
        """The spec of the ``attention_p`` equation: operands as ``(*batch, T, H, D)``."""
        nbl = len(self.batch)
        canonical = Layout(tuple(range(nbl)), nbl, nbl + 1, nbl + 2)
        mqa = Layout(tuple(range(nbl)), nbl, None, nbl + 1)
        k_layout = canonical if self.kv_head is not None else mqa
        lo, hi = self.band or (None, None)
        # A band reaching past the diagonal on both sides is a two-sided window
        # (``|i - j| <= w``); one bounded above at or before it is causal (with an offset).
        two_sided = lo is not None and hi is not None and hi > 0
        mask = MaskSpec(
            causal=hi is not None and not two_sided,
            causal_offset=hi if hi is not None and not two_sided else 0,
            window=(-lo, hi if two_sided else None) if lo is not None else None,
            segments=bool(self.segments), q_padding=bool(self.q_pads),
            kv_padding=bool(self.kv_pads),
            dense=bool(self.dense), bias=bool(self.biases), empty_rows=self.empty_rows,
            added_fill=self.added_fill,
            topk=self.topk is not None, chunk=self.chunk,
            coordinate_band=self.coordinate_band, fill=self.fill,
            region_padding=None if self.region is None else self.region[0])
        return AttentionSpec(q=canonical, k=k_layout, v=k_layout, scale=float(self.scale),
                             softcap=self.softcap, groups=self.groups, mask=mask,
                             sinks=self.sink is not None,
                             dropout=None if self.dropout is None else self.dropout.spec)


def build_candidate(graph: Graph, qk: QKProduct, pv: ValueProduct,
                    stats: RuleStats, column: SinkColumn | None = None,
                    zeroing: Sequence[Pred] = ()) -> Candidate:
    """Put the two products together (or refuse, with the first reason found); ``column``
    is the sink column concatenated after the logits, if any; ``zeroing``: the predicates
    of the masks that zero the probabilities after the softmax (``pv.zeroed``)."""
    p_dims = _resolve(pv.p_dims, qk)
    shared = list(range(qk.n_batch))
    kv_head, batch = _kv_heads_and_batch(graph, qk, shared)

    q_in, q_scale = strip_scale(graph, qk.q)
    k_in, k_scale = strip_scale(graph, qk.k)
    scale, softcap, biases, factors = visible_form(qk.steps, q_scale * k_scale)
    rows, preds, fill = empty_rows(qk.steps)
    if fill is not None and (zeroing or pv.dropout is not None):
        after = "zeroed by a mask after the softmax" if zeroing else "dropped out"
        raise NotAttention(f"masked logits become {fill:g}, too large to hide them (each "
                           f"masked key keeps a share of its row), and the probabilities are "
                           f"{after}: not carried together; fill with -inf")
    if zeroing:
        rows = _zeroed_rows(preds, zeroing, column)
    added = rows == "uniform" and fill_added(qk.steps, preds)
    parts = _mask_parts(qk, preds, batch, stats)
    sides = [d.source for d in parts.dense] + [b for b, _ in biases] \
        + list(parts.segments or ()) + ([parts.topk.indices] if parts.topk else []) \
        + ([parts.coordinates[0]] if parts.coordinates else []) \
        + [t.source for t in (parts.region or ())[1:] if isinstance(t, Dense)]
    if any(set(side.dims) & set(qk.merged) for side in sides):
        raise NotAttention("a mask or bias varies along dims merged by a reshape of the logits")
    q_seq = parts.q_dim
    if q_seq is None and not qk.q_free:
        raise NotAttention("the keys are gathered per query (the query dim is shared by both "
                           "operands of the logits product, as k[idx] of shape [B, Q, k, ...]): "
                           "not an attention over one key sequence; pass the picks as "
                           "cptransform.attention(..., topk_indices=idx) to shard it")
    if q_seq is None:
        same = [lab for lab in qk.q_free if qk.sizes[lab] == qk.sizes[qk.kv]]
        q_seq = (same or qk.q_free)[0]
    lengths = qk.sizes[q_seq], qk.sizes[qk.kv]
    added = _added_fill(added, softcap is not None or bool(biases),
                        _rows_may_be_empty(parts, *lengths))
    _refuse_fills_in_biases(qk, preds, batch, stats, lengths)
    group = tuple(lab for lab in qk.q_free if lab != q_seq)
    heads = ((kv_head,) if kv_head is not None else ()) + group
    sink = None if column is None else _sink_operand(graph, column, qk, batch, q_seq, heads)

    factor_operands = tuple((_factor_operand(side, qk), exponent)
                            for side, exponent in factors)
    drop = None if pv.dropout is None else dropout.plan(
        pv.dropout, qk.labels, qk.merged, qk.sizes, q_seq, qk.kv, set(batch) | set(heads),
        rows, _rows_may_be_empty(parts, qk.sizes[q_seq], qk.sizes[qk.kv]))
    v_in, v_dims, v_feature, dv = _value_operand(pv, p_dims, shared, qk)
    sizes = {**qk.sizes, V_FEATURE: dv}
    if kv_head is not None and not group and kv_head in v_dims:
        rk = unrepeat(graph, k_in, qk.k_dims[kv_head])
        rv = unrepeat(graph, v_in, v_dims[kv_head])
        if rk is not None and rv is not None and rk[1] == rv[1]:
            k_in, v_in = rk[0], rv[0]
    hq = int(np.prod([sizes[lab] for lab in heads]))
    hk = 1 if kv_head is None else compat.aval_of(k_in).shape[qk.k_dims[kv_head]]
    if hq % hk:
        raise NotAttention(f"{hq} query heads over {hk} KV heads")

    out_labels = _out_labels(pv, p_dims)
    want = [lab for lab in [*batch, q_seq, *heads, V_FEATURE]
            if lab in out_labels or sizes[lab] != 1]
    if sorted(map(str, (lab for lab in out_labels if lab is not None))) \
            != sorted(map(str, want)):
        raise NotAttention("the output dims do not line up with q's dims")

    q_pads, kv_pads, dense, topk, kinds = _data_parts(parts, batch, q_seq, qk.kv)
    return Candidate(
        root=pv.root, out=pv.out,
        q=Operand(q_in, _labels_of(qk.q_dims, qk.q_contract, Q_FEATURE, q_in)),
        k=Operand(k_in, _labels_of(qk.k_dims, qk.k_contract, K_FEATURE, k_in)),
        v=Operand(v_in, _labels_of(v_dims, v_feature, V_FEATURE, v_in)),
        batch=tuple(batch), q_seq=q_seq, kv_seq=qk.kv, kv_head=kv_head, group=group,
        sizes=sizes, out_labels=out_labels, scale=scale, softcap=softcap,
        biases=tuple(biases), empty_rows=rows, added_fill=added, band=parts.band,
        segments=tuple(parts.segments or ()), q_pads=q_pads, kv_pads=kv_pads, dense=dense,
        groups=hq // hk, mask_kinds=kinds, sink=sink,
        topk=None if topk is None else topk.indices, chunk=parts.chunk, visible=tuple(preds),
        coordinates=parts.coordinates[0] if parts.coordinates else None,
        coordinate_band=parts.coordinates[1] if parts.coordinates else None, dropout=drop,
        after=pv.after, factors=factor_operands, fill=fill, region=parts.region)


def _kv_heads_and_batch(graph: Graph, qk: QKProduct, shared: list) -> tuple:
    """``(kv_head, batch labels)``: the kv-heads dim is the last shared dim in K's order
    that is not K's leading dim (by convention the batch); the others are batch. Any
    choice is exact."""
    k_order = _dims_before_squeeze(graph, qk.k)
    cand = [lab for lab in shared if k_order[qk.k_dims[lab]] != 0]
    kv_head = max(cand, key=lambda lab: k_order[qk.k_dims[lab]]) if cand else None
    return kv_head, [lab for lab in shared if lab != kv_head]


def _data_parts(parts: MaskParts, batch: list, q_seq, kv_seq) -> tuple:
    """``(q_pads, kv_pads, dense, topk, kinds)``: padding masks (a query-only or key-only
    predicate, e.g. ``tokens != pad``) need no S×S operand: they are the query and key
    padding terms' per-token operands; top-k indices shared by every query are no
    per-query selection and stay dense data."""
    q_pads = tuple(d for d in parts.dense if _only_on(d, batch, q_seq))
    kv_pads = tuple(d for d in parts.dense if d not in q_pads and _only_on(d, batch, kv_seq))
    dense = tuple(d for d in parts.dense if d not in q_pads and d not in kv_pads)
    topk, kinds = parts.topk, parts.kinds
    if topk is not None and q_seq not in topk.indices.dims:
        dense += (as_dense(topk, topk.origin),)
        topk, kinds = None, kinds if "dense" in kinds else kinds + ("dense",)
    return q_pads, kv_pads, dense, topk, kinds


def _added_fill(added: bool, beside: bool, may_be_empty: bool) -> bool:
    """``MaskSpec.added_fill`` for a finite fill added to the scores (``added``), ``beside``
    a bias or after a soft-cap: refused where a row may see no key (one device's uniform
    softmax sends that row's gradient to every bias entry, or through the cap, which the
    schedules do not give); where every row sees a key it hides its keys as a selected
    fill does, and nothing is added."""
    if not (added and beside):
        return added
    if may_be_empty:
        raise NotAttention("a finite fill added to the scores after a soft-cap or beside a "
                           "bias, and a row may see no key: that row's score gradient is not "
                           "reproduced for those (select the fill with where(mask, x, fill) "
                           "instead)")
    return False


def _refuse_fills_in_biases(qk: QKProduct, preds: list, batch: list, stats: RuleStats,
                            lengths: tuple[int, int]) -> None:
    """Refuse a bias operand carrying a mask's fill (``Step.hidden``) where the masks, its
    fill's included, may leave a row no key: that row's scores are all within rounding of
    the fill, where the kernels' float32 log-sum-exp loses the row's ``log n``."""
    hidden = fills_in_biases(qk.steps)
    if hidden and _rows_may_be_empty(_mask_parts(qk, preds + hidden, batch, stats), *lengths):
        raise NotAttention("a bias carries a mask's fill (summed into it before a reshape, "
                           "transpose or cast brings it to the logits) and a row may see no "
                           "key: such a row's scores are all near the fill, which the "
                           "kernels' log-sum-exp cannot tell apart; add the fill to the "
                           "logits directly, s + bias + where(mask, 0, fill)")


def _rows_may_be_empty(parts: MaskParts, q_len: int, kv_len: int) -> bool:
    """Whether a query row may see no key: unless the mask is a band around the diagonal
    (causal, windows, chunks) of as many queries as keys, data decides."""
    lo, hi = parts.band or (None, None)
    return bool(parts.dense or parts.segments or parts.topk or parts.coordinates
                or parts.region) \
        or q_len != kv_len or (lo is not None and lo > 0) or (hi is not None and hi < 0)


def _zeroed_rows(preds: list, zeroing: Sequence[Pred], column: SinkColumn | None) -> str:
    """``"zero"``: probabilities zeroed after the softmax by exactly the logits' mask are
    unchanged in a row that sees a key (the hidden ones are already 0) and all zero in a
    row that sees none. Any other zeroing mask changes the attention: refused."""
    want = set(conjuncts(And(tuple(preds))))
    if column is not None or not want or any(set(conjuncts(z)) != want for z in zeroing):
        raise NotAttention("the probabilities are zeroed after the softmax by a mask other "
                           "than the one applied to the logits")
    return "zero"


def _dims_before_squeeze(graph: Graph, k: Any) -> tuple:
    """For each dim of ``k``, its position in the value ``k`` was squeezed from (its own
    position when no reshape dropped size-1 dims: ``jnp.matmul`` drops a size-1 batch,
    which must not make the heads K's leading dim)."""
    nd = len(compat.aval_of(k).shape)
    eqn = graph.producer(k)
    if eqn is not None and eqn.primitive.name in UNIT_RESHAPES:
        src = unit_reshape_dims(compat.aval_of(eqn.invars[0]).shape,
                                compat.aval_of(k).shape, tuple(range(nd)))
        if src is not None:
            at = {label: i for i, label in enumerate(src) if label is not None}
            return tuple(at.get(d, d) for d in range(nd))
    return tuple(range(nd))


def _sink_operand(graph: Graph, column: SinkColumn, qk: QKProduct, batch: list, q_seq,
                  heads: tuple) -> Operand:
    """The sink logits' source, checked to be one value per batch entry and query head."""
    atom, dims = sink_source(graph, column.column, qk.labels, qk.merged,
                             qk.labels.index(qk.kv))
    held = [lab for d in dims for lab in d]
    if q_seq in held:
        raise NotAttention("the sink varies over query positions (a sink is one logit per "
                           "batch entry and query head)")
    if not set(held) <= set(batch) | set(heads) or len(set(held)) != len(held):
        raise NotAttention("the sink varies along a dim that is not batch or heads")
    if not np.issubdtype(compat.aval_of(atom).dtype, np.floating):
        raise NotAttention("the sink column is not floating point")
    return Operand(atom, dims)


def _factor_operand(side, qk: QKProduct) -> Operand:
    """A data factor on the logits, labelled for the queries to take it: constant along
    the keys, any dim a reshape of the logits merged given as its parts."""
    if qk.kv in side.dims:
        raise NotAttention("the logits are multiplied by data that varies along the keys, "
                           "not a temperature per query or per head (scale the keys before "
                           "the q·k product instead)")
    return Operand(side.var, tuple(() if lab is None else qk.merged.get(lab, (lab,))
                                   for lab in side.dims))


def _resolve(p_dims: tuple, qk: QKProduct) -> tuple:
    """The q·k label of each dim of the probabilities operand. A dim the chain merged must
    come back split into the same parts (sizes, order): ``[B,T,K·G,S]`` as ``[B,T,K,G,S]``."""
    out = []
    for d in p_dims:
        if isinstance(d, Split):
            label = qk.labels[d.dim]
            parts = qk.merged.get(label)
            if parts is not None and tuple(qk.sizes[lab] for lab in parts) == d.sizes:
                out.append(parts[d.index])
            elif parts is None and sum(n != 1 for n in d.sizes) == 1:
                # Only size-1 dims added around a dim the chain did not merge.
                out.append(label if d.sizes[d.index] != 1 else None)
            else:
                raise NotAttention("the probabilities are reshaped to a different grouping "
                                   "than the logits")
        elif d is not None and qk.labels[d] in qk.merged:
            raise NotAttention("the value product reads dims merged by a reshape of the logits")
        else:
            out.append(None if d is None else qk.labels[d])
    return tuple(out)


def _mask_parts(qk: QKProduct, preds: list, batch: list, stats: RuleStats) -> MaskParts:
    """The conjunction of the chain's visibility predicates, split into MaskSpec parts."""
    with stats.attempt(Rule.MASK):
        parts = classify(And(tuple(preds)), qk.q_free, qk.kv, lambda lab: qk.sizes[lab],
                         qk.sizes[qk.kv], batch)
        if any(d.source is None for d in parts.dense):
            raise NotAttention("a mask part cannot be passed as a dense mask (a negated "
                               "segment comparison, or a mask hiding everything)")
    return parts


def _value_operand(pv: ValueProduct, p_dims: tuple, shared: list, qk: QKProduct):
    """``(v, label -> v dim, v's feature dim, its size)``, checking the product contracts
    the softmax axis and shares the q·k product's batch dims."""
    pc, pb, vc, vb = pv.dims()
    if len(pc) != 1 or p_dims[pc[0]] != qk.kv:
        raise NotAttention("the value product does not contract the softmax axis")
    v_shape = compat.aval_of(pv.v).shape
    v_free = [d for d in range(len(v_shape)) if d not in vc and d not in vb]
    # A size-1 batch dim the q·k product had no dim for (``jnp.matmul`` drops size-1 batch
    # dims, ``einsum`` keeps them) is no dim of the attention: it carries no label.
    unit = [j for j, i in enumerate(pb) if p_dims[i] is None and v_shape[vb[j]] == 1]
    pb = [i for j, i in enumerate(pb) if j not in unit]
    vb = [d for j, d in enumerate(vb) if j not in unit]
    held = [p_dims[i] for i in pb]
    # ... and a size-1 batch dim of the q·k product the p·v product dropped is none either.
    if len(set(held)) != len(held) or not set(held) <= set(shared) \
            or any(qk.sizes[lab] != 1 for lab in set(shared) - set(held)):
        raise NotAttention("the value product's batch dims differ from the q·k product's")
    if len(v_free) != 1 or v_shape[vc[0]] != qk.sizes[qk.kv]:
        raise NotAttention("V must have one feature dim and K's sequence length")
    v_dims = {p_dims[i]: vb[j] for j, i in enumerate(pb)}
    v_dims[qk.kv] = vc[0]
    return pv.v, v_dims, v_free[0], v_shape[v_free[0]]


def _out_labels(pv: ValueProduct, p_dims: tuple) -> tuple:
    """The labels of the p·v output dims, in order."""
    pc, pb, _, _ = pv.dims()
    p_free = [p_dims[i] for i in range(len(p_dims)) if i not in pc and i not in pb]
    batch = [p_dims[i] for i in pb]
    return tuple(batch + (p_free + [V_FEATURE] if pv.p_is_lhs else [V_FEATURE] + p_free))


def _only_on(part, batch: list, seq_label) -> bool:
    """Whether a dense mask part varies only along batch dims and one sequence dim."""
    used = {lab for lab in part.source.dims if lab is not None}
    return seq_label in used and used <= set(batch) | {seq_label}


def _labels_of(label_dim: dict, feature: int, feature_label: str, atom: Any) -> tuple:
    """Per-dim labels of an operand from its label -> dim map and its feature dim."""
    out: list = [None] * len(compat.aval_of(atom).shape)
    for lab, d in label_dim.items():
        out[d] = lab
    out[feature] = feature_label
    return tuple(out)
