"""Kernels declare what they can run; ``kernel="auto"`` never takes an unchecked one."""
import warnings

import jax
import jax.numpy as jnp
import pytest

from cptransform.ir.errors import KernelError
from cptransform.lowering.kernels import capabilities, kernels
from cptransform.lowering.kernels.capabilities import (
    ALL_TERMS, Capabilities, choose_kernel, warn_passed_over)
from cptransform.op import mask_terms
from cptransform.op.attention_spec import AttentionSpec, Layout, MaskSpec

BTHD = Layout.parse("BTHD")


def spec(**mask):
    return AttentionSpec(q=BTHD, k=BTHD, v=BTHD, scale=1.0, mask=MaskSpec(**mask))


def test_a_named_kernel_refuses_what_it_cannot_run():
    with pytest.raises(KernelError, match="float64") as err:
        choose_kernel("pallas", spec(causal=True), jnp.float64, (8, 8), kernels())
    assert isinstance(err.value, NotImplementedError)
    without_topk = Capabilities(mask_terms=ALL_TERMS - {mask_terms.TopK})
    assert "top-k" in without_topk.refusal(spec(causal=True, topk=True), jnp.float32, (8, 8),
                                           "cpu")
    with pytest.raises(KernelError, match="coordinate_band"):
        choose_kernel("pallas", spec(causal=True, coordinate_band=(-3, 3)), jnp.float32,
                      (8, 8), kernels())
    kernel, _ = choose_kernel("auto", spec(coordinate_band=(-3, 3)), jnp.float32, (8, 8),
                              kernels(), backend="tpu")
    assert kernel.name == "xla"
    with pytest.raises(KernelError, match="unknown kernel"):
        choose_kernel("triton", spec(), jnp.float32, (8, 8), kernels())
    kernel, why = choose_kernel("pallas", spec(chunk=4, causal=True), jnp.bfloat16, (8, 8),
                                kernels())
    assert kernel.name == "pallas" and why == "pallas: requested"


def test_auto_takes_pallas_on_a_device_only_after_its_self_check(monkeypatch):
    """On a GPU/TPU ``auto`` runs the self-check once per device kind; a failed check falls
    back to XLA with one warning line saying why."""
    calls = []
    verdict = {"pallas": "its dq differs from the reference"}

    def fake_compare(kernel):
        calls.append(kernel.name)
        return verdict.get(kernel.name)

    monkeypatch.setattr(capabilities, "_compare", fake_compare)
    monkeypatch.setattr(capabilities, "_CHECKED", {})
    kernel, why = choose_kernel("auto", spec(causal=True), jnp.float32, (64, 64), kernels(),
                                backend="gpu")
    assert kernel.name == "xla" and "self-check failed: its dq differs" in why
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_passed_over(why)
    assert len(caught) == 1 and "\n" not in str(caught[0].message)
    choose_kernel("auto", spec(window=(3, 3)), jnp.float32, (64, 64), kernels(), backend="gpu")
    assert calls == ["pallas"]  # cached per device kind

    monkeypatch.setattr(capabilities, "_CHECKED", {})
    verdict.clear()
    kernel, why = choose_kernel("auto", spec(causal=True), jnp.float32, (64, 64), kernels(),
                                backend="tpu")
    assert kernel.name == "pallas" and "not" not in why
    kernel, why = choose_kernel("auto", spec(causal=True, topk=True), jnp.float32, (64, 64),
                                kernels(), backend="tpu")
    assert kernel.name == "pallas"  # the Pallas kernels read every mask term


def test_requested_pallas_that_fails_on_the_device_is_one_clear_error(monkeypatch):
    """``kernel="pallas"`` on a GPU/TPU whose self-check fails (a kernel that does not
    compile there, or differs from the reference): one error naming the kernel, the device
    kind and ``kernel='xla'``; a passing check returns the kernel."""
    failure = "it failed to run: ValueError: Triton could not compile cp_attention_dkv"
    monkeypatch.setattr(capabilities, "_compare", lambda kernel: failure)
    monkeypatch.setattr(capabilities, "_CHECKED", {})
    with pytest.raises(KernelError) as err:
        choose_kernel("pallas", spec(causal=True), jnp.float32, (64, 64), kernels(),
                      backend="gpu")
    text = str(err.value)
    assert "kernel='pallas'" in text and jax.devices()[0].device_kind in text
    assert "Triton could not compile" in text and "kernel='xla'" in text
    monkeypatch.setattr(capabilities, "_compare", lambda kernel: None)
    monkeypatch.setattr(capabilities, "_CHECKED", {})
    kernel, why = choose_kernel("pallas", spec(causal=True), jnp.float32, (64, 64),
                                kernels(), backend="gpu")
    assert kernel.name == "pallas" and why == "pallas: requested"


def test_auto_on_cpu_is_the_xla_kernel():
    kernel, why = choose_kernel("auto", spec(causal=True), jnp.float32, (8, 8), kernels(),
                                backend="cpu")
    assert kernel.name == "xla" and why == "xla: fastest capable kernel on cpu"


def test_explain_names_each_attentions_kernel(rng):
    import numpy as np
    from conftest import needs_halo
    from cptransform import attention, context_parallel

    needs_halo()

    q = jnp.asarray(np.random.default_rng(0).normal(size=(1, 32, 2, 8)), jnp.float32)
    cp = context_parallel(lambda q, k, v: attention(q, k, v, causal=True, chunk_size=8),
                          cp=4, schedule="halo", load_balance="none")
    text = cp.explain(q, q, q)
    assert "schedule: halo" in text and "chunk=8" in text
    assert "kernel: xla (fastest capable kernel on cpu)" in text
