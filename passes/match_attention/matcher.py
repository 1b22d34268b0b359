"""The matcher of one (sub-)jaxpr: each softmax core, then the two products around it."""
from __future__ import annotations

from cptransform.analysis.mask_analysis import MaskAnalyzer
from cptransform.analysis.match_report import MatchReport
from cptransform.ir import compat
from cptransform.ir.graph import Graph
from cptransform.ir.rewrite import Replacement
from cptransform.op.attention_spec import EmptyRows
from cptransform.passes.match_attention.anchor import (Softmax, exponentials, find_softmax,
                                                      is_normalizer)
from cptransform.passes.match_attention.candidate import Candidate, build_candidate
from cptransform.passes.match_attention.chain import ChainReader, side_dims
from cptransform.passes.match_attention.emit import replacement
from cptransform.passes.match_attention.log_normalized import log_normalized
from cptransform.passes.match_attention.qk_product import read_qk_product
from cptransform.passes.match_attention.row_scan import find_row_scan
from cptransform.passes.match_attention.row_test import find_row_test
from cptransform.passes.match_attention.sink import split_sink
from cptransform.passes.match_attention.stats import NotAttention, Rule, RuleStats
from cptransform.passes.match_attention.value_product import deferred, normalized
from cptransform.passes.match_attention.walk import only_feeds


class Matcher:
    """Finds the attentions of one (sub-)jaxpr at nesting ``depth``."""

    def __init__(self, graph: Graph, stats: RuleStats, depth: int):
        self.g = graph
        self.stats = stats
        self.depth = depth
        self.chains = ChainReader(graph, MaskAnalyzer(graph), stats)
        #: ``(report, attention_like)`` for every refusal.
        self.refusals: list[tuple[MatchReport, bool]] = []
        #: ``(report, keys, logits)`` for every refused softmax whose exponentials reach a
        #: product (a ``dot_general``: weights applied to values, not a distribution kept
        #: for a loss): ``keys`` the ``(k, dim)`` of the q·k product it normalizes over
        #: (None when the chain cannot be read), ``logits`` the ``(value, axes)`` it
        #: normalizes.
        self.refused: list[tuple[MatchReport, tuple | None, tuple]] = []
        #: ``(atom, dim)``: the q and k sequence dims of every rewritten attention.
        self.sequence_dims: list[tuple] = []

    def run(self) -> tuple[list[Replacement], list[MatchReport]]:
        """The replacements to apply and a report per softmax core found."""
        reps, reports, folded = [], [], set()
        for eqn in self.g.jaxpr.eqns:
            if eqn.primitive.name != "reduce_sum":
                continue
            try:
                with self.stats.attempt(Rule.SOFTMAX):
                    softmax = find_softmax(self.g, eqn)
            except NotAttention as e:
                # A sum of exponentials that is no softmax core (several axes, a shift
                # that varies along the axis) is reported too: it may normalize a q·k
                # product whole; any other sum is no softmax.
                exp = exponentials(self.g, eqn)
                if exp is not None:
                    report = MatchReport(compat.source_line(exp), "refused", str(e),
                                         depth=self.depth, rule=Rule.SOFTMAX.value)
                    reports.append(report)
                    self.refusals.append((report, False))
                    if self._weights_values(exp):
                        self.refused.append((report, None, (exp.invars[0],
                                                            tuple(eqn.params["axes"]))))
                continue
            src = compat.source_line(softmax.exp_eqn)
            try:
                candidate, rule = self._attention(softmax)
            except NotAttention as e:
                report = MatchReport(src, "refused", str(e), depth=self.depth, rule=e.rule)
                reports.append(report)
                self.refusals.append((report, e.attention_like))
                if self._weights_values(softmax.exp_eqn):
                    self.refused.append((report, self._keys(softmax),
                                         (softmax.logits, (softmax.axis,))))
                continue
            spec, kinds = candidate.spec(), candidate.kinds
            row_test = find_row_test(self.g, self.chains.masks, candidate)
            if row_test is not None:
                spec = spec.replace(mask=spec.mask.replace(empty_rows=EmptyRows.ZERO.value))
                kinds += ("row-test",)
                reps.append(row_test.replacement())
                folded.add(id(row_test.reduction))
            reps.append(replacement(candidate, spec))
            self.sequence_dims += [(candidate.q.atom, candidate.q.labels.index(candidate.q_seq)),
                                   (candidate.k.atom, candidate.k.labels.index(candidate.kv_seq))]
            reports.append(MatchReport(src, "rewritten", "", spec, " ".join(kinds) or "full",
                                       rule.value, self.depth))
        return reps + self._row_scans(folded), reports

    def _row_scans(self, folded: set) -> list[Replacement]:
        """A row reduction of a mask that no row test folded, as counts along its keys
        (:mod:`row_scan`): the ``S×S`` operand is never built."""
        scans = []
        for eqn in self.g.jaxpr.eqns:
            if id(eqn) in folded:
                continue
            try:
                scans.append(find_row_scan(self.chains.masks, eqn))
            except (IndexError, KeyError, ValueError, TypeError):
                # A value the mask analysis did not foresee: the reduction runs as written
                # (exact; a gather it causes is a leak ``explain(leaks=True)`` names).
                continue
        return [scan.replacement() for scan in scans if scan is not None]

    def _weights_values(self, exp_eqn) -> bool:
        """Whether the exponentials of ``exp_eqn`` reach a ``dot_general`` (the
        probabilities weight values, as an attention's do), so that the softmax, left
        alone over a sequence's keys, is an attention left whole."""
        return any(e.primitive.name == "dot_general" for e in self.g.descendants(exp_eqn))

    def _keys(self, softmax: Softmax) -> tuple | None:
        """``(k, dim)``: the dim of a q·k product's right operand that a refused softmax
        normalizes over, or ``None`` when its input is no q·k product. Whether that dim is
        a sequence (an attention left whole: its probabilities multiplied by data, a
        softmax combined with a non-softmax) or not (a loss over the vocabulary, a softmax over heads) dataflow
        decides: ``match-attention`` links it to the rewritten attentions' sequences."""
        try:
            column = split_sink(self.g, softmax.logits, softmax.axis)
            chain = self.chains.walk(softmax.logits if column is None else column.keys)
            qk = read_qk_product(self.chains, chain, softmax.axis)
        except (NotAttention, IndexError, KeyError, ValueError, TypeError):
            return None
        return qk.k, qk.k_dims[qk.kv]

    def _attention(self, softmax: Softmax) -> tuple[Candidate, Rule]:
        g = self.g
        with self.stats.attempt(Rule.LOGITS_CHAIN):
            column = split_sink(g, softmax.logits, softmax.axis)
            chain = self.chains.walk(softmax.logits if column is None else column.keys)
        cut = None if column is None else (softmax.axis, column.width)
        e, sum_eqn = softmax.e, softmax.sum_eqn
        ident = tuple(range(len(compat.aval_of(e).shape)))
        users = [u for u in g.users(e) if u is not sum_eqn]
        if g.is_output(e) or len(users) > 1:
            raise NotAttention("the exponentials are read elsewhere")
        user = users[0] if users else None
        if user is None:
            rule = Rule.LOG_NORMALIZED
            with self.stats.attempt(rule):
                product = normalized(g, log_normalized(g, softmax), ident, cut)
        elif user.primitive.name == "div" and user.invars[0] is e and \
                is_normalizer(g, user.invars[1], softmax, ident):
            rule = Rule.NORMALIZED
            with self.stats.attempt(rule):
                if not only_feeds(g, softmax.sum, user):
                    raise NotAttention("the softmax normaliser is read elsewhere")
                product = normalized(g, user.outvars[0], ident, cut)
        else:
            rule = Rule.DEFERRED
            with self.stats.attempt(rule):
                product = deferred(g, softmax, ident, cut)
        try:
            with self.stats.attempt(Rule.VALUE_PRODUCT):
                qk = read_qk_product(self.chains, chain, softmax.axis)
                zeroing = [self.chains.masks.predicate(
                    mask, side_dims(mask, tuple(None if d is None else qk.labels[d]
                                                for d in dims)))
                    for mask, dims in product.zeroed]
                return build_candidate(g, qk, product, self.stats, column, zeroing), rule
        except NotAttention as err:
            err.attention_like = True
            err.rule = rule.value
            raise
        except (IndexError, KeyError, ValueError, TypeError) as err:
            # A spelling the candidate reader did not foresee: the softmax is left alone
            # (the program stays exact) and the report names the failure.
            failed = NotAttention(f"the matcher could not read this candidate "
                                  f"({type(err).__name__}: {err}); left alone, please "
                                  "report the program")
            failed.attention_like, failed.rule = True, rule.value
            raise failed from err
