"""A softmax normalised after the value product: ``(e @ v) / sum``, in any arrangement.

MaxText divides the unnormalised output by the row sum only after the value product and a
reshape, with the sum moved to the output's dim order and reshaped the same way
(``[B, K, G, T, 1] -> [B, T, K, G, 1] -> [B, T, K·G, 1]``). The division is exact whatever
moves sit on either side, as long as the divisor at each element of the numerator is that
element's row sum. Both sides are labelled in terms of the softmax input's dims: a dim of a
value is the tuple of softmax-input dims it holds in row-major order (merged dims hold
several; size-1 dims none), ``("v", i)`` for the value's own dims. The numerator's labels
follow the product's output through transposes, reshapes that merge or add and drop size-1
dims, and casts; the divisor's follow the row sum forward through the same and broadcasts.
They must agree at every dim the rows vary along, and the divisor may only be broadcast
along the value's own dims.
"""
from __future__ import annotations

from typing import Any

from cptransform.analysis.dim_rules import reshape_groups
from cptransform.analysis.primitives import Moves, moving
from cptransform.ir import compat
from cptransform.ir.graph import Graph
from cptransform.passes.match_attention.anchor import Softmax, Split
from cptransform.passes.match_attention.stats import NotAttention
from cptransform.passes.match_attention.walk import single_user

#: Ops that may sit between the product and the division, on either side.
_MOVES = moving(Moves.IDENTITY, Moves.CAST, Moves.RESHAPE, Moves.SQUEEZE, Moves.PERMUTE)
#: The divisor may also be broadcast (along the value's own dims only).
_DIVISOR_MOVES = _MOVES | moving(Moves.BROADCAST)
#: A dim the divisor was broadcast along: constant there.
BROADCAST = None


def numerator(graph: Graph, out: Any, labels: tuple) -> tuple[Any, tuple, tuple]:
    """From the product's output ``out`` (dims labelled ``labels``: a softmax-input dim, or
    None for the value's own dims) to the division dividing it: ``(div equation, the moves
    on the way, the numerator's labels there)``."""
    labels = tuple((("v", i),) if lab is None else (lab,) for i, lab in enumerate(labels))
    after = []
    while True:
        user = single_user(graph, out)
        if user is None:
            raise NotAttention("the value product of unnormalised exponentials is not "
                               "divided by the row sum")
        if user.primitive.name == "div" and user.invars[0] is out:
            return user, tuple(after), labels
        if user.primitive.name not in _MOVES:
            raise NotAttention(f"the value product of unnormalised exponentials goes through "
                               f"{user.primitive.name} before its division by the row sum")
        labels = moved(user, labels)
        after.append(user)
        out = user.outvars[0]


def divides_by_row_sum(graph: Graph, div: Any, softmax: Softmax, labels: tuple) -> bool:
    """Whether ``div``'s divisor is ``softmax``'s row sum arranged as the numerator (labelled
    ``labels``), read only on the way to it."""
    chain, atom = [], div.invars[1]
    while atom is not softmax.sum:
        eqn = graph.producer(atom)
        ins = [] if eqn is None else [a for a in eqn.invars if not compat.is_literal(a)]
        if eqn is None or eqn.primitive.name not in _DIVISOR_MOVES or len(ins) != 1 \
                or single_user(graph, atom) is None:
            return False
        chain.append(eqn)
        atom = ins[0]
    if single_user(graph, softmax.sum) is None:
        return False
    nd = len(compat.aval_of(softmax.e).shape)
    got = tuple((d,) for d in range(nd) if d != softmax.axis)
    try:
        for eqn in reversed(chain):
            got = moved(eqn, got)
    except NotAttention:
        return False
    shape = compat.aval_of(div.outvars[0]).shape
    return len(got) == len(labels) and all(
        n == 1 or _same_rows(a, _whole(b)) for a, b, n in zip(got, labels, shape))


def _whole(atoms: tuple) -> tuple:
    """``atoms`` with each complete, ordered run of the parts of a split softmax-input dim
    merged back into that dim: MaxText takes the softmax over ``[B, K·G, T, S]`` and views
    the exponentials as ``[B, K, G, T, S]`` for the product, whose heads it merges again."""
    out: list = []
    i = 0
    while i < len(atoms):
        atom = atoms[i]
        if isinstance(atom, Split):
            parts = [j for j, n in enumerate(atom.sizes) if n != 1]
            run = atoms[i:i + len(parts)]
            if [getattr(a, "index", None) for a in run] == parts and all(
                    isinstance(a, Split) and a.dim == atom.dim and a.sizes == atom.sizes
                    for a in run):
                out.append(atom.dim)
                i += len(parts)
                continue
        out.append(atom)
        i += 1
    return tuple(out)


def _same_rows(divisor: tuple | None, numerator: tuple) -> bool:
    """Whether a divisor dim holds the numerator dim's rows, in the same order, and is
    constant (broadcast, or size 1) along the value's own dims merged into it."""
    if divisor in ((), BROADCAST):
        return all(_own(x) for x in numerator)
    return len(divisor) == len(numerator) and all(
        a == b or (a == _ANY and _own(b)) for a, b in zip(divisor, numerator))


def _own(atom: Any) -> bool:
    """An atom naming one of the value's own dims (its features)."""
    return isinstance(atom, tuple) and atom[0] == "v"


#: An atom of a divisor dim it was broadcast along, merged with others by a reshape.
_ANY = ("*",)


def moved(eqn: Any, labels: tuple) -> tuple:
    """The labels of ``eqn``'s result from those of its operand."""
    name = eqn.primitive.name
    src = [a for a in eqn.invars if not compat.is_literal(a)][0]
    in_shape, out_shape = compat.aval_of(src).shape, compat.aval_of(eqn.outvars[0]).shape
    if name in moving(Moves.PERMUTE):
        return tuple(labels[p] for p in eqn.params["permutation"])
    if name in moving(Moves.BROADCAST):
        new: list = [BROADCAST] * len(out_shape)
        for i, o in enumerate(eqn.params["broadcast_dimensions"]):
            new[o] = labels[i] if in_shape[i] == out_shape[o] else BROADCAST
        return tuple(() if out_shape[o] == 1 else lab for o, lab in enumerate(new))
    if name in moving(Moves.RESHAPE, Moves.SQUEEZE):
        groups = reshape_groups(in_shape, out_shape)
        if groups is None:
            raise NotAttention("an empty dim on the way to the division")
        new = [()] * len(out_shape)
        for ins, outs in groups:
            held = tuple(x for i in ins if in_shape[i] != 1
                         for x in (labels[i] if labels[i] is not BROADCAST else (_ANY,)))
            wide = [o for o in outs if out_shape[o] != 1]
            if len(wide) > 1:
                raise NotAttention("a dim is split on the way to the division by the row "
                                   "sum")
            for o in wide:
                new[o] = held
        return tuple(new)
    return labels
