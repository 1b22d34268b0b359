"""Closed-form communication, per device per attention: the records and building blocks.

Each schedule's own formula lives with its :class:`~cptransform.lowering.schedule.Schedule`
record (``volume``); this module holds what they are written in. Bytes follow the
convention of :mod:`cptransform.lowering.collectives` (what one device puts on the wire):
an all-to-all of ``b`` bytes over ``n`` devices moves ``b·(n-1)/n``, an all-gather of a
``b``-byte shard ``b·(n-1)``, a reduce-scatter of ``b`` bytes ``b·(n-1)/n``, a
collective-permute ``b``. With ``h = heads·head_dim`` and ``h_kv = kv_heads·head_dim``
(elements per token), bf16, the textbook forward volumes are ring ``2·s·h_kv·(cp-1)/cp``,
Ulysses ``(s/cp)·(2h + 2h_kv)·(cp-1)/cp`` and all-gather ``2·s·h_kv·(cp-1)/cp``.

On top of the payload come the int32 positions (and segment ids) that travel with K/V or
are gathered (:func:`metadata`), counted exactly as the schedules move them. Dense masks
and biases are not modelled (Ulysses moves them to head sharding; the other schedules leave
them local).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from cptransform.analysis.attention_shape import AttentionShape

POSITION_BYTES = 4


@dataclass(frozen=True)
class Transfer:
    """One collective of a schedule: what moves, how, in which pass, bytes per device.

    ``axis`` is the index of the schedule's CP mesh axis it runs over (hybrid: 0 the Ulysses
    axis, 1 the ring axis), which decides its link class; ``overlapped`` transfers are sent
    in steps while the previous step computes (the ring's rotations), the others are waited
    for.
    """

    name: str
    kind: str
    bytes: int
    backward: bool = False
    payload: bool = True
    axis: int = 0
    overlapped: bool = False


@dataclass(frozen=True)
class CommVolume:
    """The per-device transfers of one schedule for one attention."""

    schedule: str
    transfers: tuple[Transfer, ...]

    def _by_kind(self, backward: bool) -> dict[str, int]:
        out: Counter = Counter()
        for t in self.transfers:
            if t.backward == backward:
                out[t.kind] += t.bytes
        return dict(out)

    @property
    def forward(self) -> dict[str, int]:
        """Forward bytes per device by collective kind."""
        return self._by_kind(False)

    @property
    def backward(self) -> dict[str, int]:
        """Extra bytes per device of the backward pass, by collective kind."""
        return self._by_kind(True)

    @property
    def forward_total(self) -> int:
        return sum(self.forward.values())

    @property
    def backward_total(self) -> int:
        return sum(self.backward.values())

    def payload_bytes(self, backward: bool = False) -> int:
        """Bytes of q, k, v, o (and their gradients) only: the textbook formula."""
        return sum(t.bytes for t in self.transfers if t.payload and t.backward == backward)


def metadata(shape: AttentionShape, names: tuple[str, ...]) -> list[tuple[str, int]]:
    """The ``(name, bytes per local token)`` of the int operands (positions, segment ids)
    that travel with the operands ``names`` (``"q"``, ``"kv"``), times the side's local
    (padded) length: the bytes one device holds of each."""
    out = []
    for side in names:
        local = (shape.q_padded if side == "q" else shape.kv_padded) // shape.cp
        if shape.positions:
            out.append((f"{side}_positions", local * shape.position_batch * POSITION_BYTES))
        if shape.segments:
            out.append((f"{side}_segment_ids",
                        local * shape.segment_batch * shape.segment_bytes))
    return out


def kv_elements(shape: AttentionShape, kv_heads: int | None = None) -> dict[str, int]:
    """Elements per token of K and of V (``kv_heads`` overrides the shape's, e.g. after
    Ulysses repeats them)."""
    kv = shape.kv_heads if kv_heads is None else kv_heads
    return {"k": kv * shape.head_dim, "v": kv * shape.dv}
