"""Pattern rules as data: small composable matchers over a :class:`~cptransform.ir.graph.Graph`.

A :class:`Pat` describes the equation that produces a value: its primitive(s), patterns
for its operands, a name under which the matched value is captured, and an optional
predicate. Unary "wrapper" primitives listed in ``skip`` are looked through first, so
``Pat("reduce_max", ..., skip=WRAPPERS)`` also matches ``stop_gradient(broadcast(max(x)))``.

    row_max = Pat("reduce_max", (Pat.any("x"),), name="max")
    centred = Pat("sub", (Pat.any("logits"), row_max.through(WRAPPERS)))
    captures = centred.match(graph, var)      # {"logits": var, "x": var, "max": var} or None

Captures map names to atoms (variables or literals); ``captures["<name>.eqn"]`` holds the
equation that produced a named non-leaf value.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable

from cptransform.ir import compat
from cptransform.ir.graph import Graph

Predicate = Callable[[Graph, Any, dict], bool]


def _prims(spec: str | Iterable[str] | None) -> frozenset[str] | None:
    if spec is None:
        return None
    return frozenset([spec]) if isinstance(spec, str) else frozenset(spec)


@dataclass(frozen=True)
class Pat:
    """Matches an atom by the equation producing it (``prims=None``: matches any atom).

    ``operands``: patterns for the equation's inputs, in order (``None``: not checked);
    ``commutative``: also try the two operands swapped; ``literal``: the atom must be a
    literal or constant scalar; ``where(graph, atom, captures)`` must hold.
    """

    prims: frozenset[str] | None = None
    operands: tuple["Pat", ...] | None = None
    name: str | None = None
    where: Predicate | None = None
    skip: frozenset[str] = frozenset()
    commutative: bool = False
    literal: bool = False

    def __init__(self, prims=None, operands=None, name=None, where=None, skip=(),
                 commutative=False, literal=False):
        object.__setattr__(self, "prims", _prims(prims))
        object.__setattr__(self, "operands", None if operands is None else tuple(operands))
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "where", where)
        object.__setattr__(self, "skip", frozenset(skip))
        object.__setattr__(self, "commutative", commutative)
        object.__setattr__(self, "literal", literal)

    @classmethod
    def any(cls, name: str | None = None, where: Predicate | None = None) -> "Pat":
        """Any atom, captured as ``name``."""
        return cls(None, name=name, where=where)

    @classmethod
    def scalar(cls, name: str | None = None, where: Callable[[Any], bool] | None = None) -> "Pat":
        """A literal scalar whose value satisfies ``where(value)``."""
        test = None if where is None else (lambda g, a, c: where(compat.literal_value(a)))
        return cls(None, name=name, where=test, literal=True)

    def through(self, wrappers: Iterable[str]) -> "Pat":
        """This pattern, looking through any chain of the unary ``wrappers`` first."""
        return replace(self, skip=self.skip | frozenset(wrappers))

    def match(self, graph: Graph, atom: Any, captures: dict | None = None) -> dict | None:
        """Captures when ``atom`` matches, else ``None``."""
        caps = dict(captures or {})
        return caps if self._match(graph, atom, caps) else None

    def _match(self, graph: Graph, atom: Any, caps: dict) -> bool:
        if self.skip:
            atom = look_through(graph, atom, self.skip)
        if self.literal and not compat.is_literal(atom):
            return False
        eqn = None
        if self.prims is not None:
            eqn = graph.producer(atom)
            if eqn is None or eqn.primitive.name not in self.prims:
                return False
            if self.operands is not None and not self._match_operands(graph, eqn, caps):
                return False
        if self.name is not None:
            if self.name in caps and caps[self.name] is not atom:
                return False
            caps[self.name] = atom
            if eqn is not None:
                caps[self.name + ".eqn"] = eqn
        return self.where is None or bool(self.where(graph, atom, caps))

    def _match_operands(self, graph: Graph, eqn: Any, caps: dict) -> bool:
        ins = list(eqn.invars)
        if len(ins) != len(self.operands):
            return False
        orders = [ins, ins[::-1]] if self.commutative and len(ins) == 2 else [ins]
        for order in orders:
            trial = dict(caps)
            if all(p._match(graph, a, trial) for p, a in zip(self.operands, order)):
                caps.clear()
                caps.update(trial)
                return True
        return False


def one_of(*pats: Pat) -> "Alt":
    """The first of ``pats`` that matches."""
    return Alt(pats)


@dataclass(frozen=True)
class Alt:
    """Alternatives, tried in order; usable wherever a :class:`Pat` is."""

    pats: tuple

    def match(self, graph: Graph, atom: Any, captures: dict | None = None) -> dict | None:
        for p in self.pats:
            out = p.match(graph, atom, captures)
            if out is not None:
                return out
        return None

    def _match(self, graph: Graph, atom: Any, caps: dict) -> bool:
        out = self.match(graph, atom, caps)
        if out is None:
            return False
        caps.update(out)
        return True

    def through(self, wrappers: Iterable[str]) -> "Alt":
        return Alt(tuple(p.through(wrappers) for p in self.pats))


def look_through(graph: Graph, atom: Any, wrappers: frozenset[str]) -> Any:
    """Follow ``atom`` back through single-input equations whose primitive is in ``wrappers``."""
    while True:
        eqn = graph.producer(atom)
        if eqn is None or eqn.primitive.name not in wrappers or len(eqn.invars) != 1:
            return atom
        atom = eqn.invars[0]
