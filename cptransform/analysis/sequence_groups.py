"""A sequence held by several dims of one value: the patches of an image ``[B, H, W, C]``
(``H·W`` tokens), the frames × patches of a video ``[B, T, P, C]``, an image of pixels
whose rows and columns are cut into patches (``[B, H·p, W·p, 3]``).

The dimension graph of :mod:`cptransform.analysis.seq_axes` has a node per ``(atom,
dim)``; this module adds a node per ``(atom, group)`` (a
:data:`~cptransform.analysis.dim_rules.Group`: dims, major first, each in chunks) where a
reshape merges dims into one or splits one into several (the primitives table's
``groups`` column), and carries each such node through every equation that links all of
its members (elementwise ops, transposes, broadcasts, calls' bodies; the major dim of a
reshape as a chunked member), so a group reaches the inputs the way a dim does. A group is
an ordered tuple: ``(H, W)`` and ``(W, H)`` are two token orders, never one.
"""
from __future__ import annotations

import collections
import math
from typing import Any, Iterable

import networkx as nx

from cptransform.analysis.dim_rules import Group
from cptransform.analysis.primitives import group_links
from cptransform.ir import compat

#: A node of the dimension graph: ``(atom, dim)`` or ``(atom, group)``.
Node = tuple[Any, Any]


def node(atom, group: Group) -> Node:
    """The node of ``group`` of ``atom``: a plain ``(atom, dim)`` for a whole single dim."""
    if len(group) == 1 and group[0][1] == 1:
        return (atom, group[0][0])
    return (atom, tuple(group))


def is_group(n: Node) -> bool:
    return isinstance(n[1], tuple)


def members(n: Node) -> Group:
    """The members of a node (a single dim is one member in chunks of 1)."""
    return n[1] if is_group(n) else ((n[1], 1),)


def size(n: Node) -> int:
    """How many indices the node's axis has (its members' sizes over their chunks)."""
    shape = n[0].aval.shape
    return math.prod(shape[d] // c for d, c in members(n))


def dims(n: Node) -> tuple[int, ...]:
    """The dims of a node, major first."""
    return tuple(d for d, _ in members(n))


class _MemberMap:
    """Per equation, how each ``(atom, dim)`` maps onto the dims of the equation's other
    atoms, with the chunk factor (``member_links`` in both directions)."""

    def __init__(self):
        # atom -> equation index -> other atom id -> list of (dim, other atom, other dim,
        # factor): member (dim, c) is (other dim, c * factor) there.
        self.by_atom: dict = collections.defaultdict(
            lambda: collections.defaultdict(lambda: collections.defaultdict(list)))

    def add(self, index: int, a, da: int, b, db: int, factor) -> None:
        if compat.is_literal(a) or compat.is_literal(b):
            return
        self.by_atom[a][index][id(b)].append((da, b, db, factor))
        self.by_atom[b][index][id(a)].append((db, a, da, 1 / factor if factor != 1 else 1))

    def images(self, n: Node) -> Iterable[Node]:
        """The nodes equal to ``n`` on the other atoms of every equation that links all of
        its members (each to one dim, the dims distinct, the chunks whole)."""
        atom = n[0]
        for per_atom in self.by_atom.get(atom, {}).values():
            for links in per_atom.values():
                mapped = []
                for d, c in members(n):
                    hits = {(b, db, _chunk(c, f, b, db)) for da, b, db, f in links if da == d}
                    hits = {h for h in hits if h[2] is not None}
                    if len(hits) != 1:
                        break
                    mapped.append(next(iter(hits)))
                else:
                    other = mapped[0][0]
                    group = tuple((db, c) for _, db, c in mapped)
                    if len({d for d, _ in group}) == len(group) and other is not atom:
                        yield node(other, group)


def _chunk(c: int, factor, atom, d: int) -> int | None:
    """The chunk ``c * factor`` of a member on dim ``d`` of ``atom``, or None when it is
    not a whole number dividing the dim."""
    value = c * factor
    chunk = int(round(value))
    if chunk < 1 or abs(value - chunk) > 1e-9 or atom.aval.shape[d] % chunk:
        return None
    return chunk


def add_groups(graph: nx.Graph, eqns: list, links_of) -> None:
    """Add to ``graph`` the group nodes of ``eqns``' merges and splits, carried through
    every equation that links their members (``links_of(eqn)``: the equation's plain
    links, bodies included), each linked to the node it equals."""
    members_map = _MemberMap()
    todo = []
    for index, eqn in enumerate(eqns):
        for a, da, b, db in links_of(eqn):
            members_map.add(index, a, da, b, db, 1)
        groups, chunked = group_links(eqn)
        for a, da, b, db, factor in chunked:
            members_map.add(index, a, da, b, db, factor)
        for a, ga, b, gb in groups:
            left, right = node(a, ga), node(b, gb)
            graph.add_edge(left, right)
            todo += [n for n in (left, right) if is_group(n)]
    seen = set(todo)
    while todo:
        current = todo.pop()
        for image in members_map.images(current):
            graph.add_edge(current, image)
            if is_group(image) and image not in seen:
                seen.add(image)
                todo.append(image)


def sharded_dim(shape, group: Group, cp: int) -> int | None:
    """The dim of ``group`` that carries the CP sharding of the merged sequence in
    contiguous shards: its major member, when its tokens (size over chunk) split evenly
    over ``cp`` devices (each device then holds whole patches); ``None`` otherwise (left
    to the partitioner)."""
    d, c = group[0]
    return d if (shape[d] // c) % cp == 0 else None
