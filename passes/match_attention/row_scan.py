"""Row reductions of a mask along its key axis, as counts along the keys.

keras-hub's Gemma zeroes the attention's output rows that see no key with
``all(mask == 0, axis=-1)`` on its ``[B, T, S]`` mask. When that row test cannot be folded
into the attention (:mod:`row_test`: an int mask with negative entries makes ``== 0`` no
complement of the attention's ``> 0``), the ``S×S`` mask it reduces would be built as it
is, and under context parallelism its key axis gathers the sequence. Such a reduction is
rewritten here into an exactly equal program that never builds the square:

* its operand is read by the mask analysis as a visible-pair predicate over its own dims,
  with the reduced axis as the key position ``j`` and another dim of the same length as
  the row position ``i``; the predicate must be ``K(j) & (P(i, j) ? In(j) : Out(j))``:
  key-only tests (padding, integer data tests; ``K``), at most a one-sided causal band
  and at most a region test (:class:`~cptransform.analysis.mask_values.RegionTest`), both
  split at the same diagonal ``P = (j <= i + e)``, ``e`` 0 or -1;
* ``any_j visible(i, j)`` is then ``count(j <= i + e: K & In) > 0`` or
  ``count(j > i + e: K & Out) > 0``: an inclusive or exclusive ``cumsum`` of ``[.., S]``
  int32 flags and a reversed one (no overflow below 2**31 keys), read at ``j = i`` and
  moved onto the row axis by a transpose;
* ``reduce_or`` is that ``any``; ``reduce_and`` of the operand is ``not any`` of its
  complement.

The cumulative sums are recurrences: ``match-recurrences`` passes their totals between
the devices, so the row test costs ``S/cp`` per device and ``cp`` numbers of traffic.
Anything else (a window, segments, a test that varies with the row, rows and keys of
different lengths) is left as it is: exact, with its ``S×S`` operand.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
from jax import lax

from cptransform.analysis.mask_analysis import MaskAnalyzer
from cptransform.analysis.mask_parts import MaskParts, classify
from cptransform.analysis.mask_values import Const, Dense, Pred, is_known
from cptransform.ir import compat
from cptransform.ir.rewrite import Replacement
from cptransform.passes.match_attention.emit import all_of

#: The boolean reductions along the keys, and whether each is ``all`` (of hidden pairs: it
#: holds for a row that sees no key) rather than ``any`` (of visible ones).
ROW_REDUCTIONS = {"reduce_and": True, "reduce_or": False}
#: The diagonals a side of the split may end on: keys ``j <= i`` or ``j <= i - 1``.
_SPLITS = (0, -1)


@dataclass(frozen=True)
class RowScan:
    """A row reduction read as counts: ``reduction`` the ``reduce_or``/``reduce_and``
    equation, ``axis`` its key axis, ``q_dim`` the operand dim of the rows, ``split`` the
    diagonal ``e`` of ``P = (j <= i + e)``, ``inside``/``outside`` the key tests that make a
    key visible on ``P`` and off it (each a tuple of :class:`Dense`, all to hold; None:
    no key there is visible)."""

    reduction: Any
    axis: int
    q_dim: int
    split: int
    inside: tuple | None
    outside: tuple | None

    def replacement(self) -> Replacement:
        """The reduction replaced by its counts (see the module docstring)."""
        operand = self.reduction.invars[0]
        shape = compat.aval_of(operand).shape
        out_shape = compat.aval_of(self.reduction.outvars[0]).shape
        negated = ROW_REDUCTIONS[self.reduction.primitive.name]
        tests = [t for side in (self.inside, self.outside) for t in side or ()]
        target = list(range(len(shape)))
        sizes = dict(enumerate(shape))
        axis, q_dim, inclusive = self.axis, self.q_dim, self.split == 0

        def flags(tests, values):
            if not tests:
                keys = [1] * len(shape)
                keys[axis] = shape[axis]
                return lax.convert_element_type(jnp.ones(keys, jnp.bool_), jnp.int32)
            return lax.convert_element_type(all_of(tests, values, target, sizes, (axis,)),
                                            jnp.int32)

        def build(*values):
            seen = None
            values = list(values)
            for side, before in ((self.inside, True), (self.outside, False)):
                if side is None:
                    continue
                f, values = flags(side, values[:len(side)]), values[len(side):]
                count = lax.cumsum(f, axis, reverse=not before)
                # Inclusive of the diagonal on P's side when e = 0, on the other when -1.
                if before != inclusive:
                    count = lax.sub(count, f)
                hit = lax.gt(count, jnp.zeros((), jnp.int32))
                seen = hit if seen is None else lax.bitwise_or(seen, hit)
            perm = list(range(len(shape)))
            perm[axis], perm[q_dim] = q_dim, axis
            rows = lax.transpose(seen, perm)
            rows = lax.reshape(rows, tuple(n for d, n in enumerate(rows.shape) if d != axis))
            rows = lax.broadcast_in_dim(rows, out_shape, tuple(range(len(out_shape))))
            return [lax.bitwise_not(rows) if negated else rows]

        return Replacement(self.reduction, tuple(t.source.var for t in tests), build)


def find_row_scan(masks: MaskAnalyzer, eqn: Any) -> RowScan | None:
    """The :class:`RowScan` of a row reduction ``eqn`` when its operand reads as a
    predicate of that form (module docstring), else None (it stays as it is)."""
    if eqn.primitive.name not in ROW_REDUCTIONS or len(eqn.params["axes"]) != 1:
        return None
    operand, = eqn.invars
    aval = compat.aval_of(operand)
    (axis,), shape = eqn.params["axes"], aval.shape
    if aval.dtype != jnp.bool_ or compat.is_literal(operand) or shape[axis] == 1:
        return None
    dims = tuple(d if n != 1 else None for d, n in enumerate(shape))
    rows = [d for d in range(len(shape)) if d != axis and shape[d] != 1]
    pred = key_visibility(masks, eqn, dims)
    if not is_known(pred):
        return None
    parts = classify(pred, rows, axis, lambda d: shape[d], shape[axis], rows)
    return _row_scan(eqn, axis, parts, shape)


def key_visibility(masks: MaskAnalyzer, eqn: Any, dims: tuple) -> Pred:
    """The visible pairs a row reduction ``eqn`` (of :data:`ROW_REDUCTIONS`) reads from its
    boolean operand, whose dims index top dims ``dims``: the operand's complement under
    ``all``, the operand itself under ``any``."""
    operand, = eqn.invars
    if ROW_REDUCTIONS[eqn.primitive.name]:
        return masks.complement(operand, dims)
    return masks.predicate(operand, dims)


def _row_scan(eqn: Any, axis: int, parts: MaskParts, shape: tuple) -> RowScan | None:
    """The :class:`RowScan` of classified ``parts``, or None when they are not of the
    form ``K(j) & (P(i, j) ? In(j) : Out(j))`` with one diagonal."""
    q_dim = parts.q_dim
    if q_dim is None or shape[q_dim] != shape[axis] or parts.pairs_by_data:
        return None
    keys = list(parts.dense)
    splits = []
    if parts.band not in (None, (None, None)):
        splits.append(_split(parts.band, (), None))
    if parts.region is not None:
        bounds, inside, outside = parts.region
        if any(not isinstance(t, (Dense, Const)) for t in (inside, outside)):
            return None
        sides = [(t,) if isinstance(t, Dense) else () if t.value else None
                 for t in (inside, outside)]
        splits.append(_split(bounds, *sides))
        keys += [t for t in (inside, outside) if isinstance(t, Dense)]
    if not splits or None in splits or len({s[0] for s in splits}) != 1:
        return None
    if any(t.source is None or q_dim in t.source.dims for t in keys):
        return None
    split, inside, outside = splits[0][0], tuple(parts.dense), tuple(parts.dense)
    for _, on, off in splits:
        inside = None if inside is None or on is None else inside + on
        outside = None if outside is None or off is None else outside + off
    if inside is None and outside is None:
        return None
    return RowScan(eqn, axis, q_dim, split, inside, outside)


def _split(bounds: tuple, on: tuple | None, off: tuple | None) -> tuple | None:
    """``(e, tests on P, tests off P)`` for a one-sided ``(lo, hi)`` on ``j - i``: tests
    that hold where the bounds do (``on``) and elsewhere (``off``); None when two-sided or
    not split at a diagonal of :data:`_SPLITS`."""
    lo, hi = bounds
    if lo is None and hi in _SPLITS:
        return hi, on, off
    if hi is None and lo is not None and lo - 1 in _SPLITS:
        return lo - 1, off, on
    return None
