"""Sets of integers as sorted, merged intervals: the values of ``kv - q`` a band keeps."""
from __future__ import annotations

import math
from typing import Sequence

Interval = tuple  # (lo, hi), ints or None for an open side


def _lo_key(lo):
    return -math.inf if lo is None else lo


def _hi_key(hi):
    return math.inf if hi is None else hi


def normalize(intervals: Sequence[Interval]) -> tuple[Interval, ...]:
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
    """The integers in both ``a`` and ``b``."""
    out = []
    for lo1, hi1 in a:
        for lo2, hi2 in b:
            lo = lo2 if lo1 is None else lo1 if lo2 is None else max(lo1, lo2)
            hi = hi2 if hi1 is None else hi1 if hi2 is None else min(hi1, hi2)
            out.append((lo, hi))
    return normalize(out)


def union(a: Sequence[Interval], b: Sequence[Interval]) -> tuple[Interval, ...]:
    """The integers in ``a`` or ``b``."""
    return normalize(tuple(a) + tuple(b))


def complement(a: Sequence[Interval]) -> tuple[Interval, ...]:
    """The integers not in ``a``."""
    out, start = [], None
    for lo, hi in normalize(a):
        if lo is not None:
            out.append((start, lo - 1))
        if hi is None:
            return normalize(out)
        start = hi + 1
    out.append((start, None))
    return normalize(out)
