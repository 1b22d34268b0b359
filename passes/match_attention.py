"""``match-attention``: replace each attention subgraph with one ``attention_p`` equation.

Matching is anchored on the softmax core, the part every spelling shares:
``e = exp(x - c)`` with ``c`` constant along one axis, ``sum(e, axis)``, and the division,
either of ``e`` (``p = e / sum``, then ``p @ v``) or of the value product
(``(e @ v) / sum``). From there it walks

* back from ``x`` through elementwise and layout equations to the ``q·k`` ``dot_general``
  (the *logits chain*), reading each step as a scale, a soft-cap ``m·tanh(s·x)``, an
  additive bias, or a mask (``where``/``select_n`` with a fill value, a multiply by a 0/1
  mask, an additive mask). Masked entries are then simulated on a few sample values: the
  result must not depend on the scores, and must be ``-inf`` everywhere
  (``empty_rows="zero"``) or one finite very negative value everywhere
  (``empty_rows="uniform"``: a fully masked row averages V, as the original does);
* forward from the probabilities to the ``p·v`` ``dot_general``, through casts and
  transposes only, with no other reader of the probabilities.

Dims are tracked by *labels* (the dims of the ``q·k`` product: shared batch dims, the
query's free dims, the key position), so any layout (BTHD, BHTD, no batch, heads under
``vmap``, GQA as a reshape of q or a ``repeat`` of K/V) maps onto the spec without
guessing. Masks are classified by :mod:`cptransform.analysis.mask_analysis`; analytic parts become
``MaskSpec`` fields and their iota/compare subgraphs die, the rest becomes the ``mask``
operand. Anything that does not fit is left alone and reported with its reason.

Assumption for finite fills (``-1e9``, ``finfo.min``, ...): a fill ``f <= -1e4`` only
counts as a mask when the visible logits stay far above it (``exp(f - max)`` underflows
to 0), which holds for any real model.
"""
from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import combinations
from typing import Any, Sequence

import jax.numpy as jnp
import numpy as np
from jax import lax

from cptransform.ir import compat
from cptransform.op.attention import attention_p
from cptransform.op.attention_spec import AttentionSpec, Layout, MaskSpec
from cptransform.ir.graph import Graph
from cptransform.analysis.dim_rules import unit_reshape_dims
from cptransform.analysis.mask_analysis import MaskAnalyzer
from cptransform.analysis.mask_parts import MaskParts, classify
from cptransform.analysis.mask_values import And, Indicator, Opaque, Pred, Scalar, p_not
from cptransform.analysis.match_report import MatchReport
from cptransform.ir.module import Module
from cptransform.ir.patterns import Pat, look_through, one_of
from cptransform.ir.pipeline import Pass, PassResult, register
from cptransform.ir.rewrite import Replacement, Rewriter
from cptransform.ir.errors import MatchAttentionError

#: Equations that only move, cast or broadcast a value.
WRAPPERS = frozenset({"broadcast_in_dim", "reshape", "stop_gradient", "convert_element_type",
                      "squeeze", "expand_dims", "copy", "copy_p"})
#: The finite fill at or below which a masked logit counts as masked.
FINITE_FILL_LIMIT = -1e4

_ROW_MAX = one_of(
    Pat("max", (Pat.scalar(where=lambda v: v == -np.inf), Pat("reduce_max", name="row_max")),
        commutative=True),
    Pat("reduce_max", name="row_max"))
#: ``exp(x - c)`` with ``c`` a (stop-gradient, broadcast) row max, or ``exp(x)``.
SOFTMAX_EXP = one_of(
    Pat("exp", (Pat("sub", (Pat.any("logits"), _ROW_MAX.through(WRAPPERS | {"transpose"}))),),
        name="exp"),
    Pat("exp", (Pat.any("logits"),), name="exp"))

_DV = "dv"  # the label of V's feature dim

RULES = ("softmax", "normalized-probabilities", "deferred-normalization", "logits-chain",
         "value-product", "mask")


class NotAttention(Exception):
    """A softmax that is not a rewritable attention; the message is the reason.

    ``attention_like``: both products (q·k and p·v) were found, so ``strict`` objects.
    """

    attention_like = False


# -- statistics ------------------------------------------------------------------------------

@dataclass
class RuleStats:
    """Attempts, hits and time per rule over one run of the pass."""

    table: dict = field(default_factory=lambda: {r: {"attempts": 0, "hits": 0, "seconds": 0.0}
                                                  for r in RULES})

    @contextmanager
    def attempt(self, rule: str):
        entry = self.table[rule]
        entry["attempts"] += 1
        start = time.perf_counter()
        ok = False
        try:
            yield
            ok = True
        finally:
            entry["seconds"] += time.perf_counter() - start
            entry["hits"] += ok


# -- small graph helpers ---------------------------------------------------------------------

def follow_back(graph: Graph, atom: Any, dims: tuple, target: Any,
                through: frozenset = WRAPPERS) -> tuple | None:
    """Dim map of ``target`` when ``atom`` is ``target`` moved/broadcast/cast, else None.

    ``dims`` labels ``atom``'s dims; the result labels ``target``'s dims (None: size 1 or
    broadcast away).
    """
    while atom is not target:
        eqn = graph.producer(atom)
        if eqn is None or eqn.primitive.name not in through:
            return None
        name = eqn.primitive.name
        ins = [a for a in eqn.invars if not compat.is_literal(a)]
        if len(ins) != 1:
            return None
        src = ins[0]
        out_shape = compat.aval_of(atom).shape
        src_shape = compat.aval_of(src).shape
        if name == "broadcast_in_dim":
            dims = tuple(dims[o] if src_shape[i] == out_shape[o] else None
                         for i, o in enumerate(eqn.params["broadcast_dimensions"]))
        elif name == "transpose":
            new = [None] * len(dims)
            for j, p in enumerate(eqn.params["permutation"]):
                new[p] = dims[j]
            dims = tuple(new)
        elif name in ("reshape", "squeeze", "expand_dims"):
            dims = unit_reshape_dims(src_shape, out_shape, dims)
            if dims is None:
                return None
        elif name == "max":
            lit = [a for a in eqn.invars if compat.is_literal(a)]
            if len(lit) != 1 or compat.literal_value(lit[0]) != -np.inf:
                return None
        atom = src
    return dims


def scalar_value(graph: Graph, atom: Any) -> float | None:
    """The value of a scalar constant (a literal, a 0-d/size-1 const, or their broadcast)."""
    atom = look_through(graph, atom, frozenset({"broadcast_in_dim", "convert_element_type",
                                                 "reshape"}))
    if compat.is_literal(atom):
        return float(np.asarray(compat.literal_value(atom)).reshape(()))
    if graph.is_const(atom):
        value = np.asarray(graph.const_value(atom))
        if value.size == 1:
            return float(value.reshape(()))
    return None


def single_user(graph: Graph, atom: Any) -> Any | None:
    """The only equation reading ``atom`` (None if several, none, or it is an output)."""
    users = graph.users(atom)
    if len(users) != 1 or graph.is_output(atom):
        return None
    return users[0]


def only_feeds(graph: Graph, atom: Any, target: Any) -> bool:
    """Whether ``atom`` is read only by ``target``, possibly through single-use wrappers."""
    while True:
        user = single_user(graph, atom)
        if user is target:
            return True
        if user is None or user.primitive.name not in WRAPPERS:
            return False
        atom = user.outvars[0]


# -- the logits chain ------------------------------------------------------------------------

@dataclass(frozen=True)
class Step:
    """One equation of the logits chain, read forward from the q·k product."""

    kind: str                 # scale tanh bias shift mask-replace mask-mul mask-bias cast layout
    value: float = 0.0        # scale factor, shift, fill or bias sign
    pred: Pred | None = None  # visibility predicate of a mask step
    side: Opaque | None = None
    perm: tuple | None = None  # new labels after a layout step


_CHAIN_PRIMS = frozenset({"mul", "div", "add", "sub", "select_n", "tanh", "convert_element_type",
                          "transpose", "reshape", "squeeze", "expand_dims", "neg", "copy",
                          "copy_p"})


class Matcher:
    """Finds the attentions of one (sub-)jaxpr; see the module docstring."""

    def __init__(self, graph: Graph, stats: RuleStats, depth: int):
        self.g = graph
        self.stats = stats
        self.depth = depth
        self.masks = MaskAnalyzer(graph)
        self._reaches: dict = {}
        #: ``(report, attention_like)`` for every refusal.
        self.refusals: list[tuple[MatchReport, bool]] = []

    # -- anchors ---------------------------------------------------------------------------

    def run(self) -> tuple[list[Replacement], list[MatchReport]]:
        reps, reports = [], []
        for eqn in self.g.jaxpr.eqns:
            if eqn.primitive.name != "reduce_sum":
                continue
            try:
                with self.stats.attempt("softmax"):
                    core = self._softmax(eqn)
            except NotAttention:
                continue
            src = compat.source_line(core["exp.eqn"])
            try:
                rep, spec, kinds, rule = self._attention(core)
            except NotAttention as e:
                report = MatchReport(src, "refused", str(e), depth=self.depth,
                                     rule=core.get("rule", ""))
                reports.append(report)
                self.refusals.append((report, e.attention_like))
                continue
            reps.append(rep)
            reports.append(MatchReport(src, "rewritten", "", spec, " ".join(kinds) or "full",
                                       rule, self.depth))
        return reps, reports

    def _softmax(self, sum_eqn: Any) -> dict:
        axes = tuple(int(a) for a in sum_eqn.params["axes"])
        if len(axes) != 1:
            raise NotAttention("sum over several axes")
        e = look_through(self.g, sum_eqn.invars[0], frozenset({"convert_element_type"}))
        core = SOFTMAX_EXP.match(self.g, e)
        if core is None:
            raise NotAttention("not a sum of exponentials")
        core["axis"] = axes[0]
        core["sum"] = sum_eqn.outvars[0]
        core["sum.eqn"] = sum_eqn
        core["e"] = e
        x = core["logits"]
        if "row_max" in core:
            # Any stabiliser constant along the softmax axis leaves softmax unchanged.
            sub = self.g.producer(core["exp.eqn"].invars[0])
            nd = len(compat.aval_of(x).shape)
            dims = follow_back(self.g, sub.invars[1], tuple(range(nd)), core["row_max"],
                               WRAPPERS | {"max", "transpose"})
            if dims is None or axes[0] in dims:
                raise NotAttention("the subtracted row maximum is not constant along the "
                                   "softmax axis")
        return core

    def _normalizer(self, atom: Any, core: dict, dims: tuple) -> bool:
        """Whether ``atom`` is the row sum broadcast back onto values labelled ``dims``."""
        axis = core["axis"]
        nd = len(compat.aval_of(core["e"]).shape)
        want = tuple(d for d in range(nd) if d != axis)
        got = follow_back(self.g, atom, dims, core["sum"])
        if got is None or len(got) != len(want):
            return False
        sum_shape = compat.aval_of(core["sum"]).shape
        return all(a == b or (a is None and n == 1) for a, b, n in zip(got, want, sum_shape))

    # -- one attention ---------------------------------------------------------------------

    def _attention(self, core: dict):
        g = self.g
        with self.stats.attempt("logits-chain"):
            chain = self._logits_chain(core["logits"])
        e, sum_eqn = core["e"], core["sum.eqn"]
        nd = len(compat.aval_of(e).shape)
        ident = tuple(range(nd))
        users = [u for u in g.users(e) if u is not sum_eqn]
        if g.is_output(e) or len(users) != 1:
            raise NotAttention("the exponentials are read elsewhere")
        user = users[0]
        if user.primitive.name == "div" and user.invars[0] is e and \
                self._normalizer(user.invars[1], core, ident):
            rule = "normalized-probabilities"
            with self.stats.attempt(rule):
                if not only_feeds(g, core["sum"], user):
                    raise NotAttention("the softmax normaliser is read elsewhere")
                pv, p_dims, p_operand = self._to_value_product(user.outvars[0], ident)
                root, out_var = pv, pv.outvars[0]
        else:
            rule = "deferred-normalization"
            with self.stats.attempt(rule):
                pv, p_dims, p_operand = self._to_value_product(e, ident, sum_eqn)
                root, out_var = self._deferred_root(pv, p_operand, p_dims, core)
        core["rule"] = rule
        try:
            with self.stats.attempt("value-product"):
                plan = self._plan(chain, core, pv, p_operand, p_dims, root, out_var)
        except NotAttention as err:
            err.attention_like = True
            raise
        return plan.replacement, plan.spec, plan.kinds, rule

    def _to_value_product(self, p: Any, dims: tuple, also_read_by: Any = None):
        """Follow the probabilities through casts/transposes to the p·v dot_general.

        ``also_read_by``: an equation allowed to read ``p`` itself besides the path (the
        row sum, when the normalisation comes after the value product).
        """
        while True:
            users = [u for u in self.g.users(p) if u is not also_read_by]
            also_read_by = None
            user = users[0] if len(users) == 1 and not self.g.is_output(p) else None
            if user is None:
                err = NotAttention("the attention probabilities are also used elsewhere "
                                   "(returned weights, dropout, ...)")
                err.attention_like = any(u.primitive.name == "dot_general"
                                         for u in self.g.users(p))
                raise err
            name = user.primitive.name
            if name == "dot_general":
                return user, dims, p
            if name == "convert_element_type":
                pass
            elif name == "transpose":
                dims = tuple(dims[i] for i in user.params["permutation"])
            elif name in ("reshape", "squeeze", "expand_dims"):
                new = unit_reshape_dims(compat.aval_of(p).shape,
                                        compat.aval_of(user.outvars[0]).shape, dims,
                                        forward=True)
                if new is None:
                    raise NotAttention("the probabilities are reshaped before the value product")
                dims = new
            else:
                raise NotAttention(f"the probabilities go through {name} before the value "
                                   "product (dropout or another use), not plain attention")
            p = user.outvars[0]

    def _deferred_root(self, pv: Any, p_operand: Any, p_dims: tuple, core: dict):
        """``(e @ v) / sum``: the division after the value product is the root."""
        out = pv.outvars[0]
        user = single_user(self.g, out)
        if user is None or user.primitive.name != "div" or user.invars[0] is not out:
            raise NotAttention("the value product of unnormalised exponentials is not divided "
                               "by the row sum")
        out_dims = self._pv_out_dims(pv, p_operand, p_dims)
        if out_dims is None or not self._normalizer(user.invars[1], core, out_dims):
            raise NotAttention("the value product is divided by something other than the "
                               "row sum")
        return user, user.outvars[0]

    def _pv_out_dims(self, pv, p_operand, p_dims):
        """Labels of the p·v output dims in terms of p's dims (v's own dims: None)."""
        (lc, rc), (lb, rb) = pv.params["dimension_numbers"]
        p_is_lhs = pv.invars[0] is p_operand
        pc, pb = (lc, lb) if p_is_lhs else (rc, rb)
        vc = rc if p_is_lhs else lc
        v_nd = len(compat.aval_of(pv.invars[1 if p_is_lhs else 0]).shape)
        p_free = [p_dims[i] for i in range(len(p_dims)) if i not in pc and i not in pb]
        v_free = [None for i in range(v_nd) if i not in vc and i not in (rb if p_is_lhs else lb)]
        batch = [p_dims[i] for i in pb]
        return tuple(batch + (p_free + v_free if p_is_lhs else v_free + p_free))

    # -- logits chain ----------------------------------------------------------------------

    def _reaches_dot(self, atom: Any) -> bool:
        """Whether ``atom`` comes from a dot_general through chain equations only."""
        stack = [atom]
        while stack:
            a = stack.pop()
            if compat.is_literal(a) or a in self._reaches:
                continue
            eqn = self.g.producer(a)
            if eqn is None or (eqn.primitive.name != "dot_general"
                               and eqn.primitive.name not in _CHAIN_PRIMS):
                self._reaches[a] = False
                continue
            if eqn.primitive.name == "dot_general":
                self._reaches[a] = True
                continue
            pending = [x for x in eqn.invars if not compat.is_literal(x) and x not in self._reaches]
            if pending:
                stack.append(a)
                stack.extend(pending)
                continue
            self._reaches[a] = any(self._reaches.get(x, False) for x in eqn.invars
                                   if not compat.is_literal(x))
        return self._reaches.get(atom, False)

    def _logits_chain(self, x: Any) -> list:
        """Equations from the q·k dot_general to the softmax input, first to last."""
        eqns = []
        atom = x
        while True:
            eqn = self.g.producer(atom)
            if eqn is None:
                raise NotAttention("softmax input does not come from a q·k product")
            if eqn.primitive.name == "dot_general":
                break
            if eqn.primitive.name not in _CHAIN_PRIMS:
                raise NotAttention(f"softmax input comes from {eqn.primitive.name}, not from a "
                                   "q·k product")
            out_shape = compat.aval_of(atom).shape
            cands = [i for i, a in enumerate(eqn.invars) if not compat.is_literal(a)
                     and compat.aval_of(a).dtype != np.bool_
                     and (compat.aval_of(a).shape == out_shape
                          or eqn.primitive.name not in ("add", "sub", "mul", "div", "select_n"))
                     and self._reaches_dot(a)]
            if eqn.primitive.name == "select_n":
                cands = [i for i in cands if i > 0]
            if not cands:
                raise NotAttention("softmax input does not come from a q·k product")
            eqns.append((eqn, cands[0]))
            atom = eqn.invars[cands[0]]
        eqns.reverse()
        return [(self.g.producer(atom), None)] + eqns

    # -- putting it together ---------------------------------------------------------------

    def _plan(self, chain, core, pv, p_operand, p_dims, root, out_var) -> "Plan":
        qk = chain[0][0]
        (lc, rc), (lb, rb) = qk.params["dimension_numbers"]
        lhs, rhs = qk.invars
        nl, nr = (len(compat.aval_of(a).shape) for a in (lhs, rhs))
        if len(lc) != 1 or len(rc) != 1:
            raise NotAttention("the q·k product contracts several dims")
        l_free = [d for d in range(nl) if d not in lc and d not in lb]
        r_free = [d for d in range(nr) if d not in rc and d not in rb]
        nb = len(lb)
        # Output dim labels of the q·k product are 0..n-1; read the chain forward.
        labels = tuple(range(nb + len(l_free) + len(r_free)))
        steps, labels = self._read_chain(chain, labels)
        kv_label = labels[core["axis"]]
        if kv_label is None:
            raise NotAttention("the softmax axis is not a dim of the q·k product")
        if kv_label >= nb + len(l_free):
            if len(r_free) != 1:
                raise NotAttention("the key operand has several free dims")
            q_var, k_var, q_free, k_seq = lhs, rhs, l_free, r_free[0]
            qb, kb, qc, kc = lb, rb, lc[0], rc[0]
            q_free_labels = list(range(nb, nb + len(l_free)))
        elif kv_label >= nb:
            if len(l_free) != 1:
                raise NotAttention("the key operand has several free dims")
            q_var, k_var, q_free, k_seq = rhs, lhs, r_free, l_free[0]
            qb, kb, qc, kc = rb, lb, rc[0], lc[0]
            q_free_labels = list(range(nb + 1, nb + 1 + len(r_free)))
        else:
            raise NotAttention("softmax axis is a batch dim of the q·k product, not K's "
                               "sequence axis")
        if labels[core["axis"]] != kv_label or p_dims is None:
            raise NotAttention("softmax axis is not K's sequence axis")
        label_q_dim = {i: qb[i] for i in range(nb)}
        label_q_dim.update({lab: d for lab, d in zip(q_free_labels, q_free)})
        label_k_dim = {i: kb[i] for i in range(nb)}
        label_k_dim[kv_label] = k_seq
        q_shape = compat.aval_of(q_var).shape
        k_shape = compat.aval_of(k_var).shape
        sizes = {lab: q_shape[d] for lab, d in label_q_dim.items()}
        sizes[kv_label] = k_shape[k_seq]
        return build_plan(self, steps, labels, core, qk, q_var, k_var, qc, kc, nb,
                          q_free_labels, kv_label, label_q_dim, label_k_dim, sizes,
                          pv, p_operand, p_dims, root, out_var)

    def _read_chain(self, chain, labels):
        """Steps of the chain with the mask/bias sides analysed; the final labels."""
        steps: list[Step] = []
        for eqn, main in chain[1:]:
            name = eqn.primitive.name
            out_shape = compat.aval_of(eqn.outvars[0]).shape
            others = [a for i, a in enumerate(eqn.invars) if i != main]
            if name in ("convert_element_type", "copy", "copy_p"):
                if not np.issubdtype(eqn.params.get("new_dtype", np.float32), np.floating):
                    raise NotAttention("logits are cast to a non-float type")
                steps.append(Step("cast"))
                continue
            if name == "transpose":
                labels = tuple(labels[i] for i in eqn.params["permutation"])
                steps.append(Step("layout"))
                continue
            if name in ("reshape", "squeeze", "expand_dims"):
                new = unit_reshape_dims(compat.aval_of(eqn.invars[main]).shape, out_shape,
                                        labels, forward=True)
                if new is None or {x for x in new if x is not None} != \
                        {x for x in labels if x is not None}:
                    raise NotAttention("the logits are reshaped (dims merged or split)")
                labels = new
                steps.append(Step("layout"))
                continue
            if name == "neg":
                steps.append(Step("scale", -1.0))
                continue
            if name == "tanh":
                steps.append(Step("tanh"))
                continue
            side_atom = others[-1] if name != "select_n" else None
            if name == "select_n":
                if len(eqn.invars) != 3 or compat.aval_of(eqn.invars[0]).dtype != np.bool_:
                    raise NotAttention("logits selected by a non-boolean index")
                fill_atom = eqn.invars[3 - main]
                fill = scalar_value(self.g, fill_atom)
                if fill is None:
                    raise NotAttention("masked logits are replaced by a non-constant value")
                pred = self.masks.predicate(eqn.invars[0], _side_dims(eqn.invars[0], labels))
                if main == 2:  # select_n(pred, on_false, on_true)
                    steps.append(Step("mask-replace", fill, pred))
                else:
                    steps.append(Step("mask-replace", fill, _negate(pred, eqn.invars[0], labels)))
                continue
            value = self.masks.analyze(side_atom, _side_dims(side_atom, labels)) \
                if not compat.is_literal(side_atom) else Scalar(compat.literal_value(side_atom))
            if isinstance(value, Pred):
                value = Indicator(value, 1, 0)
            if isinstance(value, Scalar):
                c = float(value.value)
                if name == "mul":
                    steps.append(Step("scale", c))
                elif name == "div" and main == 0 and c != 0:
                    steps.append(Step("scale", 1.0 / c))
                elif name == "add":
                    steps.append(Step("shift", c))
                elif name == "sub":
                    steps.append(Step("shift", -c) if main == 0 else Step("scale", -1.0))
                    if main != 0:
                        steps.append(Step("shift", c))
                else:
                    raise NotAttention("logits divide a constant")
                continue
            if name == "mul" and isinstance(value, Indicator) and \
                    (value.on_true, value.on_false) == (1, 0):
                steps.append(Step("mask-mul", 0.0, value.pred))
                continue
            if name in ("add", "sub") and main == 0 or name == "add":
                sign = -1.0 if name == "sub" else 1.0
                if isinstance(value, Indicator):
                    t, f = float(value.on_true) * sign, float(value.on_false) * sign
                    if t == 0:
                        steps.append(Step("mask-bias", f, value.pred))
                    elif f == 0:
                        steps.append(Step("mask-bias", t, _negate(value.pred, side_atom, labels)))
                    else:
                        raise NotAttention("an additive 0/1-style term with no zero side")
                    continue
                if isinstance(value, Opaque) and value.var is side_atom:
                    steps.append(Step("bias", sign, side=value))
                    continue
                steps.append(Step("bias", sign, side=Opaque.of(side_atom,
                                                               _side_dims(side_atom, labels))))
                continue
            raise NotAttention(f"logits go through {name} with a non-constant operand")
        return steps, labels


def _negate(pred: Pred, atom: Any, labels: tuple) -> Pred:
    return p_not(pred, Opaque.of(atom, _side_dims(atom, labels)))


def _side_dims(atom: Any, labels: tuple) -> tuple:
    """Labels of a side operand of an elementwise equation (same shape as the main one)."""
    shape = compat.aval_of(atom).shape
    if len(shape) == 0:
        return ()
    return tuple(lab if n != 1 else None for lab, n in zip(labels, shape))


# -- from a matched chain to an attention_p equation -------------------------------------------

@dataclass(frozen=True)
class Plan:
    """A matched attention: the replacement to apply, its spec and mask parts."""

    replacement: Replacement
    spec: AttentionSpec
    kinds: tuple


def strip_scale(graph: Graph, atom: Any) -> tuple[Any, float]:
    """``(x, c)`` with ``atom == x * c`` for scalar constants multiplied or divided in."""
    c = 1.0
    while True:
        eqn = graph.producer(atom)
        if eqn is None or eqn.primitive.name not in ("mul", "div"):
            return atom, c
        shape = compat.aval_of(atom).shape
        a, b = eqn.invars
        order = ((a, b), (b, a)) if eqn.primitive.name == "mul" else ((a, b),)
        for x, s in order:
            v = scalar_value(graph, s)
            if v is not None and v != 0 and not compat.is_literal(x) \
                    and compat.aval_of(x).shape == shape:
                c = c * v if eqn.primitive.name == "mul" else c / v
                atom = x
                break
        else:
            return atom, c


def unrepeat(graph: Graph, atom: Any, dim: int) -> tuple[Any, int] | None:
    """``(x, g)`` when ``atom`` is ``jnp.repeat(x, g, axis=dim)`` (broadcast + merge)."""
    eqn = graph.producer(atom)
    if eqn is None or eqn.primitive.name != "reshape":
        return None
    src = eqn.invars[0]
    out_shape, in_shape = compat.aval_of(atom).shape, compat.aval_of(src).shape
    if len(in_shape) != len(out_shape) + 1 or \
            in_shape[:dim] + (in_shape[dim] * in_shape[dim + 1],) + in_shape[dim + 2:] != out_shape:
        return None
    bc = graph.producer(src)
    if bc is None or bc.primitive.name != "broadcast_in_dim":
        return None
    x = bc.invars[0]
    want = tuple(d for d in range(len(in_shape)) if d != dim + 1)
    if tuple(bc.params["broadcast_dimensions"]) != want or \
            compat.aval_of(x).shape != out_shape[:dim] + (in_shape[dim],) + out_shape[dim + 1:]:
        return None
    return x, in_shape[dim + 1]


def arrange(x, dims: Sequence, target: Sequence, sizes: dict, full: Sequence = ()):
    """Rearrange ``x`` (dims labelled ``dims``; None = size 1) to ``target``.

    ``target`` entries are labels or tuples of labels merged into one dim (in that order);
    labels absent from ``x`` become size 1, except those in ``full`` (broadcast to size).
    Emits only the reshapes/transposes/broadcasts that change something (``lax``, not
    ``jnp``: this runs once per attention while re-tracing).
    """
    keep = [i for i, d in enumerate(dims) if d is not None and x.shape[i] != 1]
    labs = [dims[i] for i in keep]
    flat = [lab for t in target for lab in (t if isinstance(t, tuple) else (t,))]
    if keep != list(range(x.ndim)):
        x = lax.reshape(x, tuple(x.shape[i] for i in keep))
    perm = [labs.index(lab) for lab in flat if lab in labs]
    if perm != sorted(perm):
        x = lax.transpose(x, perm)
    labs = [labs[i] for i in perm]
    want, merged = [], []
    for t in target:
        group = t if isinstance(t, tuple) else (t,)
        have = [x.shape[labs.index(lab)] if lab in labs else 1 for lab in group]
        grow = any(lab in full for lab in group) or (len(group) > 1 and any(n != 1 for n in have))
        sub = [sizes[lab] if grow else n for lab, n in zip(group, have)]
        want.extend(sub)
        merged.append(int(np.prod(sub)))
    placed = [flat.index(lab) for lab in labs]
    if tuple(want) != x.shape or placed != list(range(len(flat))):
        x = lax.broadcast_in_dim(x, tuple(want), tuple(placed))
    if tuple(merged) != x.shape:
        x = lax.reshape(x, tuple(merged))
    return x


def _labels_of(label_dim: dict, feature: int, feature_label: str, ndim: int) -> list:
    """Per-dim labels of an operand from its label -> dim map and its feature dim."""
    out: list = [None] * ndim
    for lab, d in label_dim.items():
        out[d] = lab
    out[feature] = feature_label
    return out


def _visible_form(steps: Sequence[Step], scale: float):
    """``(scale, softcap, biases)`` of the logits where no mask hides them."""
    inner = None  # (scale inside tanh, multiplier outside) once a tanh was seen
    biases: list = []
    for st in steps:
        if st.kind == "scale":
            if inner is not None:
                inner = (inner[0], inner[1] * st.value)
            else:
                scale *= st.value
            biases = [(side, coef * st.value) for side, coef in biases]
        elif st.kind == "tanh":
            if inner is not None or biases:
                raise NotAttention("tanh of logits that already carry a bias or soft-cap")
            inner = (scale, 1.0)
        elif st.kind == "bias":
            biases.append((st.side, st.value))
    softcap = None
    if inner is not None:
        s, m = inner
        if m == 0:
            raise NotAttention("soft-capped logits multiplied by zero")
        scale, softcap = s * m, abs(m)
    return scale, softcap, biases


_SAMPLES = (-2.5, 0.75, 3.0)
_BIAS_SAMPLES = (-1.25, 2.0)


def _empty_rows(steps: Sequence[Step]) -> tuple[str, list[Pred]]:
    """How masked logits end up, and the distinct visibility predicates.

    Each subset of mask predicates that hides an entry is simulated on sample scores and
    biases (float32, as the program computes): the hidden value must not depend on them,
    and must be ``-inf`` for every subset or one finite value ``<= FINITE_FILL_LIMIT``.
    """
    preds: list[Pred] = []
    for st in steps:
        if st.pred is not None and st.pred not in preds:
            preds.append(st.pred)
    if not preds:
        return "zero", preds
    if len(preds) > 6:
        raise NotAttention("more than six distinct masks on the logits")
    hidden_values = set()
    f32 = np.float32
    for r in range(1, len(preds) + 1):
        for hidden in combinations(range(len(preds)), r):
            hid = {i for i in hidden}
            outs = set()
            for x in _SAMPLES:
                for b in _BIAS_SAMPLES:
                    v = f32(x)
                    with np.errstate(all="ignore"):
                        for st in steps:
                            masked = st.pred is not None and preds.index(st.pred) in hid
                            if st.kind == "scale":
                                v = f32(v * f32(st.value))
                            elif st.kind == "shift":
                                v = f32(v + f32(st.value))
                            elif st.kind == "tanh":
                                v = f32(np.tanh(v))
                            elif st.kind == "bias":
                                v = f32(v + f32(st.value) * f32(b))
                            elif st.kind == "mask-replace" and masked:
                                v = f32(st.value)
                            elif st.kind == "mask-mul" and masked:
                                v = f32(v * f32(0))
                            elif st.kind == "mask-bias" and masked:
                                v = f32(v + f32(st.value))
                    outs.add(float(v) if not np.isnan(v) else "nan")
            if len(outs) != 1 or "nan" in outs:
                raise NotAttention("masked logits still depend on the scores or bias "
                                   "(mask applied before a soft-cap or bias?)")
            hidden_values |= outs
    if hidden_values == {-math.inf}:
        return "zero", preds
    if len(hidden_values) == 1:
        (fill,) = hidden_values
        if fill <= FINITE_FILL_LIMIT:
            return "uniform", preds
        raise NotAttention(f"masked logits become {fill:g}, too large to hide them")
    raise NotAttention("masked logits take different values depending on which mask hides "
                       f"them ({', '.join(sorted(f'{v:g}' for v in hidden_values))})")


def build_plan(m: Matcher, steps, labels, core, qk, q_var, k_var, qc, kc, nb, q_free_labels,
               kv_label, label_q_dim, label_k_dim, sizes, pv, p_operand, p_dims, root,
               out_var) -> Plan:
    g = m.g
    p_dims = tuple(None if d is None else labels[d] for d in p_dims)
    shared = list(range(nb))
    # The kv-heads dim: the last shared dim in K's order that is not K's leading dim
    # (by convention the batch); others are batch. Any choice is exact.
    cand = [lab for lab in shared if label_k_dim[lab] != 0]
    kv_head = max(cand, key=lambda lab: label_k_dim[lab]) if cand else None
    batch_labels = [lab for lab in shared if lab != kv_head]

    q_in, q_scale = strip_scale(g, q_var)
    k_in, k_scale = strip_scale(g, k_var)
    scale, softcap, biases = _visible_form(steps, q_scale * k_scale)
    empty_rows, preds = _empty_rows(steps)

    with m.stats.attempt("mask"):
        pred = And(tuple(preds)) if preds else And(())
        parts: MaskParts = classify(pred, q_free_labels, kv_label, lambda lab: sizes[lab],
                                    sizes[kv_label], batch_labels)
        if any(d.source is None for d in parts.dense):
            raise NotAttention("a mask part cannot be passed as a dense mask (a negated "
                                  "segment comparison, or a mask hiding everything)")
    q_seq = parts.q_dim
    if q_seq is None:
        same = [lab for lab in q_free_labels if sizes[lab] == sizes[kv_label]]
        q_seq = (same or q_free_labels)[0]
    group_labels = [lab for lab in q_free_labels if lab != q_seq]
    heads_labels = ([kv_head] if kv_head is not None else []) + group_labels

    # p·v: which v dims carry which labels.
    (lc, rc), (lb, rb) = pv.params["dimension_numbers"]
    p_is_lhs = pv.invars[0] is p_operand
    v_var = pv.invars[1 if p_is_lhs else 0]
    pc, pb, vc, vb = (lc, lb, rc, rb) if p_is_lhs else (rc, rb, lc, lb)
    if len(pc) != 1 or p_dims[pc[0]] != kv_label:
        raise NotAttention("the value product does not contract the softmax axis")
    if sorted(p_dims[i] for i in pb) != sorted(shared):
        raise NotAttention("the value product's batch dims differ from the q·k product's")
    v_shape = compat.aval_of(v_var).shape
    v_free = [d for d in range(len(v_shape)) if d not in vc and d not in vb]
    if len(v_free) != 1 or v_shape[vc[0]] != sizes[kv_label]:
        raise NotAttention("V must have one feature dim and K's sequence length")
    label_v_dim = {p_dims[i]: vb[j] for j, i in enumerate(pb)}
    label_v_dim[kv_label] = vc[0]
    sizes = dict(sizes)
    sizes[_DV] = v_shape[v_free[0]]

    v_in = v_var
    if kv_head is not None and not group_labels:
        rk = unrepeat(g, k_in, label_k_dim[kv_head])
        rv = unrepeat(g, v_in, label_v_dim[kv_head])
        if rk is not None and rv is not None and rk[1] == rv[1]:
            k_in, v_in = rk[0], rv[0]

    # Everything is presented as (*batch, T, H, D); size-1 dims come and go freely.
    nbl = len(batch_labels)
    canonical = Layout(tuple(range(nbl)), nbl, nbl + 1, nbl + 2)
    q_target = [*batch_labels, q_seq, tuple(heads_labels), "qd"]
    kv_heads = () if kv_head is None else (kv_head,)
    k_target = [*batch_labels, kv_label, *kv_heads, "kd"]
    v_target = [*batch_labels, kv_label, *kv_heads, _DV]
    mqa = Layout(tuple(range(nbl)), nbl, None, nbl + 1)
    k_layout = canonical if kv_head is not None else mqa
    hq = int(np.prod([sizes[lab] for lab in heads_labels]))
    hk = 1 if kv_head is None else compat.aval_of(k_in).shape[label_k_dim[kv_head]]
    if hq % hk:
        raise NotAttention(f"{hq} query heads over {hk} KV heads")
    groups = hq // hk
    q_labels = _labels_of(label_q_dim, qc, "qd", len(compat.aval_of(q_in).shape))
    k_labels = _labels_of(label_k_dim, kc, "kd", len(compat.aval_of(k_in).shape))
    v_labels = _labels_of(label_v_dim, v_free[0], _DV, len(compat.aval_of(v_in).shape))
    out_labels = [*batch_labels, q_seq, *heads_labels, _DV]
    out_labels_pv = [p_dims[i] for i in pb]
    p_free = [p_dims[i] for i in range(len(p_dims)) if i not in pc and i not in pb]
    out_labels_pv += p_free + [_DV] if p_is_lhs else [_DV] + p_free
    if sorted(map(str, out_labels_pv)) != sorted(map(str, out_labels)):
        raise NotAttention("the output dims do not line up with q's dims")

    # Padding masks (a query-only or key-only predicate, e.g. ``tokens != pad``) need no
    # S×S operand: they are folded into segment ids (see ``padding_ids``).
    pads = [d for d in parts.dense
            if _only_on(d, batch_labels, q_seq) or _only_on(d, batch_labels, kv_label)]
    q_pads = [d for d in pads if _only_on(d, batch_labels, q_seq)]
    kv_pads = [d for d in pads if d not in q_pads]
    dense_parts = [d for d in parts.dense if d not in pads]
    band = parts.band
    mask_spec = MaskSpec(
        causal=band is not None and band[1] is not None,
        causal_offset=band[1] if band is not None and band[1] is not None else 0,
        window=(-band[0], None) if band is not None and band[0] is not None else None,
        segments=parts.segments is not None or bool(pads), dense=bool(dense_parts),
        bias=bool(biases), empty_rows=empty_rows)
    spec = AttentionSpec(q=canonical, k=k_layout, v=k_layout, scale=float(scale),
                         softcap=softcap, groups=groups, mask=mask_spec)

    sides: list = []
    seg_sides = list(parts.segments) if parts.segments else []
    sides += [s.var for s in seg_sides]
    sides += [d.source.var for d in q_pads + kv_pads + dense_parts]
    sides += [b.var for b, _ in biases]
    pair_target = [*batch_labels, tuple(heads_labels), q_seq, kv_label]
    full = (q_seq, kv_label)
    out_aval = compat.aval_of(out_var)
    n_seg, n_dense = len(seg_sides), len(dense_parts)
    n_qpad, n_kvpad = len(q_pads), len(kv_pads)

    def build(q, k, v, *side_values):
        operands = [arrange(q, q_labels, q_target, sizes), arrange(k, k_labels, k_target, sizes),
                    arrange(v, v_labels, v_target, sizes)]
        vals = list(side_values)
        q_seq_target, kv_seq_target = [*batch_labels, q_seq], [*batch_labels, kv_label]
        ids = [None, None]
        if n_seg:
            ids = [arrange(vals[0], seg_sides[0].dims, q_seq_target, sizes, (q_seq,)),
                   arrange(vals[1], seg_sides[1].dims, kv_seq_target, sizes, (kv_label,))]
        vals = vals[n_seg:]
        if n_qpad or n_kvpad:
            q_ok = _all_of(q_pads, vals[:n_qpad], q_seq_target, sizes, (q_seq,))
            kv_ok = _all_of(kv_pads, vals[n_qpad:n_qpad + n_kvpad], kv_seq_target, sizes,
                            (kv_label,))
            ids = padding_ids(ids, q_ok, kv_ok, nbl, sizes[q_seq], sizes[kv_label])
        vals = vals[n_qpad + n_kvpad:]
        if ids[0] is not None:
            operands += ids
        if n_dense:
            operands.append(_all_of(dense_parts, vals[:n_dense], pair_target, sizes, full))
        vals = vals[n_dense:]
        if biases:
            total = None
            for (b, coef), val in zip(biases, vals):
                term = arrange(lax.convert_element_type(val, jnp.float32), b.dims, pair_target,
                               sizes, full)
                term = lax.mul(term, jnp.float32(coef)) if coef != 1 else term
                total = term if total is None else lax.add(total, term)
            operands.append(total)
        out = attention_p.bind(*operands, spec=spec)
        split = out.shape[:nbl + 1] + tuple(sizes[lab] for lab in heads_labels) \
            + out.shape[-1:]
        if split != out.shape:
            out = lax.reshape(out, split)
        out = arrange(out, out_labels, out_labels_pv, sizes)
        if out.dtype != out_aval.dtype:
            out = lax.convert_element_type(out, out_aval.dtype)
        return [out]

    kinds = tuple(k for k in parts.kinds if k != "dense" or dense_parts) \
        + (("padding",) if pads else ()) + (("bias",) if biases else ())
    rep = Replacement(root, (q_in, k_in, v_in, *sides), build)
    return Plan(rep, spec, kinds)


def _only_on(part, batch_labels, seq_label) -> bool:
    """Whether a dense mask part varies only along batch dims and one sequence dim."""
    used = {lab for lab in part.source.dims if lab is not None}
    return seq_label in used and used <= set(batch_labels) | {seq_label}


def _all_of(parts, values, target, sizes, full):
    """The conjunction of dense mask parts, each arranged to ``target`` (boolean)."""
    mask = None
    for d, val in zip(parts, values):
        val = val if val.dtype == jnp.bool_ else lax.ne(val, jnp.zeros((), val.dtype))
        val = lax.bitwise_not(val) if d.negated else val
        val = arrange(val, d.source.dims, target, sizes, full)
        mask = val if mask is None else lax.bitwise_and(mask, val)
    return mask


def padding_ids(ids, q_ok, kv_ok, lead: int, q_len: int, kv_len: int):
    """Segment ids that also encode query/key padding: ``q == kv`` iff the segments are
    equal and both tokens are kept.

    ``ids``: the ``[q_ids, kv_ids]`` found (or ``None``s), ``q_ok``/``kv_ok``: boolean
    ``(*batch|1, T)`` keep-masks (or ``None``), ``lead``: the number of batch dims. Kept
    tokens get even ids (``2·segment``, or 0 without segments); a dropped query gets 1 and
    a dropped key 3, which equal nothing on the other side.
    """
    def encode(base, ok, dropped, length):
        base = jnp.zeros((1,) * lead + (length,), jnp.int32) if base is None \
            else lax.mul(lax.convert_element_type(base, jnp.int32), jnp.int32(2))
        if ok is None:
            return base
        shape = jnp.broadcast_shapes(base.shape, ok.shape)
        return lax.select(jnp.broadcast_to(ok, shape), jnp.broadcast_to(base, shape),
                          lax.full(shape, dropped, jnp.int32))

    return [encode(ids[0], q_ok, 1, q_len), encode(ids[1], kv_ok, 3, kv_len)]


# -- the pass --------------------------------------------------------------------------------

def _closed_jaxprs(closed: Any, depth: int = 0, out: dict | None = None) -> dict:
    """``id(open jaxpr) -> (closed or open jaxpr, nesting depth)`` for every (sub-)jaxpr."""
    out = {} if out is None else out
    out[id(compat.open_jaxpr(closed))] = (closed, depth)
    for eqn in compat.open_jaxpr(closed).eqns:
        for _, sub in compat.eqn_subjaxprs(eqn):
            _closed_jaxprs(sub, depth + 1, out)
    return out


@register
@dataclass(frozen=True)
class MatchAttention(Pass):
    """Replace every attention subgraph with one ``attention_p`` (run after canonicalize).

    ``strict``: raise when a softmax between a q·k and a p·v product cannot be rewritten,
    instead of leaving it and reporting why.
    """

    name = "match-attention"
    summary = "find softmax(q·k)·v subgraphs (any spelling) and replace them with attention_p"

    strict: bool = False

    def run(self, module: Module) -> PassResult:
        stats = RuleStats()
        reports: list[MatchReport] = []
        refusals: list[tuple[MatchReport, bool]] = []
        known = _closed_jaxprs(module.jaxpr)

        def plan(jaxpr):
            closed, depth = known.get(id(jaxpr), (jaxpr, 0))
            matcher = Matcher(Graph(closed), stats, depth)
            reps, found = matcher.run()
            reports.extend(found)
            refusals.extend(matcher.refusals)
            return reps

        new = Rewriter(plan=plan).run(module.jaxpr)
        if self.strict:
            bad = [r for r, attention_like in refusals if attention_like]
            if bad:
                raise MatchAttentionError(
                    "match-attention{strict=true}: attention not rewritten:\n  " +
                    "\n  ".join(map(str, bad)) +
                    "\nRewrite it with cptransform.attention(...), or drop strict to leave it.")
        hits = sum(r.rewritten for r in reports)
        log = tuple(str(r) for r in reports)
        if not hits:
            return PassResult(module.with_jaxpr(module.jaxpr, matches=reports,
                                                match_stats=stats.table), False, log)
        return PassResult(module.with_jaxpr(new, matches=reports, match_stats=stats.table),
                          True, log)
