"""What passes learn about a whole program, as one typed record (``Module.facts``).

Decisions about one attention live on its ``attention_p`` equation (``AttentionSpec``);
facts about the whole program live here. A pass declares the facts (:class:`Fact`) it
``requires`` and ``ensures``; the pipeline checks them around every pass, so a missing fact
is one clear error naming the pass to run (or the option to give) first.
"""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:  # types only: the records are defined in the layers above
    from cptransform.analysis.load_balance import LayoutBalance
    from cptransform.analysis.match_report import MatchReport
    from cptransform.analysis.recurrence_cost import RecurrencePlan
    from cptransform.analysis.seq_axes_summary import SeqAxesSummary
    from cptransform.analysis.sharded_sequence import ShardedSequence
    from cptransform.op.layouts import Conversion, SequenceLayout
    from cptransform.passes.plan_context_parallel import AttentionPlan


class Fact(enum.Enum):
    """A fact a pass can require or ensure; the value says where it comes from."""

    MESH = "the CP mesh and its axes (given by context_parallel(), or --cp in the CLI)"
    MATCHES = "attention match reports (run match-attention first)"
    SEQ_AXES = "the sequence axes of inputs and outputs (run infer-seq-axes first)"
    PLAN = "a schedule per attention and the sequence layout (run plan-context-parallel first)"


@dataclass(frozen=True)
class Facts:
    """Program-wide facts; ``None`` (or empty) until the pass that provides them ran."""

    mesh: Any = None                                   # jax.sharding.Mesh holding cp_axes
    cp_axes: tuple[str, ...] = ()                      # hybrid: (ulysses_axis, ring_axis)
    seq_axes_overrides: Mapping[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    matches: tuple[MatchReport, ...] | None = None
    match_stats: Mapping[str, Mapping[str, float]] | None = None
    seq_axes: SeqAxesSummary | None = None
    plan: tuple[AttentionPlan, ...] | None = None
    layout: SequenceLayout | None = None               # None: contiguous
    balance: tuple[LayoutBalance, ...] = ()            # one per candidate layout (planner)
    reorder_log: tuple[str, ...] = ()
    conversions: tuple[Conversion, ...] = ()          # reorder-sequence: priced conversions
    recurrences: tuple[RecurrencePlan, ...] = ()       # planner: one per recurrence
    sharded_sequence: ShardedSequence | None = None    # planner: which of several sequences

    def has(self, fact: Fact) -> bool:
        """Whether ``fact`` has been provided."""
        return {Fact.MESH: self.mesh is not None and bool(self.cp_axes),
                Fact.MATCHES: self.matches is not None,
                Fact.SEQ_AXES: self.seq_axes is not None,
                Fact.PLAN: self.plan is not None}[fact]

    @property
    def cp(self) -> int:
        """Devices over the CP axes (1 without a mesh)."""
        if self.mesh is None:
            return 1
        size = 1
        for axis in self.cp_axes:
            size *= self.mesh.shape[axis]
        return size

    def replace(self, **changes) -> "Facts":
        return dataclasses.replace(self, **changes)
