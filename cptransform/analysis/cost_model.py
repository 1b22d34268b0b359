"""Closed-form communication, per device per attention: the records and building blocks.

Each schedule states its transfers once, in its statement
(:class:`~cptransform.analysis.schedule_statement.Statement`): what moves, by which
collective, how often, over which axis; this module holds the :class:`Transfer` record they
are written in, and its bytes follow from the kind (:data:`WIRE`), in the convention of
:mod:`cptransform.lowering.collectives` (what one device puts on the wire): an all-to-all of
``b`` bytes over ``n`` devices moves ``b·(n-1)/n``, an all-gather of a ``b``-byte shard
``b·(n-1)``, a reduce-scatter of ``b`` bytes ``b·(n-1)/n``, an all-reduce ``2·b·(n-1)/n``,
a collective-permute ``b``. With ``h = heads·head_dim`` and ``h_kv = kv_heads·head_dim``
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


#: Bytes one device puts on the wire for one collective of kind ``kind``, from the bytes it
#: holds of what it sends (``held``) and the devices taking part (``n``; the convention of
#: :mod:`cptransform.lowering.collectives`).
WIRE = {
    "all_to_all": lambda held, n: held * (n - 1) // n,
    "all_gather": lambda held, n: held * (n - 1),
    "reduce_scatter": lambda held, n: held * (n - 1) // n,
    "all_reduce": lambda held, n: 2 * held * (n - 1) // n,
    "collective_permute": lambda held, n: held,
}

#: Bytes one device holds after one collective of kind ``kind`` (what it receives lands in
#: a buffer of this size: an all-gather's is the whole, a reduce-scatter's one shard).
RESIDENT = {"all_gather": lambda held, n: held * n,
            "reduce_scatter": lambda held, n: held // n}


@dataclass(frozen=True)
class Transfer:
    """One collective of a schedule, as its statement gives it: what moves, how, how often,
    in which pass.

    ``held`` is the bytes one device holds of what it sends (its K shard, the block it
    passes on), ``group`` the devices taking part and ``times`` how often it runs (the
    ring's ``cp - 1`` hops); :attr:`bytes` follows from the kind (:data:`WIRE`). ``axis``
    is the index of the schedule's CP mesh axis it runs over (hybrid: 0 the Ulysses axis,
    1 the ring axis), which decides its link class; ``overlapped`` transfers are sent in
    steps while the previous step computes (the ring's rotations), the others are waited
    for.
    """

    name: str
    kind: str
    held: int
    group: int = 1
    times: int = 1
    backward: bool = False
    payload: bool = True
    axis: int = 0
    overlapped: bool = False

    @property
    def bytes(self) -> int:
        """Bytes per device on the wire, all ``times`` together."""
        return self.times * WIRE[self.kind](self.held, self.group)

    @property
    def resident(self) -> int:
        """Bytes one device holds of what one run of it delivers (:data:`RESIDENT`)."""
        return RESIDENT.get(self.kind, lambda held, n: held)(self.held, self.group)


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


def operands(shape: AttentionShape, names: tuple[str, ...], kind: str, rows: int, *,
             element: int | None = None, heads: int | None = None,
             kv_heads: int | None = None, prefix: str = "", **fields) -> list[Transfer]:
    """One :class:`Transfer` of each of the operands ``names`` (``"q"``, ``"k"``, ``"v"``,
    ``"o"``), of which one device holds ``rows`` (batch rows times tokens) in ``element``
    bytes per element (default ``shape.dtype_bytes``); ``heads``/``kv_heads`` override the
    shape's (after Ulysses splits or repeats them), ``prefix="d"`` names their gradients and
    ``fields`` are the other fields of :class:`Transfer`."""
    h = shape.heads if heads is None else heads
    kv = shape.kv_heads if kv_heads is None else kv_heads
    width = {"q": h * shape.head_dim, "k": kv * shape.head_dim, "v": kv * shape.dv,
             "o": h * shape.dv}
    size = shape.dtype_bytes if element is None else element
    return [Transfer(prefix + name, kind, rows * width[name] * size, **fields)
            for name in names]


def metadata(shape: AttentionShape, sides: tuple[str, ...], kind: str,
             tokens: int | None = None, **fields) -> list[Transfer]:
    """The transfers (not payload) of the int operands (positions, segment ids) that travel
    with the operands of ``sides`` (``"q"``, ``"kv"``): one device holds the side's local
    (padded) length of them, or ``tokens``; ``fields`` as in :func:`operands`."""
    out = []
    for side in sides:
        local = (shape.q_padded if side == "q" else shape.kv_padded) // shape.cp
        local = local if tokens is None else tokens
        if shape.positions:
            out.append((f"{side}_positions", local * shape.position_batch * POSITION_BYTES))
        if shape.segments:
            out.append((f"{side}_segment_ids",
                        local * shape.segment_batch * shape.segment_bytes))
    return [Transfer(name, kind, held, payload=False, **fields) for name, held in out]
