"""Compiler passes: one module per pass, named after its file in kebab-case.

The registry lives here, not in the IR toolkit (the xDSL habit): :func:`get_all_passes`
maps each pass name to a factory that imports its module only when the pass is asked for,
and is what :meth:`cptransform.ir.pipeline.Pipeline.parse` receives as ``available``.
"""
from __future__ import annotations

from typing import Callable

from cptransform.ir.pipeline import Pass


def get_all_passes() -> dict[str, Callable[[], type[Pass]]]:
    """Every built-in pass in pipeline order: name → a factory returning its class."""
    def canonicalize():
        from cptransform.passes.canonicalize import Canonicalize
        return Canonicalize

    def match_attention():
        from cptransform.passes.match_attention import MatchAttention
        return MatchAttention

    def match_windows():
        from cptransform.passes.match_windows import MatchWindows
        return MatchWindows

    def match_recurrences():
        from cptransform.passes.match_recurrences import MatchRecurrences
        return MatchRecurrences

    def infer_seq_axes():
        from cptransform.passes.infer_seq_axes import InferSeqAxes
        return InferSeqAxes

    def plan_context_parallel():
        from cptransform.passes.plan_context_parallel import PlanContextParallel
        return PlanContextParallel

    def reorder_sequence():
        from cptransform.passes.reorder_sequence import ReorderSequence
        return ReorderSequence

    def lower_context_parallel():
        from cptransform.passes.lower_context_parallel import LowerContextParallel
        return LowerContextParallel

    return {"canonicalize": canonicalize, "match-attention": match_attention,
            "match-windows": match_windows, "match-recurrences": match_recurrences,
            "infer-seq-axes": infer_seq_axes, "plan-context-parallel": plan_context_parallel,
            "reorder-sequence": reorder_sequence,
            "lower-context-parallel": lower_context_parallel}
