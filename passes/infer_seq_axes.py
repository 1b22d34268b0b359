"""Pass ``infer-seq-axes``: record which inputs and outputs carry the sequence axis.

The analysis itself (:func:`cptransform.analysis.seq_axes_summary.analyse`) works on any
program and is re-run by later passes on their own input (variables change with every
re-trace); this pass records the stable facts — per flat input and output, the sequence
dims — in ``module.facts.seq_axes`` and fails early when no attention reaches an input.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from cptransform.analysis.primitives import Family, facts
from cptransform.analysis.seq_axes import SeqAxes
from cptransform.ir import compat
from cptransform.ir.errors import SeqAxisError
from cptransform.ir.facts import Fact
from cptransform.ir.module import Module, iter_eqns
from cptransform.ir.pipeline import Pass, PassResult
from cptransform.analysis.seq_axes import infer_seq_axes
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
        if module.facts.seq_axes_overrides:
            check_overrides(module, summary)
        if axes.attentions and not any(summary.inputs):
            starts = patch_embeddings(module, axes)
            if not starts:
                raise SeqAxisError(
                    "no input of the function reaches an attention's sequence axis through "
                    "dataflow; pass seq_axes= to say which argument dims are the sequence "
                    "(an int dim, a tuple of dims, or dims merged into the sequence as a "
                    "tuple inside it: ((1, 2),) for the H·W patches of [B, H, W, C])")
            summary = dataclasses.replace(summary, starts=starts)
        return PassResult(module.with_jaxpr(module.jaxpr, seq_axes=summary), False,
                          (f"infer-seq-axes: {summary.describe()}",))


def patch_embeddings(module: Module, axes: SeqAxes) -> tuple[str, ...]:
    """Where the sequence starts inside the program when no input carries it: a
    convolution (a ViT's patch embedding, strided over pixels) whose result holds a
    sequence and whose operands hold none. Its operands are not sharded (every device
    reads the whole image); its result and everything after it are."""
    def carries(atom) -> bool:
        return bool(axes.dims(atom) or axes.groups(atom))

    starts = []
    for eqn in iter_eqns(module.jaxpr):
        row = facts(eqn.primitive.name)
        if row is not None and row.family is Family.WINDOW \
                and any(carries(v) for v in eqn.outvars) \
                and not any(carries(a) for a in eqn.invars):
            starts.append(f"{eqn.primitive.name} at {compat.source_line(eqn)}")
    return tuple(starts)


def check_overrides(module: Module, summary) -> None:
    """Refuse a ``seq_axes`` override whose dim is not the attention's sequence length, or
    that contradicts what dataflow proves about that input."""
    # Without the overrides, every sequence is an attention's: the lengths to match.
    plain = infer_seq_axes(module.jaxpr)
    inferred, lengths = summarize(module, plain).inputs, plain.lengths
    for index, dims in module.facts.seq_axes_overrides.items():
        name = summary.input_names[index]
        shape = module.in_avals[index].shape
        for d in dims:
            merged = isinstance(d, tuple)
            length = math.prod(shape[i] for i, _ in d) if merged else shape[d]
            if lengths and length not in lengths:
                what = f"dims {tuple(i for i, _ in d)} merged" if merged else f"dim {d}"
                raise SeqAxisError(
                    f"seq_axes says {what} of {name} (shape {shape}) is the sequence, but "
                    f"the attentions' sequence lengths are {list(lengths)}; point "
                    "seq_axes at the dim of that length, or leave the argument to inference "
                    "(None)")
        if inferred[index] and set(inferred[index]) != set(dims):
            raise SeqAxisError(
                f"seq_axes gives {name} (shape {shape}) sequence dims {list(dims)}, but "
                f"dataflow to the attention proves dims {list(inferred[index])}; fix the "
                "seq_axes entry (or drop it: inference already finds this argument)")

