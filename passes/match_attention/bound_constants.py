"""Inputs of sub-jaxprs that are constants outside them, followed back to their values.

A loop body, branch or call body sees the loop-invariant operands of its equation (``scan``
and ``while`` constants, ``cond`` operands, a call's arguments) as plain inputs: a mask fill
value closed over by a scanned layer (penzai's ``use_layer_stack=True``) reaches the body
that way. Where such an operand is a literal, a constant, or computed from constants alone
outside (small values, evaluated here), the body's graph reads it as that constant.
"""
from __future__ import annotations

from typing import Any

import jax
import numpy as np

from cptransform.ir import compat
from cptransform.ir.graph import Graph

#: The largest value (in elements) computed from constants that is evaluated to follow it.
_MAX_FOLDED = 1 << 16


class BoundGraph(Graph):
    """A :class:`Graph` whose inputs in ``bound`` (var -> value) read as constants."""

    def __init__(self, jaxpr: Any, bound: dict):
        super().__init__(jaxpr)
        self.bound = bound

    def is_const(self, atom: Any) -> bool:
        return atom in self.bound or super().is_const(atom)

    def const_value(self, atom: Any) -> Any:
        if not compat.is_literal(atom) and atom in self.bound:
            return self.bound[atom]
        return super().const_value(atom)


def bound_inputs(closed: Any) -> dict:
    """``id(open sub-jaxpr) -> {input var: value}`` for every (nested) sub-jaxpr of
    ``closed`` whose loop-invariant inputs are constants outside it (a sub-jaxpr shared by
    several equations keeps the inputs every one of them binds to the same value)."""
    out: dict = {}
    _visit(Graph(closed), {}, out)
    return out


def _visit(graph: Graph, bound: dict, out: dict) -> None:
    folded: dict = {}
    for eqn in graph.jaxpr.eqns:
        for body, outer in _invariant_inputs(eqn):
            found = {}
            for var, atom in zip(body.invars, outer):
                if atom is not None:
                    value = _value(graph, atom, bound, folded)
                    if value is not None:
                        found[var] = value
            key = id(body)
            if key in out:
                found = {v: x for v, x in found.items()
                         if v in out[key] and np.array_equal(out[key][v], x)}
            out[key] = found
        for _, sub in compat.eqn_subjaxprs(eqn):
            _visit(Graph(sub), out.get(id(compat.open_jaxpr(sub)), {}), out)


def _invariant_inputs(eqn: Any) -> list:
    """``(open body, outer atom or None per body input)`` for each body of ``eqn``: the
    outer operand an input stays equal to on every iteration or call (None for carries
    and scanned slices)."""
    return [(body.jaxpr, list(body.inputs)) for body in compat.bodies(eqn)]


def _value(graph: Graph, atom: Any, bound: dict, folded: dict) -> Any:
    """The value of ``atom`` if it is a constant of ``graph`` (or computed from constants
    alone by plain equations, at most ``_MAX_FOLDED`` elements), else None."""
    if compat.is_literal(atom):
        return np.asarray(compat.literal_value(atom))
    if atom in bound:
        return bound[atom]
    if graph.is_const(atom):
        return np.asarray(graph.const_value(atom))
    if atom in folded:
        return folded[atom]
    eqn = graph.producer(atom)
    value = None
    if eqn is not None and len(eqn.outvars) == 1 and not any(compat.eqn_subjaxprs(eqn)) \
            and not eqn.effects and np.prod(compat.aval_of(atom).shape) <= _MAX_FOLDED:
        args = [_value(graph, x, bound, folded) for x in eqn.invars]
        if all(a is not None for a in args):
            # Evaluated now, even while the user's function is being traced (by jit or grad
            # around the transform): the value is a constant of the program.
            with jax.ensure_compile_time_eval():
                value = np.asarray(eqn.primitive.bind(*args, **eqn.params))
    folded[atom] = value
    return value
