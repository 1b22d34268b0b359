"""Text pictures of a ring schedule: devices × steps, each block skip / partial / full."""
from __future__ import annotations

import numpy as np

from cptransform.op.attention_reference import visible
from cptransform.op.attention_spec import MaskSpec
from cptransform.op.layouts import SequenceLayout

FULL, PARTIAL, SKIP, UNKNOWN = "#", "+", ".", "?"


def block_kind(mask: MaskSpec, q_pos: np.ndarray, kv_pos: np.ndarray,
               segment_ids: np.ndarray | None = None) -> str:
    """Classify one (query shard, key shard) block by the band mask on positions.

    Segment ids and dense masks depend on data: such blocks are ``?`` unless the band
    already hides them entirely — or, for segments, unless ``segment_ids`` (``[B, S]`` in
    natural order) gives the data: then the block is classified for that batch."""
    data = mask.segments and segment_ids is not None
    known = mask.replace(segments=data, dense=False, bias=False)
    seg = np.asarray(segment_ids) if data else None
    seen = np.asarray(visible(known, q_pos[None], kv_pos[None],
                              seg[:, q_pos] if data else None, seg[:, kv_pos] if data else None))
    if not seen.any():
        return SKIP
    if mask.dense or (mask.segments and not data):
        return UNKNOWN
    return FULL if seen.all() else PARTIAL


def device_work(mask: MaskSpec, positions: np.ndarray, seq_len: int,
                segment_ids: np.ndarray | None = None) -> np.ndarray | None:
    """Visible (query, key) pairs per device (rows of ``positions``); ``None`` when the mask
    depends on data not given: a dense mask, or segment ids without ``segment_ids``
    (``[B, S]`` in natural order; the pairs are then summed over the batch, counted on a
    ``[B, S, S]`` array: for inspecting example-sized batches)."""
    if mask.dense or (mask.segments and segment_ids is None):
        return None
    if mask.segments:
        seg = np.asarray(segment_ids)
        pos = np.arange(seq_len)[None]
        seen = visible(mask.replace(bias=False), pos, pos, seg, seg)  # [B, 1, S, S]
        per_query = np.asarray(seen).sum(axis=(0, 1, 3))
        return per_query[positions].sum(axis=-1).astype(float)
    lo, hi = mask.band()
    q = positions.astype(np.int64)
    first = np.maximum(0, q + (lo if lo is not None else -seq_len))
    last = np.minimum(seq_len - 1, q + (hi if hi is not None else seq_len))
    return np.maximum(0, last - first + 1).sum(axis=-1).astype(float)


def ring_chart(mask: MaskSpec, layout: SequenceLayout,
               segment_ids: np.ndarray | None = None) -> str:
    """Rows = devices, columns = ring steps (step ``i`` on device ``r`` holds the KV shard
    of device ``(r - i) mod cp``), then the work per device relative to the mean; with
    ``segment_ids`` (``[B, S]``, natural order) both are for that batch."""
    cp = layout.cp
    positions = layout.all_positions()
    lines = [f"ring over {cp} devices, {layout.name} layout "
             f"({FULL} full, {PARTIAL} partial, {SKIP} skipped, {UNKNOWN} data-dependent)",
             "          step " + " ".join(f"{i:>2}" for i in range(cp))]
    for r in range(cp):
        kinds = [block_kind(mask, positions[r], positions[(r - i) % cp], segment_ids)
                 for i in range(cp)]
        lines.append(f"device {r:>2}      " + " ".join(f"{k:>2}" for k in kinds))
    work_arr = device_work(mask, positions, layout.seq_len, segment_ids)
    if work_arr is None:
        return "\n".join(lines)
    if work_arr.mean() > 0:
        lines.append("work/mean      " + " ".join(f"{w / work_arr.mean():.2f}" for w in work_arr))
        lines.append(f"slowest device: {work_arr.max() / work_arr.mean():.2f}x the mean")
    return "\n".join(lines)
