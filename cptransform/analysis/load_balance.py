"""The load balance of one sequence layout over a whole program: :class:`LayoutBalance`.

The planner plans every attention under each layout the sequence length allows and keeps,
per layout, the FLOPs every layout rank executes (forward + backward, after the kernel's
block skipping: :mod:`cptransform.analysis.block_work`) under each attention's chosen
schedule, summed over the attentions, and the predicted time of the whole program (the sum
of the chosen schedules' predictions, each priced on its slowest device). The work counts
the mask's band exactly (causal, window, causal offsets); segment ids and dense masks are
data, so their blocks count as visible (an upper bound: the layout is chosen by the band
part of such masks, see :data:`DATA_MASK_NOTE`).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cptransform.analysis.block_work import Work
from cptransform.op.layouts import LAYOUTS
from cptransform.op.mask_terms import TERMS

#: What the balance assumes about masks that depend on data.
DATA_MASK_NOTE = (" / ".join(t.label for t in TERMS if t.key_hull is None)
                  + " are data: their blocks count as visible, so the balance is that of "
                  "the mask's band part")

#: Predicted program times within this factor count as a tie, which goes to the layout with
#: the least work on its busiest rank, then to the earlier of :data:`LAYOUTS` (contiguous
#: needs no reordering).
TIE = 1.01


def rank_flops(work: Work, cp: int) -> np.ndarray:
    """``[cp]`` FLOPs per layout rank from a schedule's :class:`Work`: a schedule whose
    groups span several consecutive layout ranks (Ulysses: all of them; hybrid: ``U``)
    gives each rank its group's value; a ``Work`` without per-device FLOPs gives every
    rank the slowest device's (balanced, never under the truth)."""
    if not work.device_flops:
        return np.full(cp, float(work.flops))
    per_device = np.asarray(work.device_flops, dtype=float)
    return np.repeat(per_device, cp // len(per_device))


@dataclass(frozen=True)
class LayoutBalance:
    """One candidate layout: the schedule it leads each attention to, the FLOPs each layout
    rank executes summed over attentions (``rank_flops``), the predicted program time
    (``time_s``; ``None`` without a hardware row) and whether the layout was chosen."""

    layout: str
    schedules: tuple[str, ...]
    rank_flops: tuple[float, ...]
    time_s: float | None
    data_masks: bool = False
    chosen: bool = False

    @property
    def slowest(self) -> float:
        """FLOPs of the busiest rank."""
        return max(self.rank_flops, default=0.0)

    @property
    def balance(self) -> float:
        """Busiest rank over the mean rank (1.0: perfectly balanced)."""
        mean = float(np.mean(self.rank_flops)) if self.rank_flops else 0.0
        return self.slowest / mean if mean else 1.0

    def describe(self) -> str:
        """One line: max/mean, the busiest rank's FLOPs, the predicted time, the schedules."""
        line = f"{self.layout}: max/mean {self.balance:.2f}x, busiest rank " \
               f"{self.slowest / 1e9:.3g} GFLOP"
        if self.time_s is not None:
            line += f", predicted {self.time_s * 1e3:.3g} ms"
        line += f" ({', '.join(self.schedules) or 'no attention'})"
        return line + (" <- chosen" if self.chosen else "")


def best_layout(balances: list[LayoutBalance]) -> LayoutBalance:
    """The layout with the least predicted program time (without prices: the least work on
    the busiest rank); ties (:data:`TIE`) go to the least busiest-rank work, then to the
    order of :data:`LAYOUTS`."""
    if all(b.time_s is not None for b in balances):
        fastest = min(b.time_s for b in balances)
        balances = [b for b in balances if b.time_s <= TIE * fastest]
    least = min(b.slowest for b in balances)
    balances = [b for b in balances if b.slowest <= TIE * least]
    return min(balances, key=lambda b: LAYOUTS.index(b.layout))
