"""Plan pictures: each schedule's own chart (exact character grids for cp=4 causal over 64
tokens, contiguous layout), the work per rank of every layout, the fallback for a schedule
without a chart, and the PNG; and, given a batch's segment ids, blocks and work per device
for that data."""
import sys
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import needs_halo
from cptransform import attention, context_parallel
from cptransform.api.plan_chart import balance_table, block_kind, charts_for, device_work, \
    render_png, render_text
from cptransform.ir.errors import PlotError
from cptransform.op.attention_spec import MaskSpec
from cptransform.op.mask_terms import BlockKind
from cptransform.op.layouts import SequenceLayout

CONTIGUOUS = SequenceLayout("contiguous", 64, 4)
LEGEND = "(# full, + partial, . skipped, ? data-dependent)"


def causal(q, k, v):
    return jnp.sum(attention(q, k, v, causal=True))


def planned(schedule):
    x = jax.random.normal(jax.random.key(0), (1, 64, 4, 16))
    facts = context_parallel(causal, cp=4, schedule=schedule, load_balance="none",
                             hardware="h100").module(x, x, x).facts
    (plan,) = facts.plan
    return plan, facts


def drawn(schedule):
    plan, _ = planned(schedule)
    return "\n".join(render_text(c) for c in charts_for(plan, CONTIGUOUS))


# 16-token shards in 8-token tiles: rank r runs 4r + 3 tiles (3, 7, 11, 15; mean 9).
RING = f"""ring over 4 devices, contiguous layout {LEGEND}
     step  0  1  2  3
device  0  +  .  .  .
device  1  +  #  .  .
device  2  +  #  #  .
device  3  +  #  #  #
work/mean  0.33 0.78 1.22 1.67
slowest device: 1.67x the mean"""

ALLGATHER = f"""allgather over 4 devices, contiguous layout (one kernel call per device) {LEGEND}
key shard  0  1  2  3
device  0  +  .  .  .
device  1  #  +  .  .
device  2  #  #  +  .
device  3  #  #  #  +
work/mean  0.33 0.78 1.22 1.67
slowest device: 1.67x the mean"""

SHARDS = """     key shard  0  1  2  3
query shard  0  +  .  .  .
query shard  1  #  +  .  .
query shard  2  #  #  +  .
query shard  3  #  #  #  +"""

ULYSSES = (f"ulysses over 4 devices, contiguous layout: every device runs this grid for its "
           f"1 of 4 heads (equal work) {LEGEND}\n" + SHARDS)

# Ring level over 2 groups of 32 tokens in 16-token tiles: 3 and 3 + 4 tiles (mean 5).
HYBRID = f"""hybrid ring level: 2 groups of 2 devices, contiguous layout {LEGEND}
    step  0  1
group  0  +  .
group  1  +  #
work/mean 0.60 1.40
slowest group: 1.40x the mean
hybrid Ulysses level: group g's 2 devices each run rows [g·2, (g+1)·2) for 2 of 4 heads \
{LEGEND}
""" + SHARDS


@pytest.mark.parametrize("schedule,expected", [("ring", RING), ("allgather", ALLGATHER),
                                               ("ulysses", ULYSSES), ("hybrid", HYBRID)])
def test_each_schedule_draws_its_own_chart(schedule, expected):
    assert drawn(schedule) == expected


def test_work_per_rank_for_every_layout():
    _, facts = planned("ring")
    assert balance_table(facts.balance) == "\n".join([
        "work per rank by layout (FLOPs over all attentions / mean; * chosen):",
        "* contiguous 0.33 0.78 1.22 1.67  max/mean 1.67x",
        "  zigzag     1.00 1.00 1.00 1.00  max/mean 1.00x",
        "  striped    1.00 1.00 1.00 1.00  max/mean 1.00x"])


def test_a_schedule_without_a_chart_says_so():
    plan, _ = planned("ring")
    assert charts_for(replace(plan, schedule="unregistered"), CONTIGUOUS) == \
        "no chart for schedule 'unregistered'"


HALO = f"""halo over 4 devices, contiguous layout (one kernel call per device: neighbours' halos \
and local keys) {LEGEND}
key piece  0  1
device  0  .  +
device  1  +  +
device  2  +  +
device  3  +  +
work/mean  1.00 1.00 1.00 1.00
slowest device: 1.00x the mean"""


def test_halo_chart():
    """A causal window of 3: each device's one call holds its left neighbour's last 3 keys
    (none on device 0: skipped) and its own 16, both partial."""
    needs_halo()

    def windowed(q, k, v):
        return jnp.sum(attention(q, k, v, causal=True, window=(3, 0)))

    x = jax.random.normal(jax.random.key(0), (1, 64, 4, 16))
    (plan,) = context_parallel(windowed, cp=4, schedule="halo", load_balance="none",
                               hardware="h100").module(x, x, x).facts.plan
    assert "\n".join(render_text(c) for c in charts_for(plan, CONTIGUOUS)) == HALO


def test_png_needs_matplotlib(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(PlotError, match=r"\.venv/bin/pip install matplotlib .*pip install -e"):
        render_png(str(tmp_path / "plan.png"), [], ())


@pytest.mark.slow
def test_png_draws_every_chart(tmp_path):
    pytest.importorskip("matplotlib")
    plan, facts = planned("hybrid")
    charts = charts_for(plan, CONTIGUOUS)
    path = tmp_path / "plan.png"
    render_png(str(path), [("attention #0", c) for c in charts], facts.balance)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- charts for one batch's segment ids ------------------------------------------------------

S, CP = 16, 2
#: Two documents, one per contiguous shard (5 + 3 tokens, then 8), in two rows.
SEGMENTS = np.array([[1] * 5 + [2] * 3 + [3] * 8, [1] * 8 + [2] * 8])


def test_segment_blocks_are_classified_for_the_data():
    mask = MaskSpec(causal=True, segments=True)
    first, second = SequenceLayout("contiguous", S, CP).all_positions()
    assert block_kind(mask, second, first) == BlockKind.UNKNOWN  # no data: cannot tell
    assert block_kind(mask, second, first, SEGMENTS) == BlockKind.SKIP  # no document crosses shards
    assert block_kind(mask, first, first, SEGMENTS) == BlockKind.PARTIAL
    assert block_kind(MaskSpec(segments=True), first, first, SEGMENTS[1:]) == BlockKind.FULL


def test_device_work_counts_visible_pairs_of_the_batch():
    mask = MaskSpec(causal=True, segments=True)
    positions = SequenceLayout("zigzag", S, CP).all_positions()
    assert device_work(mask, positions, S) is None
    token = np.arange(S)
    visible = ((SEGMENTS[:, :, None] == SEGMENTS[:, None, :])
               & (token[None, None, :] <= token[None, :, None]))
    want = [visible[:, rows].sum() for rows in positions]
    np.testing.assert_array_equal(device_work(mask, positions, S, SEGMENTS), want)
