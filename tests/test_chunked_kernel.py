"""The chunked XLA kernel: forward and every gradient against the reference block
(``attention_reference.attend`` and its autodiff), for every mask kind, head sharing,
Dv ≠ D, odd lengths, chunks that do not divide the length, bf16; and the pair
classification counted exactly."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import fast_every
from schedule_cases import make_case, relative_error

from cptransform.lowering.block import Block
from cptransform.lowering.kernels import get_kernel
from cptransform.analysis.block_work import chunk_size
from cptransform.lowering.kernels.chunked import ChunkedKernel, chunk_kinds, executed_fraction
from cptransform.op.attention_reference import attend, attention_reference, merge, split_operands
from cptransform.op.attention_spec import AttentionSpec, Layout, MaskSpec
from cptransform.op.mask_terms import BlockKind

BTHD = Layout.parse("BTHD")
HEADS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)}
KINDS = {
    "none": MaskSpec(), "causal": MaskSpec(causal=True), "window": MaskSpec(window=(3, 2)),
    "causal_window": MaskSpec(causal=True, window=(4, None)),
    "segments": MaskSpec(segments=True), "dense": MaskSpec(dense=True),
    "dense_causal": MaskSpec(causal=True, dense=True), "bias": MaskSpec(bias=True),
    "softcap": MaskSpec(causal=True), "everything": MaskSpec(
        causal=True, window=(6, None), segments=True, dense=True, bias=True)}


def problem(rng, kind, heads, *, tq=13, tkv=11, d=8, dv=12, batch=2, dtype=jnp.float32,
            dense_heads=True):
    """A random block (queries at positions 3…, keys at 0…) and its spec."""
    h, hkv = HEADS[heads]
    mspec = KINDS[kind]
    normal = lambda *s: jnp.asarray(rng.normal(size=s), dtype)  # noqa: E731
    q_pos, kv_pos = jnp.arange(tq, dtype=jnp.int32)[None] + 3, jnp.arange(tkv, dtype=jnp.int32)[None]
    block = Block(normal(batch, tq, h, d), normal(batch, tkv, hkv, d), normal(batch, tkv, hkv, dv),
                  q_pos, kv_pos)
    if mspec.segments:
        seg = lambda t: jnp.asarray(np.sort(rng.integers(0, 3, (batch, t)), axis=1), jnp.int32)  # noqa: E731
        block = block.replace(q_seg=seg(tq), kv_seg=seg(tkv))
    mh = h if dense_heads else 1
    if mspec.dense:
        mask = rng.random((batch, mh, tq, tkv)) < 0.6
        mask[:, :, min(2, tq - 1)] = False  # a row that sees no key
        block = block.replace(mask=jnp.asarray(mask))
    if mspec.bias:
        block = block.replace(bias=normal(1, mh, tq, tkv))
    spec = AttentionSpec(q=BTHD, k=BTHD, v=BTHD, scale=1.0 / math.sqrt(d), groups=h // hkv,
                         softcap=2.5 if kind == "softcap" else None, mask=mspec)
    return block, spec


def reference(block, spec):
    return attend(spec, block.q, block.k, block.v, block.q_pos, block.kv_pos,
                  bias=block.bias, **block.term_operands())


def check(block, spec, kernel, tol):
    """Forward against ``attend``; the kernel backward against ``jax.vjp`` of ``attend``."""
    rng = np.random.default_rng(1)
    o, lse = jax.jit(lambda b: kernel.forward(b, spec))(block)
    o_ref, lse_ref = reference(block, spec)
    assert o.dtype == jnp.float32 and o.shape == o_ref.shape and lse.shape == lse_ref.shape
    assert relative_error(o, o_ref) <= tol
    finite = np.isfinite(np.asarray(lse_ref))
    assert np.array_equal(np.isfinite(np.asarray(lse)), finite)
    assert relative_error(jnp.where(finite, lse, 0), jnp.where(finite, lse_ref, 0)) <= tol

    do = jnp.asarray(rng.normal(size=o_ref.shape), jnp.float32)
    dlse = jnp.where(finite, jnp.asarray(rng.normal(size=lse_ref.shape), jnp.float32), 0.0)

    def ref_fwd(q, k, v, bias):
        return reference(block.replace(q=q, k=k, v=v, bias=bias), spec)

    _, vjp = jax.vjp(ref_fwd, block.q, block.k, block.v, block.bias)
    want = vjp((do, dlse))
    got = jax.jit(lambda b, o, lse, do, dlse: kernel.backward(b, o, lse, do, spec, dlse=dlse))(
        block, o_ref, lse_ref, do, dlse)
    for name, g, w in zip(("dq", "dk", "dv", "dbias"), got, want):
        if w is None:
            assert g is None, name
            continue
        assert g.shape == w.shape, name
        assert relative_error(g, w.astype(jnp.float32)) <= tol, name


# Every third mask kind in the fast tier (the schedule tests' fast slices run others).
@pytest.mark.parametrize("kind,heads", [
    pytest.param(kind, list(HEADS)[i % 3], marks=() if i % 3 == 0 else pytest.mark.slow)
    for i, kind in enumerate(KINDS)])
@pytest.mark.slow
def test_matches_reference(rng, kind, heads):
    block, spec = problem(rng, kind, heads)
    check(block, spec, ChunkedKernel(chunk=4), 1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("tq,tkv,chunk", [(16, 16, 4), (17, 9, 5), (7, 23, 8), (1, 5, 2),
                                          (12, 12, 512)])
def test_lengths_and_chunks(rng, tq, tkv, chunk):
    """Odd lengths, chunks that do not divide them, a single chunk and single queries."""
    block, spec = problem(rng, "everything", "gqa", tq=tq, tkv=tkv)
    check(block, spec, ChunkedKernel(chunk=chunk), 1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["causal", "dense", "bias"])
def test_bfloat16(rng, kind):
    block, spec = problem(rng, kind, "gqa", dtype=jnp.bfloat16, dense_heads=False)
    check(block, spec, ChunkedKernel(chunk=4), 2e-2)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["causal", "segments", "dense_causal", "bias"])
def test_equals_attention_reference(rng, kind):
    """The registered "xla" kernel on a whole problem equals ``attention_reference``."""
    case = make_case(rng, kind, "gqa", seq=24, dv=12)
    a = split_operands(case.spec, case.operands)
    pos = jnp.arange(24, dtype=jnp.int32)[None]
    block = Block(a["q"], a["k"], a["v"], pos, pos, a["q_segment_ids"], a["kv_segment_ids"],
                  a["mask"], a["bias"])
    o, _ = ChunkedKernel(chunk=8).forward(block, case.spec.replace(positions=True))
    assert relative_error(o, attention_reference(*case.operands, spec=case.spec)) <= 1e-5
    assert get_kernel("xla").name == get_kernel("auto").name == "xla"
    assert isinstance(get_kernel("xla"), ChunkedKernel)


@pytest.mark.slow
def test_nan_propagates_and_empty_rows_are_decided_by_the_mask(rng):
    """A NaN query gives NaN in its row (not an "empty" row), a row whose mask excludes
    every key gives o = 0 and lse = -inf, and the other rows stay finite."""
    block, spec = problem(rng, "dense", "mha")
    block = block.replace(q=block.q.at[0, 5, 1].set(jnp.nan))
    o, lse = ChunkedKernel(chunk=4).forward(block, spec)
    assert np.all(np.isnan(np.asarray(o[0, 5, 1]))) and np.isnan(float(lse[0, 1, 5]))
    assert np.all(np.asarray(o[:, 2]) == 0) and np.all(np.asarray(lse[:, :, 2]) == -np.inf)
    others = np.delete(np.asarray(o[1]), 2, axis=0)
    assert np.all(np.isfinite(others))


@pytest.mark.parametrize("nb", fast_every([2, 4, 8, 16], 3))
def test_causal_classification_counts(nb):
    """Causal on nb × nb chunks: nb(nb+1)/2 pairs computed, the nb diagonal ones partial."""
    t = 4 * nb
    pos = jnp.arange(t, dtype=jnp.int32)[None]
    block = Block(jnp.zeros((1, t, 1, 2)), jnp.zeros((1, t, 1, 2)), jnp.zeros((1, t, 1, 2)),
                  pos, pos)
    spec = AttentionSpec(q=BTHD, k=BTHD, v=BTHD, scale=1.0, mask=MaskSpec(causal=True))
    kinds = np.asarray(chunk_kinds(block, spec, 4))
    assert kinds.shape == (nb, nb)
    assert np.sum(kinds != BlockKind.SKIP) == nb * (nb + 1) // 2
    assert np.sum(kinds == BlockKind.PARTIAL) == nb
    assert np.all(np.diag(kinds) == BlockKind.PARTIAL)
    assert np.all(kinds[np.tril_indices(nb, -1)] == BlockKind.FULL)
    assert float(executed_fraction(block, spec, 4)) == pytest.approx((nb + 1) / (2 * nb))


def test_classification_of_other_masks():
    """Window, segments and dense tiles; padded keys are never FULL."""
    pos = jnp.arange(8, dtype=jnp.int32)[None]
    z = jnp.zeros((1, 8, 1, 2))
    spec = lambda **m: AttentionSpec(q=BTHD, k=BTHD, v=BTHD, scale=1.0,  # noqa: E731
                                     mask=MaskSpec(**m))
    window = chunk_kinds(Block(z, z, z, pos, pos), spec(window=(1, 1)), 2)
    assert np.array_equal(np.asarray(window), [[1, 2, 0, 0], [2, 1, 2, 0], [0, 2, 1, 2],
                                               [0, 0, 2, 1]])
    seg = jnp.asarray([[0, 0, 0, 0, 1, 1, 2, 2]])
    segments = chunk_kinds(Block(z, z, z, pos, pos, seg, seg), spec(segments=True), 2)
    assert np.array_equal(np.asarray(segments), [[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0],
                                                 [0, 0, 0, 1]])
    dense = jnp.zeros((1, 1, 8, 8), bool).at[:, :, :2, :2].set(True).at[0, 0, 7, 0].set(True)
    kinds = chunk_kinds(Block(z, z, z, pos, pos, mask=dense), spec(dense=True), 2)
    assert np.asarray(kinds)[0, 0] == BlockKind.FULL
    assert np.asarray(kinds)[3, 0] == BlockKind.PARTIAL
    assert np.sum(np.asarray(kinds) != BlockKind.SKIP) == 2
    z7 = jnp.zeros((1, 7, 1, 2))
    padded = chunk_kinds(Block(z7, z7, z7, pos[:, :7], pos[:, :7]), spec(), 4)
    assert np.array_equal(np.asarray(padded), [[1, 2], [1, 2]])


def test_chunk_size():
    assert chunk_size(2048, 256) == 256 and chunk_size(256, 256) == 128
    assert chunk_size(24, 512) == 12 and chunk_size(31, 512) == 31
    assert chunk_size(31, 8) == 8 and chunk_size(12, 4) == 3 and chunk_size(1, 4) == 1


@pytest.mark.parametrize("kind,heads", [("dense", "gqa"), pytest.param(
    "everything", "mqa", marks=pytest.mark.slow)])
def test_running_partials_are_merged_and_summed_in_place(rng, kind, heads):
    """The kernel contract's running arguments: ``forward(..., running=(o, lse))`` equals
    :func:`merge` of that partial with the block's own result (empty, NaN and finite running
    rows, rows this block leaves empty), and ``backward(..., dq=, dk=, dv=)`` equals the
    running sums plus the block's gradients."""
    block, spec = problem(rng, kind, heads)
    kernel = ChunkedKernel(chunk=4)
    b, tq, h, dv = block.q.shape[0], block.q.shape[1], block.q.shape[2], block.v.shape[3]
    lse0 = jnp.asarray(rng.normal(size=(b, h, tq)), jnp.float32)
    lse0 = lse0.at[:, :, 0].set(-jnp.inf).at[0, 1, 4].set(jnp.nan)
    o0 = jnp.asarray(rng.normal(size=(b, tq, h, dv)), jnp.float32).at[:, 0].set(0.0)
    got = jax.jit(lambda blk, o, lse: kernel.forward(blk, spec, running=(o, lse)))(
        block, o0, lse0)
    want = merge(o0, lse0, *kernel.forward(block, spec))
    for g, w in zip(got, want):
        g, w = np.asarray(g), np.asarray(w)
        assert np.array_equal(np.isnan(g), np.isnan(w))
        assert np.array_equal(np.isinf(g), np.isinf(w))
        finite = np.isfinite(w)
        np.testing.assert_allclose(g[finite], w[finite], rtol=1e-5, atol=1e-6)

    o, lse = reference(block, spec)
    do = jnp.asarray(rng.normal(size=o.shape), jnp.float32)
    sums = [jnp.asarray(rng.normal(size=x.shape), jnp.float32) for x in (block.q, block.k, block.v)]
    fresh = kernel.backward(block, o, lse, do, spec)
    summed = jax.jit(lambda blk, o, lse, do, dq, dk, dv: kernel.backward(
        blk, o, lse, do, spec, dq=dq, dk=dk, dv=dv))(block, o, lse, do, *sums)
    for name, g, s, f in zip(("dq", "dk", "dv"), summed, sums, fresh):
        assert relative_error(g, s + f) <= 1e-6, name


@pytest.mark.parametrize("kind,heads", [("causal", "gqa"), pytest.param(
    "everything", "mha", marks=pytest.mark.slow)])
def test_backward_is_linear_in_the_output_cotangent(rng, kind, heads):
    """Forward mode transposes the program's VJP (``cptransform.api.forward_mode``), so the
    kernel backward must be linear in ``dO`` (nothing read off it by a comparison, such as
    the NaN flags of skipped pairs): ``jax.linear_transpose`` traces it, and the transpose
    is its adjoint, ``<B·dO, t> = <dO, Bᵀ·t>``."""
    block, spec = problem(rng, kind, heads, tq=16, tkv=16)
    kernel = ChunkedKernel(chunk=4)
    o, lse = reference(block, spec)
    assert (chunk_kinds(block, spec, 4) == BlockKind.SKIP).any()

    def grads(do):
        return kernel.backward(block, o, lse, do, spec)[:3]

    do = jnp.asarray(rng.normal(size=o.shape), jnp.float32)
    t = tuple(jnp.asarray(rng.normal(size=x.shape), jnp.float32)
              for x in (block.q, block.k, block.v))
    (transposed,) = jax.jit(jax.linear_transpose(grads, do))(t)
    forward = sum(jnp.vdot(g, x) for g, x in zip(jax.jit(grads)(do), t))
    np.testing.assert_allclose(jnp.vdot(do, transposed), forward, rtol=1e-4)
