"""The ``"cudnn"`` kernel on a CPU: an XLA stand-in for the two cuDNN calls (same signature
and semantics: top-left causal, a left window, float32 lse, a backward from the merged o/lse;
a variant never reads a masked key, as cuDNN), the step classification, forward and backward per step kind
against ``attend`` and its VJP, two key halves merged equal to one-shot attention, the NaN
terms of masked keys, a ring end to end, the whole kernel lowered for CUDA from this host on
the real private JAX module, the refusals, and ``kernel="auto"`` on a (faked) GPU.

The real kernel on a GPU is in ``test_accelerator.py``."""
from __future__ import annotations

import math
import re
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh
from schedule_cases import Case, check_schedule, relative_error

from cptransform.ir import compat
from cptransform.ir.errors import KernelError
from cptransform.lowering.block import Block
from cptransform.lowering.kernels import capabilities, kernels
from cptransform.lowering.kernels.capabilities import choose_kernel
from cptransform.lowering.kernels.chunked import ChunkedKernel
from cptransform.lowering.kernels.cudnn import (
    SPLIT, CudnnCalls, CudnnKernel, StepKind, masked_keys, masked_queries, step_kind)
from cptransform.op.attention_reference import attend
from cptransform.op.attention_spec import AttentionSpec, Layout, MaskSpec

BTHD = Layout.parse("BTHD")
CAUSAL = MaskSpec(causal=True)
#: bfloat16 operands: o and the gradients are rounded to 8 bits of their magnitude.
TOL = 2e-2


# --- the stand-in: cuDNN's two calls in XLA ---------------------------------------------

def _visible(tq, tkv, causal, window):
    i, j = jnp.arange(tq)[:, None], jnp.arange(tkv)[None]
    ok = (j <= i) if causal else jnp.ones((tq, tkv), bool)
    return ok if window is None else ok & (j > i - window)


def _per_pair(ok, x, query_side: bool):
    """``x [B, T, H, F]`` as ``[B, H, Tq, Tkv, F]`` with masked pairs 0 (never multiplied:
    like cuDNN, the skipping stand-in does not read a masked key)."""
    x = jnp.swapaxes(x, 1, 2)
    x = x[:, :, :, None] if query_side else x[:, :, None]
    return jnp.where(ok[None, None, :, :, None], x, 0.0)


def _contract(ok, skipping: bool):
    """``(p_or_ds [B, H, Tq, Tkv], x [B, T, H, F], query_side) -> [B, T', H, F]``: the sum
    over the other side, through :func:`_per_pair` when ``skipping``."""
    def contract(w, x, query_side):
        if skipping:
            spec = "bhqk,bhqkd->bkhd" if query_side else "bhqk,bhqkd->bqhd"
            return jnp.einsum(spec, w, _per_pair(ok, x, query_side))
        return jnp.einsum("bhqk,bqhd->bkhd" if query_side else "bhqk,bkhd->bqhd", w, x)
    return contract


def _operands(q, k, v, *rest):
    g = q.shape[2] // k.shape[2]
    return (q.astype(jnp.float32), *(jnp.repeat(x, g, axis=2).astype(jnp.float32)
                                     for x in (k, v)), *(x.astype(jnp.float32) for x in rest))


def standin(skipping: bool = False) -> CudnnCalls:
    """cuDNN's two calls in XLA (top-left causal, a left window, float32 lse, the backward
    from the given o/lse); ``skipping``: masked keys are never read (as cuDNN), else they are
    multiplied by exact zeros (as a dense softmax; cheaper to compile)."""
    def forward(q, k, v, *, scale, causal, window):
        q32, k32, v32 = _operands(q, k, v)
        ok = _visible(q.shape[1], k.shape[1], causal, window)
        s = jnp.where(ok, jnp.einsum("bqhd,bkhd->bhqk", q32, k32) * scale, -jnp.inf)
        lse = jax.nn.logsumexp(s, axis=-1)
        o = _contract(ok, skipping)(jnp.exp(s - lse[..., None]), v32, False)
        return o.astype(q.dtype), lse

    def backward(q, k, v, o, lse, do, *, scale, causal, window):
        q32, k32, v32, o32, do32 = _operands(q, k, v, o, do)
        ok = _visible(q.shape[1], k.shape[1], causal, window)
        contract = _contract(ok, skipping)
        s = jnp.einsum("bqhd,bkhd->bhqk", q32, k32) * scale
        p = jnp.where(ok, jnp.exp(jnp.where(ok, s, 0.0) - lse[..., None]), 0.0)
        if skipping:
            dp = jnp.einsum("bhqkd,bhqkd->bhqk", _per_pair(ok, do32, True),
                            _per_pair(ok, v32, False))
        else:
            dp = jnp.einsum("bqhd,bkhd->bhqk", do32, v32)
        ds = p * (dp - jnp.einsum("bqhd,bqhd->bhq", do32, o32)[..., None]) * scale
        dq, dk, dv = contract(ds, k32, False), contract(ds, q32, True), contract(p, do32, True)
        b, tkv, h, _ = dk.shape
        g = q.shape[2] // k.shape[2]
        per_kv = lambda x: x.reshape(b, tkv, h // g, g, -1).sum(3)  # noqa: E731
        return dq.astype(q.dtype), per_kv(dk).astype(k.dtype), per_kv(dv).astype(v.dtype)

    return CudnnCalls(forward, backward)


STANDIN = standin()


# --- problems ---------------------------------------------------------------------------

def _positions(*runs):
    """Int32 ``[1, T]`` positions: the concatenated ``range``s."""
    return jnp.asarray(np.concatenate([np.arange(*r) for r in runs]), jnp.int32)[None]


def problem(rng, q_pos, kv_pos, mask=CAUSAL, heads=(4, 2), d=16, dtype=jnp.bfloat16):
    """``(block, spec)``: random q, k, v (batch 2, ``heads = (H, Hkv)``) at the positions."""
    h, hkv = heads
    normal = lambda *s: jnp.asarray(rng.normal(size=s), dtype)  # noqa: E731
    tq, tkv = q_pos.shape[1], kv_pos.shape[1]
    block = Block(normal(2, tq, h, d), normal(2, tkv, hkv, d), normal(2, tkv, hkv, d),
                  q_pos, kv_pos)
    return block, AttentionSpec(BTHD, BTHD, BTHD, scale=1 / math.sqrt(d), groups=h // hkv,
                                mask=mask)


def reference(block, spec, do):
    """Float32 ``(o, lse, dq, dk, dv)``: ``attend`` and its VJP at ``do``."""
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    (o, lse), vjp = jax.vjp(lambda q, k, v: attend(spec, q, k, v, block.q_pos, block.kv_pos),
                            f32(block.q), f32(block.k), f32(block.v))
    return (o, lse) + vjp((do, jnp.zeros_like(lse)))


def run_kernel(kernel, block, spec, do):
    """``(o, lse, dq, dk, dv)`` of the kernel's forward, then its backward from that o/lse
    (what a schedule with one key block runs), jitted."""
    def step(block, do):
        o, lse = kernel.forward(block, spec)
        return (o, lse) + tuple(kernel.backward(block, o, lse, do, spec)[:3])
    return jax.jit(step)(block, do)


def assert_matches(got, want, tol=TOL):
    for name, g, w in zip(("o", "lse", "dq", "dk", "dv"), got, want):
        assert g.shape == w.shape and g.dtype == jnp.float32, name
        err = relative_error(g, w)
        assert err <= tol, f"{name}: relative error {err:.3g} > {tol}"


# --- the step classification ------------------------------------------------------------

KIND_CASES = {
    # name: (q positions, kv positions, mask, the kind)
    "diagonal": (_positions((0, 16)), _positions((0, 16)), CAUSAL, StepKind.CAUSAL),
    "zigzag diagonal": (_positions((0, 4), (28, 32)), _positions((0, 4), (28, 32)), CAUSAL,
                        StepKind.CAUSAL),
    "striped diagonal": (_positions((1, 32, 4)), _positions((1, 32, 4)), CAUSAL,
                         StepKind.CAUSAL),
    "longer queries": (_positions((0, 12)), _positions((0, 8)), CAUSAL, StepKind.CAUSAL),
    "below": (_positions((16, 32)), _positions((0, 16)), CAUSAL, StepKind.FULL),
    "above": (_positions((0, 16)), _positions((16, 32)), CAUSAL, StepKind.SKIP),
    "offset diagonal": (_positions((4, 20)), _positions((0, 16)), CAUSAL, StepKind.OTHER),
    "striped, later rank": (_positions((0, 32, 4)), _positions((1, 32, 4)), CAUSAL,
                            StepKind.SHIFTED),
    "striped, earlier rank": (_positions((1, 32, 4)), _positions((0, 32, 4)), CAUSAL,
                              StepKind.CAUSAL),
    "striped, two ranks later": (_positions((0, 32, 4)), _positions((2, 32, 4)), CAUSAL,
                                 StepKind.SHIFTED),
    "gapped": (_positions((0, 8)), _positions((0, 4), (5, 9)), CAUSAL, StepKind.OTHER),
    "no mask": (_positions((0, 8)), _positions((20, 36)), MaskSpec(), StepKind.FULL),
    "window": (_positions((0, 16)), _positions((0, 16)), MaskSpec(causal=True, window=(3, 0)),
               StepKind.CAUSAL),
    "striped window": (_positions((1, 32, 4)), _positions((1, 32, 4)),
                       MaskSpec(causal=True, window=(5, 0)), StepKind.OTHER),
    "right window": (_positions((0, 16)), _positions((0, 16)), MaskSpec(window=(3, 2)),
                     StepKind.OTHER),
}


@pytest.mark.parametrize("name", KIND_CASES)
def test_step_kind_reads_the_positions(rng, name):
    q_pos, kv_pos, mask, want = KIND_CASES[name]
    block, spec = problem(rng, q_pos, kv_pos, mask)
    assert int(step_kind(block, spec)) == want


def test_segments_full_or_not_and_the_split_plan(rng):
    """One segment id on both sides is no mask; another id on a key (a padded one) makes
    the call ``OTHER``; a zigzag rank's block against a lower rank's splits into sub-blocks
    cuDNN runs (two full, two skipped), while a sub-block with the padded key stays XLA."""
    block, spec = problem(rng, _positions((0, 8)), _positions((0, 8)),
                          MaskSpec(causal=True, segments=True))
    ids = jnp.zeros((1, 8), jnp.int32)
    assert int(step_kind(block.replace(q_seg=ids, kv_seg=ids), spec)) == StepKind.CAUSAL
    padded = block.replace(q_seg=ids, kv_seg=ids.at[0, 7].set(1))
    assert int(step_kind(padded, spec)) == StepKind.OTHER

    kernel = CudnnKernel()
    mixed, spec = problem(rng, _positions((0, 4), (100, 116, 4)),
                          _positions((0, 4), (101, 117, 4)))
    kind, _, kinds = kernel._plan(mixed, spec)
    assert int(step_kind(mixed, spec)) == StepKind.OTHER and int(kind) == SPLIT
    assert np.asarray(kinds).tolist() == [[StepKind.CAUSAL, StepKind.SKIP],
                                          [StepKind.FULL, StepKind.SHIFTED]]
    zigzag, spec = problem(rng, _positions((8, 12), (20, 24)), _positions((0, 4), (28, 32)))
    kind, sizes, kinds = kernel._plan(zigzag, spec)
    assert int(kind) == SPLIT and sizes == (4, 4)
    assert np.asarray(kinds).tolist() == [[StepKind.FULL, StepKind.SKIP]] * 2
    with_pad = zigzag.replace(q_seg=jnp.zeros((1, 8), jnp.int32),
                              kv_seg=jnp.zeros((1, 8), jnp.int32).at[0, 0].set(1))
    segments = replace(spec, mask=MaskSpec(causal=True, segments=True))
    assert int(kernel._plan(with_pad, segments)[0]) == StepKind.OTHER


# --- the 0·x terms of masked keys -------------------------------------------------------

@pytest.mark.parametrize("lo", [None, -2])
def test_masked_sums_are_those_of_the_dense_mask(rng, lo):
    """Against brute force: row ``i`` sums ``0·x`` over the keys its top-left causal mask
    (window ``lo``) hides, key ``j`` over the queries that do not see it; a NaN or Inf
    reaches exactly the rows (keys) that skip it."""
    tq, tkv, groups = 5, 7, 2
    x = np.zeros((1, tkv, 1, 3), np.float32)
    x[0, 2, 0, 1], x[0, 6, 0, 0] = np.nan, np.inf
    i, j = np.arange(tq)[:, None], np.arange(tkv)[None]
    hidden = (j > i) | ((j < i + lo) if lo is not None else False)
    zero = np.where(np.isfinite(x), 0.0, np.nan)  # 0·x
    want = np.einsum("qk,bkhf->bqhf", hidden.astype(np.float32), np.nan_to_num(zero, nan=1.0))
    want = np.where(want > 0, np.nan, 0.0)
    got = masked_keys(jnp.asarray(zero), tq, "causal", lo, groups)
    np.testing.assert_array_equal(np.asarray(got), np.repeat(want, groups, axis=2))

    y = np.zeros((1, tq, groups, 2), np.float32)
    y[0, 3, 1, 0] = np.nan
    zero_y = np.where(np.isfinite(y), 0.0, np.nan)
    per_kv = np.nan_to_num(zero_y, nan=1.0).sum(2, keepdims=True)
    want = np.where(np.einsum("qk,bqhf->bkhf", hidden.astype(np.float32), per_kv) > 0,
                    np.nan, 0.0)
    got = masked_queries(jnp.asarray(zero_y), tkv, "causal", lo, groups)
    np.testing.assert_array_equal(np.asarray(got), want)


# --- forward and backward per step kind -------------------------------------------------

STEP_CASES = [
    # (name, q positions, kv positions, mask, heads, pieces); the fast tier runs the first:
    # a call cuDNN cannot run whole, whose sub-blocks are causal, skipped, full, shifted
    ("split-into-every-kind", _positions((0, 4), (100, 116, 4)),
     _positions((0, 4), (101, 117, 4)), CAUSAL, (4, 2), 2),
    ("striped-later-rank-shifted", _positions((0, 64, 4)), _positions((3, 64, 4)), CAUSAL,
     (4, 2), 1),
    ("zigzag-off-diagonal-split", _positions((8, 12), (20, 24)), _positions((0, 4), (28, 32)),
     CAUSAL, (4, 2), 2),
    ("diagonal-gqa", _positions((0, 16)), _positions((0, 16)), CAUSAL, (4, 2), 1),
    ("full-mqa", _positions((16, 32)), _positions((0, 16)), CAUSAL, (4, 1), 1),
    ("skipped", _positions((0, 16)), _positions((16, 32)), CAUSAL, (2, 2), 1),
    ("delegated-offset", _positions((4, 20)), _positions((0, 16)), CAUSAL, (4, 2), 1),
    ("window", _positions((0, 16)), _positions((0, 16)),
     MaskSpec(causal=True, window=(4, None)), (4, 2), 1),
    ("striped-diagonal-longer-keys", _positions((1, 48, 4)), _positions((1, 64, 4)), CAUSAL,
     (2, 2), 1),
]


@pytest.mark.parametrize("name,q_pos,kv_pos,mask,heads,pieces", [
    pytest.param(*c, id=c[0], marks=() if i < 1 else pytest.mark.slow)
    for i, c in enumerate(STEP_CASES)])
def test_forward_and_backward_match_the_reference(rng, name, q_pos, kv_pos, mask, heads,
                                                  pieces):
    block, spec = problem(rng, q_pos, kv_pos, mask, heads)
    do = jnp.asarray(rng.normal(size=block.q.shape), jnp.float32)
    got = run_kernel(CudnnKernel(pieces=pieces, calls=STANDIN), block, spec, do)
    assert_matches(got, reference(block, spec, do))


@pytest.mark.slow
def test_two_key_halves_merged_equal_one_shot_attention(rng):
    """A ring step by step: queries at 16…31 against the keys 16…31 (a diagonal block) and
    then 0…15 (a full one), merged through ``running``; the backward per half from the
    merged o/lse, dQ summed: attention over all 32 keys."""
    block, spec = problem(rng, _positions((16, 32)), _positions((0, 32)), CAUSAL)
    do = jnp.asarray(rng.normal(size=block.q.shape), jnp.float32)
    kernel = CudnnKernel(pieces=1, calls=STANDIN)
    halves = [block.replace(k=block.k[:, s], v=block.v[:, s], kv_pos=block.kv_pos[:, s])
              for s in (slice(16, 32), slice(0, 16))]
    kinds = [int(step_kind(h, spec)) for h in halves]
    assert kinds == [StepKind.CAUSAL, StepKind.FULL]

    def ring(do):
        running = None
        for half in halves:
            running = kernel.forward(half, spec, running)
        o, lse = running
        (dq1, dk1, dv1, _), (dq0, dk0, dv0, _) = (kernel.backward(h, o, lse, do, spec)
                                                  for h in halves)
        return (o, lse, dq0 + dq1, jnp.concatenate([dk0, dk1], axis=1),
                jnp.concatenate([dv0, dv1], axis=1))

    assert_matches(jax.jit(ring)(do), reference(block, spec, do))


@pytest.mark.slow
def test_nan_in_a_masked_key_reaches_every_row_as_on_one_device(rng):
    """A NaN in V of a key the top-left causal mask hides from the first rows: the dense
    softmax multiplies it by their exact-zero probability, so it reaches every row; the
    stand-in (like cuDNN) never reads it, the kernel adds it back."""
    block, spec = problem(rng, _positions((0, 16)), _positions((0, 16)), CAUSAL)
    block = block.replace(v=block.v.at[0, 12, 1, 3].set(jnp.nan),
                          k=block.k.at[1, 9, 0, 2].set(jnp.nan))
    do = jnp.asarray(rng.normal(size=block.q.shape), jnp.float32)
    got = run_kernel(CudnnKernel(pieces=1, calls=standin(skipping=True)), block, spec, do)
    want = reference(block, spec, do)
    for name, g, w in zip(("o", "lse", "dq", "dk", "dv"), got, want):
        assert np.array_equal(np.isnan(np.asarray(g)), np.isnan(np.asarray(w))), name


@pytest.mark.slow
def test_what_cudnn_cannot_run_is_the_xla_kernel(rng):
    """float32 operands (and sinks) go to the chunked XLA kernel whole: the same numbers."""
    block, spec = problem(rng, _positions((0, 16)), _positions((0, 16)), dtype=jnp.float32)
    do = jnp.asarray(rng.normal(size=block.q.shape), jnp.float32)
    got = run_kernel(CudnnKernel(calls=STANDIN), block, spec, do)
    want = run_kernel(ChunkedKernel(), block, spec, do)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["zigzag", "contiguous", "striped"])
def test_ring_with_the_cudnn_kernel_matches_the_reference(rng, monkeypatch, layout):
    """``kernel="cudnn"`` through the ring schedule on 4 devices (the stand-in for cuDNN),
    output and every gradient against the unsharded reference, bfloat16 GQA causal."""
    stand_in = CudnnKernel(calls=STANDIN)
    caps = CudnnKernel.capabilities
    monkeypatch.setattr(CudnnKernel, "capabilities",
                        replace(caps, backends=caps.backends | {"cpu"}))
    monkeypatch.setitem(kernels(), "cudnn", stand_in)
    normal = lambda *s: jnp.asarray(rng.normal(size=s), jnp.bfloat16)  # noqa: E731
    spec = AttentionSpec(BTHD, BTHD, BTHD, scale=0.25, groups=2, mask=CAUSAL)
    case = Case((normal(2, 32, 4, 16), normal(2, 32, 2, 16), normal(2, 32, 2, 16)), spec)
    check_schedule(case, mesh=make_mesh((4,), ("cp",)), axes="cp", schedule="ring",
                   layout=layout, kernel="cudnn", tol=TOL)


# --- the real private module: lowered for CUDA on this host -----------------------------

def test_the_kernel_lowers_for_cuda_on_the_private_module(monkeypatch):
    """The whole kernel (forward, backward; the switch, the sub-blocks, the XLA fallback)
    lowered for CUDA from this host, through JAX's private cuDNN module on this JAX: the
    forward and backward custom calls with cuDNN's NO_MASK and CAUSAL masks and the window.
    (The forward checks for a cuDNN library, which a CPU host has none of: told 9.10.)"""
    monkeypatch.setattr("jax._src.cudnn.fused_attention_stablehlo.check_cudnn_version",
                        lambda: 91000)
    spec = AttentionSpec(BTHD, BTHD, BTHD, scale=0.125, groups=2,
                         mask=MaskSpec(causal=True, window=(100, None)))
    s = jax.ShapeDtypeStruct
    q, k = s((2, 256, 4, 64), jnp.bfloat16), s((2, 256, 2, 64), jnp.bfloat16)
    pos = s((1, 256), jnp.int32)
    kernel = CudnnKernel()

    def step(q, k, v, q_pos, kv_pos, do):
        block = Block(q, k, v, q_pos, kv_pos)
        o, lse = kernel.forward(block, spec)
        return (o, lse) + tuple(kernel.backward(block, o, lse, do, spec)[:3])

    text = jax.jit(step).trace(q, k, k, pos, pos, s((2, 256, 4, 64), jnp.float32)).lower(
        lowering_platforms=("cuda",)).as_text()
    calls = re.findall(r"custom_call @(__cudnn\$\w+)", text)
    assert set(calls) == {"__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"}
    assert set(re.findall(r"\\22mask_type\\22: \\22(\w+)\\22", text)) == {"NO_MASK", "CAUSAL"}
    assert set(re.findall(r"\\22sliding_window_length\\22: (\d+)", text)) == {"0", "101"}


# --- refusals and the choice ------------------------------------------------------------

def test_a_jax_without_the_private_module_is_a_clear_error(rng, monkeypatch):
    from jax._src.cudnn import fused_attention_stablehlo as fa
    monkeypatch.delattr(fa, "_dot_product_attention_bwd_p_wrapper")
    why = compat.cudnn_missing()
    assert "_dot_product_attention_bwd_p_wrapper" in why and jax.__version__ in why
    assert "kernel='pallas'/'xla'" in why
    block, spec = problem(rng, _positions((0, 16)), _positions((0, 16)))
    with pytest.raises(KernelError, match="_dot_product_attention_bwd_p_wrapper"):
        CudnnKernel().backward(block, block.q, jnp.zeros((2, 4, 16)), block.q, spec)
    with pytest.raises(KernelError, match="kernel='cudnn' cannot run") as err:
        choose_kernel("cudnn", spec, jnp.bfloat16, (16, 16), kernels(), backend="gpu")
    assert "_dot_product_attention_bwd_p_wrapper" in str(err.value)
    monkeypatch.setattr(capabilities, "_compare", lambda kernel: None)
    monkeypatch.setattr(capabilities, "_CHECKED", {})
    kernel, why = choose_kernel("auto", spec, jnp.bfloat16, (16, 16), kernels(), backend="gpu")
    assert kernel.name == "pallas" and "not cudnn: kernel 'cudnn' needs" in why


@pytest.mark.parametrize("what,mask,dtype,dims,extra", [
    ("float32", CAUSAL, jnp.float32, (64, 64), {}),
    ("head dim 100", CAUSAL, jnp.bfloat16, (100, 100), {}),
    ("equal q/k and v head dims", CAUSAL, jnp.bfloat16, (64, 128), {}),
    ("soft-cap", CAUSAL, jnp.bfloat16, (64, 64), {"softcap": 30.0}),
    ("lse cotangent that sinks send", CAUSAL, jnp.bfloat16, (64, 64), {"sinks": True}),
    ("band[-3, 2]", MaskSpec(window=(3, 2)), jnp.bfloat16, (64, 64), {}),
    ("top-k", MaskSpec(causal=True, topk=True), jnp.bfloat16, (64, 64), {}),
    ("cpu backend", CAUSAL, jnp.bfloat16, (64, 64), {"backend": "cpu"}),
])
def test_the_capabilities_refuse_what_cudnn_does_not_run(what, mask, dtype, dims, extra):
    backend = extra.pop("backend", "gpu")
    spec = AttentionSpec(BTHD, BTHD, BTHD, scale=0.125, mask=mask, **extra)
    with pytest.raises(KernelError, match=re.escape(what)):
        choose_kernel("cudnn", spec, dtype, dims, kernels(), backend=backend)


def test_auto_on_a_gpu_takes_cudnn_for_causal_bf16_and_pallas_for_the_rest(monkeypatch):
    """Self-checks passed (faked): cuDNN for causal and unmasked bf16, with a left window
    too, and its reason in ``explain()``'s words; Pallas for top-k, dense masks, chunks,
    coordinate bands, soft-caps and float32, naming why not cuDNN; XLA last."""
    monkeypatch.setattr(capabilities, "_compare", lambda kernel: None)
    monkeypatch.setattr(capabilities, "_CHECKED", {})

    def pick(dtype=jnp.bfloat16, **mask):
        softcap = mask.pop("softcap", None)
        spec = AttentionSpec(BTHD, BTHD, BTHD, scale=0.125, softcap=softcap,
                             mask=MaskSpec(**mask))
        return choose_kernel("auto", spec, dtype, (128, 128), kernels(), backend="gpu")

    for mask in ({"causal": True}, {}, {"causal": True, "window": (255, None)}):
        kernel, why = pick(**mask)
        assert kernel.name == "cudnn" and why == "cudnn: fastest capable kernel on gpu"
    for mask, reason in (({"causal": True, "topk": True}, "top-k"), ({"dense": True}, "dense"),
                         ({"causal": True, "chunk": 64}, "chunks(64)"),
                         ({"coordinate_band": (-3, 0)}, "coordinate_band"),
                         ({"causal": True, "softcap": 30.0}, "soft-cap")):
        kernel, why = pick(**mask)
        assert kernel.name == ("xla" if "coordinate_band" in mask else "pallas"), mask
        assert why.startswith(f"{kernel.name}: fastest capable kernel on gpu; not cudnn: ")
        assert reason in why
    kernel, why = pick(dtype=jnp.float32, causal=True)
    assert kernel.name == "pallas" and "not cudnn: it does not compute in float32" in why


def test_the_backward_primitive_takes_this_jax_s_parameters():
    """The backward binds the private primitive with the parameters this JAX's version
    declares (0.12 added ``score_mod``): its abstract evaluation accepts them and gives
    dq, dk, dv of the operands' shapes (GQA: dk and dv per KV head)."""
    s = jax.ShapeDtypeStruct
    q, k = s((2, 64, 4, 64), jnp.bfloat16), s((2, 64, 2, 64), jnp.bfloat16)
    shapes = jax.eval_shape(
        lambda q, k, lse: compat.cudnn_attention(q, k, k, q, lse, q, backward=True,
                                                 scale=0.125, causal=True, window=8),
        q, k, s((2, 4, 64), jnp.float32))
    assert [(x.shape, x.dtype) for x in shapes] == [(q.shape, q.dtype), (k.shape, k.dtype),
                                                    (k.shape, k.dtype)]


def test_explain_names_the_cudnn_kernel(rng, monkeypatch):
    """``explain()`` names each attention's kernel and why: a requested cuDNN kernel (its
    capabilities widened to this CPU, the stand-in for the calls)."""
    from cptransform import attention, context_parallel
    caps = CudnnKernel.capabilities
    monkeypatch.setattr(CudnnKernel, "capabilities",
                        replace(caps, backends=caps.backends | {"cpu"}))
    monkeypatch.setitem(kernels(), "cudnn", CudnnKernel(calls=STANDIN))
    q = jnp.asarray(rng.normal(size=(1, 32, 2, 16)), jnp.bfloat16)
    cp = context_parallel(lambda q, k, v: attention(q, k, v, causal=True), cp=8,
                          schedule="ring", kernel="cudnn")
    assert "kernel: cudnn (requested)" in cp.explain(q, q, q)


def test_the_h200_row_carries_the_measured_kernel_rates():
    from cptransform.analysis.hardware import HARDWARE
    h200 = HARDWARE["h200"]
    assert h200.kernel_flops_per_s("cudnn", "causal") == 328e12
    assert h200.kernel_flops_per_s("pallas", "full") == 137e12
    # The backward alone: 2.5 forwards' work in the forward+backward time less the forward's.
    for kernel, mask, fwd, both in (("cudnn", "causal", 328, 387), ("cudnn", "full", 567, 540),
                                    ("pallas", "causal", 67, 51)):
        want = 2.5 / (3.5 / both - 1 / fwd) * 1e12
        np.testing.assert_allclose(h200.kernel_flops_per_s(kernel, mask, backward=True), want)
    assert HARDWARE["a100"].kernel_flops_per_s("cudnn", "causal") is None


@pytest.mark.parametrize("kernel", ["cudnn", "pallas"])
@pytest.mark.parametrize("band", [(None, 0), (None, None)], ids=["causal", "full"])
def test_predictions_price_the_local_steps_at_the_kernels_measured_rates(kernel, band):
    """On a row with measured kernel rates, a schedule's compute is its forward FLOPs at
    the kernel's forward rate plus its backward FLOPs at the backward's; a kernel the row
    has no rate for keeps the row's own."""
    from cptransform.analysis.attention_shape import AttentionShape
    from cptransform.analysis.hardware import HARDWARE
    from cptransform.lowering.schedule import schedules
    h200, ring = HARDWARE["h200"], schedules()["ring"]
    shape = AttentionShape(seq_len=32768, heads=16, kv_heads=16, head_dim=128, cp=8,
                           band=band)
    plain = ring.predict(shape, h200)
    assert ring.predict(shape, h200, kernel="xla").compute_s == plain.compute_s
    total = plain.compute_s * h200.flops_per_s(2)      # forward + backward FLOPs
    mask = "full" if band == (None, None) else "causal"
    want = total / 3.5 / h200.kernel_flops_per_s(kernel, mask) \
        + total * 2.5 / 3.5 / h200.kernel_flops_per_s(kernel, mask, backward=True)
    np.testing.assert_allclose(ring.predict(shape, h200, kernel=kernel).compute_s, want,
                               rtol=1e-9)


@pytest.mark.slow
def test_the_self_check_runs_the_kernels_backward_in_bfloat16():
    """``auto``'s self-check of a kernel without float32 runs it in bfloat16, forward then
    its own backward from that o/lse: the stand-in passes, a backward off by 2x is named."""
    assert capabilities._compare(CudnnKernel(calls=STANDIN)) is None

    def doubled(*args, **kw):
        return tuple(2 * g for g in STANDIN.backward(*args, **kw))

    wrong = CudnnKernel(calls=CudnnCalls(STANDIN.forward, doubled))
    assert capabilities._compare(wrong) == "its dq differs from the reference"
