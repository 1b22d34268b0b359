"""The Pallas kernels (TPU-style and GPU-style, in interpret mode on CPU) against the oracle
and the XLA kernel: every mask kind, GQA/MQA, Dv ≠ D, odd lengths, bf16; exact block tables;
the transposed dK/dV tiles; and ``kernel="pallas"`` end to end."""
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cptransform import context_parallel
from cptransform.op.attention_reference import attend
from cptransform.op.attention_spec import AttentionSpec, Layout, MaskSpec
from cptransform.op.mask_terms import BlockKind
from cptransform.lowering.block import Block
from cptransform.lowering.kernels import get_kernel
from cptransform.lowering.kernels import pallas_tpu
from cptransform.lowering.kernels.block_table import block_table, fetch_order
from cptransform.lowering.kernels.pallas import PallasKernel
from cptransform.lowering.kernels.pallas_operands import prepare

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from examples import llama  # noqa: E402

BTHD = Layout.parse("BTHD")
VARIANTS = ("tpu", "gpu")


def make_block(rng, mask: MaskSpec, *, tq=13, tkv=11, heads=(4, 2), d=8, dv=8, batch=1,
               softcap=None, dtype=jnp.float32, q_offset=3):
    """Random operands; segments of 5 (queries) and 4 (keys) tokens; a random dense mask
    ``[B, 1, Tq, Tkv]`` and a per-head bias ``[1, H, Tq, Tkv]`` (both broadcast somewhere)."""
    h, hkv = heads
    normal = lambda *s: jnp.asarray(rng.normal(size=s), dtype)  # noqa: E731
    q_pos = jnp.arange(tq, dtype=jnp.int32)[None] + q_offset
    kv_pos = jnp.arange(tkv, dtype=jnp.int32)[None]
    block = Block(normal(batch, tq, h, d), normal(batch, tkv, hkv, d),
                  normal(batch, tkv, hkv, dv), q_pos, kv_pos)
    if mask.segments:
        block = block.replace(q_seg=(jnp.arange(tq, dtype=jnp.int32) // 5)[None],
                              kv_seg=(jnp.arange(tkv, dtype=jnp.int32) // 4)[None])
    if mask.dense:
        block = block.replace(mask=jnp.asarray(rng.random((batch, 1, tq, tkv)) < 0.6))
    if mask.bias:
        block = block.replace(bias=jnp.asarray(rng.normal(size=(1, h, tq, tkv)), jnp.float32))
    spec = AttentionSpec(BTHD, BTHD, BTHD, scale=d ** -0.5, softcap=softcap, groups=h // hkv,
                         mask=mask, positions=True)
    return block, spec


def close(got, want, tol):
    """Equal within ``tol`` of the largest magnitude; -inf where the reference has -inf."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    finite = np.isfinite(want)
    scale = max(np.max(np.abs(want[finite]), initial=0.0), 1.0)
    np.testing.assert_allclose(got[finite], want[finite], rtol=0, atol=tol * scale)


def check_kernel(kernel, block, spec, rng, tol):
    """Forward against ``attend``; backward (from the merged o/lse, with a dlse) against the
    XLA kernel's backward."""
    o_ref, lse_ref = attend(spec, block.q, block.k, block.v, block.q_pos, block.kv_pos,
                            bias=block.bias, **block.term_operands())
    o, lse = kernel.forward(block, spec)
    close(o, o_ref, tol)
    close(lse, lse_ref, tol)
    do = jnp.asarray(rng.normal(size=o_ref.shape), jnp.float32)
    dlse = jnp.asarray(rng.normal(size=lse_ref.shape), jnp.float32)
    dlse = jnp.where(jnp.isfinite(lse_ref), dlse, 0.0)
    want = get_kernel("xla").backward(block, o_ref, lse_ref, do, spec, dlse=dlse)
    got = kernel.backward(block, o_ref, lse_ref, do, spec, dlse=dlse)
    for name, g, w in zip(("dq", "dk", "dv", "dbias"), got, want):
        assert (g is None) == (w is None), name
        if w is not None:
            close(g, w, tol)


CASES = {
    # name: (mask, options)
    "causal_odd": (MaskSpec(causal=True), {}),
    "window_segments_gqa": (MaskSpec(window=(3, 2), segments=True), {}),
    "dense_bias_softcap_mqa_dv": (MaskSpec(causal=True, dense=True, bias=True),
                                  dict(heads=(2, 1), dv=16, softcap=4.0, batch=2)),
    "full_bf16": (MaskSpec(), dict(dtype=jnp.bfloat16, tq=16, tkv=16)),
}


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("case", CASES)
def test_kernel_matches_reference(variant, case, rng):
    mask, options = CASES[case]
    block, spec = make_block(rng, mask, **options)
    bf16 = options.get("dtype") == jnp.bfloat16
    # bf16: default blocks (min(T, 128)); otherwise 8 × 8 tiles over odd lengths (padding).
    kernel = PallasKernel(variant) if bf16 else PallasKernel(variant, block_q=8, block_kv=8)
    check_kernel(kernel, block, spec, rng, 2e-2 if bf16 else 1e-5)


# Pallas in interpret mode once in the fast tier: the TPU variant here; the GPU one is slow.
@pytest.mark.parametrize("variant", [pytest.param(v, marks=() if v == "tpu" else pytest.mark.slow)
                                     for v in VARIANTS])
def test_dkv_tiles_are_the_forward_tiles_transposed(variant, rng):
    """A dense mask that is not symmetric (Tq = Tkv, so a kernel reading mask[kv, q] instead
    of mask[q, kv] would run, and fail). Several blocks each way, GQA with a per-head mask."""
    t, h, hkv = 16, 2, 1
    block, spec = make_block(rng, MaskSpec(dense=True), tq=t, tkv=t, heads=(h, hkv), q_offset=0)
    dense = jnp.asarray(rng.random((1, h, t, t)) < 0.5)
    assert not np.array_equal(dense, np.swapaxes(dense, 2, 3))
    block = block.replace(mask=dense)
    check_kernel(PallasKernel(variant, block_q=8, block_kv=4), block, spec, rng, 1e-5)


def test_block_table_causal_is_exact():
    """Causal, nb × nb blocks: nb(nb+1)/2 computed, the nb diagonal ones partial."""
    nb, blk = 5, 4
    pos = jnp.arange(nb * blk, dtype=jnp.int32)[None]
    table = np.asarray(block_table(MaskSpec(causal=True), pos, pos, blk, blk))
    assert table.shape == (1, 1, nb, nb)
    assert (table != BlockKind.SKIP).sum() == nb * (nb + 1) // 2
    assert (table == BlockKind.PARTIAL).sum() == nb
    np.testing.assert_array_equal(np.diag(table[0, 0]), BlockKind.PARTIAL)
    assert (table[0, 0][np.tril_indices(nb, -1)] == BlockKind.FULL).all()


@pytest.mark.slow
def test_block_table_segments_dense_window_and_padding():
    S, F, P = BlockKind.SKIP, BlockKind.FULL, BlockKind.PARTIAL  # one letter per table entry
    pos = jnp.arange(8, dtype=jnp.int32)[None]
    seg = jnp.array([[0, 0, 0, 0, 1, 1, 1, 1]], jnp.int32)
    table = block_table(MaskSpec(segments=True), pos, pos, 4, 4, q_seg=seg, kv_seg=seg)
    np.testing.assert_array_equal(table[0, 0], [[F, S], [S, F]])
    # Window (2, 2): blocks 2 apart never meet; neighbours are partial.
    pos12 = jnp.arange(12, dtype=jnp.int32)[None]
    table = block_table(MaskSpec(window=(2, 2)), pos12, pos12, 4, 4)
    np.testing.assert_array_equal(table[0, 0], [[P, P, S],
                                                [P, P, P],
                                                [S, P, P]])
    # Dense tiles: all False → skip, all True → full, per head; padding is never full.
    dense = jnp.zeros((1, 2, 8, 6), bool).at[:, 0, :4, :4].set(True).at[:, 1, 4:, :].set(True)
    table = block_table(MaskSpec(dense=True), pos, pos[:, :6], 4, 4, mask=dense)
    np.testing.assert_array_equal(table[0], [[[F, S], [S, S]],
                                             [[S, S], [F, P]]])
    full = block_table(MaskSpec(), pos, pos[:, :6], 4, 4)
    np.testing.assert_array_equal(full[0, 0], [[F, P], [F, P]])
    ragged_q = block_table(MaskSpec(), pos[:, :6], pos, 4, 4)
    np.testing.assert_array_equal(ragged_q[0, 0], [[F, F], [P, P]])


def test_auto_is_xla_on_cpu_and_pallas_is_registered():
    assert get_kernel("auto").name == ("xla" if jax.default_backend() == "cpu" else "pallas")
    assert isinstance(get_kernel("pallas"), PallasKernel)


@pytest.fixture(scope="module")
def tiny_llama():
    cfg = llama.Config(vocab=32, dim=16, layers=1, heads=4, kv_heads=2, mlp_dim=32)
    params, tokens = llama.example_args(cfg, batch=1, seq=16, seed=2)
    loss = lambda p, t: llama.loss(p, t, cfg)  # noqa: E731
    return loss, params, tokens, jax.jit(jax.value_and_grad(loss))(params, tokens)


@pytest.mark.slow
@pytest.mark.parametrize("schedule,load_balance,variant", [
    ("ring", "zigzag", "tpu"), ("ulysses", "none", "gpu")])
def test_context_parallel_with_pallas(tiny_llama, schedule, load_balance, variant,
                                      monkeypatch):
    monkeypatch.setenv("CPTRANSFORM_PALLAS_VARIANT", variant)
    loss, params, tokens, (ref_loss, ref_grads) = tiny_llama
    f = context_parallel(loss, cp=4, schedule=schedule, load_balance=load_balance,
                         kernel="pallas")
    value, grads = jax.jit(jax.value_and_grad(f))(params, tokens)
    np.testing.assert_allclose(value, ref_loss, rtol=1e-5)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        scale = float(jnp.max(jnp.abs(r))) or 1.0
        assert float(jnp.max(jnp.abs(g - r))) <= 1e-5 * scale


def _window_block(rng, **options):
    """16 × 16 tokens, window (2, 2) in 4 × 4 tiles: each row visits 2 or 3 tiles and skips
    the rest, on both sides of the band."""
    return make_block(rng, MaskSpec(window=(2, 2)), tq=16, tkv=16, q_offset=0, **options)


def test_skipped_tpu_steps_fetch_the_block_already_held(rng):
    """Every grid step of the TPU kernels fetches, by its index map, the tile
    ``fetch_order`` names: a visited tile itself, a skipped one the last visited tile of its
    row (the first one at a row's start). So the K/V block index changes only at visited
    tiles: as many DMAs as visited tiles, in the forward (along keys) and in dK/dV (along
    the G·nq query blocks of a KV head)."""
    block, spec = _window_block(rng, heads=(4, 2))
    ops = prepare(block, spec, 4, 4)
    for table in (ops.table, pallas_tpu.kv_major_table(ops.table, ops.groups, 2)):
        table = np.asarray(table)
        fetch = np.asarray(fetch_order(table))
        fetched = pallas_tpu.fetched_tile(table.shape)
        for b, h, i in np.ndindex(*table.shape[:3]):
            row = table[b, h, i]
            visited = np.flatnonzero(row != BlockKind.SKIP)
            steps = [int(fetched(b, h, i, j, None, fetch.reshape(-1)))
                     for j in range(row.size)]
            for j, step in enumerate(steps):
                before = visited[visited <= j]
                want = before[-1] if before.size else visited[0]
                assert step == want, (b, h, i, j, steps, row)
            changes = 1 + sum(a != c for a, c in zip(steps, steps[1:]))
            assert changes == visited.size
        assert (table == BlockKind.SKIP).any()


def test_kv_major_table_is_the_forward_table_transposed(rng):
    """A per-head dense mask of 4 query heads over 2 KV heads."""
    dense = rng.random((1, 4, 16, 16)) < 0.5
    dense[..., :4, 4:8] = False
    table = np.asarray(block_table(MaskSpec(dense=True), *[jnp.arange(16)[None]] * 2, 4, 4,
                                   mask=jnp.asarray(dense)))
    assert table.shape == (1, 4, 4, 4)
    kv_major = np.asarray(pallas_tpu.kv_major_table(table, 2, 2))
    for hk, j, r in np.ndindex(2, 4, 8):
        assert kv_major[0, hk, j, r] == table[0, hk * 2 + r // 4, r % 4, j]


# The GPU kernels' loop structure (a run of full tiles without branch, then the edges by
# the table, skipped tiles loading nothing) is tested in test_pallas_gpu_loops.py.
