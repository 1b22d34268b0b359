"""Integer data in masks: a padding mask handed over as numbers and merged by arithmetic.

Tokenizers return ``attention_mask`` as integers, and libraries merge it with their causal
or window mask by arithmetic before testing it: DeepMind gemma's ``make_causal_attn_mask``
multiplies (``mask[..., None, :] * causal``; ``where(mask, logits, K_MASK)`` then tests
``!= 0``), keras-hub takes ``minimum(mask, causal)`` (Keras' ``Softmax`` then tests
``> 0.5``, cast to the mask's int dtype: ``> 0``).

The analysis reads such a value as :class:`~cptransform.analysis.mask_values.Cases`: on
each region of the logits (a predicate) a constant or a
:class:`~cptransform.analysis.mask_values.Data` (the data with the steps taken so far). A
compare gives each region either a constant — where the outcome is the same for every
integer (``minimum(mask, 0) > 0`` never holds) — or a test of the data alone, a
:class:`~cptransform.analysis.mask_values.Dense` part whose ``test`` replays the steps on
the per-token value. When one test remains, the visible pairs are the conjunction of the
regions it holds on and that per-token test, so the padding stays ``[B, S]``. When two
remain, one on a band and the other off it, they are a
:class:`~cptransform.analysis.mask_values.RegionTest` (a ``RegionPadding`` term, two
``[B, S]`` operands): ``minimum(mask, causal) != 0`` keeps a key whose entry is negative
visible past the causal mask, which no conjunction says. Anything else stays data (exact,
``S×S``).

Only integer data is read so: its steps replay exactly and no NaN or Inf can make a
constant outcome wrong.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from cptransform.analysis.mask_predicates import NP_COMPARE, integer_data, is_int
from cptransform.analysis.mask_values import (Cases, Const, Data, Dense, Opaque, Pred,
                                              is_known, p_and, p_or, region_test)
from cptransform.ir import compat

#: Each binary op on two constants, as the program computes it elementwise.
COMBINE: dict[str, Callable] = {
    "add": lambda x, y: x + y, "sub": lambda x, y: x - y, "mul": lambda x, y: x * y,
    "min": min, "max": max, "and": lambda x, y: x & y, "or": lambda x, y: x | y,
    "xor": lambda x, y: x ^ y}

#: The ops a :class:`Data` value takes with an integer constant (its steps).
DATA_STEPS = ("min", "max", "mul", "add", "and", "or")
#: The float types an integer value may be converted to before its compare: every integer
#: is finite in them, and the conversion keeps the order.
_FLOATS = ("float32", "float64", "bfloat16")
#: The most regions a :class:`Cases` value keeps (each a product of the merged masks').
MAX_REGIONS = 16
#: Each compare's negation (exact for integers: no NaN).
NEGATED = {"eq": "ne", "ne": "eq", "lt": "ge", "ge": "lt", "le": "gt", "gt": "le"}


def data_cases(value: Any) -> list | None:
    """``value`` as ``(region, value there)`` cases when it is integer data or
    :class:`Cases` (else None)."""
    if isinstance(value, Cases):
        return list(value.cases)
    if integer_data(value):
        return [(Const(value=True), Data(value))]
    return None


def dtype_of(value: Data) -> np.dtype:
    """The type of ``value`` after its steps (the last conversion's, or the source's)."""
    for kind, arg in reversed(value.steps):
        if kind == "convert":
            return np.dtype(arg)
    return np.dtype(compat.aval_of(value.source.var).dtype)


def step(op: str, a: Any, b: Any) -> Any:
    """``a op b`` of two region values (constants or :class:`Data`); None when it is none
    (data on both sides, or an op or constant a :class:`Data` does not take)."""
    if not isinstance(a, Data) and not isinstance(b, Data):
        return COMBINE[op](a, b)
    if isinstance(a, Data) and isinstance(b, Data):
        return None
    x, k = (a, b) if isinstance(a, Data) else (b, a)
    if op == "sub" and x is a and is_int(k):
        op, k = "add", -k
    if op not in DATA_STEPS or not is_int(k) or dtype_of(x).kind not in "iu":
        return None
    k = int(k)
    if op in ("mul", "and") and k == 0:
        return 0
    if (op == "mul" and k == 1) or (op == "add" and k == 0):
        return x
    return Data(x.source, x.steps + ((op, k),))


def converted(value: Any, dtype: Any) -> Any:
    """A region value converted to ``dtype``; None for a :class:`Data` whose order or
    finiteness the conversion could change (a narrower integer, a half float)."""
    dtype = np.dtype(dtype)
    if not isinstance(value, Data):
        return dtype.type(value).item()
    here = dtype_of(value)
    if here.kind not in "iu" or not (np.can_cast(here, dtype, "safe") or dtype.name in _FLOATS):
        return None
    return Data(value.source, value.steps + (("convert", dtype.name),))


def compared(op: str, value: Cases, c: Any, origin: Opaque) -> Pred:
    """The predicate ``value op c``: per region a constant or a test of the data; the
    conjunction of the regions' union and the one test that remains, a
    :class:`~cptransform.analysis.mask_values.RegionTest` where two tests remain on a band
    and off it (:func:`_two_tests`), or the compare's result as data (``origin``)."""
    c = np.asarray(c).item()
    tests: dict = {}
    for region, v in value.cases:
        outcome = _outcome(v, op, c)
        if outcome is False:
            continue
        test = Const(value=True) if outcome else \
            Dense(source=v.source, test=v.steps + ((op, c),), origin=origin)
        tests.setdefault(test, []).append(region)
    if not tests:
        return Const(value=False, origin=origin)
    if len(tests) > 2:
        return Dense(source=origin, origin=origin)
    unions = [(test, _union(regions, origin)) for test, regions in tests.items()]
    where = unions[0][1] if len(unions) == 1 else p_or(unions[0][1], unions[1][1], origin)
    out = p_and(where, unions[0][0] if len(unions) == 1 else _two_tests(unions, origin), origin)
    return out if is_known(out) else Dense(source=origin, origin=origin)


def _union(regions: list, origin: Opaque) -> Pred:
    out = regions[0]
    for region in regions[1:]:
        out = p_or(out, region, origin)
    return out


def _two_tests(unions: list, origin: Opaque) -> Pred:
    """Which of two tests holds where, each given with the union of its regions: a
    :class:`RegionTest` when one union is a band (the other test holds off it; the caller
    ands the union of both), else data."""
    (inside, region), (outside, _) = unions
    out = region_test(region, inside, outside, origin)
    return Dense(source=origin, origin=origin) if out is None else out


def _outcome(value: Any, op: str, c: Any) -> bool | None:
    """``value op c`` when it is the same for every value of the data (always, for a
    constant), else None: after ``min(., k)`` a value is at most ``k``, after
    ``max(., k)`` at least ``k``."""
    if not isinstance(value, Data):
        return bool(NP_COMPARE[op](value, c))
    bound = next((s for s in reversed(value.steps) if s[0] != "convert"), None)
    if bound is None or bound[0] not in ("min", "max"):
        return None
    k, upper = bound[1], bound[0] == "min"
    reaching, away = (("gt", "ge"), ("lt", "le")) if upper else (("lt", "le"), ("gt", "ge"))
    beyond = k < c if upper else k > c
    if op in reaching and not NP_COMPARE[op](k, c):
        return False
    if op in away and NP_COMPARE[op](k, c):
        return True
    if op in ("eq", "ne") and beyond:
        return op == "ne"
    return None
