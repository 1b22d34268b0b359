"""What a visibility predicate means for an attention: the parts of its ``MaskSpec``.

A band on ``kv - q`` becomes causal/window bounds, a bound on one index that the rest of
the mask implies (``kv < prompt_len`` beside causal over a longer KV cache) is dropped, one band of ``kv`` around integer data
indexed by the query (``kv - coordinate[q]``) a coordinate band, one
``q_ids[q] == kv_ids[kv]`` comparison becomes segment ids, one top-k scatter along the key
dim becomes top-k indices, a key test that differs on a band and off it region padding
(:class:`RegionTest`), and everything else stays dense (data to be and-ed).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from cptransform.analysis.intervals import intersect, normalize
from cptransform.analysis.mask_values import (TOPK_DIM, Band, Chunk, CoordinateBand,
                                              Const, Dense, IndexRange, Opaque, Pred,
                                              RegionTest, Segments, TopK, as_dense, conjuncts)


@dataclass(frozen=True)
class MaskParts:
    """The visible-pair predicate split into MaskSpec parts.

    ``band``: bounds ``(lo, hi)`` on ``kv - q`` (None: open) or None; ``q_dim``: the top
    dim that is the query position (None when no analytic part says); ``segments``:
    ``(q_ids, kv_ids)`` opaque values; ``dense``: predicates kept as data (each
    :class:`Dense`, to be and-ed); ``topk``: the :class:`TopK` whose indices select the
    keys (or None); ``chunk``: the chunk size of a Llama-4 chunk predicate (or None);
    ``coordinates``: the query coordinates (an :class:`Opaque`) of a coordinate band and
    its bounds ``(lo, hi)`` on ``kv - coordinate`` (or None); ``region``: a key test that
    depends on the pair's region, ``((lo, hi), inside, outside)`` with bounds on ``kv - q``
    and each test a key-only :class:`Dense` or a true :class:`Const` (or None); ``kinds``:
    names of the parts found, for reports.
    """

    band: tuple | None
    q_dim: int | None
    segments: tuple | None
    dense: tuple
    kinds: tuple
    topk: TopK | None = None
    chunk: int | None = None
    coordinates: tuple | None = None
    region: tuple | None = None

    @property
    def pairs_by_data(self) -> bool:
        """Whether a part ties keys to queries by data or by blocks (segment ids, top-k
        indices, chunks, a coordinate band): beyond the band, the region padding and the
        dense parts."""
        return any(p is not None for p in (self.segments, self.topk, self.chunk,
                                           self.coordinates))


@dataclass
class _Reading:
    """The analytic parts one conjunction yields, read term by term (:data:`_READERS`):
    at most one of each kind beside any number of bands, all on one query dim."""

    q_dims: Sequence[int]
    kv_dim: int
    batch_dims: Sequence[int]
    q_dim: int | None = None
    bands: list = field(default_factory=list)
    segs: list = field(default_factory=list)
    topks: list = field(default_factory=list)
    chunks: list = field(default_factory=list)
    coords: list = field(default_factory=list)
    ranges: list = field(default_factory=list)
    regions: list = field(default_factory=list)

    def on_query_dim(self, qd) -> bool:
        """Whether ``qd`` can be the query dim (the parts read so far agree), taking it."""
        if qd not in self.q_dims or self.q_dim not in (None, qd):
            return False
        self.q_dim = qd
        return True


def _read_band(r: _Reading, term: Band) -> bool:
    pair = (term.a, term.b)
    qd = pair[0] if pair[1] == r.kv_dim else pair[1]
    if r.kv_dim not in pair or not r.on_query_dim(qd):
        return False
    ivs = term.intervals if term.b == r.kv_dim else \
        normalize(tuple((None if hi is None else -hi, None if lo is None else -lo)
                        for lo, hi in term.intervals))
    r.bands.append(Band(qd, r.kv_dim, ivs, origin=term.origin))
    return True


def _read_range(r: _Reading, term: IndexRange) -> bool:
    r.ranges.append(term)
    return True


def _read_chunk(r: _Reading, term: Chunk) -> bool:
    qd = term.a if term.b == r.kv_dim else term.b
    if r.kv_dim not in (term.a, term.b) or r.chunks or not r.on_query_dim(qd):
        return False
    r.chunks.append(term)
    return True


def _read_topk(r: _Reading, term: TopK) -> bool:
    used = {d for d in term.indices.dims if d not in (None, TOPK_DIM)}
    if term.key_dim != r.kv_dim or r.kv_dim in used or r.topks \
            or not used <= set(r.batch_dims) | set(r.q_dims):
        return False
    r.topks.append(term)
    return True


def _read_coordinates(r: _Reading, term: CoordinateBand) -> bool:
    qd = _coordinate_query_dim(term, r.q_dims, r.kv_dim, r.batch_dims)
    if qd is None or r.coords or len(term.intervals) != 1 or not r.on_query_dim(qd):
        return False
    r.coords.append(term)
    return True


def _read_segments(r: _Reading, term: Segments) -> bool:
    parts = _segment_sides(term, r.q_dims, r.kv_dim, r.batch_dims, r.q_dim)
    if parts is None or r.segs:
        return False
    r.q_dim = parts[0]
    r.segs.append(Segments(parts[1], parts[2], origin=term.origin))
    return True


def _read_region(r: _Reading, term: RegionTest) -> bool:
    band = term.region
    pair = (band.a, band.b)
    qd = pair[0] if pair[1] == r.kv_dim else pair[1]
    keys = set(r.batch_dims) | {r.kv_dim}
    per_key = all((isinstance(t, Const) and t.value) or (
        isinstance(t, Dense) and {d for d in t.source.dims if d is not None} <= keys)
        for t in (term.inside, term.outside))
    if r.kv_dim not in pair or r.regions or not per_key or not r.on_query_dim(qd):
        return False
    (lo, hi), = band.intervals if band.b == r.kv_dim else \
        ((None if band.intervals[0][1] is None else -band.intervals[0][1],
          None if band.intervals[0][0] is None else -band.intervals[0][0]),)
    r.regions.append(((lo, hi), term.inside, term.outside))
    return True


#: How each kind of term becomes an analytic part; a term a reader declines (or of a kind
#: without one, such as a constant) stays dense.
_READERS: dict[type, Callable[[_Reading, Pred], bool]] = {
    Band: _read_band, IndexRange: _read_range, Chunk: _read_chunk, TopK: _read_topk,
    CoordinateBand: _read_coordinates, Segments: _read_segments, RegionTest: _read_region}


def classify(pred: Pred, q_dims: Sequence[int], kv_dim: int, q_len_of: Callable[[int], int],
             kv_len: int, batch_dims: Sequence[int]) -> MaskParts:
    """Split a visibility predicate over the logits' dims into MaskSpec parts.

    ``q_dims``: top dims that may be the query position (the query's free dims);
    ``kv_dim``: the key position dim; ``batch_dims``: dims that segment ids may vary along.
    Parts that cannot be analytic (a band on a heads dim, a band with a gap, a second set
    of segment ids) become dense.
    """
    r = _Reading(q_dims, kv_dim, batch_dims)
    dense: list[Dense] = []
    for term in conjuncts(pred):
        reader = _READERS.get(type(term))
        if reader is None or not reader(r, term):
            dense.append(as_dense(term, term.origin))
    band = _merged_band(r, q_len_of, kv_len) if r.bands else None
    if r.bands and band is None:
        dense.extend(as_dense(b, b.origin) for b in r.bands)
    q_len = None if band is None else q_len_of(r.q_dim)
    dense.extend(as_dense(t, t.origin) for t in r.ranges
                 if not _implied(t, band, q_len, r.kv_dim, q_len_of, kv_len))
    kinds = _band_kinds(band) + [f"chunk({c.size})" for c in r.chunks] \
        + ["coordinate_band({},{})".format(*c.intervals[0]) for c in r.coords] \
        + ["segments"] * bool(r.segs) + ["topk"] * bool(r.topks) \
        + ["region_padding"] * bool(r.regions) + ["dense"] * bool(dense)
    return MaskParts(band, r.q_dim, (r.segs[0].x, r.segs[0].y) if r.segs else None,
                     tuple(dense), tuple(kinds), r.topks[0] if r.topks else None,
                     r.chunks[0].size if r.chunks else None,
                     (r.coords[0].coordinate, r.coords[0].intervals[0]) if r.coords else None,
                     r.regions[0] if r.regions else None)


def _merged_band(r: _Reading, q_len_of: Callable[[int], int], kv_len: int) -> tuple | None:
    """The bands' intersection as ``(lo, hi)`` on ``kv - q`` (a side no query reaches past
    opened), or None when it has a gap or starts after the diagonal (kept dense)."""
    ivs: tuple = ((None, None),)
    for b in r.bands:
        ivs = intersect(ivs, b.intervals)
    if len(ivs) != 1:
        return None
    lo, hi = ivs[0]
    lo = None if lo is None or lo <= -(q_len_of(r.q_dim) - 1) else lo
    hi = None if hi is None or hi >= kv_len - 1 else hi
    return (lo, hi) if lo is None or lo <= 0 else None


def _implied(term: IndexRange, band: tuple | None, q_len: int | None, kv_dim: int,
             size_of: Callable[[int], int], kv_len: int) -> bool:
    """Whether a bound on one index holds wherever the rest of the mask lets a pair
    through: on the key dim, at every key the band ``lo <= kv - q <= hi`` reaches from a
    query ``0 <= q < q_len``; on any other dim, at every index of the dim."""
    if term.a != kv_dim:
        first, last = 0, size_of(term.a) - 1
    else:
        lo, hi = band or (None, None)
        first = 0 if lo is None else max(0, lo)
        last = kv_len - 1 if hi is None else min(kv_len - 1, hi + q_len - 1)
    if first > last:
        return True
    return intersect(term.intervals, ((first, last),)) == ((first, last),)


def _band_kinds(band: tuple | None) -> list[str]:
    """The report names of a band: a two-sided window, or causal and/or a left window."""
    if band is None:
        return []
    lo, hi = band
    if lo is not None and hi is not None and hi > 0:
        return [f"window({-lo},{hi})"]
    return ([] if hi is None else ["causal" if hi == 0 else f"causal({hi:+d})"]) \
        + ([] if lo is None else [f"window({-lo})"])


def _coordinate_query_dim(term: CoordinateBand, q_dims, kv_dim, batch_dims):
    """The query dim a coordinate band's coordinate is indexed by, when its key is the key
    position and its coordinate varies along exactly one query dim (and batch dims), else
    None: the dim map proves the data is per query, sizes never do."""
    used = {d for d in term.coordinate.dims if d is not None}
    qs = used & set(q_dims)
    if term.key_dim != kv_dim or len(qs) != 1 or not used <= set(batch_dims) | qs:
        return None
    return next(iter(qs))


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
