"""Pass ``infer-seq-axes``: record which inputs and outputs carry the sequence axis.

The analysis itself (:func:`cptransform.analysis.seq_axes_summary.analyse`) works on any
program and is re-run by later passes on their own input (variables change with every
re-trace); this pass records the stable facts — per flat input and output, the sequence
dims — in ``module.facts.seq_axes`` and fails early when no attention reaches an input.
"""
from __future__ import annotations

from dataclasses import dataclass

from cptransform.ir.facts import Fact
from cptransform.ir.module import Module
from cptransform.ir.pipeline import Pass, PassResult
from cptransform.analysis.seq_axes import SeqAxisError
from cptransform.analysis.seq_axes_summary import analyse, summarize


@dataclass(frozen=True)
class InferSeqAxes(Pass):
    """Find the sequence axis of inputs, intermediates and outputs from attention's q/k/v."""

    name = "infer-seq-axes"
    summary = "which values carry the sequence axis (dataflow from attention to inputs)"
    ensures = (Fact.SEQ_AXES,)

    def run(self, module: Module) -> PassResult:
        axes = analyse(module)
        summary = summarize(module, axes)
        if axes.attentions and not any(summary.inputs):
            raise SeqAxisError(
                "no input of the function reaches an attention's sequence axis through "
                "dataflow; pass seq_axes= to say which argument dims are the sequence")
        return PassResult(module.with_jaxpr(module.jaxpr, seq_axes=summary), False,
                          (f"infer-seq-axes: {summary.describe()}",))
