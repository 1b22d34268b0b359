"""What a read logits chain does: to the visible logits (scale, soft-cap, biases), and to
the masked ones (how empty rows end up).

Assumption for finite fills (``-1e9``, ``finfo.min``, ...): a fill ``f <= -1e4`` only
counts as a mask when the visible logits stay far above it (``exp(f - max)`` underflows
to 0), which holds for any real model.
"""
from __future__ import annotations

import math
from itertools import combinations
from typing import Callable, Sequence

import numpy as np

from cptransform.analysis.mask_values import Pred
from cptransform.passes.match_attention.chain import FINITE_FILL_LIMIT, Step, StepKind
from cptransform.passes.match_attention.stats import NotAttention


def visible_form(steps: Sequence[Step], scale: float):
    """``(scale, softcap, biases, factors)`` of the logits where no mask hides them;
    ``factors``: the data factors ``(operand, exponent)`` on the raw products, which the
    queries take (a factor outside a soft-cap, or on a bias, is refused)."""
    inner = None  # (scale inside tanh, multiplier outside) once a tanh was seen
    biases: list = []
    factors: list = []
    for st in steps:
        if st.kind is StepKind.FACTOR:
            if inner is not None:
                raise NotAttention("a data factor multiplies soft-capped logits (outside "
                                   "the tanh): only a constant cap can be carried; apply "
                                   "the factor before the soft-cap")
            if biases:
                raise NotAttention("a data factor multiplies logits that already carry a "
                                   "bias: apply it before adding the bias")
            factors.append((st.side, st.value))
        elif st.kind is StepKind.SCALE:
            if inner is not None:
                inner = (inner[0], inner[1] * st.value)
            else:
                scale *= st.value
            biases = [(side, coef * st.value) for side, coef in biases]
        elif st.kind is StepKind.TANH:
            if inner is not None or biases:
                raise NotAttention("tanh of logits that already carry a bias or soft-cap")
            inner = (scale, 1.0)
        elif st.kind is StepKind.BIAS:
            biases.append((st.side, st.value))
    softcap = None
    if inner is not None:
        s, m = inner
        if m == 0:
            raise NotAttention("soft-capped logits multiplied by zero")
        scale, softcap = s * m, abs(m)
    return scale, softcap, biases, factors


_SAMPLES = (-2.5, 0.75, 3.0)
#: Sample ``(bias, factor)`` values (a factor comes before every mask: after one it is
#: refused before the simulation).
_SIDE_SAMPLES = ((-1.25, 0.5), (2.0, -2.0), (-1.25, 2.0))
_f32 = np.float32

#: ``effect(v, step, (bias, factor) sample, masked)``: a step's effect on one float32 logit.
_EFFECT: dict[StepKind, Callable] = {
    StepKind.SCALE: lambda v, st, b, masked: _f32(v * _f32(st.value)),
    StepKind.SHIFT: lambda v, st, b, masked: _f32(v + _f32(st.value)),
    StepKind.TANH: lambda v, st, b, masked: _f32(np.tanh(v)),
    StepKind.BIAS: lambda v, st, b, masked: _f32(v + _f32(st.value) * _f32(b[0])),
    StepKind.FACTOR: lambda v, st, b, masked: _f32(v * _f32(b[1] ** st.value)),
    StepKind.MASK_REPLACE: lambda v, st, b, masked: _f32(st.value) if masked else v,
    StepKind.MASK_MUL: lambda v, st, b, masked: _f32(v * _f32(0)) if masked else v,
    StepKind.MASK_BIAS: lambda v, st, b, masked: _f32(v + _f32(st.value)) if masked else v,
    StepKind.CAST: lambda v, st, b, masked: v,
    StepKind.LAYOUT: lambda v, st, b, masked: v,
}


def empty_rows(steps: Sequence[Step]) -> tuple[str, list[Pred], float | None]:
    """How masked logits end up: the ``MaskSpec.empty_rows`` they give (``"nan"`` for a
    ``-inf`` fill, ``"uniform"`` for a finite one that hides its keys), the distinct
    visibility predicates, and the kept fill (``MaskSpec.fill``: a finite value above
    ``FINITE_FILL_LIMIT``, which hides nothing: each masked key keeps a share of its row;
    ``None`` otherwise).

    Each subset of mask predicates that hides an entry is simulated on sample scores and
    biases (float32, as the program computes): the hidden value must not depend on them,
    and must be ``-inf`` for every subset or one finite value.
    """
    preds: list[Pred] = []
    for st in steps:
        if st.pred is not None and st.pred not in preds:
            preds.append(st.pred)
    if not preds:
        return "zero", preds, None
    if len(preds) > 6:
        raise NotAttention("more than six distinct masks on the logits")
    _factor_after_mask(steps)
    hidden_values = set()
    for r in range(1, len(preds) + 1):
        for hidden in combinations(range(len(preds)), r):
            outs = set()
            for x in _SAMPLES:
                for b in _SIDE_SAMPLES:
                    v = _f32(x)
                    with np.errstate(all="ignore"):
                        for st in steps:
                            masked = st.pred is not None and preds.index(st.pred) in hidden
                            v = _EFFECT[st.kind](v, st, b, masked)
                    outs.add(float(v) if not np.isnan(v) else "nan")
            if len(outs) != 1 or "nan" in outs:
                raise NotAttention("masked logits still depend on the scores or bias "
                                   "(mask applied before a soft-cap or bias?)")
            hidden_values |= outs
    if hidden_values == {-math.inf}:
        # softmax over a row of -inf is NaN on one device: the rewrite must say so.
        return "nan", preds, None
    if len(hidden_values) == 1:
        (fill,) = hidden_values
        if fill <= FINITE_FILL_LIMIT:
            return "uniform", preds, None
        return "zero", preds, _kept_fill(steps, fill)
    raise NotAttention("masked logits take different values depending on which mask hides "
                       f"them ({', '.join(sorted(f'{v:g}' for v in hidden_values))})")


def _kept_fill(steps: Sequence[Step], fill: float) -> float:
    """``fill``, the logit masked keys keep (too large to hide them), when the kernels
    can give it as one device does: selected (``where(mask, x, fill)``), never a product
    ``x·mask``, whose masked logit ``0·x`` is NaN where ``x`` is infinite."""
    if not math.isfinite(fill):
        raise NotAttention(f"masked logits become {fill:g}: no key is hidden and every masked "
                           "one takes all of its row's probability")
    if any(st.kind is StepKind.MASK_MUL for st in steps):
        raise NotAttention(f"masked logits become {fill:g} (too large to hide them) by a "
                           "product with the mask: 0·x is NaN where x is infinite, which a "
                           f"kept fill does not reproduce; select it: where(mask, x, {fill:g})")
    return fill


def _factor_after_mask(steps: Sequence[Step]) -> None:
    """Refuse a data factor applied after a mask: the fill times the factor is no mask
    the queries can take. A ``-inf`` fill times ``t`` sends ``0·(-inf) = NaN`` to ``t``'s
    gradient on one device (every hidden pair does), which a factor folded into the
    queries would not; a finite fill times ``t`` may stop hiding its keys."""
    masked = False
    for st in steps:
        masked = masked or st.pred is not None
        if masked and st.kind is StepKind.FACTOR:
            raise NotAttention("a data factor multiplies the logits after a mask (on one "
                               "device the -inf fill times it makes its gradient NaN, and "
                               "a finite fill times it may no longer hide a key): apply "
                               "the factor before the mask")


def fills_in_biases(steps: Sequence[Step]) -> list[Pred]:
    """The visibility predicates of the mask fills bias operands carry (``Step.hidden``):
    summed into a bias that a layout op then brings to the logits, they hide keys that no
    mask step names."""
    return [p for st in steps if st.kind is StepKind.BIAS for p in st.hidden]


def fill_added(steps: Sequence[Step], preds: Sequence[Pred]) -> bool:
    """Whether the masked logits still carry the scores' gradient: every mask step adds its
    fill (``x + where(mask, 0, fill)``) rather than selecting it or multiplying by the mask.

    On one device an empty row of such a softmax (``empty_rows="uniform"``) sends its
    gradient to every score (``MaskSpec.added_fill``). A fill added by some masks and
    selected by others would send it to the keys hidden by added masks only: refused.
    """
    cut = {st.pred for st in steps
           if st.kind in (StepKind.MASK_REPLACE, StepKind.MASK_MUL) and st.pred is not None}
    if not cut:
        return bool(preds)
    if set(preds) <= cut:
        return False
    raise NotAttention("a finite fill added to the scores by some masks and selected by "
                       "others: a fully masked row's gradient would reach only some keys")
