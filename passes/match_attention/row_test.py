"""Row tests after an attention: ``where(row sees no key, 0, attention output)``.

keras-hub's Gemma zeroes the output rows that see no key after the attention, with
``all(mask == 0, axis=-1)`` on the mask the attention applies; building that ``S×S`` mask
outside the attention gathers the sequence. The select is the attention with
``empty_rows="zero"`` when it is proven to zero exactly the attention's empty rows:

* the select reads the attention's output through casts, transposes, reshapes and
  broadcasts only (nothing else reads the values on the way) and puts a zero (a scalar
  constant, or its broadcast) where its predicate says a row is empty;
* the predicate is, through broadcasts, reshapes and ``not``, a reduction along one axis
  that is the attention's key axis, its other dims batch, query or heads dims of the
  output: ``all(hidden)`` (a row is empty) or ``any(visible)`` (it is not). The key-wise
  visible predicate is read by the same mask analysis as the attention's own mask, so
  ``mask == 0`` is the complement of ``mask > 0.5`` only where the analysis proves the
  mask takes two values, 0 and 1 (a float mask of data values proves nothing);
* the rows it zeroes are exactly the empty ones: for an attention that already returns
  zero in its empty rows, its mask implies the row test's (every row the select zeroes is
  empty, so zero already); for one whose empty rows are the mean of V (a *selected*
  finite fill), the two masks are equal. On one device the select zeroes the cotangent of
  those rows and the selected fill keeps the scores' gradient out of them, so the
  gradient is zero-rows' too. A ``-inf`` fill (NaN rows whose gradient reaches every V),
  an added fill (its empty rows' scores receive a gradient) and sinks are left alone.

A proven row test becomes the attention's ``empty_rows="zero"`` on its spec and a
replacement of the select by its attention operand; the row test is then dead code.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from cptransform.analysis.dim_rules import reshape_groups
from cptransform.analysis.mask_analysis import MaskAnalyzer
from cptransform.analysis.mask_values import And, Pred, implies
from cptransform.analysis.primitives import Moves, moving
from cptransform.ir import compat
from cptransform.ir.graph import Graph
from cptransform.ir.rewrite import Replacement
from cptransform.op.attention_spec import EmptyRows
from cptransform.passes.match_attention.candidate import Candidate
from cptransform.passes.match_attention.row_scan import ROW_REDUCTIONS, key_visibility
from cptransform.passes.match_attention.walk import WRAPPERS, scalar_value, single_user, step_back

#: Ops between the attention and the select: they move, cast or broadcast its values.
_ON_THE_WAY = moving(Moves.IDENTITY, Moves.BARRIER, Moves.CAST, Moves.PERMUTE,
                     Moves.RESHAPE, Moves.SQUEEZE, Moves.BROADCAST)


@dataclass(frozen=True)
class RowTest:
    """A select proven to zero exactly the attention's empty rows: ``select`` is the
    ``select_n`` equation, ``kept`` its operand that carries the attention's output,
    ``reduction`` the row reduction its predicate reads (dead once it is replaced)."""

    select: Any
    kept: Any
    reduction: Any

    def replacement(self) -> Replacement:
        """The select replaced by the attention's output (zero in empty rows already)."""
        return Replacement(self.select, (self.kept,), lambda x: [x])


def find_row_test(graph: Graph, masks: MaskAnalyzer, c: Candidate) -> RowTest | None:
    """The row test after the attention ``c``, when one is proven (see the module
    docstring), else None (the select stays as it is: exact, with its mask)."""
    if c.sink is not None or c.added_fill or c.fill is not None \
            or c.empty_rows not in (EmptyRows.ZERO.value, EmptyRows.UNIFORM.value):
        return None
    found = _select_after(graph, c.out, c.out_labels)
    if found is None:
        return None
    select, kept, labels = found
    pred, on_false, on_true = select.invars
    zero = on_true if kept is on_false else on_false
    fill = scalar_value(graph, zero)
    # -0.0 is no attention's zero: a later 1/x would tell them apart.
    if zero is kept or fill != 0 or math.copysign(1.0, fill) < 0:
        return None
    row = _row_reduction(graph, masks, pred, labels, c)
    if row is None:
        return None
    tested, empty_when_true, reduction = row
    if empty_when_true != (zero is on_true):
        return None
    visible = And(c.visible)
    if not implies(visible, tested):
        return None
    if c.empty_rows == EmptyRows.UNIFORM.value and not implies(tested, visible):
        return None
    return RowTest(select, kept, reduction)


def _select_after(graph: Graph, atom: Any, labels: tuple) -> tuple | None:
    """``(select, its operand on the way, that operand's labels)`` for the ``select_n``
    the attention output ``atom`` (dims ``labels``) reaches through :data:`_ON_THE_WAY`
    ops, each its value's only reader; None when there is none."""
    while True:
        user = single_user(graph, atom)
        if user is None:
            return None
        name = user.primitive.name
        if name == "select_n" and len(user.invars) == 3 and user.invars[0] is not atom \
                and compat.aval_of(user.invars[0]).shape == compat.aval_of(atom).shape:
            return user, atom, labels
        if name not in _ON_THE_WAY or len(user.invars) != 1:
            return None
        labels = _forward_labels(user, labels)
        atom = user.outvars[0]


def _forward_labels(eqn: Any, labels: tuple) -> tuple:
    """The labels of ``eqn``'s result from its operand's: a dim keeps its label where it
    holds that one dim's values (None: a new, merged or split dim)."""
    name = eqn.primitive.name
    in_shape = compat.aval_of(eqn.invars[0]).shape
    out_shape = compat.aval_of(eqn.outvars[0]).shape
    out: list = [None] * len(out_shape)
    if name == "transpose":
        return tuple(labels[p] for p in eqn.params["permutation"])
    if name == "broadcast_in_dim":
        for i, o in enumerate(eqn.params["broadcast_dimensions"]):
            out[o] = labels[i] if in_shape[i] == out_shape[o] else None
        return tuple(out)
    if name in ("reshape", "squeeze"):
        for ins, outs in reshape_groups(in_shape, out_shape) or ():
            wide_in = [i for i in ins if in_shape[i] != 1] or list(ins)
            wide_out = [o for o in outs if out_shape[o] != 1] or list(outs)
            if len(wide_in) == 1 and len(wide_out) == 1 \
                    and in_shape[wide_in[0]] == out_shape[wide_out[0]]:
                out[wide_out[0]] = labels[wide_in[0]]
        return tuple(out)
    return labels


def _row_reduction(graph: Graph, masks: MaskAnalyzer, atom: Any, labels: tuple,
                   c: Candidate) -> tuple[Pred, bool, Any] | None:
    """``(visible, empty_when_true, reduction)`` when the boolean ``atom`` (dims ``labels``) is,
    through wrappers and ``not``, ``all(hidden)`` or ``any(visible)`` along the key axis:
    ``visible`` is the key-wise visible predicate read over the attention's labels,
    ``empty_when_true`` whether ``atom`` holds for the rows that see no visible key,
    ``reduction`` the reducing equation."""
    negated = False
    while True:
        eqn = graph.producer(atom)
        if eqn is None:
            return None
        name = eqn.primitive.name
        if name in ROW_REDUCTIONS:
            break
        if name == "not" and compat.aval_of(atom).dtype == bool:
            negated, atom = not negated, eqn.invars[0]
            continue
        back = step_back(eqn, atom, labels) if name in WRAPPERS else None
        if back is None:
            return None
        atom, labels = back
    (operand,), axes = eqn.invars, eqn.params["axes"]
    shape = compat.aval_of(operand).shape
    if len(axes) != 1 or compat.aval_of(operand).dtype != bool \
            or shape[axes[0]] != c.sizes[c.kv_seq]:
        return None
    dims = labels[:axes[0]] + (c.kv_seq,) + labels[axes[0]:]
    rows = set(c.batch) | {c.q_seq} | set(c.heads)
    if any(d is None and n != 1 or d is not None and d != c.kv_seq and d not in rows
           for d, n in zip(dims, shape)) or dims.count(c.kv_seq) != 1:
        return None
    return key_visibility(masks, eqn, dims), ROW_REDUCTIONS[name] != negated, eqn
