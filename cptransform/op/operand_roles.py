"""What each operand of an attention is: the :class:`Side` of the tokens it follows and its
:class:`Role`.

The operands every attention has (q, k, v and their positions) and those that are no mask
term (a bias, the sinks, the dropout seed) are :data:`BASE_ROLES`; each mask term declares
the roles of the operands it brings (:attr:`cptransform.op.mask_terms.Band.roles` and its
siblings), and :data:`cptransform.op.attention_spec.ROLES` is the union. Validation, the
sequence-axes analysis, the reference, padding, the schedules' sharding, layout
permutation, ring travel and Ulysses' regrouping, and the kernels' slicing all loop over
that table, so an operand is declared once, by the term that reads it.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass


class Side(enum.Enum):
    """Which token dim an operand's entries follow: how it is sharded, permuted to a
    layout, sliced, sent around a ring and regrouped by Ulysses."""

    QUERY = "query"   # [B|1, Tq, ...]: one entry per query token
    KEY = "key"       # [B|1, Tkv, ...]: one entry per key; travels with K and V
    ROWS = "rows"     # [B|1, H|1, Tq, ...]: a row per query (pair masks, top-k picks)
    HEADS = "heads"   # [B|1, H, ...]: per query head, no token dim; on every CP device


#: The axis of each side's token dim in the canonical (kernel) layout (``None``: none).
TOKEN_AXIS = {Side.QUERY: 1, Side.KEY: 1, Side.ROWS: 2, Side.HEADS: None}


@dataclass(frozen=True)
class Role:
    """What one canonical operand is: its ``side``; the ``attention_p`` operand it is built
    from (``None`` for q, k, v, which are always there); ``heavy``: q, k or v (moved
    head-sharded by Ulysses' all-to-all, where the light operands are gathered);
    ``columns``: its last dim is the keys (all of them on every device, in the keys'
    layout order, narrowed per ring step); ``integer``: integer data, built as int32;
    ``boolean``: boolean data; ``mask``: read by the mask terms (positions and the terms'
    own operands)."""

    side: Side
    operand: str | None = None
    heavy: bool = False
    columns: bool = False
    integer: bool = False
    mask: bool = False
    boolean: bool = False

    @property
    def token_axis(self) -> int | None:
        """The axis of its query or key dim (a row's query dim for ``ROWS``)."""
        return TOKEN_AXIS[self.side]

    @property
    def per_token(self) -> bool:
        """One entry per query or per key (``[B|1, T]``): ranges of it classify blocks."""
        return self.side in (Side.QUERY, Side.KEY)


#: The roles of the operands that are not a mask term's, by canonical field name.
BASE_ROLES: dict[str, Role] = {
    "q": Role(Side.QUERY, heavy=True),
    "k": Role(Side.KEY, heavy=True),
    "v": Role(Side.KEY, heavy=True),
    "q_pos": Role(Side.QUERY, "q_positions", integer=True, mask=True),
    "kv_pos": Role(Side.KEY, "kv_positions", integer=True, mask=True),
    "bias": Role(Side.ROWS, "bias", columns=True),
    "sinks": Role(Side.HEADS, "sinks"),
    "dropout": Role(Side.HEADS, "dropout_seed"),
}
