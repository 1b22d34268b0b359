"""Whether a recurrence runs along a sequence, and at which granularity.

A recurrence runs along the sequence when the axis of its iterated operands is a full
sequence dim (one step per token: a scan over time, a cumsum over tokens) or the high part
of one split into chunks (one step per chunk of ``c`` tokens: a scan across the chunks of
a GLA or Mamba-2 layer, ``x.reshape(B, S // c, c, D)`` moved to the front). Values are
followed back to a sequence dim through transposes, casts and elementwise ops, and
through reshapes that split a dim with the iteration's part on top; nothing is read from
sizes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cptransform.analysis.dim_rules import reshape_groups
from cptransform.analysis.primitives import Family, facts
from cptransform.analysis.seq_axes import SeqAxes
from cptransform.ir import compat


@dataclass(frozen=True)
class Along:
    """A recurrence's axis on a sequence: which one, and ``chunk`` tokens per step."""

    sequence: int
    chunk: int


def _back(eqn, out, dim: int) -> tuple[Any, int, int] | None:
    """``(operand, dim, chunk)``: where dim ``dim`` of result ``out`` of ``eqn`` comes from,
    ``chunk`` the size of what a split put below it (1 when it is a whole dim)."""
    name = eqn.primitive.name
    row = facts(name)
    x = eqn.invars[0] if eqn.invars else None
    if x is None or compat.is_literal(x):
        return None
    if name == "transpose":
        return x, eqn.params["permutation"][dim], 1
    if name == "reshape":
        for ins, outs in reshape_groups(x.aval.shape, out.aval.shape) or ():
            if dim in outs and len(ins) == 1 and outs[0] == dim:
                chunk = 1
                for o in outs[1:]:
                    chunk *= out.aval.shape[o]
                return x, ins[0], chunk
        return None
    if row is not None and row.family is Family.ELEMENTWISE:
        for a in eqn.invars:
            if not compat.is_literal(a) and a.aval.shape == out.aval.shape:
                return a, dim, 1
    return None


def along_sequence(axes: SeqAxes, producers: dict, atom, dim: int) -> Along | None:
    """The sequence dim ``dim`` of ``atom`` runs along, followed back through its
    producers (``producers``: variable → equation), or ``None``."""
    chunk = 1
    for _ in range(64):
        if compat.is_literal(atom):
            return None
        if dim in axes.full_dims(atom):
            return Along(axes.sequence[(atom, dim)], chunk)
        eqn = producers.get(atom)
        if eqn is None:
            return None
        step = _back(eqn, atom, dim)
        if step is None:
            return None
        atom, dim, below = step
        chunk *= below
    return None


def sequence_elsewhere(axes: SeqAxes, atom, dim: int | None) -> bool:
    """``atom`` carries a sequence on a dim other than ``dim``."""
    return any(d != dim for d in axes.dims(atom))
