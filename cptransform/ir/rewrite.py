"""Rewrite by re-tracing: evaluate the old jaxpr under ``make_jaxpr`` with replacements.

Two kinds of change compose in one walk:

* **Replacements** (multi-equation patterns): the outputs of a root equation are replaced
  by what a builder computes from chosen input values; equations that only fed the root
  become dead and are removed. Matches are found on a read-only :class:`~cptransform.ir.graph.Graph`.
* **Equation rules**, a table keyed by primitive (the custom-interpreter idiom): a rule
  gets the equation and its input values and returns new outputs, or ``None`` to keep it.

Sub-jaxprs (pjit, scan, while, cond, remat, custom_jvp/vjp) are rewritten recursively and
the enclosing equation is re-bound with the new bodies; call-like equations can be inlined.
A body that runs on a mesh of its own (a model's ``shard_map``) is bound as it is: traced
outside that mesh its collectives and ``axis_index`` would name unbound axes.
Avals, effects and shardings come from re-tracing; nothing is keyed by printed names.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import jax

from cptransform.ir import compat


@dataclass(frozen=True)
class Replacement:
    """Replace ``root``'s outputs with ``build(*values of inputs)`` (a sequence, one per outvar)."""

    root: Any
    inputs: tuple
    build: Callable[..., Sequence[Any]]


EqnRule = Callable[[Any, list], "Sequence[Any] | None"]
Planner = Callable[[Any], "Sequence[Replacement]"]

@dataclass
class Rewriter:
    """One rewrite walk; see the module docstring.

    ``plan(open_jaxpr)`` returns the replacements for one (sub-)jaxpr; ``rules`` maps a
    primitive name to an :data:`EqnRule`; ``inline(eqn)`` says whether to evaluate a
    call-like equation's body in place; ``inlinable``: the names of the call-like
    primitives whose body can be (the primitives table's column,
    ``cptransform.analysis.primitives.INLINABLE``: the IR toolkit reads no analysis, so
    its users hand it over). A body that gained constants is inlined only when inlinable.
    """

    plan: Planner | None = None
    rules: Mapping[str, EqnRule] | None = None
    inline: Callable[[Any], bool] | None = None
    inlinable: frozenset[str] = frozenset()

    def __post_init__(self):
        self._plans: dict[int, tuple[Any, dict]] = {}

    def run(self, closed: Any) -> Any:
        """The rewritten closed jaxpr (same inputs and outputs), dead code removed."""
        return self._retrace(closed)

    def _replacements(self, jaxpr: Any) -> dict:
        """Replacements for one jaxpr, keyed by root equation identity (computed once)."""
        cached = self._plans.get(id(jaxpr))
        if cached is None or cached[0] is not jaxpr:
            reps = {id(r.root): r for r in (self.plan(jaxpr) if self.plan else ())}
            cached = (jaxpr, reps)
            self._plans[id(jaxpr)] = cached
        return cached[1]

    def _retrace(self, closed: Any) -> Any:
        jaxpr = compat.open_jaxpr(closed)
        consts = compat.consts_of(closed)
        return compat.dce(trace_like(jaxpr, lambda *xs: self.eval(jaxpr, consts, xs)))

    def eval(self, jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list:
        """Evaluate an open jaxpr with replacements under the current trace."""
        replacements = self._replacements(jaxpr)

        def step(eqn, read):
            rep = replacements.get(id(eqn))
            if rep is None:
                return self.eval_eqn(eqn, [read(a) for a in eqn.invars])
            with compat.eqn_context(eqn):
                return list(rep.build(*[read(a) for a in rep.inputs]))

        return interpret(jaxpr, consts, args, step)

    def eval_eqn(self, eqn: Any, invals: list) -> list:
        rule = (self.rules or {}).get(eqn.primitive.name)
        if rule is not None:
            with compat.eqn_context(eqn):
                outs = rule(eqn, invals)
            if outs is not None:
                return list(outs)
        subs = list(compat.eqn_subjaxprs(eqn))
        if not subs or compat.runs_on_own_mesh(eqn):
            return compat.bind_eqn(eqn, invals)
        body = self._call_body(eqn) if eqn.primitive.name in self.inlinable else None
        params = self._rewrite_params(eqn)
        wants_inline = self.inline is not None and self.inline(eqn)
        if body is not None and (wants_inline or params is None):
            with compat.inlining(eqn):
                return self.eval(compat.open_jaxpr(body), compat.consts_of(body), invals)
        if params is None:
            raise NotImplementedError(
                f"cannot rewrite inside {eqn.primitive.name}: its body gained constants and "
                "it cannot be inlined")
        return compat.bind_eqn(eqn, invals, params)

    @staticmethod
    def _call_body(eqn: Any) -> Any:
        return compat.call_body(eqn)

    def _rewrite_params(self, eqn: Any) -> dict | None:
        """Params with every sub-jaxpr rewritten (unchanged objects where nothing matched);
        ``None`` when the caller must inline instead (see :func:`map_bodies`)."""
        return map_bodies(eqn, self._rewrite_sub)

    def _rewrite_sub(self, sub: Any) -> Any:
        jaxpr = compat.open_jaxpr(sub)
        if not self._touches(jaxpr):
            return sub
        return fit_body(sub, self._retrace(sub))

    def _touches(self, jaxpr: Any) -> bool:
        """Whether a rewrite could change this jaxpr (skip re-tracing untouched bodies)."""
        if self._replacements(jaxpr):
            return True
        for eqn in jaxpr.eqns:
            if self.rules and eqn.primitive.name in self.rules:
                return True
            if compat.runs_on_own_mesh(eqn):
                continue
            if self.inline is not None and eqn.primitive.name in self.inlinable and self.inline(eqn):
                return True
            if any(self._touches(compat.open_jaxpr(s)) for _, s in compat.eqn_subjaxprs(eqn)):
                return True
        return False


def fit_body(old: Any, new: Any) -> Any:
    """``new`` (a closed jaxpr) in the form of the param ``old`` came from, or ``None`` when
    it cannot be: an open-jaxpr param (remat's, on JAX 0.10) cannot carry constants."""
    if old is compat.open_jaxpr(old) and not compat.JAXPR_CLASSES_MERGED:
        return None if compat.consts_of(new) else compat.open_jaxpr(new)
    return new


def map_bodies(eqn: Any, rewrite: Callable[[Any], Any]) -> dict | None:
    """``eqn``'s params with ``rewrite`` applied to every jaxpr-valued param (and each
    jaxpr of a tuple, as cond's branches). ``None`` when ``rewrite`` returned ``None`` for
    some body: the equation cannot be re-bound and should be inlined."""
    params = dict(eqn.params)
    for name, value in eqn.params.items():
        if compat.is_jaxpr_like(value):
            params[name] = rewrite(value)
        elif isinstance(value, tuple) and value and all(compat.is_jaxpr_like(v) for v in value):
            params[name] = tuple(rewrite(v) for v in value)
        else:
            continue
        if any(p is None for p in (params[name] if isinstance(params[name], tuple)
                                   else (params[name],))):
            return None
    return params


def trace_like(jaxpr: Any, fn: Callable) -> Any:
    """``make_jaxpr(fn)`` over arguments shaped like ``jaxpr``'s inputs.

    Weak types are kept: a body re-traced with strong inputs can change its output types
    (a scan carry would then no longer match its initial value). The params come back in
    canonical form (:func:`~cptransform.ir.compat.canonical_params`), whatever JAX spelled
    the equations ``fn`` emitted."""
    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype,
                                  weak_type=getattr(v.aval, "weak_type", False))
             for v in compat.open_jaxpr(jaxpr).invars]
    return compat.canonical_params(jax.make_jaxpr(fn)(*avals))


def interpret(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any],
              step: Callable[[Any, Callable], Sequence[Any]]) -> list:
    """Evaluate an open jaxpr equation by equation under the current trace (or any record
    of ``constvars``, ``invars``, ``eqns`` and ``outvars``: a part of one).

    ``step(eqn, read)`` returns the equation's outputs; ``read(atom)`` gives the value of
    any variable defined so far (or a literal's value)."""
    env: dict = {}

    def read(atom):
        return compat.literal_value(atom) if compat.is_literal(atom) else env[atom]

    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        env.update(zip(eqn.outvars, step(eqn, read)))
    return [read(v) for v in jaxpr.outvars]
