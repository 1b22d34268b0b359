"""Classify attention masks by abstract interpretation of the subgraph that computes them.

The analysis walks back from a mask value of the logits' shape ("the top") and gives every
value it meets an abstract meaning (:mod:`cptransform.analysis.mask_values`), with each of
the value's dims tied to a top dim (or to none, for a size-1 dim that is broadcast):

* :class:`Affine`: an integer index expression ``sum(c_d * index_d) + const`` (an ``iota``
  is ``index_d``; adds, subtracts and constant multiples keep it affine; a constant 1-d
  arange-like array is one too); :class:`AbsAffine` is its absolute value, which a compare
  with a constant turns into two half-planes (``|i - j| <= w``);
* :class:`Scalar`: a constant broadcast everywhere;
* predicates: :class:`Band` (``index_b - index_a`` in a set of intervals: compares of
  affine expressions turn into half-planes, and/or/not combine them), :class:`Const`,
  :class:`Segments` (``x[.., a, ..] == y[.., b, ..]`` of two data values) and
  :class:`Dense` (anything else: the mask is data), and :class:`And` of those;
* :class:`TopK`: a boolean ``scatter`` of True into all-False whose indices are iotas
  along every dim but one, and a ``lax.top_k``'s indices along that one (what
  ``zeros.at[b, q, idx].set(True)`` and ``put_along_axis`` trace to): the key positions a
  sparse-attention indexer selected;
* :class:`Indicator`: a number that is ``on_true`` where a predicate holds and
  ``on_false`` elsewhere (``mask.astype(f32)``, ``1 - m``, ``where(m, 0, -1e9)``);
* :class:`Opaque`: a value we do not look into (a function input, a data computation),
  with the map from its dims to the top dims so it can be rearranged later.

:func:`cptransform.analysis.mask_parts.classify` turns the conjunction of visibility
predicates into the parts of a :class:`~cptransform.op.attention_spec.MaskSpec`. Analyses
are cached per ``(value, dim map)``, so a mask shared by many layers is analysed once.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Callable

import numpy as np

from cptransform.analysis.dim_rules import unit_reshape_dims
from cptransform.analysis.intervals import normalize
from cptransform.analysis.mask_data import (MAX_REGIONS, NEGATED, compared,
                                            converted, data_cases, step)
from cptransform.analysis.mask_values import (AbsAffine, Affine, And, Band, Cases, Const,
                                              Data, Dense, DimMap, FloorDiv, IndexRange,
                                              Indicator, Opaque, Pred, Scalar, Segments, Shifted,
                                              conjuncts, is_known, p_and, p_not, p_or,
                                              region_test)
from cptransform.analysis.mask_predicates import (FLIP, MAX_CONSTANT_MASK, NP_COMPARE,
                                                  abs_band, chunk_of, constant_band,
                                                  difference_band, index_against_data,
                                                  floor_division, is_int, non_negative,
                                                  shifted_data)
from cptransform.analysis.mask_topk import topk_scatter, unwrapped_index
from cptransform.analysis.primitives import Moves, moving
from cptransform.ir import compat
from cptransform.ir.graph import Graph


#: Ops whose result is their operand's value (a scheduling barrier included: values only).
_PASS_THROUGH = moving(Moves.IDENTITY, Moves.BARRIER)
#: Ops that may only add or drop size-1 dims.
_UNIT_RESHAPES = moving(Moves.RESHAPE, Moves.SQUEEZE)
#: Ops that move or broadcast a value (read through with the dims mapped back).
_MOVES = moving(Moves.BROADCAST, Moves.PERMUTE) | _UNIT_RESHAPES


class MaskAnalyzer:
    """Abstract interpretation of mask subgraphs of one :class:`Graph` (results cached)."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self._cache: dict = {}
        self._fresh = itertools.count()

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

    def complement(self, atom: Any, dims: DimMap) -> Pred:
        """``not atom`` for a boolean ``atom``, keeping the structure that negating a
        conjunction loses: through copies and boolean casts, a boolean ``not`` is its
        operand's predicate, a compare of a two-valued mask with a constant takes the
        negated outcome on each of the mask's two values (``mask == 0`` of a 0/1 mask is
        the mask); anything else is the negation of its predicate."""
        here = Opaque.of(atom, dims)
        eqn = None if compat.is_literal(atom) else self.graph.producer(atom)
        while eqn is not None and (eqn.primitive.name in _PASS_THROUGH or _bool_cast(eqn)) \
                and not compat.is_literal(eqn.invars[0]):
            eqn = self.graph.producer(eqn.invars[0])
        if eqn is not None and eqn.primitive.name == "not" \
                and compat.aval_of(eqn.invars[0]).dtype == np.bool_:
            return self.predicate(eqn.invars[0], dims)
        if eqn is not None and eqn.primitive.name in NP_COMPARE:
            sides = [self.analyze(x, dims) for x in eqn.invars]
            if any(isinstance(x, Cases) for x in sides):
                return self._compare(NEGATED[eqn.primitive.name], *sides, atom, here)
            outcome = _two_valued_compare(eqn.primitive.name, *sides)
            if outcome is not None:
                return self.as_pred(Indicator(outcome.pred, not outcome.on_true,
                                              not outcome.on_false), here)
        return p_not(self.predicate(atom, dims), here)

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
        if isinstance(value, Cases):
            return compared("ne", value, 0, origin)
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

        def at(x):
            # An elementwise operand's size-1 dim under a full-size result dim (``[1, S] &
            # [T, S]``, as JAX 0.12 traces implicit broadcasts) indexes no top dim.
            shape = compat.aval_of(x).shape
            return tuple(None if n == 1 and m != 1 else d for d, n, m in
                         zip(dims, shape, compat.aval_of(atom).shape)) \
                if len(shape) == len(dims) else dims

        if name in _PASS_THROUGH or name in _MOVES:
            return self._moved(eqn, atom, dims, here)
        if name == "iota":
            d = dims[eqn.params["dimension"]]
            return Affine(((d, 1),), 0) if d is not None else Affine()
        if name == "convert_element_type":
            return self._convert(self.analyze(ins[0], dims), eqn.params["new_dtype"], atom, here)
        if name in ("slice", "dynamic_slice"):
            starts = self._slice_starts(eqn)
            if starts is not None:
                return self._sliced(ins[0], dims, starts, atom, here)
        if name in ("add", "sub", "mul"):
            a, b = (self.analyze(x, at(x)) for x in ins)
            out = self._arith(name, a, b, atom, here)
            return self._combine(name, a, b, atom, here) if out is here else out
        if name in ("min", "max") or (name in ("and", "or", "xor") and
                                      compat.aval_of(atom).dtype != np.bool_):
            return self._combine(name, *(self.analyze(a, at(a)) for a in ins), atom, here)
        if name == "xor":
            return self._combine(name, *(self.predicate(a, at(a)) for a in ins), atom, here)
        if name == "neg":
            return self._arith("mul", self.analyze(ins[0], dims), Scalar(-1), atom, here)
        if name == "abs":
            inner = self.analyze(ins[0], dims)
            return AbsAffine(inner) if isinstance(inner, Affine) else here
        if name in NP_COMPARE:
            return self._compare(name, *(self.analyze(x, at(x)) for x in ins), atom, here)
        if name in ("and", "or", "not") and compat.aval_of(atom).dtype == np.bool_:
            ps = [self.predicate(a, at(a)) for a in ins]
            if name == "not":
                return p_not(ps[0], here)
            return p_and(ps[0], ps[1], here) if name == "and" else p_or(ps[0], ps[1], here)
        found = self._traced_idiom(eqn, atom, dims, here)
        if found is not None:
            return found
        if name == "select_n" and len(ins) == 3 and compat.aval_of(ins[0]).dtype == np.bool_:
            return self._select(self.predicate(ins[0], at(ins[0])),
                                self.analyze(ins[1], at(ins[1])),
                                self.analyze(ins[2], at(ins[2])), atom, here)
        return self._opaque(atom, here)

    def _moved(self, eqn, atom: Any, dims: DimMap, here: Opaque) -> Any:
        """The value of a move (a pass-through, broadcast, transpose or size-1 reshape):
        its operand's, read with the dims mapped back."""
        name, src = eqn.primitive.name, eqn.invars[0]
        out_shape, src_shape = compat.aval_of(atom).shape, compat.aval_of(src).shape
        if name in _PASS_THROUGH:
            return self.analyze(src, dims)
        if name == "broadcast_in_dim":
            return self.analyze(src, tuple(dims[o] if src_shape[i] == out_shape[o] else None
                                           for i, o in enumerate(
                                               eqn.params["broadcast_dimensions"])))
        if name == "transpose":
            moved = [None] * len(dims)
            for j, p in enumerate(eqn.params["permutation"]):
                moved[p] = dims[j]
            return self.analyze(src, tuple(moved))
        src_dims = unit_reshape_dims(src_shape, out_shape, dims)
        return self._opaque(atom, here) if src_dims is None else self.analyze(src, src_dims)

    def _traced_idiom(self, eqn, atom: Any, dims: DimMap, here: Opaque) -> Any | None:
        """The value of what a jnp function traces to over several equations, read from
        its last: an index wrapped for negative values, an integer floor division, a
        top-k scatter; None when ``eqn`` ends none of them (or the reading fails)."""
        wrapped = unwrapped_index(self.graph, eqn)
        if wrapped is not None:
            inner = self.analyze(wrapped, dims)
            # ``x if x >= 0 else x + n`` is ``x`` for an index that cannot be negative.
            if isinstance(inner, Affine) and inner.const >= 0 \
                    and all(c > 0 for _, c in inner.coeffs):
                return inner
        floor = floor_division(self.graph, eqn)
        if floor is not None:
            scalar = lambda a: () if not compat.aval_of(a).shape else dims  # noqa: E731
            inner, size = (self.analyze(a, scalar(a)) for a in floor)
            if non_negative(inner) and isinstance(size, Scalar) and is_int(size.value) \
                    and int(size.value) > 0:
                return FloorDiv(inner, int(size.value))
        if eqn.primitive.name == "scatter" and compat.aval_of(atom).dtype == np.bool_:
            return topk_scatter(self, eqn, dims, here)
        return None

    def _slice_starts(self, eqn) -> tuple | None:
        """The start of a unit-stride ``slice`` per operand dim, or of a ``dynamic_slice``
        whose starts are constants (clamped as XLA clamps them); None otherwise."""
        shape = compat.aval_of(eqn.invars[0]).shape
        if eqn.primitive.name == "slice":
            if any(s != 1 for s in eqn.params.get("strides") or ()):
                return None
            return tuple(eqn.params["start_indices"])
        out = compat.aval_of(eqn.outvars[0]).shape
        starts = [self.analyze(x, ()) for x in eqn.invars[1:1 + len(shape)]]
        if not all(isinstance(x, Scalar) and is_int(x.value) for x in starts):
            return None
        return tuple(min(max(int(x.value), 0), n - m) for x, n, m in zip(starts, shape, out))

    def _sliced(self, operand: Any, dims: DimMap, starts: tuple, atom: Any,
                here: Opaque) -> Any:
        """A slice of ``operand`` starting at ``starts``: operand index ``i`` along a dim is
        the result's index plus the start. The operand is read with a fresh label on each
        shifted dim, and its index expressions and bands are moved back onto the top
        dims; data inside it (anything else) makes the slice data."""
        inner, shift = [], {}
        for d, start in zip(dims, starts):
            if start == 0 and d is not None:
                inner.append(d)
                continue
            label = _FRESH - next(self._fresh)
            shift[label] = (d, start)
            inner.append(label)
        moved = _shift(self.analyze(operand, tuple(inner)), shift)
        return self._opaque(atom, here) if moved is None else _read_from(moved, atom, here)

    def _combine(self, op: str, a: Any, b: Any, atom: Any, here: Opaque) -> Any:
        """``a op b`` of two masks taking one value where a predicate holds and another
        elsewhere (booleans, 0/1 indicators, constants), case by case: the result is an
        indicator of the union of the cases it is one value on (``min``/``*``/``&`` of a
        padding and a causal mask, ``causal ^ tril(causal, -w)``,
        ``tril(ones) - tril(ones, -w)``); more than two values, or anything else, is
        data."""
        is_bool = compat.aval_of(atom).dtype == np.bool_
        ca, cb = _cases(a), _cases(b)
        if ca is None or cb is None:
            return self._opaque(atom, here)
        found = []
        for pa, va in ca:
            for pb, vb in cb:
                region = p_and(pa, pb)
                if not _empty(region):
                    found.append((region, step(op, va, vb)))
        if any(isinstance(v, Data) or v is None for _, v in found):
            return _data_regions(found, atom, here)
        regions: dict = {}
        for region, value in found:
            regions.setdefault(value, []).append(region)
        if not regions:
            return self._opaque(atom, here)
        if len(regions) == 1:
            (value,) = regions
            return Const(value=bool(value), origin=here) if is_bool else Scalar(value)
        if len(regions) > 2:
            return self._opaque(atom, here)
        (x, rx), (y, ry) = regions.items()
        if is_bool:
            x, rx, y = (x, rx, y) if x else (y, ry, x)
        for on, region, off in ((x, rx, y), (y, ry, x)):
            pred = _union(region)
            if is_known(pred):
                return _read_from(pred if is_bool else Indicator(pred, on, off), atom, here)
            if is_bool:
                break
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
        if array.size <= MAX_CONSTANT_MASK:
            values = np.unique(array)
            if len(values) <= 2:
                on_true = values[-1]
                band = constant_band(array == on_true, dims, Opaque.of(atom, dims))
                if band is not None:
                    if array.dtype == np.bool_:
                        return band
                    return Indicator(band, on_true.item(), values[0].item())
        return self._opaque(atom, Opaque.of(atom, dims))

    def _convert(self, value: Any, dtype: Any, atom: Any, here: Opaque) -> Any:
        if np.dtype(dtype) == np.bool_:
            return self.as_pred(value, here)
        if isinstance(value, Cases):
            values = [converted(v, dtype) for _, v in value.cases]
            return here if any(v is None for v in values) else \
                Cases(tuple((r, v) for (r, _), v in zip(value.cases, values)))
        if isinstance(value, Pred):
            return Indicator(value, 1, 0)
        if isinstance(value, Affine) and not np.issubdtype(np.dtype(dtype), np.number):
            return here
        if isinstance(value, (Opaque, Shifted)):
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
        shifted = shifted_data(op, a, b, here)
        if shifted is not None:
            return shifted
        if op != "mul" and isinstance(b, Affine) and isinstance(a, Scalar) and is_int(a.value):
            a = Affine((), int(a.value))
        if op != "mul" and isinstance(a, Affine) and isinstance(b, Scalar) and is_int(b.value):
            b = Affine((), int(b.value))
        if isinstance(a, Affine) and isinstance(b, Affine) and op != "mul":
            return a.plus(b, 1 if op == "add" else -1)
        if op == "mul":
            for x, y in ((a, b), (b, a)):
                if isinstance(x, Affine) and isinstance(y, Scalar) and is_int(y.value):
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
            if isinstance(x, Scalar) and is_int(x.value):
                return Affine((), int(x.value))
            return None

        la, lb = affine(a), affine(b)
        if la is not None and lb is not None:
            return difference_band(op, la.plus(lb, -1), here)
        for x, y, o in ((a, b, op), (b, a, FLIP[op])):
            c = affine(y)
            if isinstance(x, AbsAffine) and c is not None and not c.coeffs:
                return abs_band(o, x.inner, c.const, here)
        if isinstance(a, Scalar) and isinstance(b, Scalar):
            return Const(value=bool(NP_COMPARE[op](a.value, b.value)), origin=here)
        outcome = _two_valued_compare(op, a, b)
        if outcome is not None:
            return self.as_pred(outcome, here)
        for x, y, o in ((a, b, op), (b, a, FLIP[op])):
            if isinstance(x, Cases) and isinstance(y, Scalar):
                return compared(o, x, y.value, here)
        band = index_against_data(op, a, b, affine, here)
        if band is not None:
            return band
        a, b = (x.value if isinstance(x, Shifted) else x for x in (a, b))
        if op == "eq" and isinstance(a, Opaque) and isinstance(b, Opaque):
            return Segments(a, b, origin=here)
        if op == "eq" and isinstance(a, FloorDiv) and isinstance(b, FloorDiv):
            chunk = chunk_of(a, b, here)
            if chunk is not None:
                return chunk
        for x, y, o in ((a, b, op), (b, a, FLIP[op])):
            if isinstance(x, Opaque) and isinstance(y, Scalar):
                return Dense(source=x, test=((o, y.value),), origin=here)
        return Dense(source=here, origin=here)

    def _select(self, p: Pred, on_false: Any, on_true: Any, atom: Any, here: Opaque) -> Any:
        if isinstance(on_false, Scalar) and isinstance(on_true, Scalar):
            return Indicator(p, on_true.value, on_false.value)
        is_bool = compat.aval_of(atom).dtype == np.bool_
        ct, cf = _cases(on_true), _cases(on_false)
        if not is_bool and ct is not None and cf is not None \
                and any(isinstance(v, Data) for _, v in ct + cf):
            # select_n(p, f, t): t's cases where p holds, f's elsewhere.
            return _data_regions([(p_and(p, r), v) for r, v in ct]
                                 + [(p_and(p_not(p, None), r), v) for r, v in cf], atom, here)
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
            # ``where(causal, valid_a, valid_b)``: one per-key test on a band, another off it.
            out = region_test(p, t, f, here)
            if out is None:
                return self._opaque(atom, here)
        return out if is_bool else Indicator(out, 1, 0)


#: Fresh labels (below every top dim and every update-dim label) for the shifted dims of
#: a sliced operand.
_FRESH = -(1 << 20)

def _data_regions(found: list, atom: Any, here: Opaque) -> Any:
    """A value that is a constant or integer data on each region of ``found``
    (``(region, value)`` pairs) as :class:`Cases`. It stays opaque where the regions are
    decided by data alone (a computation on data, as gemma's positions
    ``cumsum(mask) - (cumsum(mask) >= 1)``, not a mask merged with an analytic one), where
    a region value is none (None), or beyond :data:`MAX_REGIONS` regions."""
    kept = [(r, v) for r, v in found if not _empty(r)]
    if any(v is None for _, v in kept) or len(kept) > MAX_REGIONS \
            or all(isinstance(t, Dense) for r, _ in kept for t in conjuncts(r)):
        return MaskAnalyzer._opaque(atom, here)
    return Cases(tuple(kept))


def _bool_cast(eqn) -> bool:
    """Whether ``eqn`` casts a boolean to a boolean (a weak-type change: the same value)."""
    return eqn.primitive.name == "convert_element_type" \
        and compat.aval_of(eqn.invars[0]).dtype == np.bool_ \
        and compat.aval_of(eqn.outvars[0]).dtype == np.bool_


def _two_valued_compare(op: str, a: Any, b: Any) -> Indicator | None:
    """``a op b`` of a two-valued mask (an :class:`Indicator`) and a constant, as the
    indicator of the outcomes on the mask's two values; None for other operands."""
    for x, y, o in ((a, b, op), (b, a, FLIP[op])):
        if isinstance(x, Indicator) and isinstance(y, Scalar):
            return Indicator(x.pred, bool(NP_COMPARE[o](x.on_true, y.value)),
                             bool(NP_COMPARE[o](x.on_false, y.value)))
    return None


def _cases(value: Any) -> list | None:
    """``value`` as ``(predicate, value there)`` cases covering every position, or None."""
    data = data_cases(value)
    if data is not None:
        return data
    if isinstance(value, Scalar):
        return [(Const(value=True), value.value)]
    if isinstance(value, Indicator):
        return [(value.pred, value.on_true), (p_not(value.pred, None), value.on_false)]
    if isinstance(value, Pred):
        return [(value, True), (p_not(value, None), False)]
    return None


def _empty(p: Pred) -> bool:
    """Whether ``p`` provably holds nowhere."""
    if isinstance(p, Const):
        return not p.value
    if p.line is not None:
        return not p.intervals
    if isinstance(p, And):
        return any(_empty(t) for t in p.terms)
    return False


def _union(regions: list) -> Pred:
    out = regions[0]
    for r in regions[1:]:
        out = p_or(out, r, None)
    return out


def _read_from(value: Any, atom: Any, here: Opaque) -> Any:
    """``value`` computed for ``atom`` from other values: its predicate's origin becomes
    ``atom`` where ``atom`` holds exactly where the predicate does (a boolean, or an
    indicator that is 0 elsewhere), so a part kept as data reads ``atom`` itself; else
    the parts keep their own origins."""
    is_bool = compat.aval_of(atom).dtype == np.bool_
    if isinstance(value, Pred) and is_bool and not isinstance(value, (And, Dense)):
        return dataclasses.replace(value, origin=here)
    if isinstance(value, Indicator) and not is_bool and bool(value.on_true) \
            and not value.on_false and not isinstance(value.pred, (And, Dense)):
        return Indicator(dataclasses.replace(value.pred, origin=here), value.on_true,
                         value.on_false)
    return value


def _shift(value: Any, shift: dict) -> Any:
    """``value`` (read with fresh labels) in terms of the top dims: fresh label ``f`` is
    index ``shift[f] = (top dim or None, start)`` plus its start. None where a part of
    ``value`` is data or a band becomes a bound on one index alone."""
    def index(label):
        return shift.get(label, (label, 0))

    if isinstance(value, (Scalar, Const)):
        return value
    if isinstance(value, Affine):
        out = Affine((), value.const)
        for d, c in value.coeffs:
            top, start = index(d)
            out = out.plus(Affine(((top, c),) if top is not None else (), c * start))
        return out
    if isinstance(value, AbsAffine):
        return AbsAffine(_shift(value.inner, shift))
    if isinstance(value, Indicator):
        pred = _shift(value.pred, shift)
        return None if pred is None else Indicator(pred, value.on_true, value.on_false)
    if isinstance(value, And):
        out: Pred = Const(value=True)
        for term in value.terms:
            moved = _shift(term, shift)
            if moved is None:
                return None
            out = p_and(out, moved)
        return out
    if isinstance(value, IndexRange):
        top, start = index(value.a)
        ivs = tuple((None if lo is None else lo - start, None if hi is None else hi - start)
                    for lo, hi in value.intervals)
        if top is None:
            return Const(value=any((lo is None or lo <= 0) and (hi is None or hi >= 0)
                                   for lo, hi in ivs))
        return IndexRange(top, normalize(ivs))
    if isinstance(value, Band):
        (ta, sa), (tb, sb) = index(value.a), index(value.b)
        # index_b - index_a = (top_b - top_a) + (sb - sa) lies in the intervals.
        ivs = tuple((None if lo is None else lo - (sb - sa), None if hi is None else hi - (sb - sa))
                    for lo, hi in value.intervals)
        if ta is None and tb is None or ta == tb:
            return Const(value=any((lo is None or lo <= 0) and (hi is None or hi >= 0)
                                   for lo, hi in ivs))
        if ta is None or tb is None:
            return None
        if ta > tb:
            ta, tb = tb, ta
            ivs = tuple((None if hi is None else -hi, None if lo is None else -lo)
                        for lo, hi in ivs)
        return Band(ta, tb, normalize(ivs))
    return None


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


