"""Closed-form communication of each context-parallel schedule, per device per attention.

Bytes follow the convention of :mod:`cptransform.lowering.collectives` (what one device
puts on the wire): an all-to-all of ``b`` bytes over ``n`` devices moves ``b·(n-1)/n``, an
all-gather of a ``b``-byte shard ``b·(n-1)``, a reduce-scatter of ``b`` bytes ``b·(n-1)/n``,
a collective-permute ``b``. With ``h = heads·head_dim`` and ``h_kv = kv_heads·head_dim``
(elements per token), bf16, the forward volumes are the textbook ones:

* ring: ``2·s·h_kv·(cp-1)/cp`` (K and V make ``cp-1`` hops);
* Ulysses: ``(s/cp)·(2h + 2h_kv)·(cp-1)/cp`` (q, k, v, o all-to-alls);
* all-gather: ``2·s·h_kv·(cp-1)/cp`` (like the ring, but at once);
* hybrid ``cp = u·r``: Ulysses over ``u`` plus a ring over ``r`` on ``heads/u`` heads.

On top of the payload come the int32 positions (and segment ids) that travel with K/V or
are gathered, counted here exactly as the schedules move them. Dense masks and biases are
not modelled (Ulysses moves them to head sharding; the other schedules leave them local).

Backward (the extra traffic of ``jax.grad``, forward not included):

* Ulysses: the transposed all-to-alls of dq, dk, dv, do: the same bytes as the forward
  payload;
* all-gather: reduce-scatters of dK and dV in ``grad_bytes`` (float32 accumulation);
* ring: see :func:`ring_volume`.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

POSITION_BYTES = 4


@dataclass(frozen=True)
class Transfer:
    """One collective of a schedule: what moves, how, in which pass, bytes per device."""

    name: str
    kind: str
    bytes: int
    backward: bool = False
    payload: bool = True


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


@dataclass(frozen=True)
class Problem:
    """The shapes that decide the communication of one attention.

    ``seq`` tokens, ``heads``/``kv_heads`` of ``head_dim`` (``v_head_dim`` for V, default
    ``head_dim``), ``batch`` sequences, ``dtype_bytes`` per q/k/v element; gradients of K/V
    are reduced in ``grad_bytes``. Positions (int32 ``[position_batch, seq]``) travel only
    when the mask reads them (``positions``: causal or window; XLA drops unused transfers);
    segment ids (``segments``) are ``[segment_batch, seq]`` of ``segment_bytes``.
    """

    seq: int
    heads: int
    kv_heads: int
    head_dim: int
    v_head_dim: int | None = None
    batch: int = 1
    dtype_bytes: int = 2
    position_batch: int = 1
    positions: bool = True
    segments: bool = False
    segment_batch: int = 1
    segment_bytes: int = 4
    grad_bytes: int = 4

    @property
    def dv(self) -> int:
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    def with_heads(self, heads: int, kv_heads: int, seq: int | None = None) -> "Problem":
        return Problem(**{**self.__dict__, "heads": heads, "kv_heads": kv_heads,
                          "seq": self.seq if seq is None else seq})


def _metadata(p: Problem, names: tuple[str, ...]) -> list[tuple[str, int]]:
    """The ``(name, bytes per token-row)`` of the int operands that travel with ``names``."""
    out = []
    for side in names:
        if p.positions:
            out.append((f"{side}_positions", p.position_batch * POSITION_BYTES))
        if p.segments:
            out.append((f"{side}_segment_ids", p.segment_batch * p.segment_bytes))
    return out


def kv_head_repeats(kv_heads: int, n: int) -> int:
    """How often Ulysses repeats each KV head so ``n`` devices can split them."""
    return n // math.gcd(kv_heads, n)


def ulysses_volume(p: Problem, cp: int) -> CommVolume:
    """Ulysses over ``cp`` devices (see the module doc)."""
    rows = p.batch * p.seq // cp
    kv = p.kv_heads * kv_head_repeats(p.kv_heads, cp)
    a2a = lambda elements: rows * elements * p.dtype_bytes * (cp - 1) // cp  # noqa: E731
    payload = [("q", a2a(p.heads * p.head_dim)), ("k", a2a(kv * p.head_dim)),
               ("v", a2a(kv * p.dv)), ("o", a2a(p.heads * p.dv))]
    transfers = [Transfer(name, "all_to_all", b) for name, b in payload]
    transfers += [Transfer(name, "all_gather", p.seq // cp * b * (cp - 1), payload=False)
                  for name, b in _metadata(p, ("q", "kv"))]
    transfers += [Transfer("d" + name, "all_to_all", b, backward=True) for name, b in payload]
    return CommVolume("ulysses", tuple(transfers))


def allgather_volume(p: Problem, cp: int) -> CommVolume:
    """All-gather of K, V (and kv positions) over ``cp`` devices; reduce-scatter of dK/dV."""
    rows = p.batch * p.seq // cp
    kv_elems = {"k": p.kv_heads * p.head_dim, "v": p.kv_heads * p.dv}
    transfers = [Transfer(name, "all_gather", rows * e * p.dtype_bytes * (cp - 1))
                 for name, e in kv_elems.items()]
    transfers += [Transfer(name, "all_gather", p.seq // cp * b * (cp - 1), payload=False)
                  for name, b in _metadata(p, ("kv",))]
    transfers += [Transfer("d" + name, "reduce_scatter",
                           p.batch * p.seq * e * p.grad_bytes * (cp - 1) // cp, backward=True)
                  for name, e in kv_elems.items()]
    return CommVolume("allgather", tuple(transfers))


def ring_volume(p: Problem, cp: int) -> CommVolume:
    """The ring over ``cp`` devices: K, V and their positions / segment ids make ``cp-1``
    hops forward; the backward rotates K, V (and metadata) again ``cp-1`` times and the
    float32 dK/dV accumulators ``cp`` times, so that they arrive home."""
    rows = p.batch * p.seq // cp
    kv_elems = {"k": p.kv_heads * p.head_dim, "v": p.kv_heads * p.dv}
    hops = cp - 1
    transfers = [Transfer(name, "collective_permute", hops * rows * e * p.dtype_bytes)
                 for name, e in kv_elems.items()]
    metadata = _metadata(p, ("kv",))
    transfers += [Transfer(name, "collective_permute", hops * p.seq // cp * b, payload=False)
                  for name, b in metadata]
    transfers += [Transfer(name, "collective_permute", hops * rows * e * p.dtype_bytes,
                           backward=True) for name, e in kv_elems.items()]
    transfers += [Transfer(name, "collective_permute", hops * p.seq // cp * b, backward=True,
                           payload=False) for name, b in metadata]
    transfers += [Transfer("d" + name, "collective_permute", cp * rows * e * p.grad_bytes,
                           backward=True) for name, e in kv_elems.items()]
    return CommVolume("ring", tuple(transfers))


def hybrid_volume(p: Problem, ulysses: int, ring: int) -> CommVolume:
    """Ulysses over ``ulysses`` devices inside, the ring over ``ring`` groups across."""
    inner = ulysses_volume(p.with_heads(p.heads, p.kv_heads, seq=p.seq // ring), ulysses)
    kv = p.kv_heads * kv_head_repeats(p.kv_heads, ulysses)
    outer = ring_volume(p.with_heads(p.heads // ulysses, kv // ulysses), ring)
    return CommVolume("hybrid", inner.transfers + outer.transfers)


def schedule_volume(schedule: str, *, seq: int, heads: int, kv_heads: int, head_dim: int,
                    cp: int, ulysses: int | None = None, **options) -> CommVolume:
    """The :class:`CommVolume` of ``schedule`` (``ring``, ``ulysses``, ``allgather`` or
    ``hybrid``; hybrid needs ``ulysses``, the size of its Ulysses axis, dividing ``cp``).
    ``options`` are the other :class:`Problem` fields."""
    p = Problem(seq=seq, heads=heads, kv_heads=kv_heads, head_dim=head_dim, **options)
    if schedule == "ring":
        return ring_volume(p, cp)
    if schedule == "ulysses":
        return ulysses_volume(p, cp)
    if schedule == "allgather":
        return allgather_volume(p, cp)
    if schedule == "hybrid":
        if ulysses is None or cp % ulysses:
            raise ValueError(f"hybrid needs ulysses= dividing cp={cp}, got {ulysses}")
        return hybrid_volume(p, ulysses, cp // ulysses)
    raise ValueError(f"unknown schedule {schedule!r}; use ring, ulysses, allgather or hybrid")

