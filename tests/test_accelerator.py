"""The accelerator tier (``-m accelerator``): on a GPU or TPU, every local-step kernel
compiled for the device (Pallas not interpreted) against a float32 reference computed on the
host CPU, output, lse and every gradient, per mask term and dtype, on fresh random data;
``kernel="auto"``'s self-check on the device; the README demo's model and a stock Flax NNX
model through ``@context_parallel`` with each kernel against the undecorated function; and
the multi-device schedules when the slice has the devices.

Without a GPU or TPU every test is skipped with that reason. With
``CPTRANSFORM_ACCELERATOR_DRY_RUN=1`` the same tests run on the CPU at small sizes, the Pallas
kernels interpreted, so the tier's own code is checked before it meets a device (run it with
``JAX_PLATFORMS=cuda`` or ``tpu`` on a device: ``conftest.py`` pins the CPU otherwise;
``bench/accelerator_check.py`` does both).
"""
from __future__ import annotations

import os
import sys
import zlib
from dataclasses import replace
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cptransform import context_parallel
from cptransform.lowering.block import Block
from cptransform.lowering.kernels import get_kernel
from cptransform.lowering.kernels.capabilities import self_check
from cptransform.lowering.kernels.lowering_check import MASKS, Case, abstract_operands
from cptransform.lowering.kernels.pallas import PallasKernel
from cptransform.op.attention_reference import attend

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

BACKEND = jax.default_backend()
ON_DEVICE = BACKEND in ("gpu", "cuda", "rocm", "tpu")
DRY_RUN = os.environ.get("CPTRANSFORM_ACCELERATOR_DRY_RUN") == "1"

pytestmark = [pytest.mark.accelerator] + ([] if ON_DEVICE or DRY_RUN else [pytest.mark.skip(
    reason=f"needs a GPU or TPU (jax.default_backend() is {BACKEND!r}); "
           "CPTRANSFORM_ACCELERATOR_DRY_RUN=1 runs the tier on the CPU, interpreted")])

#: Largest error relative to the reference's largest magnitude, per input dtype. On a GPU a
#: float32 matmul may run in TF32 (10-bit mantissa); bf16 inputs round to 8 bits.
TOLERANCE = {"float32": 1e-2 if ON_DEVICE else 1e-4, "bfloat16": 4e-2, "float16": 1e-2}
#: The problem sizes: on a device, longer than one 128-block and not a multiple of it.
SIZES = dict(tq=200, tkv=328, head_dim=64) if ON_DEVICE else dict(tq=24, tkv=40, head_dim=16)
KERNELS = ("pallas", "xla")


def _kernel(name: str):
    """The kernel as ``kernel=name`` runs it here; small Pallas blocks in a dry run."""
    if name == "pallas" and not ON_DEVICE:
        return PallasKernel(block_q=16, block_kv=16)
    return get_kernel(name)


def random_operands(case: Case, seed: int):
    """``(block, spec)`` of ``case`` with fresh random values: normal q/k/v and bias,
    positions with the queries last (every causal row sees a key), segments of 7 and 9
    tokens, a dense mask visible with probability 0.6, top-k picks that include each query's
    own position."""
    abstract, spec = abstract_operands(case)
    rng = np.random.default_rng(seed)
    tq, tkv = case.tq, case.tkv
    values = {
        "q_pos": np.arange(tq)[None] + (tkv - tq), "kv_pos": np.arange(tkv)[None],
        "q_seg": (np.arange(tq)[None] + (tkv - tq)) // 7, "kv_seg": np.arange(tkv)[None] // 9,
    }
    fields = {}
    for name in Block.__dataclass_fields__:
        struct = getattr(abstract, name)
        if struct is None:
            continue
        if name in values:
            value = values[name]
        elif name == "mask":
            value = rng.random(struct.shape) < 0.6
        elif name == "topk":
            value = rng.integers(0, tkv, struct.shape)
            value[..., 0] = values["q_pos"][0][None, None, :]
        else:
            value = rng.normal(size=struct.shape)
        fields[name] = jnp.asarray(value, struct.dtype)
    return Block(**fields), spec


def _on_host(tree):
    """``tree`` as float32 arrays on the host CPU (the reference runs there, in full
    float32 precision whatever the accelerator's matmul defaults)."""
    cpu = jax.devices("cpu")[0]
    return jax.tree.map(lambda x: jax.device_put(
        x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x, cpu), tree)


def reference(block: Block, spec, do):
    """Float32 ``(o, lse, dq, dk, dv, dbias)`` on the host: the forward by ``attend``, the
    backward by the XLA kernel from that o and lse."""
    block, do = _on_host(block), _on_host(do)
    with jax.default_device(jax.devices("cpu")[0]), jax.default_matmul_precision("highest"):
        o, lse = attend(spec, block.q, block.k, block.v, block.q_pos, block.kv_pos,
                        bias=block.bias, **block.term_operands())
        grads = get_kernel("xla").backward(block, o, lse, do, spec)
    return (o, lse) + tuple(grads)


def assert_close(name, got, want, tol):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape, name
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want), err_msg=name)
    finite = np.isfinite(want)
    scale = max(float(np.max(np.abs(want[finite]), initial=0.0)), 1.0)
    err = float(np.max(np.abs(got[finite] - want[finite]), initial=0.0))
    assert err <= tol * scale, f"{name}: max |error| {err:.3g} > {tol} x {scale:.3g}"


def _cases():
    dtypes = ("float32", "bfloat16", "float16")
    return [pytest.param(kernel, Case("device", mask, dtype, groups, SIZES["head_dim"],
                                      tq=SIZES["tq"], tkv=SIZES["tkv"]),
                         id=f"{kernel}-{mask}-{dtype}-g{groups}")
            for kernel in KERNELS for mask in MASKS for dtype in dtypes
            for groups in ((1, 4) if mask in ("causal", "dense") else (2,))]


@pytest.mark.parametrize("kernel_name, case", _cases())
def test_kernel_on_the_device_matches_the_float32_reference(kernel_name, case):
    """Forward (o, lse) and backward (dq, dk, dv, dbias) compiled for the device."""
    block, spec = random_operands(case, seed=zlib.crc32(repr(case).encode()))
    kernel = _kernel(kernel_name)
    do = jax.random.normal(jax.random.key(1), block.q.shape[:3] + block.v.shape[3:],
                           jnp.float32)

    @jax.jit
    def run(do, b: Block):
        o, lse = kernel.forward(b, spec)
        return (o, lse) + tuple(kernel.backward(b, o, lse, do, spec))

    got = run(do, block)
    want = reference(block, spec, do)
    for name, g, w in zip(("o", "lse", "dq", "dk", "dv", "dbias"), got, want):
        assert (g is None) == (w is None), name
        if w is not None:
            assert_close(name, g, w, TOLERANCE[case.dtype])


@pytest.mark.skipif(not ON_DEVICE, reason="the self-check runs where auto would use it")
def test_auto_self_check_passes_on_the_device():
    assert self_check(get_kernel("pallas")) is None


def _positions(*runs):
    return jnp.asarray(np.concatenate([np.arange(*r) for r in runs]), jnp.int32)[None]


#: The cuDNN kernel's step kinds on the device (T = 256 per block): (name, query positions,
#: key positions, mask as ``MaskSpec`` fields, q heads, kv heads).
CUDNN_CASES = [
    ("diagonal", _positions((0, 256)), _positions((0, 256)), dict(causal=True), 8, 2),
    ("full", _positions((256, 512)), _positions((0, 256)), dict(causal=True), 8, 8),
    ("skipped", _positions((0, 256)), _positions((256, 512)), dict(causal=True), 4, 1),
    ("zigzag-split", _positions((256, 384), (640, 768)), _positions((0, 128), (896, 1024)),
     dict(causal=True), 8, 2),
    ("zigzag-diagonal", _positions((128, 256), (768, 896)), _positions((128, 256), (768, 896)),
     dict(causal=True), 8, 2),
    ("window", _positions((0, 256)), _positions((0, 256)), dict(causal=True, window=(100, 0)),
     8, 2),
    ("delegated", _positions((8, 264)), _positions((0, 256)), dict(causal=True), 8, 2),
    ("no-mask", _positions((0, 200)), _positions((0, 328)), dict(), 4, 4),
]


@pytest.mark.skipif(BACKEND not in ("gpu", "cuda"), reason="cuDNN runs on NVIDIA GPUs only")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("name, q_pos, kv_pos, mask, h, hkv", CUDNN_CASES,
                         ids=[c[0] for c in CUDNN_CASES])
def test_cudnn_kernel_on_the_device_matches_the_float32_reference(name, q_pos, kv_pos, mask,
                                                                   h, hkv, dtype):
    """The real cuDNN kernel (JAX's private cuDNN attention, forward then backward from the
    merged o/lse) per step kind, against the float32 host reference."""
    from cptransform.op.attention_spec import AttentionSpec, Layout, MaskSpec
    bthd = Layout.parse("BTHD")
    spec = AttentionSpec(bthd, bthd, bthd, scale=128 ** -0.5, groups=h // hkv,
                         mask=MaskSpec(**mask))
    keys = jax.random.split(jax.random.key(zlib.crc32(name.encode())), 4)
    tq, tkv = q_pos.shape[1], kv_pos.shape[1]
    q, k, v = (jax.random.normal(key, shape, dtype) for key, shape in zip(
        keys, ((2, tq, h, 128), (2, tkv, hkv, 128), (2, tkv, hkv, 128))))
    do = jax.random.normal(keys[3], (2, tq, h, 128), jnp.float32)
    block, kernel = Block(q, k, v, q_pos, kv_pos), get_kernel("cudnn")

    @jax.jit
    def run(do, b: Block):
        o, lse = kernel.forward(b, spec)
        return (o, lse) + tuple(kernel.backward(b, o, lse, do, spec)[:3])

    want = reference(block, spec, do)
    for label, g, w in zip(("o", "lse", "dq", "dk", "dv"), run(do, block), want):
        assert_close(label, g, w, TOLERANCE[dtype])


@pytest.mark.skipif(BACKEND not in ("gpu", "cuda"), reason="cuDNN runs on NVIDIA GPUs only")
def test_cudnn_self_check_passes_on_the_device():
    assert self_check(get_kernel("cudnn")) is None


def _model(name: str):
    """``(loss, args)``: the README demo's Llama (``lax.scan`` over layers, GQA, RoPE) or a
    stock Flax NNX decoder (``nnx.MultiHeadAttention``, ``nnx.make_causal_mask``)."""
    seq = 256 if ON_DEVICE else 32
    if name == "llama":
        import llama
        cfg = llama.Config(heads=8, kv_heads=2) if ON_DEVICE else \
            replace(llama.SMALL, dim=64, heads=4, kv_heads=2)
        params, tokens = llama.example_args(cfg, batch=2, seq=seq)
        return (lambda p, t: llama.loss(p, t, cfg)), (params, tokens)
    pytest.importorskip("flax")
    from flax import nnx
    import nnx_optax
    graphdef, state = nnx.split(nnx_optax.Decoder(dim=64, heads=4, layers=2))
    (tokens,) = nnx_optax.batches(1, vocab=128, batch=2, seq=seq)
    return nnx_optax.pure_loss(graphdef), (state, tokens)


def _compare(loss, transformed, args, tol):
    with jax.default_matmul_precision("highest"):
        want_loss, want_grads = jax.jit(jax.value_and_grad(loss))(*args)
        got_loss, got_grads = jax.jit(jax.value_and_grad(transformed))(*args)
    assert_close("loss", got_loss, want_loss, tol)
    for (path, w), g in zip(jax.tree_util.tree_leaves_with_path(want_grads),
                            jax.tree_util.tree_leaves(got_grads)):
        assert_close(jax.tree_util.keystr(path), g, w, tol)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("model", ["llama", "nnx"])
def test_model_on_one_device_with_each_kernel(model, kernel):
    """``@context_parallel(cp=1)`` with the kernel against the undecorated model: the loss
    and every gradient."""
    loss, args = _model(model)
    transformed = context_parallel(loss, cp=1, kernel=kernel if ON_DEVICE else "xla")
    _compare(loss, transformed, args, 1e-2 if ON_DEVICE else 1e-5)


@pytest.mark.parametrize("schedule", ["ring", "ulysses", "allgather"])
def test_schedules_across_the_slice(schedule):
    """The README demo's model over every device of the slice, each schedule."""
    n = len(jax.devices())
    if n < 2:
        pytest.skip(f"needs a slice of 2 or more devices, have {n}")
    loss, args = _model("llama")
    transformed = context_parallel(loss, cp=n if n <= 4 else 4, schedule=schedule)
    _compare(loss, transformed, args, 1e-2 if ON_DEVICE else 1e-5)
