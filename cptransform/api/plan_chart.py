"""Text pictures of a ring schedule: devices × steps, each block skip / partial / full."""
from __future__ import annotations

import numpy as np

from cptransform.op.attention_reference import visible
from cptransform.op.attention_spec import MaskSpec
from cptransform.op.layouts import SequenceLayout

FULL, PARTIAL, SKIP, UNKNOWN = "#", "+", ".", "?"


def block_kind(mask: MaskSpec, q_pos: np.ndarray, kv_pos: np.ndarray) -> str:
    """Classify one (query shard, key shard) block by the band mask on positions.

    Segment ids, dense masks and top-k indices depend on data: such blocks are ``?``
    unless the band already hides them entirely."""
    band_only = mask.replace(segments=False, dense=False, bias=False, topk=False)
    seen = np.asarray(visible(band_only, q_pos[None], kv_pos[None]))
    if not seen.any():
        return SKIP
    if mask.segments or mask.dense or mask.topk:
        return UNKNOWN
    return FULL if seen.all() else PARTIAL


def device_work(mask: MaskSpec, positions: np.ndarray, seq_len: int) -> np.ndarray | None:
    """Visible (query, key) pairs per device (rows of ``positions``) under a band mask;
    ``None`` when the mask also depends on data (segment ids, a dense mask, top-k)."""
    if mask.segments or mask.dense or mask.topk:
        return None
    lo, hi = mask.band()
    q = positions.astype(np.int64)
    first = np.maximum(0, q + (lo if lo is not None else -seq_len))
    last = np.minimum(seq_len - 1, q + (hi if hi is not None else seq_len))
    return np.maximum(0, last - first + 1).sum(axis=-1).astype(float)


def ring_chart(mask: MaskSpec, layout: SequenceLayout) -> str:
    """Rows = devices, columns = ring steps (step ``i`` on device ``r`` holds the KV shard
    of device ``(r - i) mod cp``), then the work per device relative to the mean."""
    cp = layout.cp
    positions = layout.all_positions()
    lines = [f"ring over {cp} devices, {layout.name} layout "
             f"({FULL} full, {PARTIAL} partial, {SKIP} skipped, {UNKNOWN} data-dependent)",
             "          step " + " ".join(f"{i:>2}" for i in range(cp))]
    for r in range(cp):
        kinds = [block_kind(mask, positions[r], positions[(r - i) % cp]) for i in range(cp)]
        lines.append(f"device {r:>2}      " + " ".join(f"{k:>2}" for k in kinds))
    work_arr = device_work(mask, positions, layout.seq_len)
    if work_arr is None:
        return "\n".join(lines)
    if work_arr.mean() > 0:
        lines.append("work/mean      " + " ".join(f"{w / work_arr.mean():.2f}" for w in work_arr))
        lines.append(f"slowest device: {work_arr.max() / work_arr.mean():.2f}x the mean")
    return "\n".join(lines)
