"""Kernels declare what they can run; ``kernel="auto"`` never takes an unchecked one; the
planner decides each attention's kernel once and writes it on the equation."""
import warnings
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh
from schedule_cases import make_case, relative_error

from cptransform import attention, context_parallel
from cptransform.api.context_parallel import Options, cp_pipeline, prepare
from cptransform.ir.errors import KernelError
from cptransform.ir.module import iter_eqns, trace
from cptransform.lowering import context_parallel_attention as lowering
from cptransform.lowering.kernels import capabilities, kernels
from cptransform.lowering.kernels.capabilities import (
    ALL_TERMS, Capabilities, choose_kernel, warn_passed_over)
from cptransform.lowering.kernels.chunked import ChunkedKernel
from cptransform.op import mask_terms
from cptransform.op.attention import attention_p
from cptransform.op.attention_reference import attention_reference
from cptransform.op.attention_spec import AttentionSpec, Layout, MaskSpec
from cptransform.passes import lower_context_parallel

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
    from conftest import needs_halo

    needs_halo()

    q = jnp.asarray(np.random.default_rng(0).normal(size=(1, 32, 2, 8)), jnp.float32)
    cp = context_parallel(lambda q, k, v: attention(q, k, v, causal=True, chunk_size=8),
                          cp=4, schedule="halo", load_balance="none")
    text = cp.explain(q, q, q)
    assert "schedule: halo" in text and "chunk=8" in text
    assert "kernel: xla (fastest capable kernel on cpu)" in text



# --- the kernel is decided once, by the planner, and written on the equation ------------

def _layers(q, k, v):
    """A causal attention, then two scanned windowed ones (an equation inside a body)."""
    x = attention(q, k, v, causal=True)
    x, _ = jax.lax.scan(lambda x, _: (attention(x, k, v, window=(5, 0)), None), x, None,
                        length=2)
    return jnp.sum(jnp.sin(x))


def _operands(seed):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.normal(size=(1, 32, 4, 8)), jnp.float32) for _ in range(3))


def _planned(fn, args, **options):
    """The module of ``fn`` after ``plan-context-parallel`` (and reorder-sequence), not
    lowered, and its attention specs."""
    opts = Options(cp=8, **options)
    module = prepare(trace(fn, *args), opts)
    planned = cp_pipeline(module, opts, lower=False).run(module).module
    return planned, [e.params["spec"] for e in iter_eqns(planned.jaxpr)
                     if e.primitive is attention_p]


@pytest.mark.parametrize("kernel,name", [("auto", "xla"), ("pallas", "pallas")])
def test_the_planner_writes_the_kernel_on_each_equation(kernel, name):
    """After planning every attention's spec names its kernel (``auto`` on CPU: ``xla``),
    the same as the plan's account, and the IR printer shows it."""
    module, specs = _planned(_layers, _operands(0), kernel=kernel)
    assert len(specs) == 2 and all(s.kernel == name for s in specs)
    assert [p.kernel_name for p in module.facts.plan] == [name, name]
    assert str(module).count(f"kernel={name}") == 2


def test_auto_warns_of_a_passed_over_kernel_once_per_attention(monkeypatch):
    """A faster kernel ``auto`` passes over (cuDNN does not run on CPU) is one warning per
    attention, from the planner: not once per candidate layout, not again when lowering."""
    monkeypatch.setitem(capabilities.PREFERENCE, "cpu", ("cudnn", "xla"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        context_parallel(_layers, cp=8).module(*_operands(0))
    passed_over = [str(w.message) for w in caught if "kernel='auto' uses" in str(w.message)]
    assert len(passed_over) == 2
    assert all(m.startswith("cptransform: kernel='auto' uses xla: fastest capable kernel on "
                            "cpu; not cudnn: ") for m in passed_over)


def test_lowering_reads_the_planned_kernel_and_does_not_choose(monkeypatch):
    """With the kernel on the spec, lowering never calls ``choose_kernel``: the transformed
    function's value and gradients still match the one-device function on random data."""
    def refuse(*args, **kwargs):
        raise AssertionError("lowering chose a kernel again")

    monkeypatch.setattr(lowering, "choose_kernel", refuse)
    # A schedule jitted by an earlier test for an equal spec would not be traced again.
    lower_context_parallel._schedule_call.cache_clear()
    args = _operands(1)
    value, grads = jax.value_and_grad(context_parallel(_layers, cp=8, kernel="auto"),
                                      argnums=(0, 1, 2))(*args)
    want, want_grads = jax.value_and_grad(_layers, argnums=(0, 1, 2))(*args)
    np.testing.assert_allclose(value, want, rtol=1e-5)
    for g, w in zip(grads, want_grads):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(w))))
    # The patch is on the path a spec without a kernel takes: a direct call chooses there.
    spec = jax.make_jaxpr(lambda q: attention(q, q, q, causal=True))(args[0]) \
        .eqns[-1].params["spec"]
    with pytest.raises(AssertionError, match="chose a kernel again"):
        lowering.context_parallel_attention(*args, spec=spec, mesh=make_mesh((4,), ("cp",)),
                                            axes="cp")


@dataclass(frozen=True)
class _Recording(ChunkedKernel):
    """The chunked kernel under another name, recording each forward a schedule traces."""

    name: str = "recording"
    traced: list = field(default_factory=list, compare=False)

    def forward(self, block, spec, running=None):
        self.traced.append(spec.mask.describe())
        return super().forward(block, spec, running)


def test_a_direct_call_runs_the_kernel_its_spec_names(rng, monkeypatch):
    """``context_parallel_attention`` runs ``spec.kernel`` when set, whatever ``kernel=``
    asks (the planner's choice wins), else the ``kernel=`` one; both match the reference;
    a name no kernel has is one clear error."""
    recording = _Recording()
    monkeypatch.setitem(kernels(), "recording", recording)
    case = make_case(rng, "causal", "gqa", seq=32)
    want = attention_reference(*case.operands, spec=case.spec)
    ring = dict(mesh=make_mesh((4,), ("cp",)), axes="cp", schedule="ring")
    out = lowering.context_parallel_attention(
        *case.operands, spec=case.spec.replace(kernel="recording"), kernel="xla", **ring)
    assert relative_error(out, want) <= 1e-5 and recording.traced
    recording.traced.clear()
    out = lowering.context_parallel_attention(*case.operands, spec=case.spec, kernel="xla",
                                              **ring)
    assert relative_error(out, want) <= 1e-5 and not recording.traced
    with pytest.raises(KernelError, match="unknown kernel 'triton'"):
        lowering.context_parallel_attention(
            *case.operands, spec=case.spec.replace(kernel="triton"), **ring)
