"""plan_chart with a batch's segment ids: blocks and work per device for that data."""
import numpy as np

from cptransform.api.plan_chart import FULL, PARTIAL, SKIP, UNKNOWN, block_kind, device_work
from cptransform.op.attention_spec import MaskSpec
from cptransform.op.layouts import SequenceLayout

S, CP = 16, 2
#: Two documents, one per contiguous shard (5 + 3 tokens, then 8), in two rows.
SEGMENTS = np.array([[1] * 5 + [2] * 3 + [3] * 8, [1] * 8 + [2] * 8])


def test_segment_blocks_are_classified_for_the_data():
    mask = MaskSpec(causal=True, segments=True)
    first, second = SequenceLayout("contiguous", S, CP).all_positions()
    assert block_kind(mask, second, first) == UNKNOWN  # no data: cannot tell
    assert block_kind(mask, second, first, SEGMENTS) == SKIP  # no document crosses shards
    assert block_kind(mask, first, first, SEGMENTS) == PARTIAL
    assert block_kind(MaskSpec(segments=True), first, first, SEGMENTS[1:]) == FULL


def test_device_work_counts_visible_pairs_of_the_batch():
    mask = MaskSpec(causal=True, segments=True)
    positions = SequenceLayout("zigzag", S, CP).all_positions()
    assert device_work(mask, positions, S) is None
    token = np.arange(S)
    visible = ((SEGMENTS[:, :, None] == SEGMENTS[:, None, :])
               & (token[None, None, :] <= token[None, :, None]))
    want = [visible[:, rows].sum() for rows in positions]
    np.testing.assert_array_equal(device_work(mask, positions, S, SEGMENTS), want)
