"""Forward from the probabilities to the ``p·v`` product, and where the attention ends.

The probabilities may only be cast, transposed, reshaped by size-1 dims or have a dim split
on the way (grouped-query attention viewing ``[B, T, K·G, S]`` as ``[B, T, K, G, S]``: each
part is a :class:`Split`, resolved against the logits' merged dims once both products are
read), and nothing else may read them. With a sink column (:mod:`~cptransform.passes.
match_attention.sink`), exactly one slice that drops it, and nothing else, is on the way.
Dropout on the way (a multiplier or a keep-mask drawn with ``jax.random``, and scalar
scales) is read by :mod:`~cptransform.passes.match_attention.dropout`. Where the
normalisation is deferred (``(e @ v) / sum``, through moves on either side:
:mod:`~cptransform.passes.match_attention.deferred`), the division after the product is the
attention's output.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from cptransform.analysis.dim_rules import reshape_groups
from cptransform.analysis.primitives import Moves, moving
from cptransform.ir import compat
from cptransform.ir.graph import Graph
from cptransform.passes.match_attention.anchor import Softmax, Split
from cptransform.passes.match_attention.deferred import divides_by_row_sum, numerator
from cptransform.passes.match_attention.dropout import DropoutReader, Drawn
from cptransform.passes.match_attention.stats import NotAttention
from cptransform.passes.match_attention.walk import UNIT_RESHAPES, scalar_value

_CASTS = moving(Moves.CAST)
_PERMUTES = moving(Moves.PERMUTE)


@dataclass(frozen=True)
class ValueProduct:
    """The ``p·v`` dot_general of one attention and the output it produces.

    ``p``: the probabilities operand of ``eqn``; ``p_dims``: which softmax-input dim (or
    :class:`Split` part of one) each of its dims is; ``root``: the equation the attention replaces (the product, or the
    division after it); ``out``: that equation's output; ``zeroed``: ``(mask, softmax-input
    dim of each of its dims)`` for each ``where(mask, p, 0)`` on the way (Keras'
    ``Softmax(mask=...)`` zeroes the probabilities the mask hides after the softmax).
    """

    eqn: Any
    p: Any
    p_dims: tuple
    root: Any
    out: Any
    zeroed: tuple = ()
    dropout: Drawn | None = None
    after: tuple = ()

    @property
    def p_is_lhs(self) -> bool:
        return self.eqn.invars[0] is self.p

    @property
    def v(self) -> Any:
        return self.eqn.invars[1 if self.p_is_lhs else 0]

    def dims(self) -> tuple[tuple, tuple, tuple, tuple]:
        """``(p contracting, p batch, v contracting, v batch)`` dims of the product."""
        (lc, rc), (lb, rb) = self.eqn.params["dimension_numbers"]
        return (lc, lb, rc, rb) if self.p_is_lhs else (rc, rb, lc, lb)


def normalized(graph: Graph, probs: Any, dims: tuple,
               sink: tuple[int, int] | None = None) -> ValueProduct:
    """``p = e / sum`` then ``p @ v``: the product is the root. ``sink``: ``(softmax axis,
    key count)`` when the last column along the axis is a sink to slice away."""
    pv, p_dims, p, zeroed, drawn = _to_product(graph, probs, dims, sink=sink)
    return ValueProduct(pv, p, p_dims, pv, pv.outvars[0], zeroed, drawn)


def deferred(graph: Graph, softmax: Softmax, dims: tuple,
             sink: tuple[int, int] | None = None) -> ValueProduct:
    """``(e @ v) / sum``: the division after the value product is the root (``sink`` as
    in :func:`normalized`)."""
    pv, p_dims, p, zeroed, drawn = _to_product(graph, softmax.e, dims, softmax.sum_eqn, sink)
    if zeroed:
        raise NotAttention("unnormalised exponentials are zeroed by a mask before the value "
                           "product")
    product = ValueProduct(pv, p, p_dims, pv, pv.outvars[0], dropout=drawn)
    div, after, labels = numerator(graph, pv.outvars[0], _out_dims(product))
    if not divides_by_row_sum(graph, div, softmax, labels):
        raise NotAttention("the value product is divided by something other than the "
                           "row sum")
    return ValueProduct(pv, p, p_dims, div, div.outvars[0], dropout=drawn, after=after)


def _to_product(graph: Graph, p: Any, dims: tuple, also_read_by: Any = None,
                sink: tuple[int, int] | None = None):
    """Follow the probabilities through casts/transposes to the p·v dot_general.

    ``also_read_by``: an equation allowed to read ``p`` itself besides the path (the
    row sum, when the normalisation comes after the value product). ``sink``: ``(axis,
    width)``: one slice must keep the first ``width`` entries of softmax-input dim ``axis``
    (and everything else), dropping the sink column. Returns the product, the
    probabilities' dims there, the probabilities operand, the zeroing masks met and the
    dropout applied (or None).
    """
    zeroed: list = []
    drops = DropoutReader(graph)
    while True:
        users = [u for u in graph.users(p) if u is not also_read_by]
        also_read_by = None
        user = users[0] if len(users) == 1 and not graph.is_output(p) else None
        if user is None:
            err = NotAttention("the attention probabilities are also used elsewhere "
                               "(returned weights, a penalty on them, ...)")
            err.attention_like = any(u.primitive.name == "dot_general"
                                     for u in graph.users(p))
            raise err
        name = user.primitive.name
        if name == "dot_general":
            if sink is not None:
                raise NotAttention("the sink column's probability is not sliced away before "
                                   "the value product")
            return user, dims, p, tuple(zeroed), drops.found()
        if name == "slice" and sink is not None:
            _check_drops_sink(user, dims, *sink)
            sink = None
        elif drops.read(user, p, dims):
            pass
        elif _zeroes(graph, user, p):
            if any(isinstance(d, Split) for d in dims):
                raise NotAttention("the probabilities are zeroed by a mask after a reshape")
            zeroed.append((user.invars[0], dims))
        elif name in _CASTS:
            pass
        elif name in _PERMUTES:
            dims = tuple(dims[i] for i in user.params["permutation"])
        elif name in UNIT_RESHAPES:
            dims = _split_dims(compat.aval_of(p).shape, compat.aval_of(user.outvars[0]).shape,
                               dims)
        else:
            raise NotAttention(f"the probabilities go through {name} before the value "
                               "product (only casts, moves, masks, scalar scales and "
                               "dropout drawn with jax.random are read there)")
        p = user.outvars[0]


def _zeroes(graph: Graph, eqn: Any, p: Any) -> bool:
    """Whether ``eqn`` is ``where(mask, p, 0)``: ``select_n(mask, 0, p)`` of a boolean
    mask of ``p``'s rank."""
    if eqn.primitive.name != "select_n" or len(eqn.invars) != 3:
        return False
    mask, on_false, on_true = eqn.invars
    return on_true is p and on_false is not p and scalar_value(graph, on_false) == 0 \
        and compat.aval_of(mask).dtype == np.bool_ \
        and len(compat.aval_of(mask).shape) == len(compat.aval_of(p).shape)


def _check_drops_sink(eqn: Any, dims: tuple, axis: int, width: int) -> None:
    """Refuse a slice of the probabilities other than ``[..., :width]`` along ``axis``."""
    shape = compat.aval_of(eqn.invars[0]).shape
    want = tuple(width if d == axis else n for d, n in zip(dims, shape))
    strides = eqn.params.get("strides") or (1,) * len(shape)
    if axis not in dims or any(isinstance(d, Split) for d in dims) or \
            any(eqn.params["start_indices"]) or tuple(eqn.params["limit_indices"]) != want \
            or any(s != 1 for s in strides):
        raise NotAttention("the probabilities are sliced other than by dropping the last "
                           "(sink) column of the softmax axis")


def _split_dims(in_shape: tuple, out_shape: tuple, dims: tuple) -> tuple:
    """The labels after a reshape of the probabilities that adds or drops size-1 dims or
    splits a dim (a merge would mix a softmax dim with another: refused)."""
    groups = reshape_groups(in_shape, out_shape)
    if groups is None or any(sum(in_shape[i] != 1 for i in ins) > 1 for ins, _ in groups):
        raise NotAttention("the probabilities are reshaped before the value product "
                           "(dims merged)")
    new: list = [None] * len(out_shape)
    for ins, outs in groups:
        if not ins or not outs:
            continue  # a size-1 dim added or dropped
        i = max(ins, key=lambda d: in_shape[d])
        if len(outs) > 1 and (dims[i] is None or isinstance(dims[i], Split)):
            raise NotAttention("the probabilities are reshaped before the value product "
                               "(a dim split twice)")
        sizes = tuple(out_shape[o] for o in outs)
        for j, o in enumerate(outs):
            new[o] = dims[i] if len(outs) == 1 else Split(dims[i], j, sizes)
    return tuple(new)


def _out_dims(product: ValueProduct) -> tuple:
    """Labels of the p·v output dims in terms of p's dims (v's own dims: None)."""
    pc, pb, vc, vb = product.dims()
    p_dims = product.p_dims
    v_nd = len(compat.aval_of(product.v).shape)
    p_free = [p_dims[i] for i in range(len(p_dims)) if i not in pc and i not in pb]
    v_free = [None for i in range(v_nd) if i not in vc and i not in vb]
    batch = [p_dims[i] for i in pb]
    return tuple(batch + (p_free + v_free if product.p_is_lhs else v_free + p_free))
