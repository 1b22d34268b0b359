"""Coordinate bands: a window of key positions around a per-query data coordinate
(DeepMind gemma's local layer, whose queries sit at ``cumsum(input_mask) - 1``). The
term's block kinds against its element predicate, and gemma's mask spelled by hand
matched analytically and run through the schedules against one device."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_tree_close, needs_halo
from test_match_support import check, randn, specs

from cptransform import context_parallel
from cptransform.api import plan_chart
from cptransform.op import mask_terms
from cptransform.op.attention_spec import MaskSpec
from cptransform.op.mask_terms import BlockKind

B, T, H, D = 2, 32, 4, 8
#: The local layer's window: ``positions - W < kv < positions + W``.
W = 5


def test_block_kinds_are_conservative(rng):
    """Per-block coordinate ranges never skip a block with a visible pair nor call full a
    block with a hidden one; on random, unsorted coordinates every kind occurs. The plan
    chart, without the data, calls the blocks unknown."""
    kinds = set()
    for lo, hi in [(-4, 4), (None, 0), (-2, None), (3, 6)]:
        term = mask_terms.CoordinateBand(lo, hi)
        for _ in range(25):
            coord = rng.integers(0, 24, (1, 6))
            keys = rng.integers(0, 24) + np.arange(rng.integers(1, 8))[None]
            blocks = mask_terms.Blocks.cut(np.zeros_like(coord), keys, 6, keys.shape[1],
                                           q_coord=coord)
            may, full = (bool(np.all(x)) for x in term.block_kind(blocks))
            seen = np.asarray(term.visible(mask_terms.Tile(None, keys, q_coord=coord.T)))
            assert may or not seen.any()
            assert not full or seen.all()
            kinds.add((may, full))
    assert kinds == {(False, False), (True, False), (True, True)}
    # The chart and the cost model know no coordinates: data decides, as for segments.
    mask = MaskSpec(causal=True, segments=True, coordinate_band=(-3, 3))
    below, above = np.arange(8, 16), np.arange(0, 8)
    assert plan_chart.block_kind(mask, below, above) == BlockKind.UNKNOWN
    assert plan_chart.block_kind(mask, above, below) == BlockKind.SKIP
    assert plan_chart.block_kind(mask, below, above, np.zeros((1, 16), int)) \
        == BlockKind.UNKNOWN
    assert plan_chart.device_work(mask, below[None], 16, np.zeros((1, 16), int)) is None
    assert not mask_terms.positional(mask.terms()) and mask.band() == (None, 0)


def gemma_attention(q, k, v, ids, local: int | None = None):
    """gemma 2's local layer as the library builds its mask: causal by index and key
    padding (``make_causal_attn_mask``) times a window over the data positions
    ``cumsum(input_mask) - (cumsum >= 1)`` (``build_positions_from_mask``); ``local``
    also bounds the keys by index (``kv > q - local``: a window halo can take)."""
    t = ids.shape[1]
    input_mask = ids != 0
    positions = jnp.cumsum(input_mask, axis=-1)
    positions = positions - (positions >= 1)
    causal = jnp.tril(jnp.ones((t, t), bool)) if local is None \
        else jnp.tril(jnp.ones((t, t), bool)) & ~jnp.tril(jnp.ones((t, t), bool), -local)
    mask = input_mask[:, None, :] & causal[None]
    # As gemma reconstructs the cache's key positions: a cond on static lengths.
    keys = jax.lax.cond(t <= t, lambda: jnp.arange(t), lambda: jnp.zeros(t, jnp.int32))
    keys = keys[None, None, :]
    at = positions[:, :, None]
    mask = mask * ((keys > at - W) * (keys < at + W))
    s = jnp.einsum("bqhd,bkhd->bqhk", q, k) / np.sqrt(D)
    s = jnp.where(mask[:, :, None, :], s, -2.3819763e38)
    return jnp.einsum("bqhk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def inputs(rng, t: int = T):
    q, k, v = (randn(rng, B, t, H, D) for _ in range(3))
    ids = rng.integers(1, 50, (B, t))
    ids[0, :7] = 0        # left padding
    ids[1, 9:15] = 0      # padding in the middle
    return q, k, v, jnp.asarray(ids, jnp.int32)


@pytest.mark.slow
def test_gemma_mask_is_one_coordinate_band(rng):
    """Causal, key padding and the window over data positions: no dense part."""
    (spec,) = specs(check(gemma_attention, *inputs(rng), rtol=1e-5))
    assert spec.mask.coordinate_band == (-(W - 1), W - 1), spec.mask
    assert spec.mask.causal and spec.mask.kv_padding and not spec.mask.dense, spec.mask


@pytest.mark.slow
def test_window_around_key_data_stays_dense(rng):
    """The same window with the data on the key side (queries by index, keys at their data
    positions) is no coordinate band of the queries: an exact dense part."""
    def fn(q, k, v, ids):
        positions = jnp.cumsum(ids != 0, axis=-1)
        queries = jnp.arange(T)[None, :, None]
        near = (queries > positions[:, None, :] - W) & (queries < positions[:, None, :] + W)
        s = jnp.einsum("bqhd,bkhd->bqhk", q, k)
        s = jnp.where(near[:, :, None, :], s, -1e30)
        return jnp.einsum("bqhk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)

    (spec,) = specs(check(fn, *inputs(rng), rtol=1e-5))
    assert spec.mask.dense and spec.mask.coordinate_band is None, spec.mask


SCHEDULES = {"ring_zigzag": dict(schedule="ring", load_balance="zigzag"),
             "ulysses": dict(schedule="ulysses", load_balance="none"),
             "allgather": dict(schedule="allgather", load_balance="none"),
             "auto": dict(schedule="auto", load_balance="auto"),
             "hybrid": dict(schedule="hybrid", load_balance="zigzag"),
             "double_ring": dict(schedule="double_ring", load_balance="none"),
             "halo": dict(schedule="halo", load_balance="none")}


@pytest.mark.parametrize("schedule,length", [
    pytest.param(name, T, marks=() if name == "ring_zigzag" else pytest.mark.slow)
    for name in SCHEDULES] + [pytest.param("ring_zigzag", T - 2, marks=pytest.mark.slow)])
def test_loss_and_grads_match_one_device(rng, schedule, length):
    """Loss and every gradient as on one device, the mask analytic; a length the zigzag
    layout does not divide pads the queries with coordinates that see a key."""
    if schedule == "halo":
        needs_halo()
    args = inputs(rng, length)
    local = W + 2 if schedule == "halo" else None

    def loss(q, k, v, ids):
        return jnp.sum(jnp.sin(gemma_attention(q, k, v, ids, local)))

    cp = context_parallel(loss, cp=4, **SCHEDULES[schedule])
    (plan,) = cp.module(*args).facts.plan
    assert plan.mask.coordinate_band == (-(W - 1), W - 1) and not plan.mask.dense, plan.mask
    assert plan.schedule == schedule.split("_zigzag")[0] or schedule == "auto", plan.schedule
    got = jax.value_and_grad(cp, (0, 1, 2))(*args)
    want = jax.value_and_grad(loss, (0, 1, 2))(*args)
    assert_tree_close(got, want)
