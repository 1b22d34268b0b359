"""Which dimensions of which values carry the sequence axis.

Every equation relates dimensions of its inputs to dimensions of its outputs ("dim 1 of x
is dim 2 of y"); a table keyed by primitive gives those relations. They form an undirected
graph over ``(value, dim)`` pairs that reaches into sub-jaxprs (scan carries, remat and
custom-derivative bodies, cond branches, while loops). Each connected component seeded by
an attention's q/out (query side) or k/v (key side) sequence dims, their positions and
segment ids, the two sequence dims of its mask and bias, and the query dim of its top-k
indices, is one *sequence*: one for a self-attention program, two for an encoder-decoder (queries of the decoder, keys of the
encoder). Sizes are never used to guess: a dim is sequence-carrying only if the program's
dataflow connects it to attention, and two sequences of equal length stay two.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any, Iterable

import networkx as nx

from cptransform.analysis.dim_rules import Group, Link
from cptransform.analysis.primitives import seq_links
from cptransform.analysis.sequence_groups import add_groups, is_group, node, size
from cptransform.ir import compat
from cptransform.op.attention import attention_p
from cptransform.op.attention_spec import ROLES
from cptransform.op.recurrence import recurrence_p
from cptransform.op.operand_roles import Side
from cptransform.ir.errors import SeqAxisError


def attention_sides(eqn) -> tuple[list[tuple[Any, int]], list[tuple[Any, int]]]:
    """The ``(atom, dim)`` pairs of one attention equation that are its query sequence (q,
    the output, every query-side operand, the rows of mask, bias and top-k indices) and its
    key sequence (k, v, every key-side operand, the mask's and bias's columns), read from
    the operands' roles (:data:`~cptransform.op.attention_spec.ROLES`). The top-k ``k`` dim
    is no sequence; the sinks and the dropout seed (per head) have none, and
    :func:`~cptransform.analysis.dim_rules.link_attention` links none of theirs."""
    spec = eqn.params["spec"]
    operands = dict(zip(spec.operand_names(), eqn.invars))
    q_side = [(operands["q"], spec.q.seq), (eqn.outvars[0], spec.q.seq)]
    kv_side = [(operands["k"], spec.k.seq), (operands["v"], spec.v.seq)]
    for role in ROLES.values():
        x = operands.get(role.operand) if role.operand else None
        if x is None or role.side is Side.HEADS:
            continue
        nd = x.aval.ndim
        if role.per_token:
            (q_side if role.side is Side.QUERY else kv_side).append((x, nd - 1))
            continue
        # Rows: a pair mask or bias ``[..., Tq, Tkv]``, top-k picks ``[..., Tq, k]``.
        q_side.append((x, nd - 2))
        if role.columns:
            kv_side.append((x, nd - 1))
    keep = lambda seeds: [(a, d) for a, d in seeds  # noqa: E731
                          if not compat.is_literal(a) and a.aval.shape[d] != 1]
    return keep(q_side), keep(kv_side)


def _body_links(eqn) -> list[Link]:
    """Links between an equation's operands/results and its sub-jaxprs' inputs/outputs."""
    name = eqn.primitive.name
    links: list[Link] = []

    def bind(outer, inner, shift=0):
        for o, i in zip(outer, inner):
            if o is None or compat.is_literal(o) or compat.is_literal(i):
                continue
            for d in range(i.aval.ndim):
                links.append((o, d + shift, i, d))

    bodies = compat.bodies(eqn)
    if name not in ("scan", "while", "cond"):
        bodies = bodies[:1]
    for body in bodies:
        bind(body.inputs, body.jaxpr.invars)
        bind(body.carry_init, body.carry_in)
        bind(body.carry_in, body.carry_out)
        for outer, inner in body.scanned_in + body.scanned_out:
            bind([outer], [inner], shift=1)
        for outer, inner in body.outputs:
            bind([outer], [inner])
    return links


@dataclass
class SeqAxes:
    """The result of :func:`infer_seq_axes` for one program.

    A program holds one or more *sequences*: each is one connected component of the
    dimension graph, seeded by attention operands (a query side and a key side that
    dataflow does not connect are two sequences — cross-attention — whatever their sizes;
    sizes are never evidence). ``lengths[i]`` is sequence ``i``'s length, ``sequence`` maps
    each sequence-carrying ``(atom, dim)`` to its sequence; ``attentions`` are the
    ``attention_p`` equations.
    """

    lengths: tuple[int, ...] = ()
    sequence: dict = field(default_factory=dict)
    attentions: list = field(default_factory=list)
    grouped: dict = field(default_factory=dict)  # atom -> its group nodes in a sequence

    @property
    def seq_len(self) -> int | None:
        """The sequence length when the program has exactly one sequence, else ``None``."""
        return self.lengths[0] if len(self.lengths) == 1 else None

    def dims(self, atom: Any) -> tuple[int, ...]:
        if compat.is_literal(atom):
            return ()
        return tuple(d for d in range(atom.aval.ndim) if (atom, d) in self.sequence)

    def full_dims(self, atom: Any) -> tuple[int, ...]:
        """Sequence dims whose size is the whole of their sequence (shardable, permutable)."""
        return tuple(d for d in self.dims(atom)
                     if atom.aval.shape[d] == self.lengths[self.sequence[(atom, d)]])

    def carries(self, atom: Any) -> bool:
        return bool(self.dims(atom))

    def groups(self, atom: Any) -> tuple[Group, ...]:
        """Groups of dims of ``atom`` that hold a whole sequence together, each major first
        (see :mod:`~cptransform.analysis.sequence_groups`): ``((1, 1), (2, 1))`` for the
        patches of ``[B, H, W, C]`` merged into ``H·W`` tokens."""
        if compat.is_literal(atom):
            return ()
        return tuple(n[1] for n in self.grouped.get(atom, ())
                     if size(n) == self.lengths[self.sequence[n]])


def _add_links(graph: nx.Graph, eqn) -> None:
    for a, da, b, db in seq_links(eqn) + _body_links(eqn):
        graph.add_edge((a, da), (b, db))


def linked_dims(closed: Any, seeds: Iterable[tuple[Any, int]],
                candidates: Iterable[tuple[Any, int]]) -> set:
    """The ``(atom, dim)`` pairs of ``candidates`` that dataflow connects to one of
    ``seeds`` (the dimension graph of :func:`infer_seq_axes`, over every sub-jaxpr)."""
    graph = nx.Graph()
    for eqn in _walk(closed):
        _add_links(graph, eqn)
    reached: set = set()
    for seed in seeds:
        if seed in graph and seed not in reached:
            reached |= nx.node_connected_component(graph, seed)
        reached.add(seed)
    return {c for c in candidates if c in reached}


def _assign(graph: nx.Graph, seeds: list) -> tuple[dict, list] | None:
    """Each connected component holding seeds is one sequence; ``None`` when a component
    holds seeds of two sizes (sequences derived from one another: :func:`_assign_derived`)."""
    sequence: dict = {}
    lengths: list[int] = []
    for seed in seeds:
        length = size(seed)
        if seed in sequence:
            if length != lengths[sequence[seed]]:
                return None
            continue
        index = len(lengths)
        lengths.append(length)
        members = nx.node_connected_component(graph, seed) if seed in graph else set()
        for member in members | {seed}:
            sequence[member] = index
    return sequence, lengths


def _assign_derived(graph: nx.Graph, seeds: list) -> tuple[dict, list]:
    """Sequences derived from one another by a slice, pad or concatenation: a
    multi-token-prediction block attending over ``h[:, :-1]`` beside the model's ``h``,
    or one attention whose keys are its queries' tokens written into a longer KV cache
    (a pad, a ``dynamic_update_slice``) or concatenated to a cache. Each sequence is
    seeded over the links that keep a dim's size, then extended over the size-changing
    ones to the dims no sequence holds; an attention whose two sides land in two
    sequences is a cross-attention between them, each sharded on its own, the
    size-changing ops between them partitioned in natural order."""
    same_size = nx.Graph()
    same_size.add_nodes_from(graph.nodes)
    same_size.add_edges_from((a, b) for a, b in graph.edges if size(a) == size(b))
    # Over size-keeping links alone no component holds two sizes.
    sequence, lengths = _assign(same_size, seeds)
    # Breadth first from every dim the sequences hold at once: a dim reached from two
    # joins the one fewest links away (the lower sequence on a tie).
    queue = collections.deque(node for node, _ in sorted(sequence.items(),
                                                         key=lambda item: item[1]))
    while queue:
        node = queue.popleft()
        for other in graph.neighbors(node) if node in graph else ():
            if other not in sequence:
                sequence[other] = sequence[node]
                queue.append(other)
    return sequence, lengths


def _walk(jaxpr) -> Iterable[Any]:
    for eqn in compat.open_jaxpr(jaxpr).eqns:
        yield eqn
        for _, sub in compat.eqn_subjaxprs(eqn):
            yield from _walk(sub)


def infer_seq_axes(closed: Any, overrides: dict[int, tuple] | None = None) -> SeqAxes:
    """Infer sequence-carrying dims of every value of ``closed``, sequence by sequence.

    ``overrides`` maps a flat input index to its sequence dims (``()`` = none; an entry
    that is a :data:`~cptransform.analysis.dim_rules.Group` is dims merged into one
    sequence); such inputs are seeded (or cut off) explicitly, the rest follows from
    dataflow, through merges and splits of dims too
    (:mod:`~cptransform.analysis.sequence_groups`). Two seeds of one component with
    different sizes are sequences derived from one another by a slice, a pad or a
    concatenation (:func:`_assign_derived`).
    """
    graph = nx.Graph()
    seeds: list = []
    attentions = []
    eqns = list(_walk(closed))
    for eqn in eqns:
        _add_links(graph, eqn)
        if eqn.primitive is attention_p:
            attentions.append(eqn)
            # The operands of one side are one sequence by the attention's own meaning
            # (a mask input's rows are the queries), whatever dataflow says.
            for side in attention_sides(eqn):
                graph.add_edges_from(zip(side, side[1:]))
                seeds += side
    add_groups(graph, eqns, lambda eqn: seq_links(eqn) + _body_links(eqn))
    jaxpr = compat.open_jaxpr(closed)
    recurrences = [] if attentions or overrides else recurrence_seeds(closed)
    seeds += [seed for _, seed in recurrences]
    blocked = set()
    for index, dims in (overrides or {}).items():
        var = jaxpr.invars[index]
        given = [node(var, d) if isinstance(d, tuple) else (var, d) for d in dims]
        seeds += given
        blocked |= {(var, d) for d in range(var.aval.ndim)} - set(given)
        blocked |= {n for n in graph.nodes if n[0] is var and is_group(n)} - set(given)
    graph.remove_nodes_from(blocked)
    seeds = [seed for seed in seeds if seed not in blocked]
    assigned = _assign(graph, seeds)
    if recurrences and (assigned is None or len(assigned[1]) > 1):
        raise _several_axes(recurrences, graph)
    sequence, lengths = assigned or _assign_derived(graph, seeds)
    grouped: dict = {}
    for n in sequence:
        if is_group(n):
            grouped.setdefault(n[0], []).append(n)
    return SeqAxes(tuple(lengths), sequence, attentions, grouped)


def recurrence_seeds(closed: Any) -> list[tuple[Any, tuple[Any, int]]]:
    """``(equation, (atom, dim))`` for the axis of every operand and result a recurrence
    runs along: a program without attention is sharded along its recurrences."""
    seeds = []
    for eqn in _walk(closed):
        if eqn.primitive is not recurrence_p:
            continue
        rec = eqn.params["recurrence"]
        atoms = [x for x, it in zip(eqn.invars, rec.iterated) if it] + \
            [y for y, it in zip(eqn.outvars, rec.iterated_out) if it]
        seeds += [(eqn, (a, rec.axis)) for a in atoms if not compat.is_literal(a)]
    return seeds


def _several_axes(recurrences: list, graph: nx.Graph) -> SeqAxisError:
    """A program without attention whose recurrences run along several unlinked axes:
    which is the sequence is the user's to say."""
    groups: dict = {}
    for eqn, seed in recurrences:
        component = frozenset(nx.node_connected_component(graph, seed)) if seed in graph \
            else frozenset({seed})
        groups.setdefault(component, []).append((eqn, seed))
    where = "; ".join(
        f"{eqn.params['recurrence'].describe()} at {compat.source_line(eqn)} "
        f"(length {seed[0].aval.shape[seed[1]]})" for members in groups.values()
        for eqn, seed in members[:1])
    return SeqAxisError(
        f"the function has no attention, and its recurrences run along {len(groups)} "
        f"different axes: {where}; pass seq_axes= to say which input dims are the sequence")
