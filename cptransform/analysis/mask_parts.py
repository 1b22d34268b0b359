"""What a visibility predicate means for an attention: the parts of its ``MaskSpec``.

A band on ``kv - q`` becomes causal/window bounds, one band of ``kv`` around integer data
indexed by the query (``kv - coordinate[q]``) a coordinate band, one
``q_ids[q] == kv_ids[kv]`` comparison becomes segment ids, one top-k scatter along the key
dim becomes top-k indices, and everything else stays dense (data to be and-ed).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from cptransform.analysis.intervals import intersect, normalize
from cptransform.analysis.mask_values import (TOPK_DIM, Band, Chunk, Const, CoordinateBand,
                                              Dense, Opaque, Pred, Segments, TopK, as_dense,
                                              conjuncts)


@dataclass(frozen=True)
class MaskParts:
    """The visible-pair predicate split into MaskSpec parts.

    ``band``: bounds ``(lo, hi)`` on ``kv - q`` (None: open) or None; ``q_dim``: the top
    dim that is the query position (None when no analytic part says); ``segments``:
    ``(q_ids, kv_ids)`` opaque values; ``dense``: predicates kept as data (each
    :class:`Dense`, to be and-ed); ``topk``: the :class:`TopK` whose indices select the
    keys (or None); ``chunk``: the chunk size of a Llama-4 chunk predicate (or None);
    ``coordinates``: the query coordinates (an :class:`Opaque`) of a coordinate band and
    its bounds ``(lo, hi)`` on ``kv - coordinate`` (or None); ``kinds``: names of the parts
    found, for reports.
    """

    band: tuple | None
    q_dim: int | None
    segments: tuple | None
    dense: tuple
    kinds: tuple
    topk: TopK | None = None
    chunk: int | None = None
    coordinates: tuple | None = None


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
    topks: list[TopK] = []
    chunks: list[Chunk] = []
    coords: list[CoordinateBand] = []
    kinds: list[str] = []
    q_dim: int | None = None
    for term in conjuncts(pred):
        if isinstance(term, Const):
            dense.append(as_dense(term, term.origin))
        elif isinstance(term, Band):
            pair = (term.a, term.b)
            ok = kv_dim in pair and (pair[0] if pair[1] == kv_dim else pair[1]) in q_dims
            qd = pair[0] if pair[1] == kv_dim else pair[1]
            if ok and q_dim in (None, qd):
                q_dim = qd
                ivs = term.intervals if term.b == kv_dim else \
                    normalize(tuple((None if hi is None else -hi, None if lo is None else -lo)
                                     for lo, hi in term.intervals))
                bands.append(Band(qd, kv_dim, ivs, origin=term.origin))
            else:
                dense.append(as_dense(term, term.origin))
        elif isinstance(term, Chunk):
            qd = term.a if term.b == kv_dim else term.b
            if kv_dim in (term.a, term.b) and qd in q_dims and q_dim in (None, qd) \
                    and not chunks:
                q_dim = qd
                chunks.append(term)
            else:
                dense.append(as_dense(term, term.origin))
        elif isinstance(term, TopK):
            used = {d for d in term.indices.dims if d not in (None, TOPK_DIM)}
            if term.key_dim == kv_dim and kv_dim not in used and not topks \
                    and used <= set(batch_dims) | set(q_dims):
                topks.append(term)
            else:
                dense.append(as_dense(term, term.origin))
        elif isinstance(term, CoordinateBand):
            qd = _coordinate_query_dim(term, q_dims, kv_dim, batch_dims)
            if qd is not None and q_dim in (None, qd) and not coords \
                    and len(term.intervals) == 1:
                q_dim = qd
                coords.append(term)
            else:
                dense.append(as_dense(term, term.origin))
        elif isinstance(term, Segments):
            parts = _segment_sides(term, q_dims, kv_dim, batch_dims, q_dim)
            if parts is not None and not segs:
                q_dim = parts[0]
                segs.append(Segments(parts[1], parts[2], origin=term.origin))
            else:
                dense.append(as_dense(term, term.origin))
        else:
            dense.append(as_dense(term, term.origin))
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
            dense.extend(as_dense(b, b.origin) for b in bands)
        else:
            lo, hi = band
            if lo is not None and hi is not None and hi > 0:
                kinds.append(f"window({-lo},{hi})")
            else:
                if hi is not None:
                    kinds.append("causal" if hi == 0 else f"causal({hi:+d})")
                if lo is not None:
                    kinds.append(f"window({-lo})")
    if chunks:
        kinds.append(f"chunk({chunks[0].size})")
    if coords:
        kinds.append("coordinate_band({},{})".format(*coords[0].intervals[0]))
    if segs:
        kinds.append("segments")
    if topks:
        kinds.append("topk")
    if dense:
        kinds.append("dense")
    return MaskParts(band, q_dim, (segs[0].x, segs[0].y) if segs else None, tuple(dense),
                     tuple(kinds), topks[0] if topks else None,
                     chunks[0].size if chunks else None,
                     (coords[0].coordinate, coords[0].intervals[0]) if coords else None)


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
