"""The logits chain: from the ``q·k`` product to the softmax input, read as typed steps.

The walk goes back from the softmax input through the primitives of :data:`CHAIN` to a
``dot_general``, following at each equation the operand that comes from it (the *main*
operand; the others are *sides*: a mask, a bias, a constant). Reading then goes forward:
each primitive's reader turns one equation into steps (:class:`Step`: a scale, a soft-cap,
a bias, a mask) and tracks which q·k dim each dim of the logits is (its *label*).
A reshape that merges dims (grouped-query logits ``[B, T, K, G, S]`` viewed as
``[B, T, K·G, S]``) gives the merged dim a fresh label standing for its parts, in order.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from cptransform.analysis.dim_rules import reshape_groups
from cptransform.analysis.mask_analysis import MaskAnalyzer
from cptransform.analysis.mask_values import Const, Indicator, Opaque, Pred, Scalar, p_not
from cptransform.analysis.primitives import Family, Moves, moving, names_of
from cptransform.ir import compat
from cptransform.ir.graph import Graph
from cptransform.passes.match_attention.stats import NotAttention, RuleStats
from cptransform.passes.match_attention.walk import scalar_value, step_back

#: The finite fill at or below which a masked logit counts as masked (``logits.py``).
FINITE_FILL_LIMIT = -1e4


class StepKind(enum.Enum):
    """What one chain equation does to the logits."""

    SCALE = "scale"                # x * value
    SHIFT = "shift"                # x + value
    TANH = "tanh"                  # the inside of a soft-cap c·tanh(x / c)
    BIAS = "bias"                  # x + value * side
    FACTOR = "factor"              # x * side ** value, side data constant along the keys
    MASK_REPLACE = "mask-replace"  # where(pred, x, value)
    MASK_MUL = "mask-mul"          # where(pred, x, 0), as x * mask
    MASK_BIAS = "mask-bias"        # where(pred, x, x + value), as x + additive mask
    CAST = "cast"                  # a float cast
    LAYOUT = "layout"              # a transpose or a size-1 reshape


@dataclass(frozen=True)
class Step:
    """One step of the logits chain, read forward from the q·k product.

    ``value``: scale factor, shift, fill, bias sign or a factor's exponent (1: multiplied
    in, -1: divided by); ``pred``: the visibility predicate of a mask step; ``side``: the
    bias or factor operand; ``labels``: the labels after a layout step; ``hidden``: the
    visibility predicates of mask fills summed into a bias operand that a layout op or a
    cast then brings to the logits (the operand carries them; they are no mask step).
    """

    kind: StepKind
    value: float = 0.0
    pred: Pred | None = None
    side: Opaque | None = None
    labels: tuple | None = None
    hidden: tuple = ()


class ChainReader:
    """Walks and reads logits chains of one graph (it caches which values reach a product)."""

    def __init__(self, graph: Graph, masks: MaskAnalyzer, stats: RuleStats):
        self.g = graph
        self.masks = masks
        self.stats = stats
        self._reaches: dict = {}
        #: The merged labels of the chain being read: label -> its parts, outermost first.
        self.merged: dict = {}
        self._fresh = 0
        self._product = None

    def walk(self, x: Any) -> list:
        """``[(qk, None), (eqn, main), ...]``: the q·k dot_general, then the chain equations
        from it to the softmax input ``x`` with the index of their main operand."""
        eqns = []
        atom = x
        while True:
            eqn = self.g.producer(atom)
            if eqn is None:
                raise NotAttention("softmax input does not come from a q·k product")
            if eqn.primitive.name == "dot_general":
                break
            name = eqn.primitive.name
            if name not in CHAIN:
                raise NotAttention(f"softmax input comes from {name}, not from a q·k product")
            out_shape = compat.aval_of(atom).shape
            cands = [i for i, a in enumerate(eqn.invars) if not compat.is_literal(a)
                     and compat.aval_of(a).dtype != np.bool_
                     and (compat.aval_of(a).shape == out_shape
                          or eqn.primitive.name not in _ELEMENTWISE)
                     and self._reaches_dot(a)]
            if eqn.primitive.name == "select_n":
                cands = [i for i in cands if i > 0]
            if not cands:
                raise NotAttention(f"softmax input does not come from a q·k product through "
                                   f"the steps the matcher reads (the logits' {name} takes "
                                   "them from an op the matcher does not read)")
            eqns.append((eqn, cands[0]))
            atom = eqn.invars[cands[0]]
        eqns.reverse()
        return [(self.g.producer(atom), None)] + eqns

    def read(self, chain: list, labels: tuple) -> tuple[list[Step], tuple, dict]:
        """The steps of a walked chain (q·k output dims labelled ``labels``), the labels
        of the softmax input's dims, and the labels of merged dims with their parts."""
        steps: list[Step] = []
        self.merged, self._fresh = {}, len(labels)
        self._product = chain[0][0]
        for eqn, main in chain[1:]:
            name = eqn.primitive.name
            with self.stats.attempt(f"chain:{name}"):
                read = CHAIN[name](self, eqn, main, labels)
            for step in read:
                if step.labels is not None:
                    labels = step.labels
            steps.extend(read)
        return steps, labels, dict(self.merged)

    def reads_product(self, atom: Any) -> bool:
        """Whether ``atom`` is computed from the q·k product of the chain being read."""
        eqn = self.g.producer(atom)
        return eqn is not None and any(e is self._product
                                       for e in [eqn, *self.g.ancestors(eqn)])

    def merge(self, parts: tuple) -> int:
        """A fresh label for a dim merging ``parts`` (merged labels among them flattened)."""
        flat = tuple(p for part in parts for p in self.merged.get(part, (part,)))
        label = self._fresh
        self._fresh += 1
        self.merged[label] = flat
        return label

    def _reaches_dot(self, atom: Any) -> bool:
        """Whether ``atom`` comes from a dot_general through chain equations only."""
        stack = [atom]
        while stack:
            a = stack.pop()
            if compat.is_literal(a) or a in self._reaches:
                continue
            eqn = self.g.producer(a)
            if eqn is None or (eqn.primitive.name != "dot_general"
                               and eqn.primitive.name not in CHAIN):
                self._reaches[a] = False
                continue
            if eqn.primitive.name == "dot_general":
                self._reaches[a] = True
                continue
            pending = [x for x in eqn.invars if not compat.is_literal(x) and x not in self._reaches]
            if pending:
                stack.append(a)
                stack.extend(pending)
                continue
            self._reaches[a] = any(self._reaches.get(x, False) for x in eqn.invars
                                   if not compat.is_literal(x))
        return self._reaches.get(atom, False)


# -- the readers, one per primitive ----------------------------------------------------------

Reader = Callable[[ChainReader, Any, int, tuple], list[Step]]


def side_dims(atom: Any, labels: tuple) -> tuple:
    """Labels of a side operand of an elementwise equation (same shape as the main one)."""
    shape = compat.aval_of(atom).shape
    if len(shape) == 0:
        return ()
    return tuple(lab if n != 1 else None for lab, n in zip(labels, shape))


def _negate(pred: Pred, atom: Any, labels: tuple) -> Pred:
    return p_not(pred, Opaque.of(atom, side_dims(atom, labels)))


def _read_cast(r: ChainReader, eqn: Any, main: int, labels: tuple) -> list[Step]:
    if not np.issubdtype(eqn.params.get("new_dtype", np.float32), np.floating):
        raise NotAttention("logits are cast to a non-float type")
    return [Step(StepKind.CAST)]


def _read_transpose(r: ChainReader, eqn: Any, main: int, labels: tuple) -> list[Step]:
    return [Step(StepKind.LAYOUT, labels=tuple(labels[i] for i in eqn.params["permutation"]))]


def _read_reshape(r: ChainReader, eqn: Any, main: int, labels: tuple) -> list[Step]:
    """Size-1 dims added or dropped, or adjacent dims merged (each merge a fresh label);
    a split would need a label for part of a dim, so it is refused."""
    in_shape = compat.aval_of(eqn.invars[main]).shape
    out_shape = compat.aval_of(eqn.outvars[0]).shape
    groups = reshape_groups(in_shape, out_shape)
    if groups is None or any(sum(out_shape[o] != 1 for o in outs) > 1 or
                             not outs and labels[ins[0]] is not None for ins, outs in groups):
        raise NotAttention("the logits are reshaped (dims split, or a q·k dim dropped)")
    new: list = [None] * len(out_shape)
    for ins, outs in groups:
        parts = tuple(labels[i] for i in ins if labels[i] is not None)
        if outs and parts:
            # The merged dim is the group's non-unit output dim (a size-1 one if none is).
            out = max(outs, key=lambda o: out_shape[o])
            new[out] = parts[0] if len(parts) == 1 else r.merge(parts)
    return [Step(StepKind.LAYOUT, labels=tuple(new))]


def _read_broadcast(r: ChainReader, eqn: Any, main: int, labels: tuple) -> list[Step]:
    """A broadcast that only adds size-1 dims (``jnp.matmul`` squeezes size-1 batch dims
    for the product and puts them back after it)."""
    src_shape = compat.aval_of(eqn.invars[0]).shape
    out_shape = compat.aval_of(eqn.outvars[0]).shape
    placed = eqn.params["broadcast_dimensions"]
    if any(src_shape[i] != out_shape[o] for i, o in enumerate(placed)) or \
            any(n != 1 for o, n in enumerate(out_shape) if o not in placed):
        raise NotAttention("the logits are broadcast along a new dim")
    new: list = [None] * len(out_shape)
    for i, o in enumerate(placed):
        new[o] = labels[i]
    return [Step(StepKind.LAYOUT, labels=tuple(new))]


def _read_select(r: ChainReader, eqn: Any, main: int, labels: tuple) -> list[Step]:
    if len(eqn.invars) != 3 or compat.aval_of(eqn.invars[0]).dtype != np.bool_:
        raise NotAttention("logits selected by a non-boolean index")
    fill = scalar_value(r.g, eqn.invars[3 - main])
    if fill is None:
        raise NotAttention("masked logits are replaced by a non-constant value")
    which = eqn.invars[0]
    pred = r.masks.predicate(which, side_dims(which, labels))
    # select_n(pred, on_false, on_true): the logits stay where the index picks them.
    visible = pred if main == 2 else _negate(pred, which, labels)
    return [Step(StepKind.MASK_REPLACE, fill, visible)]


def _read_arith(r: ChainReader, eqn: Any, main: int, labels: tuple) -> list[Step]:
    """``mul``/``div``/``add``/``sub`` of the logits and a side: a constant (scale, shift),
    a 0/1 mask (multiplied in, or an additive mask), or a bias."""
    name = eqn.primitive.name
    side = [a for i, a in enumerate(eqn.invars) if i != main][-1]
    value = r.masks.analyze(side, side_dims(side, labels)) \
        if not compat.is_literal(side) else Scalar(compat.literal_value(side))
    if isinstance(value, Pred):
        value = Indicator(value, 1, 0)
    if isinstance(value, Scalar):
        c = float(value.value)
        if name == "mul":
            return [Step(StepKind.SCALE, c)]
        if name == "div" and main == 0 and c != 0:
            return [Step(StepKind.SCALE, 1.0 / c)]
        if name == "add":
            return [Step(StepKind.SHIFT, c)]
        if name == "sub":
            if main == 0:
                return [Step(StepKind.SHIFT, -c)]
            return [Step(StepKind.SCALE, -1.0), Step(StepKind.SHIFT, c)]
        raise NotAttention("logits divide a constant")
    if name == "mul" and isinstance(value, Indicator) and \
            (value.on_true, value.on_false) == (1, 0):
        return [Step(StepKind.MASK_MUL, 0.0, value.pred)]
    if name in ("add", "sub") and main == 0 or name == "add":
        sign = -1.0 if name == "sub" else 1.0
        if isinstance(value, Indicator):
            t, f = float(value.on_true) * sign, float(value.on_false) * sign
            if t == 0:
                return [Step(StepKind.MASK_BIAS, f, value.pred)]
            if f == 0:
                return [Step(StepKind.MASK_BIAS, t, _negate(value.pred, side, labels))]
            raise NotAttention("an additive 0/1-style term with no zero side")
        summed = _summed_fills(r, side, labels, sign)
        if summed is not None:
            return summed
        dims = side_dims(side, labels)
        if not (isinstance(value, Opaque) and value.var is side):
            value = Opaque.of(side, dims)
        return [Step(StepKind.BIAS, sign, side=value, hidden=_fills_behind_layout(r, side, dims))]
    if name == "mul" or name == "div" and main == 0:
        # A temperature (per head, per query, learned or computed): the candidate folds
        # it into the queries when it is constant along the keys.
        if r.reads_product(side):
            raise NotAttention(f"logits go through {name} with a value computed from the "
                               "logits themselves")
        return [Step(StepKind.FACTOR, 1.0 if name == "mul" else -1.0,
                     side=Opaque.of(side, side_dims(side, labels)))]
    raise NotAttention(f"logits divide a non-constant value ({name} with the logits as "
                       "its divisor)")


def _summed_fills(r: ChainReader, side: Any, labels: tuple, sign: float) -> list[Step] | None:
    """A bias that sums an additive mask into it before the logits take it
    (``x + (bias + where(mask, 0, fill))``, transformers' T5 and its relative-position bias),
    read as the bias and the mask: ``(x + bias) + where(mask, 0, fill)``, the same logits
    (a visible pair adds 0; a fill that hides its key swallows the bias as it swallows the
    score), a constant addend read as a shift. ``None`` when every addend is a bias: a sum
    of biases stays one bias.

    Read as one bias, the fill would be data to the schedules: a row it hides wholly has
    every logit near the fill, where a float32 log-sum-exp loses the row's ``log n``.
    """
    addends = _addends(r, side, sign)
    steps = [_addend_step(r, atom, side_dims(atom, labels), s) for atom, s in addends]
    if all(st.kind is StepKind.BIAS for st in steps):
        return None
    return sorted(steps, key=lambda st: st.kind is StepKind.MASK_BIAS)


def _addends(r: ChainReader, atom: Any, sign: float) -> list[tuple[Any, float]]:
    """The terms of ``atom`` as a sum of ``add``/``sub`` equations, each with its sign."""
    eqn = None if compat.is_literal(atom) else r.g.producer(atom)
    if eqn is None or eqn.primitive.name not in ("add", "sub"):
        return [(atom, sign)]
    second = -sign if eqn.primitive.name == "sub" else sign
    return _addends(r, eqn.invars[0], sign) + _addends(r, eqn.invars[1], second)


def _addend_step(r: ChainReader, atom: Any, dims: tuple, sign: float) -> Step:
    """One addend of a bias (its dims indexing top dims ``dims``): a shift, an additive
    mask (a zero on one side and a fill that hides on the other), or a bias."""
    if compat.is_literal(atom):
        return Step(StepKind.SHIFT, sign * float(compat.literal_value(atom)))
    value = r.masks.analyze(atom, dims)
    if isinstance(value, Indicator) and isinstance(value.pred, Const):
        value = Scalar(value.on_true if value.pred.value else value.on_false)
    if isinstance(value, Scalar):
        return Step(StepKind.SHIFT, sign * float(value.value))
    if isinstance(value, Indicator):
        t, f = float(value.on_true) * sign, float(value.on_false) * sign
        if t == 0 and f <= FINITE_FILL_LIMIT:
            return Step(StepKind.MASK_BIAS, f, value.pred)
        if f == 0 and t <= FINITE_FILL_LIMIT:
            return Step(StepKind.MASK_BIAS, t, p_not(value.pred, Opaque.of(atom, dims)))
    return Step(StepKind.BIAS, sign, side=Opaque.of(atom, dims))


def _fills_behind_layout(r: ChainReader, side: Any, dims: tuple) -> tuple:
    """The predicates of the mask fills summed into a bias ``side`` (whose dims index top
    dims ``dims``) before transposes, reshapes, broadcasts or casts bring the sum to the
    logits (``jax.nn.dot_product_attention(bias=bias + where(mask, 0, fill))`` views the
    bias per KV head): the sum cannot be split into the bias and the mask there, but the
    candidate must know a row may be hidden wholly by data the kernels see as a bias."""
    atom, moved = side, False
    while (eqn := None if compat.is_literal(atom) else r.g.producer(atom)) is not None \
            and eqn.primitive.name in _BIAS_MOVES:
        back = (eqn.invars[0], _reshape_dims(eqn, dims)) \
            if eqn.primitive.name in _RESHAPES else step_back(eqn, atom, dims)
        if back is None:
            break
        (atom, dims), moved = back, True
    if not moved or eqn is None or eqn.primitive.name not in ("add", "sub"):
        return ()
    steps = [_addend_step(r, a, tuple(dims), s) for a, s in _addends(r, atom, 1.0)]
    return tuple(st.pred for st in steps if st.kind is StepKind.MASK_BIAS)


def _reshape_dims(eqn: Any, dims: tuple) -> tuple:
    """A dim kept whole by the reshape keeps its top dim; split or merged ones get none."""
    src = compat.aval_of(eqn.invars[0]).shape
    out = compat.aval_of(eqn.outvars[0]).shape
    before: list = [None] * len(src)
    for ins, outs in reshape_groups(src, out) or ():
        kept_in = [i for i in ins if src[i] != 1]
        kept_out = [o for o in outs if out[o] != 1]
        if len(kept_in) == 1 and len(kept_out) == 1:
            before[kept_in[0]] = dims[kept_out[0]]
    return tuple(before)


#: Ops that only move or cast a bias on its way to the logits (``copy``: the same value;
#: ``walk.step_back`` maps their dims back, :func:`_reshape_dims` the reshapes'). A bias's
#: reshape may split or merge dims (jax.nn's per-KV-head view), which ``step_back`` declines.
_BIAS_MOVES = moving(Moves.CAST, Moves.PERMUTE, Moves.BROADCAST, Moves.RESHAPE,
                     Moves.SQUEEZE) | {"copy", "copy_p"}
_RESHAPES = moving(Moves.RESHAPE, Moves.SQUEEZE)


#: The primitives a logits chain may go through, and how each one is read.
CHAIN: dict[str, Reader] = {
    "convert_element_type": _read_cast,                         # logits.astype(f32)
    "copy": _read_cast,
    "copy_p": _read_cast,
    "transpose": _read_transpose,                               # head/seq permutations
    "reshape": _read_reshape,                                   # size-1 dims, merges
    "squeeze": _read_reshape,
    "broadcast_in_dim": _read_broadcast,                        # size-1 dims added
    "neg": lambda r, e, main, labels: [Step(StepKind.SCALE, -1.0)],   # -x
    "tanh": lambda r, e, main, labels: [Step(StepKind.TANH)],         # c * tanh(x / c)
    "select_n": _read_select,                                   # where(mask, x, fill)
    "mul": _read_arith,                                         # scale, 0/1 mask
    "div": _read_arith,                                         # x / sqrt(d)
    "add": _read_arith,                                         # bias, additive mask
    "sub": _read_arith,
}

#: The main operand of an elementwise equation has the logits' shape (a side may not).
_ELEMENTWISE = names_of(Family.ELEMENTWISE)
