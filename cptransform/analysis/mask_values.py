"""The abstract values of mask analysis: index expressions, constants and predicates.

:mod:`cptransform.analysis.mask_analysis` gives every value of a mask subgraph one of these
meanings; :mod:`cptransform.analysis.mask_parts` sorts the resulting predicate into
``MaskSpec`` parts. Each value's dims are tied to the dims of "the top" (the logits the
mask applies to) by a :data:`DimMap`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from cptransform.analysis.intervals import complement, intersect, normalize, union

DimMap = tuple  # per dim of a value: the top dim it indexes, or None (size-1, broadcast)


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
class AbsAffine:
    """``|inner|`` of an index expression: only compared with a constant it is a band on
    both sides (``|i - j| <= w``); anything else about it is opaque."""

    inner: Affine


@dataclass(frozen=True)
class FloorDiv:
    """``inner // size`` of an index expression that cannot be negative (``size > 0``):
    compared for equality with another it is a chunk predicate (Llama-4)."""

    inner: Affine
    size: int


@dataclass(frozen=True)
class Shifted:
    """``source + offset`` of an integer data value ``source`` and a constant: a data
    coordinate that a compare with a key index makes a :class:`CoordinateBand` (gemma's
    ``positions - W``); ``value`` is the sum itself, what anything else reads."""

    source: Opaque
    offset: int
    value: Opaque


@dataclass(frozen=True)
class Scalar:
    """A constant, the same everywhere."""

    value: Any


@dataclass(frozen=True)
class Pred:
    """Base of the predicates; ``origin`` is the boolean value it was read from."""

    origin: Opaque | None = field(default=None, compare=False, kw_only=True)

    @property
    def line(self) -> tuple | None:
        """The difference an interval predicate bounds to its ``intervals`` (hashable:
        equal for two predicates of one difference), or None for any other predicate."""
        return None


@dataclass(frozen=True)
class Const(Pred):
    """Always ``value``."""

    value: bool = True


@dataclass(frozen=True)
class Band(Pred):
    """``index[b] - index[a]`` lies in ``intervals`` (``a < b`` are top dims)."""

    a: int = 0
    b: int = 0
    intervals: tuple = ()

    @property
    def line(self) -> tuple:
        return Band, self.a, self.b


@dataclass(frozen=True)
class IndexRange(Pred):
    """``index[a]`` lies in ``intervals``: a bound on one index alone (``kv < prompt_len``
    over a longer KV cache)."""

    a: int = 0
    intervals: tuple = ()

    @property
    def line(self) -> tuple:
        return IndexRange, self.a


@dataclass(frozen=True)
class Chunk(Pred):
    """``index[a] // size == index[b] // size`` (``a < b`` are top dims): Llama-4 chunked
    attention's fixed chunks of ``size`` positions."""

    a: int = 0
    b: int = 0
    size: int = 1


@dataclass(frozen=True)
class Segments(Pred):
    """``x == y`` where ``x`` and ``y`` are data indexed by different top dims."""

    x: Opaque | None = None
    y: Opaque | None = None


@dataclass(frozen=True)
class CoordinateBand(Pred):
    """``index[key_dim] - coordinate`` lies in ``intervals``, ``coordinate`` an integer data
    value (its dims map to top dims): a window around data positions."""

    coordinate: Opaque | None = None
    key_dim: int | None = None
    intervals: tuple = ()

    @property
    def line(self) -> tuple:
        return CoordinateBand, self.coordinate, self.key_dim


def same_line(a: Pred, b: Pred) -> bool:
    """Whether ``a`` and ``b`` are both interval predicates of one difference
    (:attr:`Pred.line`)."""
    return a.line is not None and a.line == b.line


@dataclass(frozen=True)
class Dense(Pred):
    """Data: the boolean value ``source`` (negated if ``negated``), or, with a ``test``, the
    data ``source`` put through it: ``((op, value), ...)``, the steps of a :class:`Data`
    then a compare, e.g. ``(("ne", 0),)`` for ``attention_mask != 0`` of an int padding
    mask, ``(("min", 1), ("gt", 0))`` for keras-hub's ``minimum`` of it with a causal mask
    tested ``> 0`` (the source keeps the data's own dims, ``[B, S]``, not the ``S×S`` of
    the compare, so a padding mask stays a per-token operand)."""

    source: Opaque | None = None
    negated: bool = False
    test: tuple = ()


@dataclass(frozen=True)
class RegionTest(Pred):
    """``inside`` where ``region`` holds and ``outside`` elsewhere: ``region`` an interval
    predicate (a :class:`Band` of one interval), ``inside`` and ``outside`` each a
    :class:`Dense` test of integer data or a :class:`Const`. An integer padding mask merged
    with a causal mask by arithmetic and tested: ``minimum(mask, causal) != 0`` is
    ``mask != 0`` on the causal band and ``mask < 0`` off it."""

    region: Pred | None = None
    inside: Pred | None = None
    outside: Pred | None = None


def region_test(region: Pred, inside: Pred, outside: Pred, origin: Opaque | None):
    """``inside`` where ``region`` holds and ``outside`` elsewhere as a :class:`RegionTest`
    (``region`` or its complement a band of one interval; each test a :class:`Dense` of
    a source or a :class:`Const`), or None. Only with an ``origin``: read as data where
    no term can take it, it is that value."""
    tests = origin is not None and all(
        isinstance(t, Const) or (isinstance(t, Dense) and t.source is not None)
        for t in (inside, outside))
    if not tests or not isinstance(region, Band) or inside == outside:
        return None
    if len(region.intervals) != 1:
        region, inside, outside = p_not(region, origin), outside, inside
    if len(region.intervals) != 1:
        return None
    return RegionTest(region=region, inside=inside, outside=outside, origin=origin)


@dataclass(frozen=True)
class Data:
    """An integer number per element read from data: ``steps`` (``(op, constant)`` pairs,
    op one of ``min max mul add and or``, or ``("convert", dtype name)``) applied in order
    to ``source``, an integer :class:`Opaque` value of the program (its dims map to top
    dims). A compare of it is a :class:`Dense` part whose ``test`` replays the steps."""

    source: Opaque
    steps: tuple = ()


@dataclass(frozen=True)
class Cases:
    """A number that is ``value`` where ``pred`` holds, for each ``(pred, value)`` of
    ``cases`` (disjoint regions covering every element; a value is a constant or a
    :class:`Data`): an integer padding mask merged with analytic masks by arithmetic
    (``mask[:, None, :] * causal``, ``minimum(mask, causal)``)."""

    cases: tuple


#: The label of a top-k indices value's ``k`` dim in its :class:`Opaque` dim map (it is
#: no top dim: the indices list key positions along it).
TOPK_DIM = "topk"


@dataclass(frozen=True)
class TopK(Pred):
    """Key ``index[key_dim]`` is one of ``indices[.., :]``: a boolean scatter of True into
    all-False at a top-k's indices along ``key_dim`` (the dims of ``indices`` map to top
    dims, its ``k`` dim to :data:`TOPK_DIM`)."""

    indices: Opaque | None = None
    key_dim: int | None = None


@dataclass(frozen=True)
class And(Pred):
    """All of ``terms``."""

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


def is_known(p: Pred) -> bool:
    """Whether every part of ``p`` says what it is (no :class:`Dense` without a source:
    a union or negation of parts that is no analytic predicate and no value of the
    program)."""
    return all(not isinstance(t, Dense) or t.source is not None for t in conjuncts(p))


def implies(a: Pred, b: Pred) -> bool:
    """Whether ``a`` implies ``b``, proven term by term: every conjunct of ``b`` is a
    conjunct of ``a``, or an interval predicate holding wherever ``a``'s on the same
    difference (:func:`same_line`) all hold. False when it cannot be proven (a part of
    unknown meaning proves nothing)."""
    terms = conjuncts(a)
    if any(isinstance(t, Const) and not t.value for t in terms):
        return True
    if not (is_known(a) and is_known(b)):
        return False
    lines: dict = {}
    for t in terms:
        if t.line is not None:
            lines[t.line] = intersect(lines.get(t.line, ((None, None),)), t.intervals)
    for t in conjuncts(b):
        held = lines.get(t.line) if t.line is not None else None
        inside = held is not None and intersect(held, t.intervals) == normalize(held)
        if t not in terms and not inside:
            return False
    return True


def p_and(a: Pred, b: Pred, origin: Opaque | None = None) -> Pred:
    """``a and b``, merging bands over the same pair of dims."""
    if isinstance(a, Const):
        return b if a.value else a
    if isinstance(b, Const):
        return a if b.value else b
    if same_line(a, b):
        return dataclasses.replace(a, intervals=intersect(a.intervals, b.intervals),
                                   origin=origin)
    return And(tuple(conjuncts(a) + conjuncts(b)), origin=origin)


def as_dense(p: Pred, origin: Opaque) -> Dense:
    """``p`` kept as data: the boolean value ``origin`` it was read from."""
    return p if isinstance(p, Dense) else Dense(source=origin, origin=origin)


def p_or(a: Pred, b: Pred, origin: Opaque) -> Pred:
    """``a or b``; only bands over the same pair of dims stay analytic."""
    if isinstance(a, Const):
        return a if a.value else b
    if isinstance(b, Const):
        return b if b.value else a
    if same_line(a, b):
        return dataclasses.replace(a, intervals=union(a.intervals, b.intervals),
                                   origin=origin)
    # A band or a per-token test (``max(padding, causal)``): the test off the band.
    for region, test in ((a, b), (b, a)):
        either = region_test(region, Const(value=True), test, origin)
        if either is not None:
            return either
    return Dense(source=origin, origin=origin)


def p_not(a: Pred, origin: Opaque) -> Pred:
    """``not a``."""
    if isinstance(a, Const):
        return Const(value=not a.value, origin=origin)
    if a.line is not None:
        return dataclasses.replace(a, intervals=complement(a.intervals), origin=origin)
    if isinstance(a, Dense):
        return Dense(source=a.source, negated=not a.negated, test=a.test, origin=origin)
    terms = conjuncts(a)
    if isinstance(a, And) and len(terms) == 2:
        # ``not (band and test)`` (``max(padding, causal)`` read through its zeros): the
        # negated test on the band, true off it.
        for band, test in (terms, terms[::-1]):
            either = region_test(band, p_not(test, origin), Const(value=True), origin)
            if either is not None and isinstance(test, Dense):
                return either
    return Dense(source=origin, origin=origin)
