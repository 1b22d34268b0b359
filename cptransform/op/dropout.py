"""Dropout on the attention probabilities, with the bits one device draws.

``jax.random`` draws ``random_bits(key, shape)`` with the partitionable threefry (JAX's
default since 0.5): element ``i`` of the row-major flattened ``shape`` is
``x ^ y`` for ``(x, y) = threefry2x32(key, (i >> 32, i & 0xffffffff))``. Its value
depends on the key and on ``i`` alone, so the bits of any block of ``(batch, head, query,
key)`` pairs follow from their global indices: every device, every ring step and every
kernel tile draws exactly the bits one device draws for those pairs, and no ``S × S``
array of bits ever exists.

:class:`DropoutSpec` says how a pair's index is made from its positions (the strides of
the query and key positions in ``i``; the batch and head part is data, the operand
``dropout_seed`` ``(*batch, heads, 4)`` uint32: the key's two words, then the high and low
word of the pair ``(b, h)``'s offset) and how the bits become the multiplier of the
probabilities (:class:`MultiplierMap`: the program's own elementwise chain, e.g.
``uniform(bits) < keep`` then ``where(keep, p / keep, 0)``, replayed on each tile).

The multiplier touches only the softmax's numerator: ``o = Σ_k p_k·M_k·v_k`` with the
row's normaliser unchanged, so the merge of partial results by log-sum-exp is unchanged;
the backward is ``dV = (P∘M)ᵀ dO``, ``dP = (dO Vᵀ)∘M`` and ``Δ = rowsum(dO∘O)`` as without
dropout. With ``zeroes`` (``where(keep, p·c, 0)``), a dropped pair contributes an exact 0
even where ``p`` is NaN, as the select does on one device.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.random import threefry2x32_p

_WORD = 0xFFFFFFFF

#: Primitives that only move or broadcast a value: on a tile the bits are drawn in the
#: tile's own layout, so these are identities on values that depend on the bits.
LAYOUT_PRIMITIVES = frozenset({"broadcast_in_dim", "reshape", "transpose", "squeeze",
                               "expand_dims"})


@dataclass(frozen=True)
class Const:
    """A scalar constant of the multiplier's chain (a literal or a size-1 value)."""

    value: Any
    dtype: str


@dataclass(frozen=True)
class Step:
    """One equation of the chain: ``primitive.bind(*args, **dict(params))``; an arg is
    ``"bits"``, the index of an earlier step, or a :class:`Const`."""

    primitive: Any
    params: tuple
    args: tuple


@dataclass(frozen=True)
class MultiplierMap:
    """The program's elementwise chain from the drawn bits to the multiplier.

    ``factors``: steps (or constants) multiplied into the probabilities; ``keeps``: boolean
    steps a ``where(keep, p, 0)`` selects with. The multiplier is the product of the
    factors, zero where a keep is False."""

    steps: tuple
    factors: tuple
    keeps: tuple = ()

    def __call__(self, bits):
        """The multiplier (float32, ``bits``' shape) of a tile of drawn ``bits``."""
        shape = bits.shape
        vals: list = []

        def arg(a):
            if isinstance(a, Const):
                return jnp.full(shape, a.value, a.dtype)
            return bits if a == "bits" else vals[a]

        for step in self.steps:
            args = [arg(a) for a in step.args]
            if step.primitive.name in LAYOUT_PRIMITIVES:
                vals.append(args[0])
            else:
                vals.append(step.primitive.bind(*args, **dict(step.params)))
        m = jnp.ones(shape, jnp.float32)
        for f in self.factors:
            m = m * arg(f).astype(jnp.float32)
        for k in self.keeps:
            m = jnp.where(arg(k), m, 0.0)
        return m


@dataclass(frozen=True)
class DropoutSpec:
    """Dropout on one attention's probabilities (see the module doc).

    ``q_stride``/``kv_stride``: the strides of the query and key positions in the flat
    index of the program's ``random_bits`` (0 where the bits are broadcast along them);
    ``multiplier``: the chain from bits to multiplier; ``zeroes``: a dropped pair is an
    exact 0 (the program selects) rather than ``p·0``."""

    q_stride: int
    kv_stride: int
    multiplier: MultiplierMap
    zeroes: bool = False

    def describe(self) -> str:
        return "dropout"


def _mul_wide(a, c: int):
    """``a · c mod 2**64`` as ``(hi, lo)`` uint32 words, ``a`` uint32, ``c`` a Python int
    (16-bit limbs: no 64-bit integers without x64)."""
    c_lo, c_hi = c & _WORD, (c >> 32) & _WORD
    a0, a1 = a & jnp.uint32(0xFFFF), a >> jnp.uint32(16)
    c0, c1 = jnp.uint32(c_lo & 0xFFFF), jnp.uint32(c_lo >> 16)
    p00, p01, p10, p11 = a0 * c0, a0 * c1, a1 * c0, a1 * c1
    mid = p01 + p10
    mid_carry = (mid < p01).astype(jnp.uint32)
    lo = p00 + (mid << jnp.uint32(16))
    lo_carry = (lo < p00).astype(jnp.uint32)
    hi = p11 + (mid >> jnp.uint32(16)) + (mid_carry << jnp.uint32(16)) + lo_carry \
        + a * jnp.uint32(c_hi)
    return hi, lo


def _add_wide(x, y):
    """The sum of two ``(hi, lo)`` uint32 pairs, mod ``2**64``."""
    lo = x[1] + y[1]
    return x[0] + y[0] + (lo < x[1]).astype(jnp.uint32), lo


def offsets(strides: dict, sizes: dict, batch: list, heads: tuple) -> np.ndarray:
    """The ``(*batch, H, 2)`` uint32 ``(hi, lo)`` offsets of each (batch entry, query head)
    in the flat index: ``Σ index(label)·stride(label)`` over the batch labels and the head
    labels (merged in ``heads``' order); a label missing from ``strides`` has stride 0."""
    shape = [sizes[lab] for lab in batch] + [int(np.prod([sizes[h] for h in heads]))]
    total = np.zeros(shape, np.uint64)
    grids = np.indices(shape, dtype=np.uint64)
    for lab, grid in zip(batch, grids[:len(batch)]):
        total += grid * np.uint64(strides.get(lab, 0))
    head = grids[len(batch)]
    for lab in reversed(heads):
        n = sizes[lab]
        total += (head % np.uint64(n)) * np.uint64(strides.get(lab, 0))
        head = head // np.uint64(n)
    return np.stack([(total >> np.uint64(32)).astype(np.uint32),
                     (total & np.uint64(_WORD)).astype(np.uint32)], axis=-1)


def multiplier(spec: DropoutSpec, seed, q_pos, kv_pos):
    """The dropout multiplier ``[B', H, Tq, Tkv]`` (float32) of the pairs of queries at
    ``q_pos`` and keys at ``kv_pos`` (``[B|1, T]``, global sequence indices) for
    ``seed`` ``[B|1, H, 4]`` (see the module doc): the bits one device draws there."""
    seed = seed[:, :, None, None, :]
    qi = q_pos.astype(jnp.uint32)[:, None, :, None]
    ki = kv_pos.astype(jnp.uint32)[:, None, None, :]
    index = _add_wide(_add_wide((seed[..., 2], seed[..., 3]), _mul_wide(qi, spec.q_stride)),
                      _mul_wide(ki, spec.kv_stride))
    shape = jnp.broadcast_shapes(index[0].shape, index[1].shape)
    k1, k2, hi, lo = (jnp.broadcast_to(x, shape) for x in
                      (seed[..., 0], seed[..., 1], *index))
    x, y = threefry2x32_p.bind(k1, k2, hi, lo)
    return spec.multiplier(lax.bitwise_xor(x, y))


def applied(spec: DropoutSpec | None, p, m):
    """The probabilities ``p`` with the multiplier ``m`` applied (``p`` unchanged without
    dropout): ``p·m``, and an exact 0 where ``m`` is 0 when the program selects."""
    if spec is None:
        return p
    return jnp.where(m != 0, p * m, 0.0) if spec.zeroes else p * m


def threefry_key(aval) -> str | None:
    """Why the bits of a key of abstract value ``aval`` cannot be drawn per block, or
    ``None`` when they can (a single threefry key, partitionable bits)."""
    if aval.shape != ():
        return "the dropout key is an array of keys"
    threefry = jax.eval_shape(lambda: jax.random.key(0, impl="threefry2x32")).dtype
    if aval.dtype != threefry:
        return f"the dropout key's implementation ({aval.dtype}) is not threefry2x32"
    if not jax.config.jax_threefry_partitionable:
        return ("jax_threefry_partitionable is off: the bits of a block depend on the whole "
                "shape drawn")
    return None
