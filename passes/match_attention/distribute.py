"""Before matching, ``(Σ cᵢ·pᵢ) @ v`` becomes ``Σ cᵢ·(pᵢ @ v)`` when every ``pᵢ`` is a
softmax's probabilities (``match-attention{distribute=true}``, the default).

Differential attention (the Diff Transformer) combines two attention maps before one value
product: ``(softmax(q₁k₁ᵀ) - λ·softmax(q₂k₂ᵀ)) @ v``, or, as its reference code spells it,
one softmax over twice the heads viewed as ``[B, H, 2, Q, K]`` whose two halves are
combined. The matcher reads an attention as a softmax whose probabilities reach one value
product, so it would leave such a combination whole (exact, but the whole ``S×S`` work on
every device). So the product is distributed over the combination first:

* each distinct softmax then has a value product of its own and is an attention;
* the halves of a viewed softmax share one product over the view (the split of the heads is
  a head group, as in grouped-query attention) whose output is indexed per half, so the
  work is done once.

A combination is a tree of ``add``/``sub``/``neg`` and multiplications by *coefficients*:
values constant along the product's contracting (key) dim — a scalar ``λ``, a per-head
``λ_h`` broadcast over the other dims. A leaf is a softmax's probabilities, cast, maybe
viewed by a reshape that keeps the key dim, and maybe one size-1 slice squeezed away per
picked dim. Nothing is distributed unless every leaf is one, there are at least two, and
nothing outside the tree reads its intermediate values (the matcher could not use the
result otherwise).

Numbers: exact in real arithmetic; in floating point the sums associate differently
(rounding level). One non-finite case differs from the written program: an infinite value
in ``v`` meets two finite weights as ``∞ - ∞ = NaN`` where the combined weight times ``∞``
is ``±∞`` (docs/contract.md). ``match-attention{distribute=false}`` keeps the combination.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from jax import lax

from cptransform.analysis.dim_rules import reshape_groups
from cptransform.analysis.primitives import INLINABLE, Moves, moving
from cptransform.ir import compat
from cptransform.ir.graph import Graph
from cptransform.ir.rewrite import Replacement, Rewriter
from cptransform.passes.match_attention.anchor import is_normalizer, softmaxes
from cptransform.passes.match_attention.log_normalized import log_normalized
from cptransform.passes.match_attention.stats import NotAttention

_CASTS = moving(Moves.CAST)
#: Sign of each operand of the linear equations a combination is built from.
_SIGNS = {"add": (1, 1), "sub": (1, -1), "neg": (-1,)}
#: How many casts, squeezes and multiplications :func:`_combines` looks through.
_SEARCH_DEPTH = 4


@dataclass(frozen=True)
class Coefficient:
    """A factor ``value`` broadcast onto the combination's dims ``dims`` (one per dim of
    ``value``; ``()`` for a scalar)."""

    value: Any
    dims: tuple


@dataclass(frozen=True)
class Term:
    """``sign · Π coefficients · select(base)``: ``base`` is a softmax's probabilities or a
    view of them (a reshape of ``source``, else ``source`` is ``None``); ``picks`` the
    ``(dim of base, index)`` slices squeezed away to give the combination's dims (the other
    dims of ``base``, in order)."""

    sign: int
    coefficients: tuple
    base: Any
    picks: tuple
    source: Any = None


def _probabilities(graph: Graph) -> set:
    """The softmax probabilities of ``graph`` over its last dim (``e / sum`` or
    ``exp(x - logsumexp)``)."""
    found = set()
    for softmax in softmaxes(graph):
        if softmax.axis != len(compat.aval_of(softmax.e).shape) - 1:
            continue
        ident = tuple(range(len(compat.aval_of(softmax.e).shape)))
        users = [u for u in graph.users(softmax.e) if u is not softmax.sum_eqn]
        if not users:
            try:
                found.add(log_normalized(graph, softmax))
            except NotAttention:
                pass
        for user in users:
            if user.primitive.name == "div" and user.invars[0] is softmax.e and \
                    is_normalizer(graph, user.invars[1], softmax, ident):
                found.add(user.outvars[0])
    return found


class _Reader:
    """Reads the combination feeding one operand of a value product."""

    def __init__(self, graph: Graph, probs: set, contracting: int):
        self.g = graph
        self.probs = probs
        self.contracting = contracting
        #: The equations of the tree (each must only feed the tree).
        self.eqns: list = []

    def terms(self, atom: Any, sign: int = 1, coefficients: tuple = ()) -> list[Term] | None:
        """The terms ``atom`` adds up to, or ``None`` when it is no combination of
        probabilities."""
        eqn = self.g.producer(atom)
        if eqn is None:
            return None
        name = eqn.primitive.name
        if name in _SIGNS:
            self.eqns.append(eqn)
            out = []
            for operand, s in zip(eqn.invars, _SIGNS[name]):
                part = self.terms(operand, sign * s, coefficients)
                if part is None:
                    return None
                out += part
            return out
        if name == "mul":
            for factor, rest in (eqn.invars, eqn.invars[::-1]):
                coefficient = self._coefficient(factor, atom)
                if coefficient is not None:
                    self.eqns.append(eqn)
                    return self.terms(rest, sign, coefficients + (coefficient,))
            return None
        term = self._leaf(atom, sign, coefficients)
        return None if term is None else [term]

    def _coefficient(self, atom: Any, of: Any) -> Coefficient | None:
        """``atom`` as a factor of ``of`` constant along the contracting dim (a scalar, or
        a value of ``of``'s rank, maybe broadcast, of size 1 there), or ``None``."""
        shape = compat.aval_of(atom).shape
        if not shape:
            return Coefficient(atom, ())
        if len(shape) != len(compat.aval_of(of).shape):
            return None
        value, dims = atom, tuple(range(len(shape)))
        eqn = self.g.producer(atom)
        if eqn is not None and eqn.primitive.name == "broadcast_in_dim":
            value, dims = eqn.invars[0], tuple(eqn.params["broadcast_dimensions"])
        sizes = compat.aval_of(value).shape
        if any(d == self.contracting and n != 1 for d, n in zip(dims, sizes)):
            return None
        return Coefficient(value, dims)

    def _leaf(self, atom: Any, sign: int, coefficients: tuple) -> Term | None:
        """A cast, picked, viewed softmax output; ``None`` for anything else."""
        chain = []
        atom = self._through_casts(atom, chain)
        picks: tuple = ()
        eqn = self.g.producer(atom)
        if eqn is not None and eqn.primitive.name == "squeeze":
            picks = self._picks(eqn)
            if picks is None:
                return None
            sliced = self.g.producer(eqn.invars[0])
            chain += [eqn, sliced]
            atom = self._through_casts(sliced.invars[0], chain)
        base, source = atom, None
        eqn = self.g.producer(atom)
        if eqn is not None and eqn.primitive.name == "reshape":
            source = eqn.invars[0]
            if compat.aval_of(source).shape[-1:] != compat.aval_of(atom).shape[-1:]:
                return None
            chain.append(eqn)
            atom = self._through_casts(source, chain)
        if atom not in self.probs:
            return None
        self.eqns += chain
        return Term(sign, coefficients, base, picks, source)

    def _through_casts(self, atom: Any, chain: list) -> Any:
        while (eqn := self.g.producer(atom)) is not None and eqn.primitive.name in _CASTS:
            chain.append(eqn)
            atom = eqn.invars[0]
        return atom

    def _picks(self, squeeze: Any) -> tuple | None:
        """``((dim, index), ...)`` of a squeeze of a slice that keeps one index of each
        squeezed dim (not the last) and every index of the others; ``None`` otherwise."""
        sliced = self.g.producer(squeeze.invars[0])
        if sliced is None or sliced.primitive.name != "slice" or \
                any(s not in (None, 1) for s in (sliced.params.get("strides") or ())):
            return None
        shape = compat.aval_of(sliced.invars[0]).shape
        squeezed = tuple(int(d) for d in squeeze.params["dimensions"])
        starts, limits = sliced.params["start_indices"], sliced.params["limit_indices"]
        for d, n in enumerate(shape):
            whole = starts[d] == 0 and limits[d] == n
            if (d in squeezed) == whole and not (d in squeezed and n == 1):
                return None
        if len(shape) - 1 in squeezed:
            return None
        return tuple((d, int(starts[d])) for d in squeezed)

    def self_contained(self, root: Any) -> bool:
        """Whether every value of the tree is read only inside it (or by ``root``)."""
        inside = {id(e) for e in self.eqns} | {id(root)}
        for eqn in self.eqns:
            for var in eqn.outvars:
                if self.g.is_output(var) or \
                        any(id(u) not in inside for u in self.g.users(var)):
                    return False
        return True


def _distribution(graph: Graph, probs: set, eqn: Any) -> Replacement | None:
    """The replacement distributing value product ``eqn`` over a combination of
    probabilities in one of its operands, or ``None``."""
    (lc, rc), _ = eqn.params["dimension_numbers"]
    for side, contracting in ((0, lc), (1, rc)):
        x = eqn.invars[side]
        rank = len(compat.aval_of(x).shape)
        if tuple(contracting) != (rank - 1,):
            continue
        combination, squeezed, wrappers = _unwrapped(graph, x)
        reader = _Reader(graph, probs, len(compat.aval_of(combination).shape) - 1)
        reader.eqns += wrappers
        terms = reader.terms(combination)
        if terms is None or len(terms) < 2 or not reader.self_contained(eqn) or \
                reader.contracting in squeezed:
            continue
        if squeezed:
            terms = [_squeezed(t, squeezed) for t in terms]
        return _replacement(eqn, side, terms, squeezed)
    return None


def _unwrapped(graph: Graph, x: Any) -> tuple[Any, tuple, list]:
    """``(combination, dims of it squeezed, equations)``: ``x`` seen through casts and one
    squeeze of size-1 dims (``jnp.matmul`` squeezes a batch of one)."""
    eqns, squeezed = [], ()
    while (eqn := graph.producer(x)) is not None:
        if eqn.primitive.name in _CASTS:
            pass
        elif eqn.primitive.name == "squeeze" and not squeezed:
            squeezed = tuple(sorted(int(d) for d in eqn.params["dimensions"]))
        else:
            break
        eqns.append(eqn)
        x = eqn.invars[0]
    return x, squeezed, eqns


def _squeezed(term: Term, squeezed: tuple) -> Term:
    """``term`` with the size-1 dims ``squeezed`` (of the combination) picked at 0."""
    kept = [d for d in range(len(compat.aval_of(term.base).shape))
            if d not in dict(term.picks)]
    picks = tuple(sorted(term.picks + tuple((kept[d], 0) for d in squeezed)))
    return dataclasses.replace(term, picks=picks)


@dataclass(frozen=True)
class _Product:
    """The value product ``eqn`` (its combination on operand ``side``) in the terms of one
    base: ``x_batch`` the combination's batch dims, ``v_contract``/``v_batch`` ``v``'s."""

    eqn: Any
    side: int
    x_batch: tuple
    v_contract: tuple
    v_batch: tuple
    dtype: Any

    def dot(self, p, v, p_batch, v_batch):
        """``p @ v`` contracting ``p``'s last dim, batched over the given dims, with the
        written product's params and operand order (batch dims come first in the result)."""
        contract = ((p.ndim - 1,), self.v_contract)
        batch = (tuple(p_batch), tuple(v_batch))
        args = [p.astype(self.dtype), v]
        if self.side == 1:
            contract, batch, args = contract[::-1], batch[::-1], args[::-1]
        params = dict(self.eqn.params, dimension_numbers=(contract, batch))
        return compat.bind_eqn(self.eqn, args, params)[0]

    def of(self, term: Term, base, v, source=None):
        """``(y, axes)``: the product of the whole base with ``v``, once for all the terms
        with the same base and picked dims, and the axis of ``y`` each picked base dim is
        (index ``y`` there with :func:`_picked`).

        A picked dim becomes a batch dim against ``v`` broadcast along it. A view that
        split one of the softmax's dims (the reference code's ``[B, 2H, Q, K]`` seen as
        ``[B, H, 2, Q, K]``) is undone where every part of the split is then batch, so
        the product reads the softmax itself, as the matcher needs."""
        picked = [d for d, _ in term.picks]
        kept = [d for d in range(base.ndim) if d not in picked]
        bb = [kept[x] for x in self.x_batch]
        split = None if source is None else _split(source.shape, base.shape, picked, bb)
        if split is None:
            y = self.dot(base, _widened(v, [base.shape[d] for d in picked]), bb + picked,
                         list(self.v_batch) + list(range(v.ndim, v.ndim + len(picked))))
            return y, {d: len(bb) + i for i, d in enumerate(picked)}
        return self._undone(split, bb, picked, source, base.shape, v)

    def _undone(self, split, bb, picked, source, base_shape, v):
        """The product over ``source`` (the view undone): the split dim is a batch dim
        (at its kept part's place, else after the others), the picks outside it (size-1
        dims) batch dims after those; then the split dim is split again."""
        dim, parts, to_source = split
        extra = [d for d in picked if d not in parts]
        kept = [b for b in bb if b in parts]
        p_batch = [to_source[b] for b in bb]
        v_batch = list(self.v_batch)
        if kept:
            at = bb.index(kept[0])
            vk = self.v_batch[at]
            sizes = list(v.shape[:vk]) + [base_shape[p] for p in parts] + \
                list(v.shape[vk + 1:])
            where = list(range(vk)) + [vk + parts.index(kept[0])] + \
                list(range(vk + len(parts), len(sizes)))
            v = lax.broadcast_in_dim(v, tuple(sizes), tuple(where)).reshape(
                v.shape[:vk] + (source.shape[dim],) + v.shape[vk + 1:])
        else:
            at = len(bb)
            v = _widened(v, [source.shape[dim]])
            p_batch, v_batch = p_batch + [dim], v_batch + [v.ndim - 1]
        wide = _widened(v, [1] * len(extra))
        y = self.dot(source, wide, p_batch + [to_source[d] for d in extra],
                     v_batch + list(range(v.ndim, wide.ndim)))
        y = y.reshape(y.shape[:at] + tuple(base_shape[p] for p in parts) + y.shape[at + 1:])
        axes = {p: at + i for i, p in enumerate(parts)}
        first_extra = len(p_batch) + len(parts) - 1
        axes.update({d: first_extra + i for i, d in enumerate(extra)})
        return y, axes


def _widened(v, sizes: list):
    """``v`` broadcast along new trailing dims of ``sizes``."""
    return lax.broadcast_in_dim(v, v.shape + tuple(sizes), tuple(range(v.ndim))) \
        if sizes else v


def _picked(y, axes: dict, picks: tuple):
    """A term's value from its base's product :meth:`_Product.of`: indexed at its picks."""
    for dim, index in sorted(picks, key=lambda pick: -axes[pick[0]]):
        y = lax.index_in_dim(y, index, axes[dim], keepdims=False)
    return y


def _split(source_shape: tuple, base_shape: tuple, picked: list, bb: list):
    """``(source dim, base dims it is split into, base dim -> source dim)`` when the view
    keeps every dim but one, which it splits into parts that are all picked or batch dims
    (at most one of them kept), and the picks outside it are of size-1 dims; else
    ``None``."""
    groups = reshape_groups(source_shape, base_shape)
    if groups is None or any(len(ins) != 1 or not outs for ins, outs in groups):
        return None
    splits = [(ins[0], list(outs)) for ins, outs in groups if len(outs) > 1]
    if len(splits) != 1:
        return None
    dim, parts = splits[0]
    kept = [p for p in parts if p not in picked]
    if len(kept) > 1 or any(p not in bb for p in kept) or \
            any(base_shape[d] != 1 for d in picked if d not in parts):
        return None
    return dim, parts, {o: ins[0] for ins, outs in groups for o in outs}


def _replacement(eqn: Any, side: int, terms: list[Term], squeezed: tuple = ()) -> Replacement:
    """Build ``Σ sign·coefficients·pick(base @ v)`` in place of ``eqn`` (``squeezed``:
    size-1 dims of the combination squeezed before the product)."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    x_batch, v_contract, v_batch = (lb, rc, rb) if side == 0 else (rb, lc, lb)
    x = eqn.invars[side]
    v = eqn.invars[1 - side]
    products = _Product(eqn, side, tuple(x_batch), tuple(v_contract), tuple(v_batch),
                        compat.aval_of(x).dtype)
    key_dim = len(compat.aval_of(x).shape) - 1
    v_free = len(compat.aval_of(v).shape) - len(v_contract) - len(v_batch)
    x_free = [d for d in range(key_dim) if d not in x_batch]
    free_at = len(x_batch) + (0 if side == 0 else v_free)
    out_pos = {d: i for i, d in enumerate(x_batch)}
    out_pos.update({d: free_at + i for i, d in enumerate(x_free)})
    out_shape = compat.aval_of(eqn.outvars[0]).shape
    operands = list({id(a): a for t in terms for a in (t.base, t.source) if a is not None}
                    .values())
    coefficients = [c.value for t in terms for c in t.coefficients]

    kept = [d for d in range(key_dim + 1 + len(squeezed)) if d not in squeezed]
    to_x = {d: i for i, d in enumerate(kept)}

    def coefficient(value, c: Coefficient, dtype):
        """``value`` broadcast onto the product's dims (its dims on the contracting one or
        a squeezed one have size 1 and are dropped)."""
        dims = [to_x.get(d) for d in c.dims]
        gone = [i for i, d in enumerate(dims) if d is None or d == key_dim]
        value = lax.squeeze(value, gone) if gone else value
        positions = tuple(out_pos[d] for d in dims if d is not None and d != key_dim)
        return lax.broadcast_in_dim(value.astype(dtype), out_shape, positions)

    def build(v_value, *values):
        known = dict(zip(map(id, operands), values[:len(operands)]))
        factors = iter(values[len(operands):])
        total, whole = None, {}
        for term in terms:
            key = (id(term.base), frozenset(d for d, _ in term.picks))
            if key not in whole:
                source = None if term.source is None else known[id(term.source)]
                whole[key] = products.of(term, known[id(term.base)], v_value, source)
            y = _picked(whole[key][0], whole[key][1], term.picks)
            for c in term.coefficients:
                y = y * coefficient(next(factors), c, y.dtype)
            total = (y if term.sign > 0 else -y) if total is None else \
                (total + y if term.sign > 0 else total - y)
        return [total]

    return Replacement(eqn, (v, *operands, *coefficients), build)


def distribute_value_products(closed: Any) -> tuple[Any, int]:
    """``closed`` (a closed jaxpr) with every value product of a linear combination of
    softmax probabilities distributed over it, and how many were; ``closed`` itself when
    none was (then nothing is re-traced)."""
    plans = {}
    for jaxpr in _jaxprs(closed):
        if _combines(jaxpr):
            graph = Graph(jaxpr)
            probs = _probabilities(graph)
            reps = [r for e in graph.eqns if e.primitive.name == "dot_general"
                    for r in [_distribution(graph, probs, e)] if r is not None] \
                if probs else []
            if reps:
                plans[id(jaxpr)] = reps
    if not plans:
        return closed, 0
    new = Rewriter(plan=lambda jaxpr: plans.get(id(jaxpr), ()), inlinable=INLINABLE).run(closed)
    return new, sum(map(len, plans.values()))


def _jaxprs(closed: Any):
    """``closed``'s open jaxpr and those of every body inside it."""
    jaxpr = compat.open_jaxpr(closed)
    yield jaxpr
    for eqn in jaxpr.eqns:
        for _, sub in compat.eqn_subjaxprs(eqn):
            yield from _jaxprs(sub)


def _combines(jaxpr: Any) -> bool:
    """Whether ``jaxpr`` has exponentials and a dot_general reading (through casts,
    squeezes and multiplications) a sum, difference or negation: the cheap test that spares
    other programs the analysis and the re-trace."""
    if not any(e.primitive.name == "exp" for e in jaxpr.eqns):
        return False
    producers = {v: e for e in jaxpr.eqns for v in e.outvars}
    for eqn in jaxpr.eqns:
        if eqn.primitive.name != "dot_general":
            continue
        todo = [x for x in eqn.invars if not compat.is_literal(x)]
        for _ in range(_SEARCH_DEPTH):
            found = [producers.get(x) for x in todo]
            if any(p is not None and p.primitive.name in _SIGNS for p in found):
                return True
            todo = [a for p in found if p is not None and
                    (p.primitive.name in _CASTS or p.primitive.name in ("squeeze", "mul"))
                    for a in p.invars if not compat.is_literal(a)]
    return False
