"""``Block``: the per-device operands of one attention, as one pytree.

Every schedule and kernel works on the same canonical operands; a :class:`Block`
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
* ``q_valid``/``kv_valid`` bool ``[B|1, T]`` or ``None``: which queries and keys are no
  padding (``MaskSpec.q_padding``/``kv_padding``); ``kv_valid`` travels with the keys.
* ``kv_inside``/``kv_outside`` bool ``[B|1, Tkv]`` or ``None``: each key's test inside and
  outside the region of ``MaskSpec.region_padding``; they travel with the keys.
* ``q_coord`` int32 ``[B|1, Tq]`` or ``None``: the queries' data coordinates of a
  coordinate band (``MaskSpec.coordinate_band``), compared with the keys' positions. It
  belongs to the queries like ``q_seg``.
* ``dropout`` uint32 ``[B|1, H, 4]`` or ``None``: the dropout seed of each (batch entry,
  query head) (:mod:`~cptransform.op.dropout`); replicated over the CP devices like the
  sinks, but read by the kernels, which draw each tile's bits from it and the positions.

Each field's :class:`~cptransform.op.operand_roles.Role`
(:data:`~cptransform.op.attention_spec.ROLES`: its :class:`Side`, the operand it comes
from; the mask terms declare their operands' roles) says how it is sharded, permuted,
sliced, sent and regrouped; the schedules and kernels loop over it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import jax
from jax import lax

from cptransform.op.attention_spec import ROLES
from cptransform.op.mask_terms import TERM_ROLES
from cptransform.op.operand_roles import Role, Side

#: The fields that belong to the keys: they travel together (ring) or are gathered together.
KEY_FIELDS = tuple(name for name, role in ROLES.items() if role.side is Side.KEY)
#: The key fields the mask terms bring (segment ids, validity): sent with K and V as they are.
KEY_DATA = tuple(name for name in KEY_FIELDS if name in TERM_ROLES)


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
    q_valid: Any = None
    kv_valid: Any = None
    kv_inside: Any = None
    kv_outside: Any = None
    dropout: Any = None

    def replace(self, **fields) -> "Block":
        """This block with ``fields`` replaced."""
        return dataclasses.replace(self, **fields)

    def by_role(self, fn: Callable[[Any, Role], Any]) -> "Block":
        """``fn(value, role)`` of every present field (absent ones stay ``None``)."""
        return Block(**{name: None if getattr(self, name) is None
                        else fn(getattr(self, name), role) for name, role in ROLES.items()})

    def query_slice(self, start: int, stop: int) -> "Block":
        """Only queries ``[start, stop)``, with their entries of every query-side operand."""
        return self.by_role(lambda x, r: lax.slice_in_dim(x, start, stop, axis=r.token_axis)
                            if r.side in (Side.QUERY, Side.ROWS) else x)

    def key_slice(self, start: int, stop: int) -> "Block":
        """Only keys ``[start, stop)``: the key-side operands and the mask's and bias's
        columns."""
        def cut(x, r):
            if r.side is Side.KEY:
                return lax.slice_in_dim(x, start, stop, axis=1)
            return lax.slice_in_dim(x, start, stop, axis=3) if r.columns else x
        return self.by_role(cut)

    def tile(self, q_start, q_size: int, kv_start, kv_size: int) -> "Block":
        """Queries ``[q_start, q_start + q_size)`` against keys ``[kv_start, kv_start +
        kv_size)`` (traced starts): every operand cut along its side's token dims."""
        def cut(x, r):
            if r.side is Side.KEY:
                return lax.dynamic_slice_in_dim(x, kv_start, kv_size, axis=1)
            if r.side is Side.HEADS:
                return x
            x = lax.dynamic_slice_in_dim(x, q_start, q_size, axis=r.token_axis)
            return lax.dynamic_slice_in_dim(x, kv_start, kv_size, axis=3) if r.columns else x
        return self.by_role(cut)

    def term_operands(self) -> dict:
        """The operands the mask terms bring, by field name (``None`` when absent): what
        :func:`~cptransform.op.attention_reference.visible`,
        :meth:`~cptransform.op.mask_terms.Blocks.cut` and
        :meth:`~cptransform.op.mask_terms.Tile.of` take beside the positions."""
        return {name: getattr(self, name) for name in TERM_ROLES}

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
        return self.by_role(lambda x, r: lax.dynamic_slice_in_dim(
            x, source * width, width, axis=3) if r.columns else x)
