"""The operands of the Pallas kernels: a :class:`~cptransform.lowering.block.Block` brought to
the heads-major, padded layout the kernels tile, and back.

Heads-major (``[B, H, T, D]``) because Mosaic tiles the last two dims of every block: a
``(block, D)`` slab of one head is legal there, a ``(1, D)`` slice of ``[B, T, H, D]`` is not.
Lengths are padded up to a multiple of the block; padded rows and columns are excluded by
the kernels' index check (tiles holding them are never ``BlockKind.FULL``), so padding needs no
special positions and works for every mask, the unmasked one included.

A top-k mask reaches the kernels as its selection on this call's keys (``picked``, int8
``[B|1, H|1, Tq, Tkv]``, what :func:`~cptransform.op.attention_reference.selected` says for
the key positions the call holds): the indices name global positions, so under a ring the
selection of step ``i`` is the one of the KV shard held then, in the keys' layout order,
without slicing by rank. The block table's top-k term skips the tiles no index reaches;
the kernels read ``picked`` as they read a dense mask, forward Q-major and (transposed)
KV-major in dK/dV.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from cptransform.op.attention_reference import selected
from cptransform.op.attention_spec import AttentionSpec
from cptransform.lowering.block import Block
from cptransform.lowering.kernels.block_table import block_table


#: The mask terms' operands (by field name) the tiles carry: segment ids, the dense mask
#: and top-k indices (as the ``picked`` selection); a term bringing any other is refused.
TILE_OPERANDS = frozenset({"q_seg", "kv_seg", "mask", "topk"})


@dataclass(frozen=True)
class Operands:
    """Padded heads-major operands and the static facts every kernel needs.

    ``q [B, H, Tqp, D]``, ``k [B, Hkv, Tkvp, D]``, ``v [B, Hkv, Tkvp, Dv]``; positions and
    segment ids ``[B|1, Tp]`` int32; ``mask`` and ``picked`` (the top-k selection) int8 and
    ``bias`` ``[B|1, H|1, Tqp, Tkvp]``;
    ``table`` int32 ``[Bt, Ht, nq, nk]`` (:func:`block_table`). ``tq``/``tkv`` are the real
    lengths, ``bq``/``bk`` the block sizes, ``groups`` query heads per KV head.
    """

    q: object
    k: object
    v: object
    q_pos: object
    kv_pos: object
    q_seg: object
    kv_seg: object
    mask: object
    picked: object
    bias: object
    table: object
    tq: int
    tkv: int
    bq: int
    bk: int
    groups: int

    @property
    def nq(self) -> int:
        return self.q.shape[2] // self.bq

    @property
    def nk(self) -> int:
        return self.k.shape[2] // self.bk


def _pad_to(x, axis: int, length: int):
    if x is None or x.shape[axis] == length:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, length - x.shape[axis])
    return jnp.pad(x, widths)


def heads_major(x, length: int):
    """``[B, T, H, D]`` → padded ``[B, H, length, D]``."""
    return _pad_to(jnp.swapaxes(x, 1, 2), 2, length)


def tokens_major(x, length: int):
    """Inverse of :func:`heads_major`: padded ``[B, H, Tp, D]`` → ``[B, length, H, D]``."""
    return jnp.swapaxes(x[:, :, :length], 1, 2)


def prepare(block: Block, spec: AttentionSpec, bq: int, bk: int) -> Operands:
    """Pad and transpose ``block`` for kernels with ``bq × bk`` tiles; builds the table and,
    for a top-k mask, the selection ``picked`` on this block's keys."""
    tq, tkv = block.q.shape[1], block.k.shape[1]
    tqp, tkvp = -(-tq // bq) * bq, -(-tkv // bk) * bk
    table = block_table(spec.mask, block.q_pos, block.kv_pos, bq, bk, **block.term_operands())
    topk = block.topk if spec.mask.topk else None

    def dense(x):
        return _pad_to(_pad_to(x, 2, tqp), 3, tkvp)

    segments = spec.mask.segments
    return Operands(
        q=heads_major(block.q, tqp), k=heads_major(block.k, tkvp),
        v=heads_major(block.v, tkvp),
        q_pos=_pad_to(block.q_pos.astype(jnp.int32), 1, tqp),
        kv_pos=_pad_to(block.kv_pos.astype(jnp.int32), 1, tkvp),
        q_seg=_pad_to(block.q_seg.astype(jnp.int32), 1, tqp) if segments else None,
        kv_seg=_pad_to(block.kv_seg.astype(jnp.int32), 1, tkvp) if segments else None,
        # int8, not bool: Mosaic has no bool memory refs.
        mask=dense(block.mask.astype(jnp.int8)) if spec.mask.dense else None,
        picked=None if topk is None else dense(selected(topk, block.kv_pos).astype(jnp.int8)),
        bias=dense(block.bias) if block.bias is not None else None,
        table=table, tq=tq, tkv=tkv, bq=bq, bk=bk,
        groups=block.q.shape[2] // block.k.shape[2])


def head_index(size: int, h):
    """Index into a dim of ``size`` that is either the heads (``H``) or broadcast (1)."""
    return h if size > 1 else 0


def _varying(aval) -> frozenset:
    """The mesh axes a traced value varies over inside ``shard_map`` (JAX 0.10 spells it
    ``manual_axis_type.varying``, other versions ``vma``; empty outside ``shard_map``)."""
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()) or ())


def out_struct(shape, dtype, inputs) -> jax.ShapeDtypeStruct:
    """The ``out_shape`` of a ``pallas_call`` whose output varies like the most varying of
    ``inputs``: under ``shard_map(check_vma=True)`` pallas_call needs the output's type
    spelled out, and a kernel's output depends on all its inputs."""
    avals = [jax.typeof(x) for x in inputs if x is not None]
    widest = max(avals, key=lambda a: len(_varying(a)))
    if not _varying(widest):
        return jax.ShapeDtypeStruct(shape, dtype)
    if getattr(widest, "manual_axis_type", None) is not None:
        return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=widest.manual_axis_type)
    return jax.ShapeDtypeStruct(shape, dtype, vma=_varying(widest))
