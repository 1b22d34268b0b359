"""How compares of index expressions and integer data become visibility predicates.

:class:`~cptransform.analysis.mask_analysis.MaskAnalyzer` reads a mask's subgraph into
abstract values; a compare of two of them becomes a predicate here: a compare of an affine
difference of two indices with a constant is a :class:`Band` (``t op r`` solved over the
integers), of one index an :class:`IndexRange`, ``|x| op c`` two of them, an index against integer data plus a constant a
:class:`CoordinateBand`, ``i // C == j // C`` a :class:`Chunk`, and a constant boolean array
that depends on ``index_b - index_a`` alone a :class:`Band` again.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from cptransform.analysis.intervals import complement, normalize
from cptransform.analysis.mask_values import (Affine, Band, Chunk, Const, CoordinateBand,
                                              Dense, DimMap, FloorDiv, IndexRange, Opaque,
                                              Pred, Scalar, Shifted, p_and, p_or)
from cptransform.ir import compat
from cptransform.ir.graph import Graph


FLIP = {"ge": "le", "gt": "lt", "le": "ge", "lt": "gt", "eq": "eq", "ne": "ne"}


def floor_division(graph: Graph, eqn) -> tuple | None:
    """``(x, c)`` when ``eqn`` is ``x // c`` as ``jnp.floor_divide`` traces it for integers:
    ``select_n((sign(x) != sign(c)) & (rem(x, c) != 0), div(x, c), div(x, c) - 1)``."""
    if eqn.primitive.name != "select_n" or len(eqn.invars) != 3:
        return None
    quotient, corrected = (graph.producer(a) for a in eqn.invars[1:])
    if quotient is None or quotient.primitive.name != "div" or corrected is None \
            or corrected.primitive.name != "sub" or corrected.invars[0] is not eqn.invars[1]:
        return None
    cond = graph.producer(eqn.invars[0])
    if cond is None or cond.primitive.name != "and":
        return None
    rems = [graph.producer(graph.producer(a).invars[0]) for a in cond.invars
            if graph.producer(a) is not None and graph.producer(a).primitive.name == "ne"]
    x, c = quotient.invars

    def same(a, b):
        if compat.is_literal(a) and compat.is_literal(b):
            return np.array_equal(compat.literal_value(a), compat.literal_value(b))
        return a is b

    if not any(r is not None and r.primitive.name == "rem" and r.invars[0] is x
               and same(r.invars[1], c) for r in rems):
        return None
    return x, c


def non_negative(value: Any) -> bool:
    """An index expression that no index makes negative (positive coefficients)."""
    return isinstance(value, Affine) and value.const >= 0 and all(c > 0 for _, c in value.coeffs)


def chunk_of(a: FloorDiv, b: FloorDiv, origin: Opaque) -> Chunk | None:
    """``index[i] // C == index[j] // C`` of two different plain indices, or None."""
    if a.size != b.size or a.inner.const or b.inner.const \
            or len(a.inner.coeffs) != 1 or len(b.inner.coeffs) != 1:
        return None
    (da, ca), (db, cb) = a.inner.coeffs[0], b.inner.coeffs[0]
    if ca != 1 or cb != 1 or da == db:
        return None
    return Chunk(min(da, db), max(da, db), a.size, origin=origin)


NP_COMPARE = {"ge": np.greater_equal, "gt": np.greater, "le": np.less_equal,
               "lt": np.less, "eq": np.equal, "ne": np.not_equal}


MAX_CONSTANT_MASK = 1 << 22


def constant_band(visible: np.ndarray, dims: DimMap, origin: Opaque) -> Band | None:
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
    return Band(dims[i], dims[j], normalize(ivs), origin=origin)


def is_int(value: Any) -> bool:
    try:
        return float(value) == int(value)
    except (TypeError, ValueError, OverflowError):
        return False


def abs_band(op: str, x: Affine, c: int, origin: Opaque) -> Pred:
    """The predicate ``|x| op c`` for an affine ``x``: ``|x| <= c`` is ``x <= c and
    -x <= c``, ``|x| >= c`` is ``x >= c or -x >= c``, ``|x| == c`` is ``x == c or
    x == -c`` (so each side stays a band when ``x`` is a difference of two indices)."""
    upper = difference_band(op, x.plus(Affine((), c), -1), origin)           # x op c
    lower = difference_band(op, x.times(-1).plus(Affine((), c), -1), origin)  # -x op c
    if not (isinstance(upper, Band) and isinstance(lower, Band)):
        return Dense(source=origin, origin=origin)
    if op in ("le", "lt", "ne"):
        return p_and(upper, lower, origin)
    return p_or(upper, lower, origin)


def difference_band(op: str, diff: Affine, origin: Opaque) -> Pred:
    """The predicate ``diff op 0`` for an affine ``diff``."""
    coeffs = dict(diff.coeffs)
    if not coeffs:
        return Const(value=bool(NP_COMPARE[op](diff.const, 0)), origin=origin)
    if len(coeffs) == 1:
        # c * index_a + const  op  0   <=>   index_a op' -const / c
        ((a, c),) = coeffs.items()
        return IndexRange(a, solutions(FLIP[op] if c < 0 else op, -diff.const / c),
                          origin=origin)
    if len(coeffs) != 2:
        return Dense(source=origin, origin=origin)
    (a, ca), (b, cb) = sorted(coeffs.items())
    if ca != -cb:
        return Dense(source=origin, origin=origin)
    # cb * (index_b - index_a) + const  op  0   <=>   t op' r   with t = index_b - index_a
    r = -diff.const / cb
    if cb < 0:
        op = FLIP[op]
    return Band(a, b, solutions(op, r), origin=origin)


def solutions(op: str, r: float) -> tuple:
    """The integers ``t`` with ``t op r``, as normalised intervals."""
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
    return normalize(ivs)


def integer_data(value: Any) -> bool:
    """An opaque value of an integer dtype (data a coordinate can be)."""
    return isinstance(value, Opaque) \
        and np.issubdtype(compat.aval_of(value.var).dtype, np.integer)


def shifted_data(op: str, a: Any, b: Any, here: Opaque) -> Shifted | None:
    """``a op b`` as integer data plus a constant (``x ± c``, ``c + x``), or None."""
    if op == "mul" or not np.issubdtype(compat.aval_of(here.var).dtype, np.integer):
        return None
    # (data, constant, sign of the constant): ``c - x`` is no shift of ``x``.
    pairs = [(a, b, 1), (b, a, 1)] if op == "add" else [(a, b, -1)]
    for x, c, sign in pairs:
        if not isinstance(c, Scalar) or not is_int(c.value):
            continue
        if isinstance(x, Shifted):
            return Shifted(x.source, x.offset + sign * int(c.value), here)
        if integer_data(x):
            return Shifted(x, sign * int(c.value), here)
    return None


def index_against_data(op: str, a: Any, b: Any, affine: Callable[[Any], Affine | None],
                       origin: Opaque) -> CoordinateBand | None:
    """``a op b`` where one side is one index (through ``affine``) and the other integer
    data: the :class:`CoordinateBand` it bounds, or None."""
    for x, y, o in ((a, b, op), (b, a, FLIP[op])):
        band = _coordinate_band(o, affine(x), y, origin)
        if band is not None:
            return band
    return None


def _coordinate_band(op: str, index: Affine | None, data: Any,
                     origin: Opaque) -> CoordinateBand | None:
    """``index op data`` of one index (coefficient 1, plus a constant) and integer data
    plus a constant, as ``index - coordinate`` in intervals; None for anything else."""
    if index is None or len(index.coeffs) != 1 or index.coeffs[0][1] != 1:
        return None
    if isinstance(data, Shifted):
        source, offset = data.source, data.offset
    elif integer_data(data):
        source, offset = data, 0
    else:
        return None
    # index + c  op  x + offset   <=>   index - x  op  offset - c
    return CoordinateBand(coordinate=source, key_dim=index.coeffs[0][0],
                          intervals=solutions(op, offset - index.const), origin=origin)
