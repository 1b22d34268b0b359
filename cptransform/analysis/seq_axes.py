"""Which dimensions of which values carry the sequence axis.

Every equation relates dimensions of its inputs to dimensions of its outputs ("dim 1 of x
is dim 2 of y"); a table keyed by primitive gives those relations. They form an undirected
graph over ``(value, dim)`` pairs that reaches into sub-jaxprs (scan carries, remat and
custom-derivative bodies, cond branches, while loops). The sequence axis is the connected
component seeded by each attention's q/k/v/out sequence dims (and the two sequence dims of
its mask and bias, the query dim of its top-k indices). Sizes are never used to guess: a dim is sequence-carrying only if the
program's dataflow connects it to attention.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

import networkx as nx

from cptransform.analysis.dim_rules import Link
from cptransform.analysis.primitives import seq_links
from cptransform.ir import compat
from cptransform.op.attention import attention_p
from cptransform.ir.errors import SeqAxisError

def attention_seeds(eqn) -> list[tuple[Any, int]]:
    """The ``(atom, dim)`` pairs of one attention equation that are the sequence axis.

    The sinks (one logit per batch entry and head) have none: they are no seed, and
    :func:`~cptransform.analysis.dim_rules.link_attention` links no dim of theirs."""
    spec = eqn.params["spec"]
    operands = dict(zip(spec.operand_names(), eqn.invars))
    seeds = [(operands["q"], spec.q.seq), (operands["k"], spec.k.seq),
             (operands["v"], spec.v.seq), (eqn.outvars[0], spec.q.seq)]
    for name in ("q_positions", "kv_positions", "q_segment_ids", "kv_segment_ids"):
        if name in operands:
            seeds.append((operands[name], operands[name].aval.ndim - 1))
    for name in ("mask", "bias"):
        if name in operands:
            nd = operands[name].aval.ndim
            seeds += [(operands[name], nd - 2), (operands[name], nd - 1)]
    if "topk_indices" in operands:  # its rows are queries; its k dim is no sequence
        seeds.append((operands["topk_indices"], operands["topk_indices"].aval.ndim - 2))
    return [(a, d) for a, d in seeds if not compat.is_literal(a) and a.aval.shape[d] != 1]


def _body_links(eqn) -> list[Link]:
    """Links between an equation's operands/results and its sub-jaxprs' inputs/outputs."""
    name = eqn.primitive.name
    links: list[Link] = []

    def bind(outer, inner, shift=0):
        for o, i in zip(outer, inner):
            if compat.is_literal(o) or compat.is_literal(i):
                continue
            for d in range(i.aval.ndim):
                links.append((o, d + shift, i, d))

    if name == "scan":
        body = compat.open_jaxpr(eqn.params["jaxpr"])
        nc, nk = eqn.params["num_consts"], eqn.params["num_carry"]
        bind(eqn.invars[:nc + nk], body.invars[:nc + nk])
        bind(eqn.invars[nc + nk:], body.invars[nc + nk:], shift=1)
        bind(eqn.outvars[:nk], body.outvars[:nk])
        bind(eqn.outvars[nk:], body.outvars[nk:], shift=1)
        bind(body.invars[nc:nc + nk], body.outvars[:nk])
    elif name == "while":
        body = compat.open_jaxpr(eqn.params["body_jaxpr"])
        cond = compat.open_jaxpr(eqn.params["cond_jaxpr"])
        cn, bn = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
        carry = eqn.invars[cn + bn:]
        bind(eqn.invars[:cn], cond.invars[:cn])
        bind(carry, cond.invars[cn:])
        bind(eqn.invars[cn:cn + bn], body.invars[:bn])
        bind(carry, body.invars[bn:])
        bind(eqn.outvars, body.outvars)
        bind(body.invars[bn:], body.outvars)
    elif name == "cond":
        for branch in eqn.params["branches"]:
            br = compat.open_jaxpr(branch)
            bind(eqn.invars[1:], br.invars)
            bind(eqn.outvars, br.outvars)
    else:
        for _, sub in compat.eqn_subjaxprs(eqn):
            body = compat.open_jaxpr(sub)
            if len(body.invars) == len(eqn.invars) and len(body.outvars) >= len(eqn.outvars):
                bind(eqn.invars, body.invars)
                bind(eqn.outvars, body.outvars[:len(eqn.outvars)])
                break
    return links


@dataclass
class SeqAxes:
    """The result of :func:`infer_seq_axes` for one program.

    ``dims(atom)`` is the set of sequence-carrying dims of a value (of any jaxpr nested in
    the program); ``seq_len`` the attention sequence length; ``attentions`` the
    ``attention_p`` equations.
    """

    seq_len: int | None
    component: set = field(default_factory=set)
    attentions: list = field(default_factory=list)

    def dims(self, atom: Any) -> tuple[int, ...]:
        if compat.is_literal(atom):
            return ()
        return tuple(d for d in range(atom.aval.ndim) if (atom, d) in self.component)

    def full_dims(self, atom: Any) -> tuple[int, ...]:
        """Sequence dims whose size is the whole sequence (shardable, permutable)."""
        return tuple(d for d in self.dims(atom) if atom.aval.shape[d] == self.seq_len)

    def carries(self, atom: Any) -> bool:
        return bool(self.dims(atom))


def _walk(jaxpr) -> Iterable[Any]:
    for eqn in compat.open_jaxpr(jaxpr).eqns:
        yield eqn
        for _, sub in compat.eqn_subjaxprs(eqn):
            yield from _walk(sub)


def infer_seq_axes(closed: Any, overrides: dict[int, tuple[int, ...]] | None = None) -> SeqAxes:
    """Infer sequence-carrying dims of every value of ``closed``.

    ``overrides`` maps a flat input index to its sequence dims (``()`` = none); such inputs
    are seeded (or cut off) explicitly, the rest follows from dataflow.
    """
    graph = nx.Graph()
    seeds: list[tuple[Any, int]] = []
    attentions = []
    for eqn in _walk(closed):
        links = seq_links(eqn) + _body_links(eqn)
        for a, da, b, db in links:
            graph.add_edge((a, da), (b, db))
        if eqn.primitive is attention_p:
            attentions.append(eqn)
            seeds += attention_seeds(eqn)
    jaxpr = compat.open_jaxpr(closed)
    blocked = set()
    for index, dims in (overrides or {}).items():
        var = jaxpr.invars[index]
        seeds += [(var, d) for d in dims]
        blocked |= {(var, d) for d in range(var.aval.ndim) if d not in dims}
    lengths = {a.aval.shape[d] for a, d in seeds if (a, d) not in blocked}
    seq_lens = {e.invars[0].aval.shape[e.params["spec"].q.seq] for e in attentions}
    for e in attentions:
        spec = e.params["spec"]
        tq = e.invars[0].aval.shape[spec.q.seq]
        tk = e.invars[1].aval.shape[spec.k.seq]
        if tq != tk:
            raise NotImplementedError(
                f"attention at {compat.source_line(e)} has {tq} queries and {tk} keys "
                "(cross-attention or KV cache): context parallelism needs self-attention "
                "over one sequence; leave it out of the transformed function")
    if len(seq_lens) > 1:
        raise SeqAxisError(
            f"attentions use different sequence lengths {sorted(seq_lens)}; cptransform "
            "shards one sequence axis — transform each part separately")
    seq_len = next(iter(seq_lens), None) or (min(lengths) if lengths else None)
    graph.remove_nodes_from(blocked)
    component: set = set()
    for seed in seeds:
        if seed in blocked or seed in component:
            continue
        component.add(seed)
        if seed in graph:
            component |= nx.node_connected_component(graph, seed)
    return SeqAxes(seq_len, component, attentions)
