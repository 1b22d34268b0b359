"""Mask-aware load balance: the planner plans every legal layout, counts each rank's
executed FLOPs from the actual masks of all attentions, and keeps the layout with the least
predicted time. Expected counts are brute force over the kernel's tiles, never timings."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cptransform import attention, context_parallel
from cptransform.analysis.block_work import DEFAULT_CHUNK, kernel_grid
from cptransform.op.layouts import LAYOUTS, SequenceLayout
from cptransform.passes.plan_context_parallel import PlanContextParallel

RTOL = 1e-5
HEADS, D = 4, 16
#: Forward + backward FLOPs per executed score entry (D = Dv): 2(D + Dv) + 2(3D + 2Dv).
FLOPS_PER_ENTRY = 2 * (D + D) + 2 * (3 * D + 2 * D)


def operands(seq=64, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    return tuple(jax.random.normal(key, (1, seq, HEADS, D)) for key in keys)


def causal(q, k, v):
    return jnp.sum(jnp.sin(attention(q, k, v, causal=True)))


def windowed(q, k, v):
    return jnp.sum(jnp.sin(attention(q, k, v, window=(8, 0))))


def causal_and_full(q, k, v):
    return causal(q, k, v) + jnp.sum(jnp.cos(attention(q, k, v)))


def ring_rank_flops(layout, seq, cp, bands):
    """Per rank: the ring's kernel tiles (one call per KV shard) with any visible pair,
    from a dense visibility matrix, over every band, times the FLOPs per entry."""
    pos = SequenceLayout(layout, seq, cp).all_positions()
    out = np.zeros(cp)
    for lo, hi in bands:
        for r in range(cp):
            for shard in pos:
                (cq, nq), (ck, nk) = kernel_grid(len(pos[r]), len(shard), DEFAULT_CHUNK)
                rel = shard[None, :] - pos[r][:, None]
                seen = np.ones(rel.shape, bool)
                if lo is not None:
                    seen &= rel >= lo
                if hi is not None:
                    seen &= rel <= hi
                out[r] += seen.reshape(nq, cq, nk, ck).any(axis=(1, 3)).sum() * cq * ck
    return out * HEADS * FLOPS_PER_ENTRY


def facts_of(fn, *args, cp=4, **options):
    return context_parallel(fn, cp=cp, schedule="ring", hardware="h100",
                            **options).module(*args).facts


def test_causal_counts_every_layout_and_chooses_zigzag():
    facts = facts_of(causal, *operands())
    assert [b.layout for b in facts.balance] == list(LAYOUTS)
    for b in facts.balance:
        np.testing.assert_array_equal(b.rank_flops,
                                      ring_rank_flops(b.layout, 64, 4, [(None, 0)]))
    chosen = [b for b in facts.balance if b.chosen]
    # q, k and v are separate arguments: two sequences, so zigzag applies inside the
    # attention (the program is not reordered).
    assert [b.layout for b in chosen] == ["zigzag"] and [p.layout for p in facts.plan] == \
        ["zigzag"]
    by_name = {b.layout: b for b in facts.balance}
    assert by_name["zigzag"].balance == 1.0 and by_name["contiguous"].balance > 1.5


@pytest.mark.slow
def test_a_window_is_not_treated_as_causal():
    """A sliding window of 8 over 16-token shards: contiguous is as balanced on its busiest
    rank as zigzag, so the tie goes to contiguous (the old rule took zigzag for any band
    closed on the right); the program still gives the one-device numbers."""
    args = operands(seed=1)
    facts = facts_of(windowed, *args)
    by_name = {b.layout: b for b in facts.balance}
    for name, b in by_name.items():
        np.testing.assert_array_equal(b.rank_flops, ring_rank_flops(name, 64, 4, [(-8, 0)]))
    assert by_name["contiguous"].slowest == by_name["zigzag"].slowest
    assert by_name["contiguous"].chosen and [p.layout for p in facts.plan] == ["contiguous"]
    f = context_parallel(windowed, cp=4, schedule="ring", hardware="h100")
    value, grads = jax.value_and_grad(f, argnums=(0, 1, 2))(*args)
    ref_value, ref_grads = jax.value_and_grad(windowed, argnums=(0, 1, 2))(*args)
    np.testing.assert_allclose(value, ref_value, rtol=RTOL)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(g, r, rtol=RTOL, atol=RTOL * float(jnp.max(jnp.abs(r))))


def test_work_sums_over_all_attentions():
    facts = facts_of(causal_and_full, *operands())
    for b in facts.balance:
        expected = ring_rank_flops(b.layout, 64, 4, [(None, 0), (None, None)])
        np.testing.assert_array_equal(b.rank_flops, expected)
        assert b.schedules == ("ring", "ring")


def test_forced_layout_is_kept_and_every_layout_reported():
    facts = facts_of(causal, *operands(), load_balance="none")
    assert facts.layout is None
    assert [(b.layout, b.chosen) for b in facts.balance] == [
        ("contiguous", True), ("zigzag", False), ("striped", False)]
    text = context_parallel(causal, cp=4, schedule="ring", hardware="h100",
                            load_balance="none").explain(*operands(), verbose=True)
    assert "load balance per layout" in text
    # Causal ring, 8-token tiles on 16-token shards: ranks run 3, 7, 11, 15 tiles.
    assert "contiguous: max/mean 1.67x" in text and "<- chosen" in text
    assert "zigzag: max/mean 1.00x" in text


def test_a_layout_that_does_not_cut_the_length_is_priced_padded():
    """36 tokens over 4 ranks: zigzag is planned on 40 (padded inside the attention)."""
    facts = facts_of(causal, *operands(seq=36))
    assert [b.layout for b in facts.balance] == list(LAYOUTS)
    by_name = {b.layout: b for b in facts.balance}
    np.testing.assert_array_equal(by_name["zigzag"].rank_flops,
                                  ring_rank_flops("zigzag", 40, 4, [(None, 0)]))


def test_per_document_zigzag_is_refused():
    with pytest.raises(NotImplementedError, match="segment ids.*known only when"):
        context_parallel(causal, cp=4, load_balance="documents")
    with pytest.raises(NotImplementedError, match="document boundaries"):
        PlanContextParallel(load_balance="documents").check()


def test_rank_flops_spreads_groups_and_prices_an_unknown_split_at_the_slowest():
    from cptransform.analysis.block_work import Work
    from cptransform.analysis.load_balance import rank_flops
    np.testing.assert_array_equal(rank_flops(Work(1, 2, 1.5, 2, (3, 9)), 4), [3, 3, 9, 9])
    np.testing.assert_array_equal(rank_flops(Work(1, 2, 1.0), 4), [3, 3, 3, 3])


def test_segments_count_by_their_band_and_say_so():
    """Packed documents: segment ids are data, so the balance is the causal band's (the
    same counts as without them) and explain() says what was assumed."""
    q, k, v = operands()
    segments = jnp.repeat(jnp.arange(4), 16)[None]

    def packed(q, k, v, segments):
        return jnp.sum(jnp.sin(attention(q, k, v, causal=True, segment_ids=segments)))

    f = context_parallel(packed, cp=4, schedule="ring", hardware="h100")
    balances = f.module(q, k, v, segments).facts.balance
    for b in balances:
        assert b.data_masks
        np.testing.assert_array_equal(b.rank_flops,
                                      ring_rank_flops(b.layout, 64, 4, [(None, 0)]))
    assert ("note: segment ids / coordinate bands / dense masks / top-k indices / query "
            "padding / key padding / region padding are data") in f.explain(q, k, v, segments, verbose=True)
