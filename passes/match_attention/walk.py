"""Small use-def walks: following a value through ops that only move, cast or broadcast it."""
from __future__ import annotations

from typing import Any

import numpy as np

from cptransform.analysis.dim_rules import unit_reshape_dims
from cptransform.analysis.primitives import Moves, moving
from cptransform.ir import compat
from cptransform.ir.graph import Graph
from cptransform.ir.patterns import look_through

#: Equations that only move, cast or broadcast a value.
WRAPPERS = moving(Moves.IDENTITY, Moves.CAST, Moves.BROADCAST, Moves.RESHAPE, Moves.SQUEEZE)
#: Equations that may only add or drop size-1 dims.
UNIT_RESHAPES = moving(Moves.RESHAPE, Moves.SQUEEZE)
#: Equations a scalar constant is seen through.
_SCALAR_WRAPPERS = moving(Moves.BROADCAST, Moves.CAST, Moves.RESHAPE)


def follow_back(graph: Graph, atom: Any, dims: tuple, target: Any,
                through: frozenset = WRAPPERS) -> tuple | None:
    """Dim map of ``target`` when ``atom`` is ``target`` moved/broadcast/cast, else None.

    ``dims`` labels ``atom``'s dims; the result labels ``target``'s dims (None: size 1 or
    broadcast away).
    """
    while atom is not target:
        eqn = graph.producer(atom)
        if eqn is None or eqn.primitive.name not in through:
            return None
        back = step_back(eqn, atom, dims)
        if back is None:
            return None
        atom, dims = back
    return dims


def step_back(eqn: Any, atom: Any, dims: tuple) -> tuple[Any, tuple] | None:
    """``(operand, its labels)`` of a one-operand move/cast/broadcast ``eqn`` (or
    ``max(-inf, x)``) whose result ``atom`` is labelled ``dims``; None for anything else."""
    name = eqn.primitive.name
    ins = [a for a in eqn.invars if not compat.is_literal(a)]
    if len(ins) != 1:
        return None
    src = ins[0]
    out_shape = compat.aval_of(atom).shape
    src_shape = compat.aval_of(src).shape
    if name == "broadcast_in_dim":
        dims = tuple(dims[o] if src_shape[i] == out_shape[o] else None
                     for i, o in enumerate(eqn.params["broadcast_dimensions"]))
    elif name == "transpose":
        new = [None] * len(dims)
        for j, p in enumerate(eqn.params["permutation"]):
            new[p] = dims[j]
        dims = tuple(new)
    elif name in UNIT_RESHAPES:
        dims = unit_reshape_dims(src_shape, out_shape, dims)
        if dims is None:
            return None
    elif name == "max":
        lit = [a for a in eqn.invars if compat.is_literal(a)]
        if len(lit) != 1 or compat.literal_value(lit[0]) != -np.inf:
            return None
    return src, dims


def scalar_value(graph: Graph, atom: Any) -> float | None:
    """The value of a scalar constant (a literal, a 0-d/size-1 const, or their broadcast)."""
    atom = look_through(graph, atom, _SCALAR_WRAPPERS)
    if compat.is_literal(atom):
        return float(np.asarray(compat.literal_value(atom)).reshape(()))
    if graph.is_const(atom):
        value = np.asarray(graph.const_value(atom))
        if value.size == 1:
            return float(value.reshape(()))
    return None


def single_user(graph: Graph, atom: Any) -> Any | None:
    """The only equation reading ``atom`` (None if several, none, or it is an output)."""
    users = graph.users(atom)
    if len(users) != 1 or graph.is_output(atom):
        return None
    return users[0]


def only_feeds(graph: Graph, atom: Any, target: Any) -> bool:
    """Whether ``atom`` is read only by ``target``, possibly through single-use wrappers."""
    while True:
        user = single_user(graph, atom)
        if user is target:
            return True
        if user is None or user.primitive.name not in WRAPPERS:
            return False
        atom = user.outvars[0]


def strip_scale(graph: Graph, atom: Any) -> tuple[Any, float]:
    """``(x, c)`` with ``atom == x * c`` for scalar constants multiplied or divided in."""
    c = 1.0
    while True:
        eqn = graph.producer(atom)
        if eqn is None or eqn.primitive.name not in ("mul", "div"):
            return atom, c
        shape = compat.aval_of(atom).shape
        a, b = eqn.invars
        order = ((a, b), (b, a)) if eqn.primitive.name == "mul" else ((a, b),)
        for x, s in order:
            v = scalar_value(graph, s)
            if v is not None and v != 0 and not compat.is_literal(x) \
                    and compat.aval_of(x).shape == shape:
                c = c * v if eqn.primitive.name == "mul" else c / v
                atom = x
                break
        else:
            return atom, c


def unrepeat(graph: Graph, atom: Any, dim: int) -> tuple[Any, int] | None:
    """``(x, g)`` when ``atom`` is ``jnp.repeat(x, g, axis=dim)`` (broadcast + merge)."""
    eqn = graph.producer(atom)
    if eqn is None or eqn.primitive.name != "reshape":
        return None
    src = eqn.invars[0]
    out_shape, in_shape = compat.aval_of(atom).shape, compat.aval_of(src).shape
    if len(in_shape) != len(out_shape) + 1 or \
            in_shape[:dim] + (in_shape[dim] * in_shape[dim + 1],) + in_shape[dim + 2:] != out_shape:
        return None
    bc = graph.producer(src)
    if bc is None or bc.primitive.name != "broadcast_in_dim":
        return None
    x = bc.invars[0]
    want = tuple(d for d in range(len(in_shape)) if d != dim + 1)
    if tuple(bc.params["broadcast_dimensions"]) != want or \
            compat.aval_of(x).shape != out_shape[:dim] + (in_shape[dim],) + out_shape[dim + 1:]:
        return None
    return x, in_shape[dim + 1]
