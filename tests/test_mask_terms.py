"""Mask terms: each term's block classification from ranges against its own element
predicate, and Llama-4 chunked attention (a new term) through every schedule and both
kernel families where the conformance suite does not take it (non-causal chunks under
zigzag, chunks of 12 under striped), and the plan chart."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh
from schedule_cases import check_schedule, make_case, schedule_axes, schedule_mesh_shapes
from test_match_support import check, specs

from cptransform.analysis.attention_shape import attention_shape
from cptransform.api import plan_chart
from cptransform.lowering.schedule import schedules
from cptransform.op import mask_terms
from cptransform.op.attention_reference import attention_reference
from cptransform.op.attention_spec import MaskSpec
from cptransform.op.layouts import SequenceLayout

POSITION_TERMS = [mask_terms.Band(None, 0), mask_terms.Band(-5, 3), mask_terms.Band(2, None),
                  mask_terms.Chunks(7), mask_terms.Chunks(1)]


def _element_kinds(terms, q_lo, q_hi, k_lo, k_hi):
    q = np.arange(q_lo, q_hi + 1)[:, None]
    k = np.arange(k_lo, k_hi + 1)[None, :]
    seen = np.broadcast_to(mask_terms.visible(terms, mask_terms.Tile(q, k)), (q.size, k.size))
    return seen.any(), seen.all()


@pytest.mark.parametrize("term", POSITION_TERMS, ids=lambda t: t.describe())
def test_position_terms_classify_contiguous_blocks_exactly(rng, term):
    """On contiguous blocks, ``may`` is ``any`` and ``full`` is ``all`` of the predicate,
    alone and (a chunk) together with causal; the key hull skips exactly what ``meet``
    skips. (Two bands are one term: MaskSpec merges causal and window.)"""
    combined = [(term, mask_terms.Band(None, 0))] if isinstance(term, mask_terms.Chunks) else []
    for terms in [(term,)] + combined:
        for _ in range(60):
            q_lo, k_lo = rng.integers(0, 40, 2)
            q_hi, k_hi = q_lo + rng.integers(0, 12), k_lo + rng.integers(0, 12)
            blocks = mask_terms.Blocks(mask_terms.Ranges(np.array([[q_lo]]), np.array([[q_hi]])),
                                       mask_terms.Ranges(np.array([[k_lo]]), np.array([[k_hi]])))
            may, full = mask_terms.meet(terms, blocks)
            assert (bool(np.all(may)), bool(np.all(full))) == \
                _element_kinds(terms, q_lo, q_hi, k_lo, k_hi)
            first, last = mask_terms.key_hull(terms, np.array([q_lo]), np.array([q_hi]))
            kept = (first is None or k_hi >= first[0]) and (last is None or k_lo <= last[0])
            assert kept == bool(np.all(may))


def test_segment_term_is_conservative(rng):
    """Segment ranges never skip a block with a visible pair nor call a block full that
    has a hidden one."""
    term = mask_terms.Segments()
    for _ in range(100):
        q_ids, k_ids = np.sort(rng.integers(0, 5, (2, 6)), axis=1)
        blocks = mask_terms.Blocks(
            None, None, mask_terms.Ranges(q_ids.min(keepdims=True)[None], q_ids.max(keepdims=True)[None]),
            mask_terms.Ranges(k_ids.min(keepdims=True)[None], k_ids.max(keepdims=True)[None]))
        may, full = term.block_kind(blocks)
        seen = q_ids[:, None] == k_ids[None, :]
        assert bool(np.all(may)) or not seen.any()
        assert not bool(np.all(full)) or seen.all()


@pytest.mark.parametrize("region", [(None, 0), (-4, 0), (1, None)])
def test_region_padding_is_conservative_and_skips_outside_blocks(rng, region):
    """Per block from position and test ranges: never skipped with a visible pair, never
    full with a hidden one; a block wholly outside the region whose outside test is all
    False is skipped (the upper triangle of an int padding mask without negative
    entries), and the band hull stays open."""
    term = mask_terms.RegionPadding(*region)
    assert term.band() == (None, None) and term.key_hull is None
    skipped = 0
    for _ in range(200):
        q_lo, k_lo = rng.integers(0, 30, 2)
        q, k = np.arange(q_lo, q_lo + 6), np.arange(k_lo, k_lo + 6)
        inside, outside = rng.random((2, 6)) < rng.random((2, 1))
        def r(x):
            return mask_terms.Ranges(x.min(keepdims=True)[None], x.max(keepdims=True)[None])
        blocks = mask_terms.Blocks(r(q), r(k), kv_inside=r(inside), kv_outside=r(outside))
        may, full = (bool(np.all(x)) for x in term.block_kind(blocks))
        seen = np.broadcast_to(term.visible(mask_terms.Tile(
            q_pos=q[:, None], kv_pos=k[None, :], kv_inside=inside[None, :],
            kv_outside=outside[None, :])), (6, 6))
        assert may or not seen.any()
        assert not full or seen.all()
        d = k[None, :] - q[:, None]
        lo, hi = region
        wholly_outside = not np.any((lo is None or d >= lo) & (hi is None or d <= hi))
        if wholly_outside and not outside.any():
            assert not may
            skipped += 1
    assert skipped


def test_chunked_kernel_skips_the_upper_triangle_of_a_region_padding_at_run_time(rng):
    """The chunked kernel's chunk table under keras-hub's ``minimum(x, causal) != 0``:
    without negative entries every chunk above the diagonal is skipped, as under causal; a
    negative entry in a key chunk keeps that chunk's column above the diagonal."""
    from cptransform.lowering.block import Block
    from cptransform.lowering.kernels.chunked import chunk_kinds

    n, chunk = 64, 16
    x = rng.integers(1, 3, (1, n))
    pos = jnp.arange(n)[None]
    qkv = jnp.zeros((1, n, 1, 8))
    case = make_case(rng, "none", "mha", seq=n)
    spec = case.spec.replace(mask=MaskSpec(region_padding=(None, 0)))

    def kinds(x):
        block = Block(q=qkv, k=qkv, v=qkv, q_pos=pos, kv_pos=pos,
                      kv_inside=jnp.asarray(x != 0), kv_outside=jnp.asarray(x < 0))
        return np.asarray(chunk_kinds(block, spec, chunk))

    upper = np.triu(np.ones((n // chunk, n // chunk), bool), 1)
    assert np.all(kinds(x)[upper] == mask_terms.BlockKind.SKIP)
    x[0, 40] = -1  # key chunk 2
    got = kinds(x)
    assert np.all(got[:2, 2] != mask_terms.BlockKind.SKIP)
    assert np.all(got[upper & (np.arange(n // chunk) != 2)[None, :]] == mask_terms.BlockKind.SKIP)


def test_region_padding_is_priced_without_the_causal_halving(rng):
    """The planner counts a region padding's blocks as data-decided: no position term, so
    no causal halving of its work (its causal region bounds nothing)."""
    case = make_case(rng, "none", "gqa", seq=32)
    region = case.spec.replace(mask=MaskSpec(region_padding=(None, 0)))
    causal = case.spec.replace(mask=MaskSpec(causal=True))
    def shape(spec):
        return attention_shape(spec, *case.operands[:3], cp=4, layout="zigzag")
    assert shape(region).position_terms == ()
    assert shape(causal).position_terms == (mask_terms.Band(None, 0),)


def test_region_padding_is_refused_by_name_by_the_kernels_that_do_not_read_it():
    """Pallas (whose tiles carry no per-key test but segment ids) and cuDNN's delegation
    refuse the region padding by name; the chunked XLA kernel reads every term, so
    ``auto`` picks it."""
    from cptransform.lowering.kernels.capabilities import Capabilities
    from cptransform.lowering.kernels.cudnn import CudnnKernel
    from cptransform.lowering.kernels.pallas import PallasKernel
    from cptransform.op.attention_spec import AttentionSpec, Layout

    canonical = Layout((0,), 1, 2, 3)
    spec = AttentionSpec(q=canonical, k=canonical, v=canonical, scale=1.0,
                         mask=MaskSpec(region_padding=(None, 0)))
    for kernel, backend in ((PallasKernel, "tpu"), (CudnnKernel, "gpu")):
        reason = kernel.capabilities.refusal(spec, jnp.bfloat16, (64, 64), backend)
        assert reason and "region_padding[None, 0]" in reason, reason
    assert Capabilities().refusal(spec, jnp.float32, (8, 8), "cpu") is None


def chunked_case(rng, chunk: int, causal: bool = True, heads: str = "gqa", seq: int = 32):
    case = make_case(rng, "causal" if causal else "none", heads, seq=seq)
    return case.__class__(case.operands, case.spec.replace(
        mask=case.spec.mask.replace(chunk=chunk)))


@pytest.mark.parametrize("causal", [True, False])
def test_chunked_reference_is_the_llama4_predicate(rng, causal):
    """The chunk term means ``(q // C == k // C) & (k <= q)``, written out as a dense mask."""
    case = chunked_case(rng, 8, causal)
    q_pos, k_pos = np.arange(32)[:, None], np.arange(32)[None, :]
    dense = (q_pos // 8 == k_pos // 8) & ((k_pos <= q_pos) | (not causal))
    dense_spec = case.spec.replace(mask=MaskSpec(dense=True))
    want = attention_reference(*case.operands, jnp.asarray(dense)[None, None], spec=dense_spec)
    got = attention_reference(*case.operands, spec=case.spec)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def _chunked_cells():
    """Every schedule × layout on the XLA kernel; interpreted Pallas (10-30 s a cell) on
    each schedule in one layout, the layouts alternating."""
    cells = []
    for i, schedule in enumerate(schedules()):
        for layout in ("zigzag", "striped"):
            cells.append((layout, "xla", schedule))
        cells.append((("zigzag", "striped")[i % 2], "pallas", schedule))
    return cells


@pytest.mark.slow
@pytest.mark.parametrize("layout,kernel,schedule", _chunked_cells())
def test_chunked_attention_matrix(rng, schedule, kernel, layout):
    """Chunks of 12 (not a multiple of the striped shards) under striped, non-causal chunks
    under zigzag; causal chunks of 8 in every layout are ``test_conformance.py``'s."""
    case = chunked_case(rng, 12 if layout == "striped" else 8, causal=layout != "zigzag")
    axes = schedule_axes(schedule)
    shape = next(s for s in schedule_mesh_shapes(schedule) if math.prod(s) == 4)
    record = schedules()[schedule]
    problem = record.feasible(attention_shape(
        case.spec, *case.operands[:3], cp=math.prod(shape), layout=layout,
        ulysses=shape[0] if record.inner is not None else 1))
    if problem:
        pytest.skip(f"{schedule}: {problem} (the conformance suite checks the refusal)")
    check_schedule(case, mesh=make_mesh(shape, axes), axes=axes, schedule=schedule,
                   layout=layout, kernel=kernel)


def _dense_kind(mask, q_pos, k_pos):
    seen = mask_terms.visible(mask.terms(), mask_terms.Tile(q_pos[:, None], k_pos[None, :]))
    seen = np.broadcast_to(seen, (q_pos.size, k_pos.size))
    if not seen.any():
        return mask_terms.BlockKind.SKIP
    return mask_terms.BlockKind.FULL if seen.all() else mask_terms.BlockKind.PARTIAL


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("mask", [MaskSpec(causal=True, chunk=16), MaskSpec(chunk=24),
                                  MaskSpec(window=(9, 3)), MaskSpec(causal=True)])
def test_chart_cells_and_work_follow_the_terms(layout, mask):
    """The chart classifies each shard block from runs of positions as the element
    predicate does, and each device's work counts the visible pairs."""
    shards = SequenceLayout(layout, 128, 4).all_positions()
    for q in shards:
        for k in shards:
            assert plan_chart.block_kind(mask, q, k) == _dense_kind(mask, q, k)
    work = plan_chart.device_work(mask, shards, 128)
    everything = np.arange(128)
    brute = [np.broadcast_to(mask_terms.visible(mask.terms(), mask_terms.Tile(
        q[:, None], everything[None, :])), (q.size, 128)).sum() for q in shards]
    np.testing.assert_array_equal(work, brute)


def _llama4_iota(t, c):
    i = jax.lax.broadcasted_iota(jnp.int32, (t, t), 0)
    j = jax.lax.broadcasted_iota(jnp.int32, (t, t), 1)
    return (i // c == j // c) & (j <= i)


def _llama4_arange(t, c):
    # transformers' ``chunked_causal_mask`` / MaxText's ``ChunkedCausalMask`` spelling.
    q, kv = jnp.arange(t)[:, None], jnp.arange(t)[None, :]
    return (kv <= q) & (kv // c == q // c)


@pytest.mark.slow
@pytest.mark.parametrize("spelling", [_llama4_iota, _llama4_arange])
def test_chunked_spellings_match_as_one_chunk_term(rng, spelling):
    """Mask analysis reads ``//`` of iotas: the Llama-4 mask is causal plus a chunk term,
    no dense mask, and the rewrite computes the same numbers."""
    b, t, h, d = 2, 16, 2, 8

    def fn(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * d ** -0.5
        s = jnp.where(spelling(t, 4), s, -jnp.inf)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)

    args = [jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.float32) for _ in range(3)]
    module = check(fn, *args, analytic=True)
    (spec,) = specs(module)
    assert spec.mask.chunk == 4 and spec.mask.causal and not spec.mask.dense
