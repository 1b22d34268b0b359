"""The states ``reorder-sequence`` tracks per value, and the primitive sets it reads.

A value is ``perm`` (layout order), ``nat`` (natural order) or ``inv`` (no sequence dim, or
constant along it), or a :class:`Merged` sequence dim (tokens flattened with neighbours)
or a :class:`Shift` (a slice along the sequence held unsliced).
"""
from __future__ import annotations

from dataclasses import dataclass

from cptransform.analysis.primitives import CallKind, Family, calls, names_of, names_where
from cptransform.op.layouts import SequenceLayout

PERM, NAT, INV = "perm", "nat", "inv"

#: Primitives that commute with a permutation of any sequence dim they carry.
EQUIVARIANT = names_where(lambda row: row.order_safe)

#: Contractions: exact in layout order when both operands' contracted dims share one order.
CONTRACTIONS = names_of(Family.CONTRACTION)


#: Primitives that can work on a shifted value (see :class:`Shift`) without materializing it.
SHIFTABLE = names_where(lambda row: row.shiftable)


@dataclass(frozen=True)
class Shift:
    """State of a slice ``x[..., offset:offset+length, ...]`` along the sequence (dim
    ``dim``) that is *held unsliced*: the value is the full-length array in layout order.

    Next-token losses slice logits and labels by one (``logits[:, :-1]``, ``tokens[:, 1:]``).
    Materializing those slices would un-permute the logits (an all-gather of the largest
    activation); instead token-wise ops and reductions run on the full array, differently
    shifted operands are re-aligned (moving the smaller one), and reductions over the
    sequence mask out the positions outside the slice.
    """

    offset: int
    length: int
    dim: int


@dataclass(frozen=True)
class Merged:
    """State of a value whose dim ``dim`` holds the sequence merged with its neighbours,
    in row-major order: index ``(o * n + s) * inner + i`` for slot ``s`` of ``layout``
    (``n`` its length). Tokens flattened into rows (``[B*S, D]``: inner 1), folded into
    features (``[B, S*D]``: inner ``D``), or cut into chunks (``[B, S/c, c, D]``: dim 1 in
    the layout of the chunks, see :meth:`SequenceLayout.coarsen`). Row-wise ops keep it;
    an op acting along that dim needs natural order (see
    :meth:`~cptransform.passes.reorder_sequence.merged.MergedOrders.merged`)."""

    dim: int
    inner: int
    layout: SequenceLayout


#: Families whose link rules relate every operand dim an op keeps to its result dims, so
#: that a merged dim's partners are exactly the dims linked to it.
LINKED_FAMILIES = (Family.ELEMENTWISE, Family.REDUCTION, Family.CONTRACTION, Family.SHAPE,
                   Family.CUMULATIVE)

#: Single-array indexing ops whose links cover every kept dim (their other operands are
#: scalars, indices, or pieces linked through the result).
LINKED_INDEXING = frozenset({"slice", "dynamic_slice", "pad", "concatenate", "rev",
                             "gather", "split", "top_k", "unstack"})

#: Call-like primitives (the only ones whose sub-jaxprs are bodies run in their place; a
#: scatter's update jaxpr is not).
CALLS = names_of(Family.CALL)

#: Primitives whose bodies are re-traced in layout order and re-bound (loops, branches and
#: remat keep their structure); other calls are inlined.
REBUILT = calls(CallKind.CONTROL_FLOW, CallKind.REMAT)

#: Control flow that iterates (its order of iterations can follow the tokens).
LOOPS = frozenset({"scan", "while"})

#: Calls with a custom derivative rule: kept whole and run in natural order (a positional
#: op), since the rule is part of the program and may depend on the token order.
CUSTOM_RULES = calls(CallKind.CUSTOM_DERIVATIVE)
