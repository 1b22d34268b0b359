"""Top-k sparse attention (DeepSeek V3.2 style): indices instead of an S×S mask.

The reference against the dense mask a scatter builds, the matcher turning that scatter
into ``topk_indices``, every schedule × layout against one device (forward and the
gradients of q, k, v and the indexer's parameters), the chunked kernel's block skipping,
top-k larger than the causal keys, duplicate indices, and the indexer (indices or its dense
data mask) through the Pallas kernels. The XLA kernel's gather path (``topk_gather``: the
k picks of each query, not the keys): against the reference with every other mask operand,
NaN and Inf of keys it never reads, no ``[Tq, Tkv]`` array, repeated key positions, and
under every schedule with cp=8.
"""
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from conftest import make_mesh
from cptransform import attention, context_parallel
from cptransform.ir.module import iter_eqns
from cptransform.lowering.block import Block
from cptransform.lowering.context_parallel_attention import context_parallel_attention
from cptransform.lowering.kernels import topk_gather
from cptransform.lowering.kernels.chunked import ChunkedKernel, chunk_kinds
from cptransform.op.attention import attention_p
from cptransform.op.attention_reference import attend
from cptransform.op.attention_spec import AttentionSpec, Layout, MaskSpec
from cptransform.op.layouts import SequenceLayout
from cptransform.op.mask_terms import BlockKind
from test_match_support import assert_close, randn, rewrite, specs

B, S, H, D, HI, DI, K = 1, 64, 8, 8, 2, 8, 8
RTOL = 1e-5


def scatter_mask(idx, s=None):
    """The dense mask ``zeros.at[b, q, idx].set(True)`` of indices ``[b, q, k]`` (``s``
    keys; default: as many as queries)."""
    b, q = idx.shape[:2]
    s = q if s is None else s
    return jnp.zeros((b, q, s), bool).at[
        jnp.arange(b)[:, None, None], jnp.arange(q)[None, :, None], idx].set(True)


def indexer(x_q, x_k, w):
    """DeepSeek's lightning indexer: ``sum_h w_h · relu(q_h · k)``, causal (``-inf``)."""
    s = x_q.shape[1]
    scores = jnp.einsum("bshd,btd->bsht", x_q, x_k)
    scores = jnp.sum(jax.nn.relu(scores) * w[..., None], axis=2)
    causal = jnp.arange(s)[:, None] >= jnp.arange(s)[None, :]
    return jnp.where(causal, scores, -jnp.inf), causal


def sparse_loss(q, k, v, qi, ki, w, top=K, dense=False):
    """Sparse attention picked by the indexer, plus the indexer's auxiliary loss (KL from
    the main attention's head-summed distribution, held constant, to the indexer's).

    ``dense``: the indexer's mask as data (``scores`` at or above the row's ``top``-th
    largest), which stays a dense ``[B, S, S]`` mask operand instead of indices."""
    s, h, d = q.shape[1:]
    scores, causal = indexer(qi, ki, w)
    if dense:
        kth = lax.top_k(scores, top)[0][..., -1:]
        mask = (scores >= kth) & causal
    else:
        mask = scatter_mask(lax.top_k(scores, top)[1]) & causal
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) * d ** -0.5
    p = jax.nn.softmax(jnp.where(mask[:, None], logits, -jnp.inf), axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", p, v)
    full = jax.nn.softmax(jnp.where(causal, logits, -jnp.inf), axis=-1)
    target = lax.stop_gradient(jnp.sum(full, axis=1) / h)
    log_p = jax.nn.log_softmax(scores, axis=-1)
    aux = -jnp.sum(jnp.where(causal, target * log_p, 0.0)) / s
    return jnp.sum(jnp.sin(out)) + aux


def inputs(rng, s=S, h=H):
    shapes = [(B, s, h, D)] * 3 + [(B, s, HI, DI), (B, s, DI), (B, s, HI)]
    return tuple(randn(rng, *s) for s in shapes)


def relative(got, want):
    return float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))


@pytest.mark.slow
@pytest.mark.parametrize("k", [5, 2 * S])  # 2·S: more indices than keys, duplicates galore
def test_reference_matches_dense_mask(rng, k):
    q, kk, v = (randn(rng, 2, 16, 2, D) for _ in range(3))
    idx = jnp.asarray(rng.integers(0, 16, (2, 1, 16, k)), jnp.int32)
    dense = scatter_mask(idx[:, 0], 16)[:, None]

    def both(q, kk, v):
        return (attention(q, kk, v, topk_indices=idx, causal=True),
                attention(q, kk, v, mask=dense, causal=True))

    sparse, masked = both(q, kk, v)
    assert_close(sparse, masked, RTOL)
    grads = jax.grad(lambda *a: jnp.sum(jnp.sin(both(*a)[0])), argnums=(0, 1, 2))(q, kk, v)
    want = jax.grad(lambda *a: jnp.sum(jnp.sin(both(*a)[1])), argnums=(0, 1, 2))(q, kk, v)
    jax.tree.map(lambda g, w: assert_close(g, w, RTOL), grads, want)


@pytest.mark.slow
def test_matcher_carries_indices_not_a_mask(rng):
    args = inputs(rng)
    module = rewrite(sparse_loss, *args)
    (spec,) = specs(module)
    assert spec.mask.topk and spec.mask.causal and not spec.mask.dense
    (eqn,) = [e for e in module.jaxpr.jaxpr.eqns if e.primitive is attention_p]
    square = [a for a in eqn.invars if a.aval.dtype == jnp.bool_ or a.aval.shape[-2:] == (S, S)]
    assert not square, f"an S×S operand is left on attention_p: {square}"
    topk = dict(zip(spec.operand_names(), eqn.invars))["topk_indices"]
    assert topk.aval.shape[-2:] == (S, K) and topk.aval.dtype == jnp.int32
    assert_close(jax.jit(module.as_function())(*args), sparse_loss(*args), RTOL)


@pytest.mark.slow
def test_scatter_of_other_indices_stays_dense(rng):
    """Indices that are not a top-k's (here an input: any value, negative or out of range)
    keep the scatter as a dense mask."""
    q, k, v = (randn(rng, B, S, 2, D) for _ in range(3))
    idx = jnp.asarray(rng.integers(0, S, (B, S, 3)), jnp.int32)

    def fn(q, k, v, idx):
        mask = scatter_mask(idx) & (jnp.arange(S)[:, None] >= jnp.arange(S)[None, :])
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k)
        p = jax.nn.softmax(jnp.where(mask[:, None], logits, -jnp.inf), axis=-1)
        return jnp.einsum("bhqk,bkhd->bqhd", p, v)

    module = rewrite(fn, q, k, v, idx)
    (spec,) = specs(module)
    assert spec.mask.dense and not spec.mask.topk
    assert_close(jax.jit(module.as_function())(q, k, v, idx), fn(q, k, v, idx), RTOL)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["none", "zigzag"])
@pytest.mark.parametrize("schedule", ["ring", "allgather", "ulysses"])
def test_schedules_match_one_device(rng, schedule, layout):
    args = inputs(rng)
    fn = context_parallel(cp=8, schedule=schedule, load_balance=layout, kernel="xla")(
        sparse_loss)
    assert relative(fn(*args), sparse_loss(*args)) <= RTOL
    got = jax.grad(fn, argnums=tuple(range(6)))(*args)
    want = jax.grad(sparse_loss, argnums=tuple(range(6)))(*args)
    for name, g, w in zip(("q", "k", "v", "q_index", "k_index", "w_index"), got, want):
        assert relative(g, w) <= RTOL, (name, relative(g, w))
    assert "topk" in fn.explain(*args)


@pytest.mark.slow
def test_more_indices_than_causal_keys(rng):
    """k = 24 > the causal keys of the first 23 queries: top_k then picks masked (-inf)
    keys, which the causal part keeps hidden."""
    args = inputs(rng)
    fn = context_parallel(cp=8, schedule="ring", load_balance="zigzag")(
        lambda *a: sparse_loss(*a, top=24))
    want = sparse_loss(*args, top=24)
    assert relative(fn(*args), want) <= RTOL
    got = jax.grad(fn, argnums=(0, 3))(*args)
    ref = jax.grad(lambda *a: sparse_loss(*a, top=24), argnums=(0, 3))(*args)
    assert all(relative(g, w) <= RTOL for g, w in zip(got, ref))


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_duplicate_indices_under_the_ring(rng, mesh8, layout):
    q, k, v = (randn(rng, B, S, 2, D) for _ in range(3))
    idx = jnp.asarray(rng.integers(0, S, (B, 1, S, 4)), jnp.int32)
    idx = jnp.concatenate([idx, idx[..., :2]], axis=-1)  # every row repeats two indices
    spec = jax.make_jaxpr(lambda *a: attention(*a, topk_indices=idx, causal=True))(
        q, k, v).eqns[-1].params["spec"]

    def sharded(q, k, v):
        return context_parallel_attention(q, k, v, idx, spec=spec, mesh=mesh8, axes="cp",
                                          schedule="ring", layout=layout)

    def dense(q, k, v):
        return attention(q, k, v, mask=scatter_mask(idx[:, 0])[:, None], causal=True)

    # Under jit: op-by-op dispatch of eight ring steps and their transpose takes minutes.
    assert relative(jax.jit(sharded)(q, k, v), dense(q, k, v)) <= RTOL
    got = jax.jit(jax.grad(lambda *a: jnp.sum(jnp.sin(sharded(*a))), argnums=(0, 1, 2)))(q, k, v)
    want = jax.grad(lambda *a: jnp.sum(jnp.sin(dense(*a))), argnums=(0, 1, 2))(q, k, v)
    assert all(relative(g, w) <= RTOL for g, w in zip(got, want))


@pytest.mark.slow
def test_chunked_kernel_skips_chunks_no_index_falls_in(rng):
    q, k, v = (randn(rng, 1, 32, 2, D) for _ in range(3))
    pos = jnp.arange(32, dtype=jnp.int32)[None]
    # Every query picks keys 0..3 and itself: key chunks of 8 between hold no index
    # for the queries of other chunks.
    idx = jnp.concatenate([jnp.broadcast_to(jnp.arange(4), (32, 4)), pos[0][:, None]], -1)
    block = Block(q=q, k=k, v=v, q_pos=pos, kv_pos=pos, topk=idx[None, None].astype(jnp.int32))
    spec = jax.make_jaxpr(lambda *a: attention(*a, topk_indices=idx[None, None]))(
        q, k, v).eqns[-1].params["spec"].replace(positions=True)
    kinds = np.asarray(chunk_kinds(block, spec, target=8))
    empty = kinds == BlockKind.SKIP
    assert empty.sum() == 9  # of 4×4 chunks only column 0 and the diagonal are needed
    assert not empty[:, 0].any() and not np.diag(empty).any()
    o, lse = ChunkedKernel(chunk=8).forward(block, spec)
    o_ref, lse_ref = attend(spec, q, k, v, pos, pos, topk=block.topk)
    assert_close(o, o_ref, RTOL)
    assert_close(lse, lse_ref, RTOL)


#: The indexer through ``kernel="pallas"``: (schedule, layout, variant, mask form), a mesh
#: of 2 (hybrid: 2 × 2) over 16 tokens. The ring meets every layout, the other schedules
#: one each; the variants and the mask forms (indices, or the indexer's dense data mask)
#: alternate. Interpreted Pallas takes about a minute a case, so all are slow-tier; the
#: fast tier has the kernel-level test below.
PALLAS_CASES = [("ring", "none", "tpu", "topk"), ("ring", "zigzag", "gpu", "dense"),
                ("ring", "striped", "tpu", "dense"), ("allgather", "striped", "gpu", "topk"),
                ("ulysses", "zigzag", "tpu", "topk"), ("hybrid", "none", "gpu", "topk")]


@pytest.mark.slow
@pytest.mark.parametrize("schedule,layout,variant,form", PALLAS_CASES)
def test_pallas_indexer_matches_one_device(rng, monkeypatch, schedule, layout, variant, form):
    """Forward and the gradients of q, k, v and the indexer's parameters (its auxiliary loss
    path) on the Pallas kernels (interpret mode) against one device."""
    monkeypatch.setenv("CPTRANSFORM_PALLAS_VARIANT", variant)
    args = inputs(rng, s=16, h=2)
    loss = lambda *a: sparse_loss(*a, top=4, dense=form == "dense")  # noqa: E731
    mesh = make_mesh((2, 2), ("uly", "ring")) if schedule == "hybrid" else make_mesh((2,), ("cp",))
    fn = context_parallel(mesh=mesh, axis=tuple(mesh.axis_names), schedule=schedule,
                          load_balance=layout, kernel="pallas")(loss)
    assert relative(fn(*args), loss(*args)) <= RTOL
    got = jax.grad(fn, argnums=tuple(range(6)))(*args)
    want = jax.grad(loss, argnums=tuple(range(6)))(*args)
    for name, g, w in zip(("q", "k", "v", "q_index", "k_index", "w_index"), got, want):
        assert relative(g, w) <= RTOL, (name, relative(g, w))
    assert ("topk" if form == "topk" else "dense") in fn.explain(*args)


@pytest.mark.slow
def test_deepseek_example_matches_one_device():
    """``examples/deepseek_sparse.py``'s check at its smallest size (one zigzag chunk per
    device half, top-k larger than most rows' causal keys)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from examples import deepseek_sparse

    assert deepseek_sparse.demo(seq=16, batch=1, schedule="ring")


@pytest.mark.slow
def test_hybrid_matches_one_device(rng):
    args = inputs(rng)
    mesh = make_mesh((2, 4), ("uly", "ring"))
    fn = context_parallel(mesh=mesh, axis=("uly", "ring"), schedule="hybrid",
                          load_balance="zigzag")(sparse_loss)
    assert relative(fn(*args), sparse_loss(*args)) <= RTOL
    got = jax.grad(fn, argnums=tuple(range(6)))(*args)
    want = jax.grad(sparse_loss, argnums=tuple(range(6)))(*args)
    assert all(relative(g, w) <= RTOL for g, w in zip(got, want))


def test_pallas_table_skips_tiles_no_index_reaches(rng):
    """The Pallas kernels' block table of a top-k mask (with causal, odd lengths, 4 × 4
    tiles): key blocks no index reaches are skipped, and the selection the kernels read is
    the reference's. (The numbers through the kernels: the schedule matrix above.)"""
    from cptransform.lowering.kernels.pallas_operands import prepare
    from cptransform.op.attention_reference import selected

    q, k, v = randn(rng, 1, 13, 2, D), randn(rng, 1, 11, 1, D), randn(rng, 1, 11, 1, D)
    q_pos = jnp.arange(13, dtype=jnp.int32)[None] + 3
    kv_pos = jnp.arange(11, dtype=jnp.int32)[None]
    idx = jnp.asarray(rng.integers(0, 4, (1, 2, 13, 2)), jnp.int32).at[..., 1, 0].set(5)
    block = Block(q=q, k=k, v=v, q_pos=q_pos, kv_pos=kv_pos, topk=idx)
    spec = jax.make_jaxpr(lambda *a: attention(*a, topk_indices=idx, causal=True))(
        q, k, v).eqns[-1].params["spec"].replace(positions=True)
    ops = prepare(block, spec, 4, 4)
    table = np.asarray(ops.table)
    # Key blocks 1 and 2 hold no index but the 5 of query block 0's second row.
    assert table.shape == (1, 1, 4, 3) and (table[0, 0, :, 1:] == BlockKind.SKIP).sum() == 7
    assert not (table[0, 0, :, 0] == BlockKind.SKIP).any()
    np.testing.assert_array_equal(np.asarray(ops.picked[..., :13, :11]) != 0,
                                  np.asarray(selected(idx, kv_pos)))


# The gather path (lowering/kernels/topk_gather.py): each query's picks looked up among a
# call's keys, logits over the k picks only, dK/dV scatter-added. Against the reference's
# dense mask: forward, and the VJP of ``o`` (the dense backward's formulas) for q, k, v, bias.

BTHD = Layout.parse("BTHD")


def gather_case(rng, *, b=2, tq=37, tkv=50, heads=(4, 2), k=6, per_head=False, terms=(),
                softcap=None):
    """``(block, spec)``: random data, shuffled key positions (no layout keeps one range),
    query positions around them, picks that repeat, fall outside the keys (negative, past
    the last) and past the causal range."""
    h, hkv = heads
    q, kk, v = randn(rng, b, tq, h, D), randn(rng, b, tkv, hkv, D), randn(rng, b, tkv, hkv, D + 2)
    kv_pos = jnp.asarray(rng.permutation(tkv) + 3, jnp.int32)[None]
    q_pos = jnp.asarray(rng.integers(0, tkv + 6, (1, tq)), jnp.int32)
    idx = rng.integers(-2, tkv + 6, (b, h if per_head else 1, tq, k))
    idx[..., -1] = idx[..., 0]
    extra = {}
    if "segments" in terms:
        extra.update(q_seg=jnp.asarray(rng.integers(0, 2, (b, tq)), jnp.int32),
                     kv_seg=jnp.asarray(rng.integers(0, 2, (b, tkv)), jnp.int32))
    if "bias" in terms:
        extra["bias"] = randn(rng, 1, h, tq, tkv)
    if "dense" in terms:
        extra["mask"] = jnp.asarray(rng.random((b, 1, tq, tkv)) < 0.7)
    block = Block(q=q, k=kk, v=v, q_pos=q_pos, kv_pos=kv_pos, topk=jnp.asarray(idx, jnp.int32),
                  **extra)
    mask = MaskSpec(causal=True, topk=True, segments="segments" in terms, bias="bias" in terms,
                    dense="dense" in terms)
    spec = AttentionSpec(BTHD, BTHD, BTHD, scale=D ** -0.5, softcap=softcap, groups=h // hkv,
                         mask=mask, positions=True)
    return block, spec


def reference_step(block, spec, *diff):
    """``attend`` on ``block`` as a function of the fields ``diff`` (for its VJP)."""
    def run(*xs):
        blk = block.replace(**dict(zip(diff, xs)))
        return attend(spec, blk.q, blk.k, blk.v, blk.q_pos, blk.kv_pos, bias=blk.bias,
                      **blk.term_operands())
    return run


def assert_matches(got, want, rtol=RTOL):
    """:func:`assert_close` with infinities (``lse = -inf`` of empty rows) where ``want``
    has them; the tolerance scales with the finite entries."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    infinities = lambda x: np.where(np.isinf(x), x, 0)  # noqa: E731
    np.testing.assert_array_equal(infinities(got), infinities(want))
    finite = ~np.isinf(want)
    assert_close(got[finite], want[finite], rtol)


def check_gather(block, spec, distinct=True, do=None, kernel=None):
    """The gather kernel's forward and backward (cotangent ``do``, default random) against
    the reference. ``distinct``: the key positions never repeat, as a layout's (the kernel
    then skips its run-time check); ``kernel``: the one gathering (default the chunked XLA
    kernel)."""
    kernel = kernel or ChunkedKernel(chunk=8)
    assert topk_gather.applies(block, spec)
    if distinct:
        spec = spec.replace(kv_positions_layout=SequenceLayout("contiguous", 1, 1))
    diff = ("q", "k", "v") + (("bias",) if block.bias is not None else ())
    if do is None:
        do = randn(np.random.default_rng(1), *block.q.shape[:3], block.v.shape[-1])

    @jax.jit
    def reference(block):
        out, vjp = jax.vjp(reference_step(block, spec, *diff), *(getattr(block, n) for n in diff))
        return out, vjp((do, jnp.zeros_like(out[1])))

    (o, lse), want = reference(block)
    got_o, got_lse = jax.jit(lambda b: kernel.forward(b, spec))(block)
    assert_matches(got_o, o)
    assert_matches(got_lse, lse)
    got = jax.jit(lambda b: kernel.backward(b, o, lse, do, spec))(block)
    for g, w in zip(got, want):
        assert_matches(g, w)


def test_gather_matches_reference(rng):
    """Per-head picks, GQA 2, with every other mask operand (segment ids, a dense mask, a
    bias under a soft-cap) evaluated at the picks. (Picks shared by the heads: below.)"""
    check_gather(*gather_case(rng, per_head=True, terms=("segments", "dense", "bias"),
                              softcap=5.0))


def test_gather_keeps_nan_and_inf_as_dense(rng):
    """Picks shared by the heads, GQA 2, causal. A NaN in V and an Inf in K at keys no
    query picks, a NaN query row, an Inf in V at a key some rows see (those rows get Inf,
    the others ``0·Inf = NaN``) and an Inf in dO (the keys its row sees get Inf in dV, the
    others NaN) reach the output and the gradients as in the dense softmax, though the
    gather never reads most keys."""
    block, spec = gather_case(rng, b=1, tq=20, tkv=24, k=5)
    positions, picks = np.asarray(block.kv_pos)[0], np.asarray(block.topk)
    unpicked = np.flatnonzero(~np.isin(positions, picks))
    seen = int(np.flatnonzero(positions == picks[0, 0, -1, 0])[0])   # the last row sees it
    assert unpicked.size
    block = block.replace(v=block.v.at[0, int(unpicked[0]), 1, 3].set(jnp.nan)
                          .at[0, seen, 0, 4].set(jnp.inf),
                          k=block.k.at[0, int(unpicked[-1]), 0, 2].set(jnp.inf),
                          q=block.q.at[0, 5, 2, 1].set(jnp.nan))
    do = randn(rng, *block.q.shape[:3], block.v.shape[-1]).at[0, 19, 0, 2].set(-jnp.inf)
    check_gather(block, spec, do=do)


def test_gather_cost_follows_the_picks(rng):
    """Forward and backward build no ``[Tq, Tkv]`` array: every intermediate is sized by
    the picks or by one side."""
    block, spec = gather_case(rng, b=1, tq=96, tkv=160, k=4)
    # Key positions of a layout: no run-time check, so no sweep to fall back to.
    spec = spec.replace(kv_positions_layout=SequenceLayout("contiguous", 160, 1))
    kernel = ChunkedKernel()

    def step(b):
        o, lse = kernel.forward(b, spec)
        return kernel.backward(b, o, lse, o, spec)

    shapes = {tuple(v.aval.shape) for eqn in iter_eqns(jax.make_jaxpr(step)(block).jaxpr)
              for v in eqn.outvars}
    square = [s for s in shapes if 96 in s and 160 in s]
    assert not square, square
    assert not topk_gather.applies(block.replace(topk=block.topk[..., :1].repeat(160, -1)), spec)


@pytest.mark.slow
def test_repeated_key_positions_take_the_sweep(rng):
    """The caller's key positions may repeat (one pick then names several keys): the call
    checks at run time and sweeps, which the reference's set membership agrees with."""
    block, spec = gather_case(rng, b=1, tq=16, tkv=24, k=5)
    block = block.replace(kv_pos=block.kv_pos // 2, topk=block.topk // 2)
    check_gather(block, spec, distinct=False)


@pytest.fixture
def gathers(monkeypatch):
    """Counts the calls (traces) of the gather path's forward and backward."""
    calls = []
    for name in ("_forward", "_backward"):
        real = getattr(topk_gather, name)
        monkeypatch.setattr(topk_gather, name,
                            lambda *a, real=real, name=name: calls.append(name) or real(*a))
    return calls


@pytest.mark.parametrize("schedule,layout,seq", [
    ("ring", "zigzag", 128),
    pytest.param("ring", "contiguous", 128, marks=pytest.mark.slow),
    pytest.param("ring", "striped", 128, marks=pytest.mark.slow),
    pytest.param("ring", "zigzag", 120, marks=pytest.mark.slow),   # padded to 128
    pytest.param("allgather", "zigzag", 128, marks=pytest.mark.slow),
    pytest.param("allgather", "contiguous", 128, marks=pytest.mark.slow),
    pytest.param("ulysses", "striped", 128, marks=pytest.mark.slow),
    pytest.param("hybrid", "zigzag", 128, marks=pytest.mark.slow),
])
def test_gather_under_schedules(rng, gathers, schedule, layout, seq):
    """cp=8, 128 tokens (16 keys a ring step, 6 picks a query): per-head picks with
    repeats, negative and past-the-end picks and picks beyond the causal keys, GQA 4,
    through the gather path, against the undecorated attention."""
    q, k, v = randn(rng, 2, seq, 8, D), randn(rng, 2, seq, 2, D), randn(rng, 2, seq, 2, D)
    idx = jnp.asarray(rng.integers(-3, seq + 12, (2, 8, seq, 6)), jnp.int32)
    idx = idx.at[..., -1].set(idx[..., 0])
    spec = jax.make_jaxpr(lambda *a: attention(*a, topk_indices=idx, causal=True))(
        q, k, v).eqns[-1].params["spec"]

    axes = ("uly", "ring") if schedule == "hybrid" else ("cp",)
    mesh = make_mesh((2, 4) if schedule == "hybrid" else (8,), axes)

    def sharded(q, k, v):
        return context_parallel_attention(q, k, v, idx, spec=spec, mesh=mesh, axes=axes,
                                          schedule=schedule, layout=layout)

    def one_device(q, k, v):
        return attention(q, k, v, topk_indices=idx, causal=True)

    def value_and_grads(f):
        loss = lambda *a: jnp.sum(jnp.sin(f(*a)) * jnp.cos(a[0]))  # noqa: E731
        value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)
        return (value, *grads)

    got, want = value_and_grads(sharded), value_and_grads(one_device)
    assert all(relative(g, w) <= RTOL for g, w in zip(got, want))
    assert {"_forward", "_backward"} <= set(gathers)
