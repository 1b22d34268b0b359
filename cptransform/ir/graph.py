"""``Graph``: a read-only use-def view of a jaxpr, built on networkx.

Nodes are equations (keyed by identity, never by printed variable names); an edge
``producer -> consumer`` carries the variables flowing along it. Sub-jaxprs of an equation
(pjit, scan, while, cond, remat, custom_jvp/vjp bodies) get graphs of their own that know
their parent equation.
"""
from __future__ import annotations

from typing import Any, Iterator

import networkx as nx

from cptransform.ir import compat


class Graph:
    """Use-def queries over one (open or closed) jaxpr."""

    def __init__(self, jaxpr: Any, *, parent: "tuple[Graph, Any] | None" = None):
        self.jaxpr = compat.open_jaxpr(jaxpr)
        self.closed = jaxpr
        self.parent = parent
        self._producer: dict[Any, Any] = {}
        self._users: dict[Any, list] = {}
        self._index: dict[int, int] = {}
        self.nx = nx.MultiDiGraph()
        for i, eqn in enumerate(self.jaxpr.eqns):
            self._index[id(eqn)] = i
            self.nx.add_node(i, eqn=eqn)
            for atom in eqn.invars:
                if compat.is_literal(atom):
                    continue
                self._users.setdefault(atom, []).append(eqn)
                src = self._producer.get(atom)
                if src is not None:
                    self.nx.add_edge(self._index[id(src)], i, var=atom)
            for var in eqn.outvars:
                self._producer[var] = eqn
        self._outvars = {v for v in self.jaxpr.outvars if not compat.is_literal(v)}
        self._subgraphs: dict[int, list[Graph]] = {}

    @property
    def eqns(self) -> list:
        return list(self.jaxpr.eqns)

    @property
    def invars(self) -> list:
        return list(self.jaxpr.invars)

    @property
    def constvars(self) -> list:
        return list(self.jaxpr.constvars)

    @property
    def outvars(self) -> list:
        return list(self.jaxpr.outvars)

    def index(self, eqn: Any) -> int:
        """Position of ``eqn`` in program order."""
        return self._index[id(eqn)]

    def producer(self, atom: Any) -> Any:
        """The equation defining ``atom``, or ``None`` for inputs, constants and literals."""
        if compat.is_literal(atom):
            return None
        return self._producer.get(atom)

    def users(self, atom: Any) -> list:
        """Equations reading ``atom`` (in program order; an equation reading it twice once)."""
        seen, out = set(), []
        for eqn in self._users.get(atom, ()):
            if id(eqn) not in seen:
                seen.add(id(eqn))
                out.append(eqn)
        return out

    def is_output(self, atom: Any) -> bool:
        """Whether ``atom`` is an output of this jaxpr."""
        return atom in self._outvars

    def is_input(self, atom: Any) -> bool:
        return atom in set(self.jaxpr.invars)

    def is_const(self, atom: Any) -> bool:
        return atom in set(self.jaxpr.constvars)

    def const_value(self, atom: Any) -> Any:
        """The value of a constvar (closed jaxprs only), or of a literal."""
        if compat.is_literal(atom):
            return compat.literal_value(atom)
        consts = compat.consts_of(self.closed)
        for var, val in zip(self.jaxpr.constvars, consts):
            if var is atom:
                return val
        raise KeyError("not a constant of this jaxpr")

    def ancestors(self, eqn: Any) -> list:
        """Equations ``eqn`` depends on, in program order."""
        idx = nx.ancestors(self.nx, self.index(eqn))
        return [self.jaxpr.eqns[i] for i in sorted(idx)]

    def descendants(self, eqn: Any) -> list:
        """Equations that depend on ``eqn``, in program order."""
        idx = nx.descendants(self.nx, self.index(eqn))
        return [self.jaxpr.eqns[i] for i in sorted(idx)]

    def subgraphs(self, eqn: Any) -> list["Graph"]:
        """Graphs of ``eqn``'s sub-jaxprs (empty for a plain equation)."""
        key = id(eqn)
        if key not in self._subgraphs:
            self._subgraphs[key] = [Graph(sub, parent=(self, eqn))
                                    for _, sub in compat.eqn_subjaxprs(eqn)]
        return self._subgraphs[key]

    def walk(self) -> Iterator["Graph"]:
        """This graph and every nested sub-jaxpr graph, depth first."""
        yield self
        for eqn in self.jaxpr.eqns:
            for sub in self.subgraphs(eqn):
                yield from sub.walk()

    def __len__(self) -> int:
        return len(self.jaxpr.eqns)
