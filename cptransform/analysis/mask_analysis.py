"""Classify attention masks by abstract interpretation of the subgraph that computes them.

The analysis walks back from a mask value of the logits' shape ("the top") and gives every
value it meets an abstract meaning, with each of the value's dims tied to a top dim (or to
none, for a size-1 dim that is broadcast):

* :class:`Affine`: an integer index expression ``sum(c_d * index_d) + const`` (an ``iota``
  is ``index_d``; adds, subtracts and constant multiples keep it affine; a constant 1-d
  arange-like array is one too);
* :class:`Scalar`: a constant broadcast everywhere;
* predicates: :class:`Band` (``index_b - index_a`` in a set of intervals: compares of
  affine expressions turn into half-planes, and/or/not combine them), :class:`Const`,
  :class:`Segments` (``x[.., a, ..] == y[.., b, ..]`` of two data values) and
  :class:`Dense` (anything else: the mask is data), and :class:`And` of those;
* :class:`Indicator`: a number that is ``on_true`` where a predicate holds and
  ``on_false`` elsewhere (``mask.astype(f32)``, ``1 - m``, ``where(m, 0, -1e9)``);
* :class:`Opaque`: a value we do not look into (a function input, a data computation),
  with the map from its dims to the top dims so it can be rearranged later.

:func:`classify` turns the conjunction of visibility predicates into the parts of a
:class:`~cptransform.op.attention_spec.MaskSpec`: a band on ``kv - q`` (causal/window),
segment ids, and the dense remainder. Analyses are cached per ``(value, dim map)``, so a
mask shared by many layers is analysed once.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from cptransform.ir import compat
from cptransform.ir.graph import Graph

DimMap = tuple  # per dim of a value: the top dim it indexes, or None (size-1, broadcast)
Interval = tuple  # (lo, hi), ints or None for an open side


# -- interval sets on the integer line ------------------------------------------------------

def _lo_key(lo):
    return -math.inf if lo is None else lo


def _hi_key(hi):
    return math.inf if hi is None else hi


def _normalize(intervals: Sequence[Interval]) -> tuple[Interval, ...]:
    """Sorted, merged, non-empty intervals (adjacent integer intervals are merged)."""
    items = sorted((iv for iv in intervals if _lo_key(iv[0]) <= _hi_key(iv[1])),
                   key=lambda iv: _lo_key(iv[0]))
    out: list = []
    for lo, hi in items:
        if out and _lo_key(lo) <= _hi_key(out[-1][1]) + 1:
            prev_lo, prev_hi = out[-1]
            out[-1] = (prev_lo, None if hi is None or prev_hi is None else max(prev_hi, hi))
        else:
            out.append((lo, hi))
    return tuple(out)


def intersect(a: Sequence[Interval], b: Sequence[Interval]) -> tuple[Interval, ...]:
    out = []
    for lo1, hi1 in a:
        for lo2, hi2 in b:
            lo = lo2 if lo1 is None else lo1 if lo2 is None else max(lo1, lo2)
            hi = hi2 if hi1 is None else hi1 if hi2 is None else min(hi1, hi2)
            out.append((lo, hi))
    return _normalize(out)


def union(a: Sequence[Interval], b: Sequence[Interval]) -> tuple[Interval, ...]:
    return _normalize(tuple(a) + tuple(b))


def complement(a: Sequence[Interval]) -> tuple[Interval, ...]:
    out, start = [], None
    for lo, hi in _normalize(a):
        if lo is not None:
            out.append((start, lo - 1))
        if hi is None:
            return _normalize(out)
        start = hi + 1
    out.append((start, None))
    return _normalize(out)


# -- abstract values ------------------------------------------------------------------------

@dataclass(frozen=True)
class Opaque:
    """A value not looked into; ``dims[i]`` is the top dim of its dim ``i`` (or None)."""

    var: Any = field(compare=False)
    dims: DimMap
    key: int = 0

    @classmethod
    def of(cls, var: Any, dims: DimMap) -> "Opaque":
        return cls(var, tuple(dims), id(var))


@dataclass(frozen=True)
class Affine:
    """``sum(c * index[top_dim] for top_dim, c in coeffs) + const`` (integers)."""

    coeffs: tuple = ()
    const: int = 0

    def plus(self, other: "Affine", sign: int = 1) -> "Affine":
        c = dict(self.coeffs)
        for d, v in other.coeffs:
            c[d] = c.get(d, 0) + sign * v
        return Affine(tuple(sorted((d, v) for d, v in c.items() if v)),
                      self.const + sign * other.const)

    def times(self, k: int) -> "Affine":
        return Affine(tuple((d, v * k) for d, v in self.coeffs if v * k), self.const * k)


@dataclass(frozen=True)
class Scalar:
    """A constant, the same everywhere."""

    value: Any


@dataclass(frozen=True)
class Pred:
    """Base of the predicates; ``origin`` is the boolean value it was read from."""

    origin: Opaque | None = field(default=None, compare=False, kw_only=True)


@dataclass(frozen=True)
class Const(Pred):
    value: bool = True


@dataclass(frozen=True)
class Band(Pred):
    """``index[b] - index[a]`` lies in ``intervals`` (``a < b`` are top dims)."""

    a: int = 0
    b: int = 0
    intervals: tuple = ()


@dataclass(frozen=True)
class Segments(Pred):
    """``x == y`` where ``x`` and ``y`` are data indexed by different top dims."""

    x: Opaque | None = None
    y: Opaque | None = None


@dataclass(frozen=True)
class Dense(Pred):
    """Data: the boolean value ``source`` (negated if ``negated``)."""

    source: Opaque | None = None
    negated: bool = False


@dataclass(frozen=True)
class And(Pred):
    terms: tuple = ()


@dataclass(frozen=True)
class Indicator:
    """``on_true`` where ``pred`` holds, ``on_false`` elsewhere."""

    pred: Pred
    on_true: Any
    on_false: Any


def conjuncts(p: Pred) -> list[Pred]:
    """The terms of a conjunction (a non-``And`` predicate is its own only term)."""
    if isinstance(p, And):
        return [t for term in p.terms for t in conjuncts(term)]
    if isinstance(p, Const) and p.value:
        return []
    return [p]


def p_and(a: Pred, b: Pred, origin: Opaque | None = None) -> Pred:
    if isinstance(a, Const):
        return b if a.value else a
    if isinstance(b, Const):
        return a if b.value else b
    if isinstance(a, Band) and isinstance(b, Band) and (a.a, a.b) == (b.a, b.b):
        return Band(a.a, a.b, intersect(a.intervals, b.intervals), origin=origin)
    return And(tuple(conjuncts(a) + conjuncts(b)), origin=origin)


def _as_dense(p: Pred, origin: Opaque) -> Dense:
    return p if isinstance(p, Dense) else Dense(source=origin, origin=origin)


def p_or(a: Pred, b: Pred, origin: Opaque) -> Pred:
    if isinstance(a, Const):
        return a if a.value else b
    if isinstance(b, Const):
        return b if b.value else a
    if isinstance(a, Band) and isinstance(b, Band) and (a.a, a.b) == (b.a, b.b):
        return Band(a.a, a.b, union(a.intervals, b.intervals), origin=origin)
    return Dense(source=origin, origin=origin)


def p_not(a: Pred, origin: Opaque) -> Pred:
    if isinstance(a, Const):
        return Const(value=not a.value, origin=origin)
    if isinstance(a, Band):
        return Band(a.a, a.b, complement(a.intervals), origin=origin)
    if isinstance(a, Dense):
        return Dense(source=a.source, negated=not a.negated, origin=origin)
    return Dense(source=origin, origin=origin)


# -- the interpreter ------------------------------------------------------------------------

_PASS_THROUGH = ("stop_gradient", "copy", "copy_p", "optimization_barrier")
_COMPARES = ("ge", "gt", "le", "lt", "eq", "ne")
_FLIP = {"ge": "le", "gt": "lt", "le": "ge", "lt": "gt", "eq": "eq", "ne": "ne"}


class MaskAnalyzer:
    """Abstract interpretation of mask subgraphs of one :class:`Graph` (results cached)."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self._cache: dict = {}

    def analyze(self, atom: Any, dims: DimMap) -> Any:
        """The abstract value of ``atom`` whose dim ``i`` indexes top dim ``dims[i]``."""
        dims = tuple(dims)
        if compat.is_literal(atom):
            return self._constant(np.asarray(compat.literal_value(atom)), atom, dims)
        key = (atom, dims)
        hit = self._cache.get(key)
        if hit is None:
            hit = self._analyze(atom, dims)
            self._cache[key] = hit
        return hit

    def predicate(self, atom: Any, dims: DimMap) -> Pred:
        """``atom`` (boolean or a 0/1 number) read as a predicate."""
        value = self.analyze(atom, dims)
        return self.as_pred(value, Opaque.of(atom, dims))

    @staticmethod
    def as_pred(value: Any, origin: Opaque) -> Pred:
        if isinstance(value, Pred):
            return value
        if isinstance(value, Scalar):
            return Const(value=bool(value.value), origin=origin)
        if isinstance(value, Indicator):
            t, f = bool(value.on_true), bool(value.on_false)
            if t == f:
                return Const(value=t, origin=origin)
            return value.pred if t else p_not(value.pred, origin)
        return Dense(source=origin, origin=origin)

    # -- one equation at a time ------------------------------------------------------------

    def _analyze(self, atom: Any, dims: DimMap) -> Any:
        g = self.graph
        here = Opaque.of(atom, dims)
        eqn = g.producer(atom)
        if eqn is None:
            if g.is_const(atom):
                return self._constant(np.asarray(g.const_value(atom)), atom, dims)
            return self._opaque(atom, here)
        name = eqn.primitive.name
        ins = eqn.invars
        out_shape = compat.aval_of(atom).shape
        if name in _PASS_THROUGH:
            return self.analyze(ins[0], dims)
        if name == "iota":
            d = dims[eqn.params["dimension"]]
            return Affine(((d, 1),), 0) if d is not None else Affine()
        if name == "broadcast_in_dim":
            src_shape = compat.aval_of(ins[0]).shape
            bdims = eqn.params["broadcast_dimensions"]
            src_dims = tuple(dims[o] if src_shape[i] == out_shape[o] else None
                             for i, o in enumerate(bdims))
            return self.analyze(ins[0], src_dims)
        if name == "transpose":
            perm = eqn.params["permutation"]
            src = [None] * len(perm)
            for j, p in enumerate(perm):
                src[p] = dims[j]
            return self.analyze(ins[0], tuple(src))
        if name in ("reshape", "squeeze", "expand_dims"):
            src_dims = unit_reshape_dims(compat.aval_of(ins[0]).shape, out_shape, dims)
            return self._opaque(atom, here) if src_dims is None \
                else self.analyze(ins[0], src_dims)
        if name == "convert_element_type":
            return self._convert(self.analyze(ins[0], dims), eqn.params["new_dtype"], atom, here)
        if name in ("add", "sub", "mul"):
            return self._arith(name, *(self.analyze(a, dims) for a in ins), atom, here)
        if name == "neg":
            return self._arith("mul", self.analyze(ins[0], dims), Scalar(-1), atom, here)
        if name in _COMPARES:
            return self._compare(name, self.analyze(ins[0], dims), self.analyze(ins[1], dims),
                                 atom, here)
        if name in ("and", "or", "not") and compat.aval_of(atom).dtype == np.bool_:
            ps = [self.predicate(a, dims) for a in ins]
            if name == "not":
                return p_not(ps[0], here)
            return p_and(ps[0], ps[1], here) if name == "and" else p_or(ps[0], ps[1], here)
        if name == "select_n" and len(ins) == 3 and compat.aval_of(ins[0]).dtype == np.bool_:
            return self._select(self.predicate(ins[0], dims), self.analyze(ins[1], dims),
                                self.analyze(ins[2], dims), atom, here)
        return self._opaque(atom, here)

    @staticmethod
    def _opaque(atom: Any, here: Opaque) -> Any:
        if compat.aval_of(atom).dtype == np.bool_:
            return Dense(source=here, origin=here)
        return here

    def _constant(self, array: np.ndarray, atom: Any, dims: DimMap) -> Any:
        if array.size == 1:
            value = array.reshape(()).item()
            if array.dtype == np.bool_:
                return Const(value=bool(value))
            return Scalar(value)
        if np.issubdtype(array.dtype, np.integer):
            nonunit = [i for i, n in enumerate(array.shape) if n > 1]
            if len(nonunit) == 1 and dims[nonunit[0]] is not None:
                line = array.reshape(-1).astype(np.int64)
                steps = np.diff(line)
                if np.all(steps == steps[0]):
                    return Affine(((dims[nonunit[0]], int(steps[0])),), int(line[0])) \
                        if steps[0] else Affine((), int(line[0]))
        if array.size <= _MAX_CONSTANT_MASK:
            values = np.unique(array)
            if len(values) <= 2:
                on_true = values[-1]
                band = _constant_band(array == on_true, dims, Opaque.of(atom, dims))
                if band is not None:
                    if array.dtype == np.bool_:
                        return band
                    return Indicator(band, on_true.item(), values[0].item())
        return self._opaque(atom, Opaque.of(atom, dims))

    def _convert(self, value: Any, dtype: Any, atom: Any, here: Opaque) -> Any:
        if np.dtype(dtype) == np.bool_:
            return self.as_pred(value, here)
        if isinstance(value, Pred):
            return Indicator(value, 1, 0)
        if isinstance(value, Affine) and not np.issubdtype(np.dtype(dtype), np.number):
            return here
        if isinstance(value, Opaque):
            return here
        return value

    def _arith(self, op: str, a: Any, b: Any, atom: Any, here: Opaque) -> Any:
        fn: Callable = {"add": lambda x, y: x + y, "sub": lambda x, y: x - y,
                        "mul": lambda x, y: x * y}[op]
        if isinstance(a, Pred):
            a = Indicator(a, 1, 0)
        if isinstance(b, Pred):
            b = Indicator(b, 1, 0)
        if isinstance(a, Scalar) and isinstance(b, Scalar):
            return Scalar(fn(a.value, b.value))
        if op != "mul" and isinstance(b, Affine) and isinstance(a, Scalar) and _is_int(a.value):
            a = Affine((), int(a.value))
        if op != "mul" and isinstance(a, Affine) and isinstance(b, Scalar) and _is_int(b.value):
            b = Affine((), int(b.value))
        if isinstance(a, Affine) and isinstance(b, Affine) and op != "mul":
            return a.plus(b, 1 if op == "add" else -1)
        if op == "mul":
            for x, y in ((a, b), (b, a)):
                if isinstance(x, Affine) and isinstance(y, Scalar) and _is_int(y.value):
                    return x.times(int(y.value))
            if isinstance(a, Indicator) and isinstance(b, Indicator) \
                    and (a.on_true, a.on_false, b.on_true, b.on_false) == (1, 0, 1, 0):
                return Indicator(p_and(a.pred, b.pred, here), 1, 0)
        if isinstance(a, Indicator) and isinstance(b, Scalar):
            return Indicator(a.pred, fn(a.on_true, b.value), fn(a.on_false, b.value))
        if isinstance(b, Indicator) and isinstance(a, Scalar):
            return Indicator(b.pred, fn(a.value, b.on_true), fn(a.value, b.on_false))
        return here

    def _compare(self, op: str, a: Any, b: Any, atom: Any, here: Opaque) -> Pred:
        def affine(x):
            if isinstance(x, Affine):
                return x
            if isinstance(x, Scalar) and _is_int(x.value):
                return Affine((), int(x.value))
            return None

        la, lb = affine(a), affine(b)
        if la is not None and lb is not None:
            return _band(op, la.plus(lb, -1), here)
        if isinstance(a, Scalar) and isinstance(b, Scalar):
            return Const(value=bool(_NP_COMPARE[op](a.value, b.value)), origin=here)
        for x, y, o in ((a, b, op), (b, a, _FLIP[op])):
            if isinstance(x, Indicator) and isinstance(y, Scalar):
                t = bool(_NP_COMPARE[o](x.on_true, y.value))
                f = bool(_NP_COMPARE[o](x.on_false, y.value))
                return self.as_pred(Indicator(x.pred, t, f), here)
        if op == "eq" and isinstance(a, Opaque) and isinstance(b, Opaque):
            return Segments(a, b, origin=here)
        return Dense(source=here, origin=here)

    def _select(self, p: Pred, on_false: Any, on_true: Any, atom: Any, here: Opaque) -> Any:
        if isinstance(on_false, Scalar) and isinstance(on_true, Scalar):
            return Indicator(p, on_true.value, on_false.value)
        is_bool = compat.aval_of(atom).dtype == np.bool_
        f, t = _as_bool(on_false, is_bool), _as_bool(on_true, is_bool)
        if f is None or t is None:
            return self._opaque(atom, here)
        # select_n(p, f, t) == (p and t) or (not p and f)
        if isinstance(f, Const) and not f.value:
            out = p_and(p, t, here)
        elif isinstance(t, Const) and t.value:
            out = p_or(p, f, here)
        elif isinstance(t, Const) and not t.value:
            out = p_and(p_not(p, here), f, here)
        elif isinstance(f, Const) and f.value:
            out = p_or(p_not(p, here), t, here)
        else:
            return self._opaque(atom, here)
        return out if is_bool else Indicator(out, 1, 0)


def _as_bool(value: Any, is_bool: bool) -> Pred | None:
    """A boolean, or a number that is 0/1 everywhere, as a predicate (else None)."""
    if isinstance(value, Pred):
        return value
    if isinstance(value, Scalar) and (is_bool or value.value in (0, 1)):
        return Const(value=bool(value.value))
    if isinstance(value, Indicator) and (value.on_true, value.on_false) == (1, 0):
        return value.pred
    if isinstance(value, Indicator) and (value.on_true, value.on_false) == (0, 1):
        return p_not(value.pred, None)
    return None


_NP_COMPARE = {"ge": np.greater_equal, "gt": np.greater, "le": np.less_equal,
               "lt": np.less, "eq": np.equal, "ne": np.not_equal}


_MAX_CONSTANT_MASK = 1 << 22


def _constant_band(visible: np.ndarray, dims: DimMap, origin: Opaque) -> Band | None:
    """A constant boolean array that is a function of ``index_b - index_a`` only, as a Band."""
    nonunit = [i for i, n in enumerate(visible.shape) if n > 1]
    if len(nonunit) != 2 or any(dims[i] is None for i in nonunit):
        return None
    i, j = nonunit if dims[nonunit[0]] < dims[nonunit[1]] else nonunit[::-1]
    grid = np.moveaxis(visible.reshape([n for n in visible.shape if n > 1]),
                       (nonunit.index(i), nonunit.index(j)), (0, 1))
    n_a, n_b = grid.shape
    t = np.arange(n_b)[None, :] - np.arange(n_a)[:, None]
    ivs, lo_t, hi_t = [], -(n_a - 1), n_b - 1
    for diff in range(lo_t, hi_t + 1):
        cells = grid[t == diff]
        if cells.min() != cells.max():
            return None
        if cells[0]:
            ivs.append((None if diff == lo_t else diff, None if diff == hi_t else diff))
    return Band(dims[i], dims[j], _normalize(ivs), origin=origin)


def _is_int(value: Any) -> bool:
    try:
        return float(value) == int(value)
    except (TypeError, ValueError, OverflowError):
        return False


def _band(op: str, diff: Affine, origin: Opaque) -> Pred:
    """The predicate ``diff op 0`` for an affine ``diff``."""
    coeffs = dict(diff.coeffs)
    if not coeffs:
        return Const(value=bool(_NP_COMPARE[op](diff.const, 0)), origin=origin)
    if len(coeffs) != 2:
        return Dense(source=origin, origin=origin)
    (a, ca), (b, cb) = sorted(coeffs.items())
    if ca != -cb:
        return Dense(source=origin, origin=origin)
    # cb * (index_b - index_a) + const  op  0   <=>   t op' r   with t = index_b - index_a
    r = -diff.const / cb
    if cb < 0:
        op = _FLIP[op]
    if op == "ge":
        ivs = ((math.ceil(r), None),)
    elif op == "gt":
        ivs = ((math.floor(r) + 1, None),)
    elif op == "le":
        ivs = ((None, math.floor(r)),)
    elif op == "lt":
        ivs = ((None, math.ceil(r) - 1),)
    elif op == "eq":
        ivs = ((int(r), int(r)),) if r == int(r) else ()
    else:
        ivs = complement(((int(r), int(r)),)) if r == int(r) else ((None, None),)
    return Band(a, b, _normalize(ivs), origin=origin)


def unit_reshape_dims(src_shape: Sequence[int], out_shape: Sequence[int],
                      dims: DimMap, *, forward: bool = False) -> DimMap | None:
    """Labels across a reshape that only adds or drops size-1 dims (None for any other).

    ``dims`` label the output, and the input's labels are returned; with ``forward`` it is
    the other way round (``dims`` label the input)."""
    src_big = [i for i, n in enumerate(src_shape) if n != 1]
    out_big = [i for i, n in enumerate(out_shape) if n != 1]
    if [src_shape[i] for i in src_big] != [out_shape[i] for i in out_big]:
        return None
    if forward:
        src_big, out_big, src_shape = out_big, src_big, out_shape
    labels = [None] * len(src_shape)
    for i, o in zip(src_big, out_big):
        labels[i] = dims[o]
    return tuple(labels)


# -- what the mask means for an attention ----------------------------------------------------

@dataclass(frozen=True)
class MaskParts:
    """The visible-pair predicate split into MaskSpec parts.

    ``band``: bounds ``(lo, hi)`` on ``kv - q`` (None: open) or None; ``q_dim``: the top
    dim that is the query position (None when no analytic part says); ``segments``:
    ``(q_ids, kv_ids)`` opaque values; ``dense``: predicates kept as data (each
    :class:`Dense`, to be and-ed); ``kinds``: names of the parts found, for reports.
    """

    band: tuple | None
    q_dim: int | None
    segments: tuple | None
    dense: tuple
    kinds: tuple


def classify(pred: Pred, q_dims: Sequence[int], kv_dim: int, q_len_of: Callable[[int], int],
             kv_len: int, batch_dims: Sequence[int]) -> MaskParts:
    """Split a visibility predicate over the logits' dims into MaskSpec parts.

    ``q_dims``: top dims that may be the query position (the query's free dims);
    ``kv_dim``: the key position dim; ``batch_dims``: dims that segment ids may vary along.
    Parts that cannot be analytic (a band on a heads dim, a band with a gap, a second set
    of segment ids) become dense.
    """
    dense: list[Dense] = []
    bands: list[Band] = []
    segs: list[Segments] = []
    kinds: list[str] = []
    q_dim: int | None = None
    for term in conjuncts(pred):
        if isinstance(term, Const):
            dense.append(_as_dense(term, term.origin))
        elif isinstance(term, Band):
            pair = (term.a, term.b)
            ok = kv_dim in pair and (pair[0] if pair[1] == kv_dim else pair[1]) in q_dims
            qd = pair[0] if pair[1] == kv_dim else pair[1]
            if ok and q_dim in (None, qd):
                q_dim = qd
                ivs = term.intervals if term.b == kv_dim else \
                    _normalize(tuple((None if hi is None else -hi, None if lo is None else -lo)
                                     for lo, hi in term.intervals))
                bands.append(Band(qd, kv_dim, ivs, origin=term.origin))
            else:
                dense.append(_as_dense(term, term.origin))
        elif isinstance(term, Segments):
            parts = _segment_sides(term, q_dims, kv_dim, batch_dims, q_dim)
            if parts is not None and not segs:
                q_dim = parts[0]
                segs.append(Segments(parts[1], parts[2], origin=term.origin))
            else:
                dense.append(_as_dense(term, term.origin))
        else:
            dense.append(_as_dense(term, term.origin))
    band = None
    if bands:
        ivs: tuple = ((None, None),)
        for b in bands:
            ivs = intersect(ivs, b.intervals)
        lo_cut, hi_cut = -(q_len_of(q_dim) - 1), kv_len - 1
        if len(ivs) == 1:
            lo, hi = ivs[0]
            lo = None if lo is None or lo <= lo_cut else lo
            hi = None if hi is None or hi >= hi_cut else hi
            if lo is None or lo <= 0:
                band = (lo, hi)
        if band is None:
            dense.extend(_as_dense(b, b.origin) for b in bands)
        else:
            lo, hi = band
            if hi is not None:
                kinds.append("causal" if hi == 0 else f"causal({hi:+d})")
            if lo is not None:
                kinds.append(f"window({-lo})")
    if segs:
        kinds.append("segments")
    if dense:
        kinds.append("dense")
    return MaskParts(band, q_dim, (segs[0].x, segs[0].y) if segs else None, tuple(dense),
                     tuple(kinds))


def _segment_sides(term: Segments, q_dims, kv_dim, batch_dims, q_dim):
    """``(q top dim, q ids, kv ids)`` when one side varies with a query dim only, else None."""
    def role(side: Opaque):
        used = {d for d in side.dims if d is not None}
        if not used <= set(batch_dims) | set(q_dims) | {kv_dim}:
            return None
        qs = used & set(q_dims)
        if kv_dim in used and not qs:
            return ("kv", None)
        if len(qs) == 1 and kv_dim not in used:
            return ("q", next(iter(qs)))
        return None

    rx, ry = role(term.x), role(term.y)
    if rx is None or ry is None:
        return None
    if rx[0] == "q" and ry[0] == "kv":
        q_side, kv_side, qd = term.x, term.y, rx[1]
    elif rx[0] == "kv" and ry[0] == "q":
        q_side, kv_side, qd = term.y, term.x, ry[1]
    else:
        return None
    if q_dim not in (None, qd):
        return None
    return qd, q_side, kv_side
