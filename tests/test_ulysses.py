"""Ulysses schedule: dense operands shared by heads, uniform empty rows, odd local lengths,
the head divisibility error and its four all-to-alls. Every mask kind and layout against
the reference: ``test_conformance.py``."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh
from schedule_cases import HEAD_KINDS, check_schedule, make_case

from cptransform.analysis.attention_shape import AttentionShape
from cptransform.lowering.schedule import schedules
from cptransform.lowering.collectives import lower_and_count
from cptransform.lowering.context_parallel_attention import ContextParallelError, \
    context_parallel_attention


@pytest.mark.slow
@pytest.mark.parametrize("kind,heads", [("dense_causal", "gqa"), ("bias", "mha")])
def test_bf16_with_dense_operands_shared_by_heads(rng, kind, heads):
    case = make_case(rng, kind, heads, dtype=jnp.bfloat16, dense_heads=False)
    check_schedule(case, mesh=make_mesh((4,), ("cp",)), axes="cp", schedule="ulysses",
                   layout="zigzag")


@pytest.mark.slow
def test_uniform_empty_rows(rng):
    case = make_case(rng, "dense", "gqa", empty_rows="uniform", seq=16)
    check_schedule(case, mesh=make_mesh((8,), ("cp",)), axes="cp", schedule="ulysses",
                   layout="striped")


def test_indivisible_heads_is_a_clear_error(rng):
    case = make_case(rng, "causal", "mha")
    q, k, v = (x[:, :, :6] for x in case.operands)
    spec = case.spec.replace(groups=1)
    with pytest.raises(ContextParallelError, match=r"6 query heads .* size 4.*hybrid"):
        context_parallel_attention(q, k, v, spec=spec, mesh=make_mesh((4,), ("cp",)),
                                   axes="cp", schedule="ulysses")


@pytest.mark.slow
def test_odd_local_length(rng):
    case = make_case(rng, "dense_causal", "mqa", seq=24)
    check_schedule(case, mesh=make_mesh((8,), ("cp",)), axes="cp", schedule="ulysses",
                   layout="contiguous")


@pytest.mark.slow
@pytest.mark.parametrize("heads", ["mha", "gqa", "mqa"])
def test_communication_is_four_all_to_alls(heads):
    s, d, dv, cp = 64, 8, 12, 4
    h, hkv = HEAD_KINDS[heads]
    case = make_case(np.random.default_rng(0), "causal", heads, seq=s, dv=dv,
                     dtype=jnp.bfloat16)
    mesh = make_mesh((cp,), ("cp",))
    abstract = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in case.operands]

    def forward(*xs):
        return context_parallel_attention(*xs, spec=case.spec, mesh=mesh, axes="cp",
                                          schedule="ulysses", layout="zigzag",
                                          in_layout_order=True)

    report = lower_and_count(forward, *abstract)
    expected = schedules()["ulysses"].volume(AttentionShape(
        seq_len=s, heads=h, kv_heads=hkv, head_dim=d, v_head_dim=dv, cp=cp, batch=2,
        dtype_bytes=2))
    assert report.counts() == {"all_to_all": 4, "all_gather": 2}
    assert report.bytes_by_kind() == expected.forward
    assert all(c.group_size == cp for c in report.collectives)

    def loss(*xs):
        return jnp.sum(forward(*xs).astype(jnp.float32))

    grad_report = lower_and_count(jax.value_and_grad(loss, argnums=(0, 1, 2)), *abstract)
    assert grad_report.counts() == {"all_to_all": 8, "all_gather": 2}
    assert grad_report.per_device_bytes == expected.forward_total + expected.backward_total
