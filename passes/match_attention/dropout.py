"""Dropout on the probabilities before the value product, read as a multiplier of bits.

On the way from the probabilities ``p`` to ``p @ v`` a program may apply dropout:
``p * multiplier`` (flax's ``dot_product_attention_weights``: ``keep / keep_prob``,
broadcast over batch and heads or not), ``where(keep, p / keep_prob, 0)`` (``nn.Dropout``),
and scalar scales. :class:`DropoutReader` reads each such step; a factor or keep-mask must
be computed from one ``random_bits`` of a single threefry key by elementwise equations and
moves, with constants (literals, size-1 constants) as the only other inputs. The chain is
recorded as a :class:`~cptransform.op.dropout.MultiplierMap` and each dim of the drawn bits
is tied to the softmax dim it varies along, so the kernels can draw the bits of any block
from the global positions (:mod:`cptransform.op.dropout`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from cptransform.analysis.primitives import Family, Moves, moving, names_of
from cptransform.ir import compat
from cptransform.ir.graph import Graph
from cptransform.op.dropout import Const, DropoutSpec, MultiplierMap, Step, threefry_key
from cptransform.passes.match_attention.stats import NotAttention
from cptransform.passes.match_attention.walk import scalar_value, step_back

#: Equations the chain from the bits to the multiplier may apply.
_ELEMENTWISE = names_of(Family.ELEMENTWISE) | {"bitcast_convert_type"}
_MOVES = moving(Moves.BROADCAST, Moves.RESHAPE, Moves.SQUEEZE, Moves.PERMUTE)


@dataclass(frozen=True)
class Drawn:
    """The dropout found on the way to the value product.

    ``key``: the typed key the bits are drawn with; ``shape``: the shape drawn;
    ``multiplier``: the chain; ``dims``: for each dim of the drawn bits, the softmax-input
    dim it varies along (``None``: size 1)."""

    key: Any
    shape: tuple
    multiplier: MultiplierMap
    dims: tuple

    def strides(self) -> dict:
        """``softmax-input dim -> stride`` in the flat index of the drawn bits."""
        out = {}
        for i, d in enumerate(self.dims):
            if d is not None:
                out[d] = int(np.prod(self.shape[i + 1:], dtype=np.int64))
        return out


class DropoutReader:
    """Collects the dropout steps of one probabilities path (see the module doc)."""

    def __init__(self, graph: Graph):
        self.g = graph
        self.steps: list[Step] = []
        self.factors: list = []
        self.keeps: list = []
        self._refs: dict = {}
        self._drawn_memo: dict = {}
        self._bits: Any = None
        self._bits_dims: list | None = None

    def read(self, eqn: Any, p: Any, p_dims: tuple) -> bool:
        """Whether ``eqn`` (reading ``p``, whose dims are ``p_dims``) is a dropout step:
        ``p · f``, ``f · p``, ``p / c`` or ``where(keep, p, 0)`` with ``f`` and ``keep``
        drawn or constant; recorded when it is."""
        name = eqn.primitive.name
        shape = compat.aval_of(p).shape
        if name in ("mul", "div") and len(eqn.invars) == 2:
            other = eqn.invars[1] if eqn.invars[0] is p else eqn.invars[0]
            if other is p or (name == "div" and eqn.invars[0] is not p):
                return False
            value = scalar_value(self.g, other)
            if value is not None:
                if name == "div" and value == 0:
                    return False
                self.factors.append(Const(value if name == "mul" else 1.0 / value,
                                          "float32"))
                return True
            if name == "mul" and not compat.is_literal(other) and self._drawn(other) \
                    and self._fits(other, shape):
                self.factors.append(self._ref(other, self._labels(other, p_dims)))
                return True
            return False
        if name == "select_n" and len(eqn.invars) == 3 and eqn.invars[2] is p:
            keep, zero = eqn.invars[0], eqn.invars[1]
            if scalar_value(self.g, zero) == 0 and compat.aval_of(keep).dtype == np.bool_ \
                    and not compat.is_literal(keep) and self._drawn(keep) and self._fits(keep, shape):
                self.keeps.append(self._ref(keep, self._labels(keep, p_dims)))
                return True
        return False

    def found(self) -> Drawn | None:
        """The dropout read so far (``None``: no drawn factor or keep was met; a path with
        constant scales alone is no dropout)."""
        if self._bits is None:
            if self.factors:
                raise NotAttention("the probabilities are scaled before the value product")
            return None
        shape = tuple(compat.aval_of(self._bits.outvars[0]).shape)
        if any(n != 1 and d is None for n, d in zip(shape, self._bits_dims)):
            raise NotAttention("the dropout bits vary along a dim that is not one of the "
                               "probabilities'")
        key = self._bits.invars[0]
        why = threefry_key(compat.aval_of(key))
        if why is not None:
            raise NotAttention(f"dropout on the probabilities: {why}, so a block's bits "
                               "cannot be drawn alone")
        if self._bits.params.get("bit_width", 32) != 32:
            raise NotAttention("dropout bits of other than 32 bits")
        return Drawn(key, shape, MultiplierMap(tuple(self.steps), tuple(self.factors),
                                               tuple(self.keeps)), tuple(self._bits_dims))

    def _fits(self, x: Any, shape: tuple) -> bool:
        other = compat.aval_of(x).shape
        return len(other) == len(shape) and all(a in (1, b) for a, b in zip(other, shape))

    @staticmethod
    def _labels(x: Any, p_dims: tuple) -> tuple:
        return tuple(None if n == 1 else d for n, d in zip(compat.aval_of(x).shape, p_dims))

    def _drawn(self, atom: Any) -> bool:
        """Whether ``atom`` is computed from a ``random_bits`` through the chain's
        equations."""
        if atom not in self._drawn_memo:
            eqn = self.g.producer(atom)
            name = None if eqn is None else eqn.primitive.name
            self._drawn_memo[atom] = name == "random_bits" or (
                (name in _ELEMENTWISE or name in _MOVES)
                and any(self._drawn(a) for a in eqn.invars if not compat.is_literal(a)))
        return self._drawn_memo[atom]

    def _ref(self, atom: Any, labels: tuple):
        """The chain argument for ``atom`` whose dims vary along ``labels`` (softmax-input
        dims, ``None`` for size 1; read for drawn values only), adding its steps."""
        drawn = not compat.is_literal(atom) and self._drawn(atom)
        if not drawn:
            value = scalar_value(self.g, atom)
            if value is not None:
                dtype = compat.aval_of(atom).dtype
                return Const(np.asarray(value, dtype).item(), str(dtype))
            if any(n != 1 for n in compat.aval_of(atom).shape):
                raise NotAttention("the dropout multiplier reads an array other than the bits")
            labels = ()
        if atom in self._refs:
            ref, seen = self._refs[atom]
            if seen != labels:
                raise NotAttention("the dropout bits are read along different dims")
            return ref
        eqn = self.g.producer(atom)
        if eqn is None:
            raise NotAttention("the dropout multiplier reads a value other than the bits "
                               "and constants")
        name = eqn.primitive.name
        if name == "random_bits":
            self._bits_at(eqn, labels)
            ref = "bits"
        elif name in _MOVES and not drawn:
            ref = self._step(eqn, [self._ref(a, ()) for a in eqn.invars])
        elif name in _MOVES:
            back = step_back(eqn, atom, labels)
            if back is None:
                raise NotAttention(f"the dropout bits are moved by {name} other than by "
                                   "transposing or adding size-1 dims")
            ref = self._step(eqn, [self._ref(back[0], back[1])])
        elif name in _ELEMENTWISE:
            if name == "bitcast_convert_type" and \
                    compat.aval_of(eqn.invars[0]).shape != compat.aval_of(atom).shape:
                raise NotAttention("the dropout bits are bitcast to another width")
            ref = self._step(eqn, [self._ref(a, self._labels(a, labels) if drawn else ())
                                   for a in eqn.invars])
        else:
            raise NotAttention(f"the dropout multiplier goes through {name}")
        self._refs[atom] = (ref, labels)
        return ref

    def _step(self, eqn: Any, args: list) -> int:
        params = tuple(sorted(eqn.params.items()))
        try:
            hash(params)
        except TypeError as err:
            raise NotAttention(f"the dropout chain's {eqn.primitive.name} has parameters "
                               "that cannot be recorded") from err
        self.steps.append(Step(eqn.primitive, params, tuple(args)))
        return len(self.steps) - 1

    def _bits_at(self, eqn: Any, labels: tuple) -> None:
        if self._bits is not None and self._bits is not eqn:
            raise NotAttention("the dropout multiplier reads two draws of bits")
        if self._bits_dims is not None and list(labels) != self._bits_dims:
            raise NotAttention("the dropout bits are read along different dims")
        self._bits, self._bits_dims = eqn, list(labels)


@dataclass(frozen=True)
class DropoutPlan:
    """What the replacement needs for one attention's dropout: its ``spec``, the ``key``
    the bits are drawn with and ``strides``: ``(label, stride)`` of the batch and head
    labels in the flat index (the seed's offsets, :func:`~cptransform.op.dropout.offsets`)."""

    spec: DropoutSpec
    key: Any
    strides: tuple


def plan(drawn: Drawn, labels: tuple, merged: dict, sizes: dict, q_seq, kv_seq,
         others: set, rows: str, rows_may_be_empty: bool) -> DropoutPlan:
    """The :class:`DropoutPlan` of ``drawn`` for an attention whose softmax-input dims are
    ``labels`` (``merged``: label -> parts of dims the logits chain merged), with query and
    key labels ``q_seq``/``kv_seq`` and batch and head labels ``others``; ``rows`` is its
    ``empty_rows``. Refused where a block's bits would not be one device's."""
    if rows == "uniform" and rows_may_be_empty:
        # An empty row's output is the mean of V under the dropout multiplier: a sum over
        # every key with per-pair weights, which the schedules' fill (the plain mean of V)
        # does not compute.
        raise NotAttention("dropout on an attention whose masked rows fall back to the "
                           "uniform average and may be empty (a finite fill with data "
                           "masks); fill the logits with -inf to shard it")
    strides: dict = {}
    for dim, stride in drawn.strides().items():
        if not isinstance(dim, int):
            raise NotAttention("dropout on probabilities viewed with a split dim")
        label = labels[dim]
        parts = merged.get(label, (label,))
        for i, part in enumerate(parts):
            strides[part] = stride * int(np.prod([sizes[p] for p in parts[i + 1:]],
                                                 dtype=np.int64))
    q_stride, kv_stride = strides.pop(q_seq, 0), strides.pop(kv_seq, 0)
    if not set(strides) <= others:
        raise NotAttention("the dropout bits vary along a dim that is not the batch, the "
                           "heads or the sequences")
    spec = DropoutSpec(q_stride, kv_stride, drawn.multiplier, zeroes=bool(drawn.multiplier.keeps))
    return DropoutPlan(spec, drawn.key, tuple(sorted(strides.items(), key=lambda kv: str(kv[0]))))
