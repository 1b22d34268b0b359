"""Attention sinks (gpt-oss): one extra logit column concatenated after the keys' logits.

gpt-oss spells a per-head sink as ``softmax(concat([logits, sink_column], axis))[..., :-1]``:
the column holds one value per (batch, head), broadcast over the query positions, and its
probability is sliced away before the value product. That is exactly an ``attention_p``
with ``sinks`` (one more logit in each row's log-sum-exp, whose value is 0). Here:

* :func:`split_sink` finds the concatenation at the softmax input, and refuses a sink
  column that is not the last one, or a concatenation of more than one column;
* :func:`sink_source` walks back from the column through the equations that only move,
  cast or broadcast it to the array the sink values come from, labelling its dims with the
  q·k labels (a dim a reshape split into several, e.g. ``[H] → [Hkv, G, 1, 1]``, gets the
  tuple of their labels);
* the value-product walk (:mod:`~cptransform.passes.match_attention.value_product`) accepts
  the one slice that drops the column, and the candidate checks the sink varies over
  batch and heads only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cptransform.analysis.dim_rules import reshape_groups
from cptransform.analysis.primitives import Moves, moving
from cptransform.ir import compat
from cptransform.ir.graph import Graph
from cptransform.passes.match_attention.stats import NotAttention

#: Equations the sink column may come through from its source (all only move values).
_MOVES = moving(Moves.IDENTITY, Moves.CAST, Moves.BROADCAST, Moves.RESHAPE, Moves.SQUEEZE,
                Moves.PERMUTE)


@dataclass(frozen=True)
class SinkColumn:
    """The softmax input ``concat([keys, column], axis)``: ``keys`` are the keys' logits
    (``width`` of them along ``axis``), ``column`` the sink, size 1 along ``axis``."""

    keys: Any
    column: Any
    width: int


def split_sink(graph: Graph, x: Any, axis: int) -> SinkColumn | None:
    """The sink column of softmax input ``x`` (softmax over ``axis``), or None when ``x``
    is not a concatenation along ``axis``; NotAttention for one that cannot be a sink."""
    eqn = graph.producer(x)
    if eqn is None or eqn.primitive.name != "concatenate" or \
            eqn.params["dimension"] != axis:
        return None
    if len(eqn.invars) != 2:
        raise NotAttention(f"the softmax input concatenates {len(eqn.invars)} parts along "
                           "the softmax axis; a sink is one column after the keys' logits")
    keys, column = eqn.invars
    width = compat.aval_of(keys).shape[axis]
    if compat.aval_of(column).shape[axis] != 1:
        if width == 1:
            raise NotAttention("the sink column comes before the keys' logits; only a last "
                               "column sliced away after the softmax is read as a sink")
        raise NotAttention("the softmax input concatenates more than one column after the "
                           "keys' logits (one sink column is supported)")
    return SinkColumn(keys, column, width)


def sink_source(graph: Graph, column: Any, labels: tuple, merged: dict,
                axis: int) -> tuple[Any, tuple]:
    """``(source, dims)``: the array the sink column is moved, cast or broadcast from, and
    for each of its dims the tuple of q·k labels it holds, in order (``()``: size 1).

    ``labels`` label the keys' logits (the column's dims but ``axis``); ``merged`` maps a
    label the logits chain merged to its parts.
    """
    dims = tuple(() if d == axis or lab is None else merged.get(lab, (lab,))
                 for d, lab in enumerate(labels))
    atom = column
    while True:
        eqn = graph.producer(atom)
        if eqn is None or eqn.primitive.name not in _MOVES:
            return atom, dims
        back = _step_back(eqn, atom, dims)
        if back is None:
            return atom, dims
        atom, dims = back


def _step_back(eqn: Any, atom: Any, dims: tuple) -> tuple[Any, tuple] | None:
    """The operand of a one-operand move and its dims' labels; None where the labels do
    not carry over (a reshape merging dims that hold labels)."""
    ins = [a for a in eqn.invars if not compat.is_literal(a)]
    if len(ins) != 1:
        return None
    src = ins[0]
    src_shape, out_shape = compat.aval_of(src).shape, compat.aval_of(atom).shape
    name = eqn.primitive.name
    if name == "broadcast_in_dim":
        return src, tuple(dims[o] if src_shape[i] == out_shape[o] else ()
                          for i, o in enumerate(eqn.params["broadcast_dimensions"]))
    if name == "transpose":
        new: list = [()] * len(dims)
        for j, p in enumerate(eqn.params["permutation"]):
            new[p] = dims[j]
        return src, tuple(new)
    if name in moving(Moves.RESHAPE, Moves.SQUEEZE):
        groups = reshape_groups(src_shape, out_shape)
        if groups is None:
            return None
        new = [()] * len(src_shape)
        for ins_, outs in groups:
            held = tuple(lab for o in outs for lab in dims[o])
            big = [i for i in ins_ if src_shape[i] != 1]
            if held and len(big) != 1:
                return None
            if held:
                new[big[0]] = held
        return src, tuple(new)
    return src, dims
