"""Pass ``match-recurrences``: wrap each recurrence as one ``recurrence_p`` equation.

Three kinds (:class:`~cptransform.op.recurrence.Kind`):

* ``prefix``: a cumulative op (``cumsum``, ``cumprod``, ``cummax``, ``cummin``,
  ``cumlogsumexp``) or a ``lax.associative_scan`` proved from its traced form
  (:mod:`.associative`);
* ``affine``: a ``lax.scan`` with a carry, scanned inputs and per-step outputs whose carry
  is affine in itself (:func:`~cptransform.analysis.affine_carry.affine_carries`: each
  leaf's linear part diagonal or a matrix, DeltaNet's);
* ``carried``: any other such scan (a GRU); the reason its carry is not affine is kept.

Whether a recurrence's axis is the sequence is decided later (``infer-seq-axes``; in a
program without attention the recurrences' axes are the sequence); the planner unwraps
the others. A scan is left alone when its body holds an attention or a windowed op (a
scan over layers, whose body the CP lowering rewrites), or iterates a nested loop or
cumulative op over its own carry (the carry then holds what the inner loop runs along:
a loop over layers of a recurrent model).
"""
from __future__ import annotations

from dataclasses import dataclass

from cptransform.analysis.affine_carry import affine_carries
from cptransform.analysis.primitives import INLINABLE, Family, names_of
from cptransform.ir import compat
from cptransform.ir.module import Module, iter_eqns
from cptransform.ir.pipeline import Pass, PassResult
from cptransform.ir.rewrite import Replacement, Rewriter
from cptransform.op.attention import attention_p
from cptransform.op.recurrence import CUMULATIVE, Kind, Loop, Recurrence, recurrence_p
from cptransform.op.seq_window import seq_window_p
from cptransform.passes.match_recurrences.associative import find_associative_scans

#: What a scan over layers holds: ops the CP lowering rewrites inside a body.
REWRITTEN_INSIDE = frozenset({attention_p.name, seq_window_p.name, recurrence_p.name})
#: Nested ops that iterate along a dim of their operands.
ITERATING = names_of(Family.CUMULATIVE) | {"scan", "while", recurrence_p.name}


def _candidate(eqn) -> bool:
    """An equation a recurrence may start at: a cumulative op, a scan, or a slice with
    stride 2 (an associative scan's first level)."""
    name = eqn.primitive.name
    return name in CUMULATIVE or name == "scan" or (
        name == "slice" and 2 in (eqn.params.get("strides") or ()))


def _sorted(params: dict) -> tuple:
    return tuple(sorted(params.items()))


def wrap_cumulative(eqn, invals):
    """A cumulative op as a prefix recurrence along its ``axis``."""
    params = eqn.params
    rec = Recurrence(Kind.PREFIX, eqn.primitive, _sorted(params), params["axis"], (True,),
                     (True,), reverse=bool(params["reverse"]), name=eqn.primitive.name)
    return recurrence_p.bind(*invals, recurrence=rec)


def _rewritten_inside(body) -> bool:
    return any(e.primitive.name in REWRITTEN_INSIDE for e in iter_eqns(body))


def _iterates_over_carry(body, consts: int, carries: int) -> bool:
    """A nested loop or cumulative op of the body runs over a value read from the carry."""
    jaxpr = compat.open_jaxpr(body)
    reads = set(jaxpr.invars[consts:consts + carries])
    for eqn in jaxpr.eqns:
        if any(not compat.is_literal(x) and x in reads for x in eqn.invars):
            if eqn.primitive.name in ITERATING:
                return True
            reads |= set(eqn.outvars)
    return False


def wrap_scan(eqn, invals):
    """A ``lax.scan`` with a carry, scanned inputs and per-step outputs as an affine or a
    carried recurrence along its iterations; ``None`` (left alone) otherwise."""
    consts, carries = compat.scan_counts(eqn)
    xs = len(eqn.invars) - consts - carries
    ys = len(eqn.outvars) - carries
    body = eqn.params["jaxpr"]
    if not carries or not xs or not ys or _rewritten_inside(body) \
            or _iterates_over_carry(body, consts, carries):
        return None
    maps, why = affine_carries(body, consts, carries)
    loop = Loop(body, consts, carries, bool(eqn.params["reverse"]), eqn.params["unroll"])
    rec = Recurrence(Kind.AFFINE if maps is not None else Kind.CARRIED, eqn.primitive,
                     _sorted(eqn.params), 0, (False,) * (consts + carries) + (True,) * xs,
                     (False,) * carries + (True,) * ys, reverse=loop.reverse, loop=loop,
                     carries=maps or (), why=why, name="scan")
    return recurrence_p.bind(*invals, recurrence=rec)


def plan_associative(jaxpr) -> list[Replacement]:
    """One replacement per result of each associative scan proved in ``jaxpr``: the first
    evaluated binds the recurrence, the others take their results from it."""
    replacements = []
    for found in find_associative_scans(jaxpr):
        rec = Recurrence(Kind.PREFIX, None, (), found.axis, (True,) * len(found.elems),
                         (True,) * len(found.elems), reverse=found.reverse,
                         combine=found.combine, name="associative_scan")
        bound: dict = {}

        def build(*elems, rec=rec, bound=bound):
            # Keyed by the operands' identity: a body re-traced twice binds twice.
            key = tuple(map(id, elems))
            if bound.get("key") != key:
                bound.update(key=key, outs=recurrence_p.bind(*elems, recurrence=rec))
            return bound["outs"]

        for index, var in enumerate(found.outputs):
            if var is None:
                continue
            # An associative scan's result is the one result of its last add (or rev).
            root = next(e for e in jaxpr.eqns if var in e.outvars)
            replacements.append(Replacement(
                root, found.elems,
                lambda *elems, build=build, index=index: [build(*elems)[index]]))
    return replacements


@dataclass(frozen=True)
class MatchRecurrences(Pass):
    """Wrap cumulative ops, associative scans and scans with a carry as ``recurrence_p``."""

    name = "match-recurrences"
    summary = ("cumulative ops, associative scans, scans with a carry -> recurrence_p "
               "(sharded by passing state)")

    def run(self, module: Module) -> PassResult:
        if not any(_candidate(e) for e in iter_eqns(module.jaxpr)):
            return PassResult(module, False)
        rules = {name: wrap_cumulative for name in CUMULATIVE}
        rules["scan"] = wrap_scan
        new = Rewriter(plan=plan_associative, rules=rules, inlinable=INLINABLE).run(
            module.jaxpr)
        found = [e.params["recurrence"] for e in iter_eqns(new) if e.primitive is recurrence_p]
        if not found:
            return PassResult(module, False)
        kinds = {k: sum(r.kind is k for r in found) for k in Kind}
        log = (f"match-recurrences: {len(found)} recurrence(s) wrapped ("
               + ", ".join(f"{n} {k}" for k, n in kinds.items()) + ")",)
        return PassResult(module.with_jaxpr(new), bool(found), log)
