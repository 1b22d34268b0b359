"""``seq_permute_p``: a value moved between natural token order and a layout's order.

A load-balanced program holds its sequence in a layout's order (zigzag, striped: see
:mod:`cptransform.op.layouts`); ``reorder-sequence`` converts values between that order and
the natural one. Bound as one equation, a conversion says what it is: on one device it is a
gather by an index computed from an iota (:func:`take_sequence`), and the CP lowering turns
a conversion of a whole sequence-sharded dim into the collectives that move exactly the
tokens that change rank (two collective-permutes of half a shard for zigzag, one
all-to-all for striped), where XLA's SPMD partitioner would all-gather the whole sequence
for the gather and all-reduce it for its transpose.

``dim`` of the operand holds ``outer × seq_len × inner`` in row-major order (a full
sequence dim: outer and inner 1; ``[B*S]`` rows: inner 1; ``[S*D]`` features: inner
``D``); ``inverse`` is False for natural → layout order, True for layout → natural.
The conversion is linear: its tangent is the same conversion and its transpose the
inverse one.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import jax.numpy as jnp

from cptransform.ir import compat

if TYPE_CHECKING:
    from cptransform.op.layouts import SequenceLayout


def take_sequence(x, *, layout: "SequenceLayout", dim: int, inner: int, inverse: bool):
    """``x`` with the sequence digit of ``dim`` reordered by a gather (the one-device
    evaluation of :data:`seq_permute_p`)."""
    index = jnp.arange(layout.seq_len, dtype=jnp.int32)
    index = layout.slot_of_position(index) if inverse else layout.position_of_slot(index)
    shape = x.shape
    if shape[dim] == layout.seq_len:
        return jnp.take(x, index, axis=dim)
    split = shape[:dim] + (shape[dim] // (layout.seq_len * inner), layout.seq_len,
                           inner) + shape[dim + 1:]
    return jnp.take(x.reshape(split), index, axis=dim + 1).reshape(shape)


def _abstract_eval(x, **_):
    return compat.ShapedArray(x.shape, x.dtype)


def _jvp(primals, tangents, **params):
    (x,), (t,) = primals, tangents
    out = seq_permute_p.bind(x, **params)
    return out, seq_permute_p.bind(compat.instantiate_zeros(t), **params)


def _transpose(cotangent, x, *, layout, dim: int, inner: int, inverse: bool):
    # A permutation's transpose is its inverse.
    ct = compat.instantiate_zeros(cotangent)
    return [seq_permute_p.bind(ct, layout=layout, dim=dim, inner=inner, inverse=not inverse)]


def _batch(args, dims, *, layout, dim: int, inner: int, inverse: bool):
    (x,), (b,) = args, dims
    x = jnp.moveaxis(x, b, 0)
    return seq_permute_p.bind(x, layout=layout, dim=dim + 1, inner=inner, inverse=inverse), 0


seq_permute_p = compat.define_primitive(
    "seq_permute", multiple_results=False, impl=take_sequence,
    abstract_eval=_abstract_eval, jvp=_jvp, batch=_batch)
compat.define_transpose(seq_permute_p, _transpose)
compat.register_pp_rule(
    seq_permute_p,
    lambda params: (f"seq_permute[{params['layout'].name}"
                    f"{' inverse' if params['inverse'] else ''} dim={params['dim']}"
                    f"{'' if params['inner'] == 1 else ' inner=%d' % params['inner']}]"))
