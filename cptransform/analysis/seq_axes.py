"""Which dimensions of which values carry the sequence axis.

Every equation relates dimensions of its inputs to dimensions of its outputs ("dim 1 of x
is dim 2 of y"); a table keyed by primitive gives those relations. They form an undirected
graph over ``(value, dim)`` pairs that reaches into sub-jaxprs (scan carries, remat and
custom-derivative bodies, cond branches, while loops). The sequence axis is the connected
component seeded by each attention's q/k/v/out sequence dims (and the two sequence dims of
its mask and bias). Sizes are never used to guess: a dim is sequence-carrying only if the
program's dataflow connects it to attention.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import networkx as nx

from cptransform.ir import compat
from cptransform.op.attention import attention_p
from cptransform.ir.errors import SeqAxisError

Link = tuple[Any, int, Any, int]  # (atom, dim, atom, dim): the two dims are the same axis

ELEMENTWISE = frozenset("""
add sub mul div rem pow max min neg sign floor ceil round is_finite exp exp2 log log1p expm1
tanh logistic sin cos tan asin acos atan atan2 sinh cosh asinh acosh atanh sqrt rsqrt cbrt
abs integer_pow square erf erfc erf_inv lgamma digamma not and or xor eq ne lt le gt ge
select_n convert_element_type clamp nextafter shift_left shift_right_logical
shift_right_arithmetic population_count copy copy_p reduce_precision imag real conj complex
stop_gradient optimization_barrier
""".split())

#: Reductions whose result does not depend on the order of the reduced elements.
ORDER_FREE_REDUCTIONS = frozenset(
    "reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or reduce_xor".split())

def _same_dims(eqn) -> list[Link]:
    out = eqn.outvars[0]
    links = []
    for atom in eqn.invars:
        if compat.is_literal(atom) or atom.aval.ndim != out.aval.ndim:
            continue
        for d in range(out.aval.ndim):
            if atom.aval.shape[d] == out.aval.shape[d]:
                links.append((atom, d, out, d))
    return links


def _broadcast_in_dim(eqn) -> list[Link]:
    x, out = eqn.invars[0], eqn.outvars[0]
    return [(x, i, out, d) for i, d in enumerate(eqn.params["broadcast_dimensions"])
            if x.aval.shape[i] == out.aval.shape[d]]


def reshape_dim_map(in_shape: tuple, out_shape: tuple) -> dict[int, int]:
    """Input dims that survive a reshape unchanged (same size, same position in the
    row-major order of elements), mapped to their output dims. Size-1 dims are ignored."""
    ins = [(i, n) for i, n in enumerate(in_shape) if n != 1]
    outs = [(j, n) for j, n in enumerate(out_shape) if n != 1]
    mapping, a, b = {}, 0, 0
    while a < len(ins) and b < len(outs):
        if ins[a][1] == outs[b][1]:
            mapping[ins[a][0]] = outs[b][0]
            a += 1
            b += 1
            continue
        pi, pj = ins[a][1], outs[b][1]
        a += 1
        b += 1
        while pi != pj:
            if pi < pj:
                pi *= ins[a][1]
                a += 1
            else:
                pj *= outs[b][1]
                b += 1
    return mapping


def _reshape(eqn) -> list[Link]:
    x, out = eqn.invars[0], eqn.outvars[0]
    return [(x, a, out, b) for a, b in reshape_dim_map(x.aval.shape, out.aval.shape).items()]


def _dropping(param: str):
    """Rule for ops that remove the dims listed in ``params[param]`` (squeeze, reductions)."""
    def rule(eqn) -> list[Link]:
        x, out = eqn.invars[0], eqn.outvars[0]
        dropped = set(eqn.params[param])
        kept = [d for d in range(x.aval.ndim) if d not in dropped]
        return [(x, d, out, j) for j, d in enumerate(kept)]
    return rule


def _transpose(eqn) -> list[Link]:
    x, out = eqn.invars[0], eqn.outvars[0]
    return [(x, src, out, dst) for dst, src in enumerate(eqn.params["permutation"])]


def _dot_general(eqn) -> list[Link]:
    lhs, rhs = eqn.invars
    out = eqn.outvars[0]
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    links = []
    for k, (a, b) in enumerate(zip(lb, rb)):
        links += [(lhs, a, out, k), (rhs, b, out, k)]
    pos = len(lb)
    for operand, contract, batch in ((lhs, lc, lb), (rhs, rc, rb)):
        for d in range(operand.aval.ndim):
            if d not in contract and d not in batch:
                links.append((operand, d, out, pos))
                pos += 1
    return [link for link in links if not compat.is_literal(link[0])]


def _gather(eqn) -> list[Link]:
    operand, indices = eqn.invars
    out = eqn.outvars[0]
    dn = eqn.params["dimension_numbers"]
    batch_out = [d for d in range(out.aval.ndim) if d not in dn.offset_dims]
    index_dims = list(range(indices.aval.ndim - 1))
    links = [(indices, i, out, o) for i, o in zip(index_dims, batch_out)]
    for ob, ib in zip(dn.operand_batching_dims, dn.start_indices_batching_dims):
        links.append((operand, ob, out, batch_out[index_dims.index(ib)]))
    sliced = [d for d in range(operand.aval.ndim)
              if d not in dn.collapsed_slice_dims and d not in dn.operand_batching_dims]
    for d, o in zip(sliced, dn.offset_dims):
        if operand.aval.shape[d] == out.aval.shape[o]:
            links.append((operand, d, out, o))
    return links


def _slice_like(eqn) -> list[Link]:
    """Positional ops keep their dims (with new sizes along sliced axes)."""
    x, out = eqn.invars[0], eqn.outvars[0]
    if x.aval.ndim != out.aval.ndim:
        return []
    return [(x, d, out, d) for d in range(x.aval.ndim)]


def _concatenate(eqn) -> list[Link]:
    out = eqn.outvars[0]
    return [(x, d, out, d) for x in eqn.invars if not compat.is_literal(x)
            for d in range(out.aval.ndim)]


def _attention(eqn) -> list[Link]:
    """Attention links its q and out dims (other than seq and features)."""
    spec = eqn.params["spec"]
    q, out = eqn.invars[0], eqn.outvars[0]
    return [(q, d, out, d) for d in range(q.aval.ndim) if d != spec.q.feature]


RULES: dict[str, Callable[[Any], list[Link]]] = {
    **{name: _same_dims for name in ELEMENTWISE},
    "broadcast_in_dim": _broadcast_in_dim,
    "reshape": _reshape,
    "squeeze": _dropping("dimensions"),
    "transpose": _transpose,
    "dot_general": _dot_general,
    "gather": _gather,
    **{name: _dropping("axes") for name in ORDER_FREE_REDUCTIONS | {"argmax", "argmin"}},
    **{name: _same_dims for name in ("cumsum", "cumprod", "cummax", "cummin",
                                      "cumlogsumexp", "rev")},
    **{name: _slice_like for name in ("slice", "dynamic_slice", "pad")},
    "concatenate": _concatenate,
    "attention": _attention,
}


def attention_seeds(eqn) -> list[tuple[Any, int]]:
    """The ``(atom, dim)`` pairs of one attention equation that are the sequence axis."""
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
        rule = RULES.get(eqn.primitive.name)
        links = rule(eqn) if rule else []
        links += _body_links(eqn)
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


def acting_dims(eqn) -> set[int] | None:
    """Input dims along which a positional op indexes (``None``: unknown, assume all).

    A slice of the features or a concatenate of heads is order-free along the sequence even
    though ``slice``/``concatenate`` are positional in general.
    """
    name, params = eqn.primitive.name, eqn.params
    x = eqn.invars[0]
    shape = x.aval.shape
    if name == "slice":
        strides = params.get("strides") or (1,) * len(shape)
        return {d for d in range(len(shape)) if params["start_indices"][d] != 0
                or params["limit_indices"][d] != shape[d] or strides[d] != 1}
    if name == "pad":
        return {d for d, cfg in enumerate(params["padding_config"]) if tuple(cfg) != (0, 0, 0)}
    if name == "concatenate":
        return {params["dimension"]}
    if name in ("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"):
        return {params["axis"]}
    if name == "rev":
        return set(params["dimensions"])
    if name in ("argmax", "argmin"):
        return set(params["axes"])
    if name == "sort":
        return {params["dimension"]}
    if name == "dynamic_slice":
        return {d for d in range(len(shape)) if params["slice_sizes"][d] != shape[d]}
    return None
