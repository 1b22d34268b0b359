"""The work a chunked local step executes: (query chunk, key chunk) pairs after skipping.

The chunked kernel (:mod:`cptransform.lowering.kernels.chunked`) cuts each call's queries
and keys into chunks (:func:`kernel_grid`) and skips a pair exactly when the mask's terms
prove from the position ranges of its chunks that no query sees a key
(:func:`~cptransform.op.mask_terms.meet`). :func:`executed_entries` counts the score entries
of the pairs it does not skip (full and partial pairs cost the same tile) from the same
ranges and the same terms (:func:`~cptransform.op.mask_terms.key_hull`), so the count is
exact for causal, window, chunked and full masks on every layout. Segment ids, dense masks
and top-k indices depend on the data and are not counted (their pairs count as visible: an
upper bound). A finite fill (``MaskSpec.fill``) skips nothing: its shape has no position
terms, so every pair counts.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cptransform.analysis.attention_shape import AttentionShape
from cptransform.op import mask_terms
from cptransform.op.layouts import SequenceLayout

#: Default chunk length (queries and keys) of the ``"xla"`` kernel: small enough that the
#: diagonal tiles of a causal mask cost under 10% extra from 2K tokens on (``1 + 1/nb``).
DEFAULT_CHUNK = 128


def chunk_size(length: int, target: int) -> int:
    """The chunk length used for a sequence of ``length`` tokens, at most ``target``.

    A divisor of ``length`` when a reasonable one exists (no padding); of ``length / 2``
    when ``length`` is even, so that the two half-blocks of a zigzag rank never share a
    chunk. Otherwise ``min(target, length)`` and the last chunk is padded.
    """
    base = length // 2 if length % 2 == 0 and length > 1 else length
    best = max(c for c in range(1, min(target, base) + 1) if base % c == 0)
    if 2 * best >= min(target, base):
        return best
    return min(target, length)


def kernel_grid(tq: int, tkv: int, target: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """``((cq, nq), (ck, nk))``: chunk length and count for ``tq`` queries and ``tkv`` keys."""
    cq, ck = chunk_size(tq, target), chunk_size(tkv, target)
    if tkv % cq == 0 and 4 * cq >= ck:
        # Square tiles when the keys allow: a layout's chunk boundaries (zigzag halves)
        # fall on query-chunk boundaries, and then on key-chunk boundaries too.
        ck = cq
    return (cq, -(-tq // cq)), (ck, -(-tkv // ck))


def _ranges(positions: np.ndarray, size: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-chunk (min, max) of ``positions``, padded by repeating the last entry (as the
    kernel pads them)."""
    padded = np.concatenate([positions, np.repeat(positions[-1:], size * count - len(positions))])
    chunks = padded.reshape(count, size)
    return chunks.min(axis=1), chunks.max(axis=1)


def executed_entries(q_pos: np.ndarray, k_pos: np.ndarray, terms: tuple,
                     target: int = DEFAULT_CHUNK) -> int:
    """Score entries (per head and batch row) one kernel call computes for queries at
    ``q_pos`` against keys at ``k_pos`` under the positional mask ``terms``
    (:attr:`AttentionShape.position_terms`).

    The terms' key hull ``[first, last]`` of a query chunk (:func:`mask_terms.key_hull`)
    keeps a key chunk unless ``k_max < first`` or ``k_min > last``; since
    ``k_min ≤ k_max`` the two exclusions are disjoint when ``first ≤ last + 1``, so each
    query chunk counts its visible key chunks with two binary searches over sorted ranges.
    """
    (cq, nq), (ck, nk) = kernel_grid(len(q_pos), len(k_pos), target)
    q_min, q_max = _ranges(np.asarray(q_pos, np.int64), cq, nq)
    k_min, k_max = _ranges(np.asarray(k_pos, np.int64), ck, nk)
    first, last = mask_terms.key_hull(terms, q_min, q_max)
    visible = np.full(nq, nk, dtype=np.int64)
    if last is not None:
        visible = np.searchsorted(np.sort(k_min), last, side="right")
    if first is not None:
        visible = visible - np.searchsorted(np.sort(k_max), first, side="left")
    return int(np.maximum(visible, 0).sum()) * cq * ck


def forward_flops(entries: int, head_dim: int, v_head_dim: int) -> int:
    """FLOPs of the forward local step for ``entries`` score entries: ``Q·Kᵀ`` and ``P·V``."""
    return entries * 2 * (head_dim + v_head_dim)


def backward_flops(entries: int, head_dim: int, v_head_dim: int) -> int:
    """FLOPs of the flash backward: ``Q·Kᵀ`` recomputed, ``dP = dO·Vᵀ``, ``dV = Pᵀ·dO``,
    ``dQ = dS·K`` and ``dK = dSᵀ·Q`` (2.5× the forward when ``D = Dv``)."""
    return entries * 2 * (3 * head_dim + 2 * v_head_dim)


@dataclass(frozen=True)
class Work:
    """The local-step compute of one schedule for one attention: FLOPs of the slowest
    device, forward and backward, the load balance (slowest device / mean), the kernel
    calls of the busiest device per pass (each has a fixed cost: ``Hardware.call_s``),
    every device's forward plus backward FLOPs (what the layout choice sums over
    attentions) and the query heads per KV head folded into its tiles' rows (``group``:
    1 for one-head tiles, see ``Hardware.grouped_efficiency``)."""

    forward_flops: int
    backward_flops: int
    balance: float
    calls: int = 1
    device_flops: tuple[int, ...] = ()
    group: int = 1
    #: Per synchronized step (the ring's steps; one for a schedule that computes in one
    #: call), the (mean, max) over devices of the score entries computed in it.
    steps: tuple[tuple[float, float], ...] = ()
    #: Bytes of the kernel's score tile (:func:`~cptransform.analysis.local_memory.tile_bytes`),
    #: which every executed chunk pair writes and reads back (``Hardware.tile_s``).
    tile_bytes: int = 0

    @property
    def flops(self) -> int:
        """Forward plus backward FLOPs of the slowest device."""
        return self.forward_flops + self.backward_flops

    def paced(self, alone: float) -> float:
        """A pass's compute over the mean device's, when each step lasts until its busiest
        device is done (the collective that ends a step waits for every device) and a
        device computing while the others wait runs ``alone`` times faster than when all
        compute (``Hardware.alone_speedup``): ``Σ_t max(mean_t, max_t / alone) / Σ_t
        mean_t``. Dedicated devices (``alone = 1``) give the busiest device of each step;
        simulated devices on a few shared cores lose only the steps that leave cores idle
        (the contiguous ring's last ones). Without steps: one step of the slowest device."""
        if not self.steps:
            return max(1.0, self.balance / alone)
        total = sum(mean for mean, _ in self.steps)
        if not total:
            return 1.0
        return sum(max(mean, top / alone) for mean, top in self.steps) / total


def rank_positions(shape: AttentionShape) -> np.ndarray:
    """``[cp, q_padded / cp]``: the global positions each rank holds under ``shape.layout``
    (the sequence padded to the layout's multiple; pad tokens are counted as real ones)."""
    return SequenceLayout(shape.layout, shape.q_padded, shape.cp).all_positions()


def work_of(shape: AttentionShape, calls, heads: int) -> Work:
    """The :class:`Work` of a schedule whose device ``r`` makes the kernel calls
    ``calls[r]`` (``(q_pos, k_pos)`` pairs), each over ``heads`` heads of ``shape.batch``
    rows (``calls`` lists every device of the group that decides the layout's balance);
    call ``t`` of each device is its step ``t``."""
    per_call = [[executed_entries(q, k, shape.position_terms) * heads * shape.batch
                 for q, k in device] for device in calls]
    per_device = [sum(device) for device in per_call]
    # Call t of every device is step t (a device with fewer calls computes nothing then).
    steps = [[device[t] if t < len(device) else 0 for device in per_call]
             for t in range(max(len(device) for device in per_call))]
    slowest = max(per_device)
    mean = sum(per_device) / len(per_device)
    both = [forward_flops(e, shape.head_dim, shape.dv) + backward_flops(e, shape.head_dim,
                                                                        shape.dv)
            for e in per_device]
    return Work(forward_flops(slowest, shape.head_dim, shape.dv),
                backward_flops(slowest, shape.head_dim, shape.dv),
                slowest / mean if mean else 1.0, max(len(device) for device in calls),
                tuple(both), steps=tuple((sum(t) / len(t), max(t)) for t in steps))
