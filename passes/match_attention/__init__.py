"""``match-attention``: replace each attention subgraph with one ``attention_p`` equation.

Matching is anchored on the softmax core, the part every spelling shares:
``e = exp(x - c)`` with ``c`` constant along one axis, ``sum(e, axis)``, and the division,
either of ``e`` (``p = e / sum``, then ``p @ v``) or of the value product
(``(e @ v) / sum``), or the log of the sum subtracted inside a second exp
(``p = exp(x - logsumexp(x))``, ``exp(log_softmax(x))``). From there it walks

* back from ``x`` through elementwise and layout equations to the ``q·k`` ``dot_general``
  (the *logits chain*), reading each step as a scale, a soft-cap ``m·tanh(s·x)``, an
  additive bias, or a mask (``where``/``select_n`` with a fill value, a multiply by a 0/1
  mask, an additive mask). Masked entries are then simulated on a few sample values: the
  result must not depend on the scores, and must be ``-inf`` everywhere
  (``empty_rows="nan"``: a fully masked row is NaN, as the original's softmax gives) or one
  finite very negative value everywhere
  (``empty_rows="uniform"``: a fully masked row averages V, as the original does), or
  one finite value too large to hide its keys (``MaskSpec.fill``: each masked key keeps
  that logit, e.g. ``where(mask, x, -8)`` before a soft-cap);
* forward from the probabilities to the ``p·v`` ``dot_general``, through casts,
  transposes and reshapes only, with no other reader of the probabilities. A dim the
  logits chain merged (GQA logits ``[B, T, K, G, S]`` viewed as ``[B, T, K·G, S]``) must
  come back split into the same parts before the value product.

Dims are tracked by *labels* (the dims of the ``q·k`` product: shared batch dims, the
query's free dims, the key position), so any layout (BTHD, BHTD, no batch, heads under
``vmap``, GQA as a reshape of q or a ``repeat`` of K/V) maps onto the spec without
guessing. Masks are classified by :mod:`cptransform.analysis.mask_analysis`; analytic parts become
``MaskSpec`` fields and their iota/compare subgraphs die, the rest becomes the ``mask``
operand. Anything that does not fit is left alone and reported with its reason.

The modules, in the order a match uses them: ``anchor`` (the softmax core), ``chain``
(the logits chain, a table of readers keyed by primitive), ``qk_product``,
``value_product``, ``log_normalized`` (the log-sum-exp spellings), ``logits`` (visible
form and empty rows), ``candidate`` (the frozen record of a match and its spec),
``row_test`` (a select after the attention that zeroes its empty rows, folded into
``empty_rows="zero"``), ``row_scan`` (any other reduction of a mask along its keys, as
counts along the keys), ``emit`` (the replacement), ``matcher`` (one jaxpr), ``stats``
(refusals and per-rule counts), ``walk`` (use-def helpers), and ``distribute``, run before
the match: a value product of a linear combination of softmaxes (differential attention)
distributed over it, so each softmax is an attention.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from cptransform.analysis.match_report import MatchReport
from cptransform.analysis.primitives import INLINABLE
from cptransform.analysis.seq_axes import linked_dims
from cptransform.ir import compat
from cptransform.ir.errors import MatchAttentionError
from cptransform.ir.facts import Fact
from cptransform.ir.module import Module, iter_eqns
from cptransform.ir.pipeline import Pass, PassResult
from cptransform.ir.rewrite import Rewriter
from cptransform.ir.graph import Graph
from cptransform.passes.match_attention.anchor import softmaxes
from cptransform.passes.match_attention.bound_constants import BoundGraph, bound_inputs
from cptransform.passes.match_attention.distribute import distribute_value_products
from cptransform.passes.match_attention.matcher import Matcher
from cptransform.passes.match_attention.stats import RuleStats


def _closed_jaxprs(closed: Any, depth: int = 0, out: dict | None = None) -> dict:
    """``id(open jaxpr) -> (closed or open jaxpr, nesting depth)`` for every (sub-)jaxpr."""
    out = {} if out is None else out
    out[id(compat.open_jaxpr(closed))] = (closed, depth)
    for eqn in compat.open_jaxpr(closed).eqns:
        for _, sub in compat.eqn_subjaxprs(eqn):
            _closed_jaxprs(sub, depth + 1, out)
    return out


@dataclass(frozen=True)
class MatchAttention(Pass):
    """Replace every attention subgraph with one ``attention_p`` (run after canonicalize).

    ``strict``: raise when a softmax between a q·k and a p·v product cannot be rewritten,
    instead of leaving it and reporting why. ``distribute``: first distribute a value
    product over a linear combination of softmaxes (differential attention), so each is an
    attention (:mod:`~cptransform.passes.match_attention.distribute`; ``False`` keeps the
    combination whole, and unsharded).
    """

    name = "match-attention"
    summary = "find softmax(q·k)·v subgraphs (any spelling) and replace them with attention_p"
    ensures = (Fact.MATCHES,)

    strict: bool = False
    distribute: bool = True

    def run(self, module: Module) -> PassResult:
        closed, distributed = distribute_value_products(module.jaxpr) if self.distribute \
            else (module.jaxpr, 0)
        stats = RuleStats()
        reports: list[MatchReport] = []
        refusals: list[tuple[MatchReport, bool]] = []
        refused: list[tuple[MatchReport, tuple | None, tuple]] = []
        sequence_dims: list[tuple] = []
        known = _closed_jaxprs(closed)
        bound = bound_inputs(closed)

        def plan(jaxpr):
            closed, depth = known.get(id(jaxpr), (jaxpr, 0))
            matcher = Matcher(BoundGraph(closed, bound.get(id(jaxpr), {})), stats, depth)
            reps, found = matcher.run()
            reports.extend(found)
            refusals.extend(matcher.refusals)
            refused.extend(matcher.refused)
            sequence_dims.extend(matcher.sequence_dims)
            return reps

        new = Rewriter(plan=plan, inlinable=INLINABLE).run(closed)
        reports.extend(_in_shard_maps(closed))
        if self.strict:
            bad = [r for r, attention_like in refusals if attention_like]
            if bad:
                raise MatchAttentionError(
                    "match-attention{strict=true}: attention not rewritten:\n  " +
                    "\n  ".join(map(str, bad)) +
                    "\nRewrite it with cptransform.attention(...), or drop strict to leave it.")
        reports = _mark_over_keys(closed, reports, refused, sequence_dims)
        hits = sum(r.rewritten for r in reports)
        log = tuple(str(r) for r in reports)
        if distributed and hits:
            log = (f"match-attention: {distributed} value product(s) distributed over a "
                   "linear combination of softmaxes",) + log
        return PassResult(module.with_jaxpr(new if hits else module.jaxpr,
                                            matches=tuple(reports), match_stats=stats.table),
                          bool(hits), log)


def _in_shard_maps(closed: Any) -> list[MatchReport]:
    """Reports for the softmaxes inside a model's ``shard_map`` bodies (nested bodies
    included), which the rewrite never enters: the body runs as written on the model's
    mesh. Each is reported as possibly an attention left whole (so the transform warns, or
    refuses when nothing else shards), never silently run unsharded."""
    out = []
    for eqn in iter_eqns(closed):
        if eqn.primitive.name != compat.SHARD_MAP:
            continue
        where = f"inside the shard_map at {compat.source_line(eqn)}"
        for body in _bodies(eqn.params["jaxpr"]):
            for softmax in softmaxes(Graph(body)):
                source = compat.source_line(softmax.exp_eqn)
                out.append(MatchReport(
                    compat.source_line(eqn) if source == "?" else source, "refused",
                    over_keys=True,
                    reason=f"a softmax {where}, whose body runs as written on each device "
                    "of its mesh (never rewritten): an attention there runs whole. Call it "
                    "outside the shard_map to shard it over the CP axis"))
    return out


def _bodies(jaxpr: Any):
    """``jaxpr`` and every body nested in it."""
    yield jaxpr
    for eqn in compat.open_jaxpr(jaxpr).eqns:
        for _, sub in compat.eqn_subjaxprs(eqn):
            yield from _bodies(sub)


def _mark_over_keys(closed, reports: list, refused: list, sequence_dims: list) -> list:
    """``reports`` with ``over_keys`` set on the refused softmaxes (those weighting values,
    :attr:`Matcher.refused`) that dataflow links to a rewritten attention's sequences:
    attentions left to run unsharded. A softmax is one when the keys of its q·k product
    are a sequence's, or when the axis it normalizes and another dim of its input both
    are (``S×S`` logits, whatever the refusal's reason and however far the chain from the
    product was read)."""
    if not refused or not sequence_dims:
        return reports
    candidates = [keys for _, keys, _ in refused if keys is not None]
    candidates += [(logits, d) for _, _, (logits, _) in refused
                   for d in range(compat.aval_of(logits).ndim)]
    linked = linked_dims(closed, sequence_dims, candidates)
    over = set()
    for report, keys, (logits, axes) in refused:
        dims = {d for d in range(compat.aval_of(logits).ndim) if (logits, d) in linked}
        if keys in linked or dims & set(axes) and dims - set(axes):
            over.add(id(report))
    return [dataclasses.replace(r, over_keys=True) if id(r) in over else r for r in reports]
