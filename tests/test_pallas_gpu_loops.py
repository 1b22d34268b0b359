"""The GPU Pallas kernels' loop ranges: :func:`loop_bounds` condenses each block-table row
into a run of full tiles (walked without mask or branch) and the edges around it (walked by
the table), and nothing visible lies outside. Exact on random tables and on the tables of
every mask kind (checked against the element mask); programs whose tiles are all full, all
partial, or mixed (with the edges on both sides of the run, skipped tiles inside them, and
loop steps smaller than the table's tile) give the reference numbers in interpret mode."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_pallas_kernels import check_kernel, make_block

from cptransform.lowering.kernels import pallas_gpu
from cptransform.lowering.kernels.block_table import block_table, loop_bounds
from cptransform.lowering.kernels.pallas import PallasKernel
from cptransform.lowering.kernels.pallas_operands import prepare
from cptransform.op.attention_reference import visible
from cptransform.op.attention_spec import MaskSpec
from cptransform.op.mask_terms import BlockKind

S, F, P = BlockKind.SKIP, BlockKind.FULL, BlockKind.PARTIAL


def brute_bounds(row):
    """``(lo, full_lo, full_hi, hi)`` of one table row, by enumeration."""
    visited = [j for j, k in enumerate(row) if k != S]
    if not visited:
        return 0, 0, 0, 0
    lo, hi = visited[0], visited[-1] + 1
    best = (hi, hi)
    for a in range(len(row)):
        for b in range(a + 1, len(row) + 1):
            if all(k == F for k in row[a:b]) and b - a > best[1] - best[0]:
                best = (a, b)
    return lo, *best, hi


def test_loop_bounds_of_random_tables_are_exact(rng):
    for n in (1, 2, 3, 5, 8):
        for p_skip in (0.0, 0.3, 0.7, 1.0):
            kinds = rng.choice([S, F, P], size=(2, 3, 4, n),
                               p=[p_skip, (1 - p_skip) * 0.6, (1 - p_skip) * 0.4])
            got = np.asarray(loop_bounds(jnp.asarray(kinds, jnp.int32)))
            assert got.shape == (*kinds.shape[:-1], 4)
            for idx in np.ndindex(*kinds.shape[:-1]):
                assert tuple(got[idx]) == brute_bounds(list(kinds[idx])), kinds[idx]


def test_loop_bounds_of_known_rows():
    table = jnp.asarray([[[[F, F, P, S, S],          # causal: run below the diagonal
                           [S, P, F, F, P],          # window: edges on both sides
                           [F, S, F, F, S],          # two runs: the longer one
                           [P, S, P, S, S],          # no full tile: all edges
                           [S, S, S, S, S]]]], jnp.int32)
    np.testing.assert_array_equal(loop_bounds(table)[0, 0],
                                  [[0, 0, 2, 3], [1, 2, 4, 5], [0, 2, 4, 4], [0, 3, 3, 3],
                                   [0, 0, 0, 0]])


def _zigzag(t: int, chunks: int):
    """Positions ``[1, t]`` in a zigzag order: chunk 0, chunk n-1, chunk 1, chunk n-2, ..."""
    size = t // chunks
    order = [c for pair in zip(range(chunks // 2), range(chunks - 1, chunks // 2 - 1, -1))
             for c in pair]
    return jnp.asarray(np.concatenate([np.arange(c * size, (c + 1) * size) for c in order]),
                       jnp.int32)[None]


def _mask_case(rng, kind: str):
    """``(mask, kwargs of block_table without the block sizes)`` of one random mask of
    ``kind`` over 37 queries and 45 keys (ragged against every block size used)."""
    tq, tkv = 37, 45
    q_pos = jnp.asarray(np.arange(tq) + rng.integers(0, 12), jnp.int32)[None]
    kv_pos = jnp.arange(tkv, dtype=jnp.int32)[None]
    args = dict(q_pos=q_pos, kv_pos=kv_pos, q_seg=None, kv_seg=None, mask=None)
    if kind == "causal":
        return MaskSpec(causal=True), args
    if kind == "window":
        return MaskSpec(window=(int(rng.integers(2, 12)), int(rng.integers(0, 6)))), args
    if kind == "chunk":
        return MaskSpec(causal=True, chunk=int(rng.integers(3, 12))), args
    if kind == "zigzag":
        pos = _zigzag(48, 4)
        return MaskSpec(causal=True), dict(args, q_pos=pos[:, :40], kv_pos=pos)
    if kind == "segments":
        q_seg = jnp.asarray(np.sort(rng.integers(0, 4, tq)), jnp.int32)[None]
        kv_seg = jnp.asarray(np.sort(rng.integers(0, 4, tkv)), jnp.int32)[None]
        return MaskSpec(causal=True, segments=True), dict(args, q_seg=q_seg, kv_seg=kv_seg)
    if kind == "dense":  # whole tiles on and off, and noise: every kind of tile
        tiles = rng.random((2, 10, 12)) < 0.5
        dense = np.kron(tiles, np.ones((4, 4), bool))[:, None, :tq, :tkv]
        dense = dense ^ (rng.random(dense.shape) < 0.02)
        return MaskSpec(dense=True), dict(args, mask=jnp.asarray(dense))
    assert kind == "topk"
    topk = jnp.asarray(rng.integers(0, tkv, (1, 2, tq, 5)), jnp.int32)
    return MaskSpec(causal=True, topk=True), dict(args, topk=topk)


MASK_KINDS = ("causal", "window", "chunk", "zigzag", "segments", "dense", "topk")


@pytest.mark.parametrize("kind", MASK_KINDS)
def test_loop_bounds_agree_with_the_table_and_the_element_mask(rng, kind):
    """For each row: every tile of the full run is full in the table and every one of its
    pairs is visible and real (no padding); every tile outside ``[lo, hi)`` is skipped in
    the table and has no visible pair; the run is the table's longest; the edges hold
    every other visited tile. Also for the transposed (KV-major) table."""
    for _ in range(4):
        mask, args = _mask_case(rng, kind)
        see = np.asarray(visible(mask, **args))
        for bq, bk in ((4, 4), (8, 4), (4, 16)):
            table = block_table(mask, **args, block_q=bq, block_kv=bk)
            for kv_major in (False, True):
                kinds = np.asarray(jnp.swapaxes(table, 2, 3) if kv_major else table)
                bounds = np.asarray(loop_bounds(jnp.asarray(kinds)))
                for b, h, r in np.ndindex(*kinds.shape[:3]):
                    lo, full_lo, full_hi, hi = bounds[b, h, r]
                    assert (lo, full_lo, full_hi, hi) == brute_bounds(list(kinds[b, h, r]))
                    for c, kind_ in enumerate(kinds[b, h, r]):
                        i, j = (c, r) if kv_major else (r, c)
                        qs, ks = slice(i * bq, (i + 1) * bq), slice(j * bk, (j + 1) * bk)
                        pairs = see[min(b, see.shape[0] - 1), min(h, see.shape[1] - 1), qs, ks]
                        if full_lo <= c < full_hi:
                            assert kind_ == F and pairs.shape == (bq, bk) and pairs.all()
                        if not lo <= c < hi:
                            assert kind_ == S and not pairs.any()


def test_tuning_of_the_common_shapes():
    """Head dim 128 in bf16: 64-row programs, the forward stepping 64 keys with 4 warps, both
    backward kernels 32 (tokamax's Pallas-Triton blocks), dK/dV (two 64 × 128 accumulators)
    with 8 warps; D = 256 in 32-row programs; every step divides the table's tile and
    Triton's dot needs at least 16."""
    tune = pallas_gpu.tuning
    assert [pallas_gpu.table_block(d, 2) for d in (64, 128, 256)] == [128, 64, 32]
    assert pallas_gpu.table_block(128, 4) == 32
    assert tune("fwd", 64, 64, 128, 128, 2) == pallas_gpu.Tuning(64, 4, 3)
    assert tune("dq", 64, 64, 128, 128, 2) == pallas_gpu.Tuning(32, 4, 2)
    assert tune("dkv", 64, 64, 128, 128, 2) == pallas_gpu.Tuning(32, 8, 2)
    assert tune("fwd", 128, 128, 128, 128, 2) == pallas_gpu.Tuning(64, 8, 3)
    assert tune("dkv", 32, 32, 256, 256, 2) == pallas_gpu.Tuning(16, 4, 2)
    assert tune("fwd", 32, 32, 256, 256, 4) == pallas_gpu.Tuning(32, 4, 1)
    for kernel in pallas_gpu.STEP:
        for d in (16, 32, 64, 128, 256):
            for itemsize in (2, 4):
                tile = pallas_gpu.table_block(d, itemsize)
                step = tune(kernel, tile, tile, d, d, itemsize).step
                assert step >= 16 and tile % step == 0


@pytest.mark.parametrize("tiles", [pytest.param("all_full", marks=pytest.mark.slow),
                                   pytest.param("all_partial", marks=pytest.mark.slow),
                                   "mixed"])
def test_gpu_programs_give_the_reference_numbers(rng, monkeypatch, tiles):
    """Programs whose tiles are all full (one unmasked loop, no edges), all partial (edges
    only) or mixed (a causal window over zigzag positions: rows, Q-major and KV-major,
    with edges before and after the run and skipped tiles inside and outside the edges,
    and a bias, whose gradient tiles the dQ kernel zeroes there), each table tile (16 × 16,
    the GPU variant's smallest) walked in two loop steps."""
    monkeypatch.setattr(pallas_gpu, "STEP", {"fwd": 8, "dq": 8, "dkv": 8})
    kernel = PallasKernel("gpu", block_q=16, block_kv=16)
    if tiles == "all_full":
        block, spec = make_block(rng, MaskSpec(), tq=32, tkv=48, q_offset=0)
    elif tiles == "all_partial":
        block, spec = make_block(rng, MaskSpec(dense=True), tq=32, tkv=32, heads=(2, 1))
    else:
        block, spec = make_block(rng, MaskSpec(window=(40, 0), bias=True), tq=64, tkv=64,
                                 heads=(2, 1))
        pos = _zigzag(64, 4)
        block = block.replace(q_pos=pos, kv_pos=pos)
    table = np.asarray(prepare(block, spec, 16, 16).table)
    if tiles == "all_full":
        assert (table == F).all()
    elif tiles == "all_partial":
        assert (table == P).all()
    else:
        assert {S, F, P} <= set(table.ravel())
        for kinds in (table, np.swapaxes(table, 2, 3)):  # Q-major and KV-major rows
            bounds = np.asarray(loop_bounds(jnp.asarray(kinds)))
            lo, full_lo, full_hi, hi = np.moveaxis(bounds, -1, 0)
            assert ((full_lo > lo) & (hi > full_hi) & (full_hi > full_lo)).any()
            inside = [k for row, (a, _, _, d) in zip(kinds.reshape(-1, kinds.shape[-1]),
                                                     bounds.reshape(-1, 4)) for k in row[a:d]]
            assert S in inside  # a skipped tile in an edge: the edge loop's empty branch
    check_kernel(kernel, block, spec, rng, 1e-5)


def _eqns(jaxpr):
    """Every equation of ``jaxpr`` and of the jaxprs in its equations' params."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, tuple) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _eqns(inner)


def test_gpu_full_run_loop_has_no_branch_and_edges_skip_without_loading(rng):
    """The forward kernel's first loop (the run of full tiles) loads K and V and neither
    reads the table nor branches; the second (the edges) reads the table entry, then
    branches, and its skip branch is empty (no K or V of a skipped tile is loaded)."""
    block, spec = make_block(rng, MaskSpec(window=(2, 2)), tq=16, tkv=16, q_offset=0)
    ops = prepare(block, spec, 16, 4)
    jaxpr = jax.make_jaxpr(lambda: pallas_gpu.forward(ops, spec, True))()
    (call,) = [e for e in jaxpr.eqns if e.primitive.name == "pallas_call"]
    loops = [e for e in _eqns(call.params["jaxpr"]) if e.primitive.name in ("scan", "while")]
    full, edges = [(e.params.get("jaxpr") or e.params["body_jaxpr"]).jaxpr for e in loops]
    names = [e.primitive.name for e in _eqns(full)]
    assert "cond" not in names and names.count("get") == 2  # K and V
    top = [e.primitive.name for e in edges.eqns]
    assert top.count("get") == 1  # the table entry
    (by_kind,) = [e for e in edges.eqns if e.primitive.name == "cond"]
    skip = by_kind.params["branches"][1].jaxpr  # lax.cond(kind == SKIP, skip, …)
    assert not skip.eqns
    loads = [e for e in _eqns(by_kind.params["branches"][0].jaxpr) if e.primitive.name == "get"]
    assert loads  # the visited tiles load K and V
