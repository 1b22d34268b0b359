"""``Block``: the per-device operands of one attention, as one pytree.

Every schedule and kernel works on the same ten canonical operands; a :class:`Block`
carries them together so that they are sharded, sent, sliced and differentiated as one
value (``None`` fields are empty subtrees: ``jax.tree`` functions, ``lax.cond``,
``custom_vjp`` and ``shard_map`` skip them).

Shapes (``B`` = all batch dims flattened, a heads dim always present):

* ``q [B, Tq, H, D]``, ``k [B, Tkv, Hkv, D]``, ``v [B, Tkv, Hkv, Dv]``;
* ``q_pos``/``kv_pos`` int32 ``[B|1, T]``: global positions of the tokens;
* ``q_seg``/``kv_seg`` ``[B|1, T]`` or ``None``;
* ``mask`` bool and ``bias`` float ``[B|1, H|1, Tq, Tkv']`` or ``None``, where ``Tkv'`` is
  the block's keys in a kernel call and *all* keys (in layout order) where a schedule
  receives it; :meth:`Block.columns` narrows one to the other;
* ``sinks`` float ``[B|1, H]`` or ``None``: replicated over the CP devices. Only schedules
  read it (:func:`~cptransform.op.attention_reference.merge_sinks` once per row, after all
  keys are merged); kernels receive blocks without it.
* ``topk`` int32 ``[B|1, H|1, Tq, k]`` or ``None``: the global key positions each query
  may see (a top-k sparse mask). It belongs to the queries: sharded with them, never
  sent with the keys and never narrowed, since it names positions, not columns.
* ``q_coord`` int32 ``[B|1, Tq]`` or ``None``: the queries' data coordinates of a
  coordinate band (``MaskSpec.coordinate_band``), compared with the keys' positions. It
  belongs to the queries like ``q_seg``.
* ``dropout`` uint32 ``[B|1, H, 4]`` or ``None``: the dropout seed of each (batch entry,
  query head) (:mod:`~cptransform.op.dropout`); replicated over the CP devices like the
  sinks, but read by the kernels, which draw each tile's bits from it and the positions.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import jax
from jax import lax


#: The fields that belong to the keys: they travel together (ring) or are gathered together.
KEY_FIELDS = ("k", "v", "kv_pos", "kv_seg")


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Block:
    """Queries, keys, values, their positions and segment ids, a dense mask, a bias, the
    sinks, top-k key positions, the queries' coordinates and the dropout seed."""

    q: Any = None
    k: Any = None
    v: Any = None
    q_pos: Any = None
    kv_pos: Any = None
    q_seg: Any = None
    kv_seg: Any = None
    mask: Any = None
    bias: Any = None
    sinks: Any = None
    topk: Any = None
    q_coord: Any = None
    dropout: Any = None

    def replace(self, **fields) -> "Block":
        """This block with ``fields`` replaced."""
        return dataclasses.replace(self, **fields)

    def keys(self) -> "Block":
        """Only the key side (k, v, kv positions, kv segment ids): what moves with K/V."""
        return Block(**{name: getattr(self, name) for name in KEY_FIELDS})

    def with_keys(self, keys: "Block") -> "Block":
        """This block's queries and mask against the key side of ``keys``; a key field that
        ``keys`` leaves ``None`` (not sent) keeps this block's value."""
        return self.replace(**{name: getattr(keys, name) for name in KEY_FIELDS
                               if getattr(keys, name) is not None})

    def columns(self, source, width: int) -> "Block":
        """The mask and bias narrowed to key columns ``[source·width, (source+1)·width)``:
        the columns of the keys that started on rank ``source`` (a traced int)."""
        cut = lambda x: None if x is None else lax.dynamic_slice_in_dim(  # noqa: E731
            x, source * width, width, axis=3)
        return self.replace(mask=cut(self.mask), bias=cut(self.bias))
