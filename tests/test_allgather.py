"""All-gather schedule: bfloat16 with uniform empty rows, and what its communication is
(gathers forward, reduce-scatters backward). Every mask kind and layout against the
reference, and its bytes against the cost model: ``test_conformance.py``."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh
from schedule_cases import HEAD_KINDS, check_schedule, make_case

from cptransform.analysis.attention_shape import AttentionShape
from cptransform.lowering.schedule import schedules
from cptransform.lowering.collectives import lower_and_count
from cptransform.lowering.context_parallel_attention import context_parallel_attention


@pytest.mark.slow
def test_bf16_and_uniform_empty_rows(rng):
    case = make_case(rng, "dense_causal", "gqa", dtype=jnp.bfloat16, empty_rows="uniform",
                     dense_heads=False)
    check_schedule(case, mesh=make_mesh((4,), ("cp",)), axes="cp", schedule="allgather",
                   layout="zigzag")


@pytest.mark.slow
@pytest.mark.parametrize("heads,segments", [("gqa", False), ("mha", True)])
def test_communication_gathers_forward_and_reduce_scatters_backward(heads, segments):
    s, d, dv, cp = 64, 8, 12, 8
    h, hkv = HEAD_KINDS[heads]
    kind = "segments" if segments else "causal"
    case = make_case(np.random.default_rng(0), kind, heads, seq=s, dv=dv,
                     dtype=jnp.bfloat16)
    mesh = make_mesh((cp,), ("cp",))
    abstract = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in case.operands]

    def forward(*xs):
        return context_parallel_attention(*xs, spec=case.spec, mesh=mesh, axes="cp",
                                          schedule="allgather", layout="striped",
                                          in_layout_order=True)

    def loss(*xs):
        return jnp.sum(forward(*xs).astype(jnp.float32))

    expected = schedules()["allgather"].volume(AttentionShape(
        seq_len=s, heads=h, kv_heads=hkv, head_dim=d, v_head_dim=dv, cp=cp, batch=2,
        dtype_bytes=2, segments=segments, positions=not segments, segment_batch=2))
    report = lower_and_count(forward, *abstract)
    assert report.counts() == {"all_gather": 3}  # K, V and kv positions or segment ids
    assert report.bytes_by_kind() == expected.forward
    gathered = sorted(str(c.operands[0]) for c in report.collectives)
    assert f"2x8x{hkv}x{d}xbf16" in gathered and f"2x8x{hkv}x{dv}xbf16" in gathered
    grad_report = lower_and_count(jax.value_and_grad(loss, argnums=(0, 1, 2)), *abstract)
    scatters = grad_report.of_kind("reduce_scatter")
    assert sorted(str(c.operands[0]) for c in scatters) == sorted(
        [f"2x{s}x{hkv}x{d}xf32", f"2x{s}x{hkv}x{dv}xf32"])
    assert grad_report.counts()["all_gather"] == report.counts()["all_gather"]
    assert grad_report.bytes_by_kind() == {
        kind: expected.forward.get(kind, 0) + expected.backward.get(kind, 0)
        for kind in {*expected.forward, *expected.backward}}
