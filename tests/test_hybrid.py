"""Hybrid schedule (Ulysses × ring on two mesh axes): positions over groups, degenerate
factorisations, the head divisibility error and the collectives on each axis. Every mask
kind and layout against the reference: ``test_conformance.py``."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh
from schedule_cases import HEAD_KINDS, Case, check_schedule, make_case, position_case

from cptransform.analysis.attention_shape import AttentionShape
from cptransform.lowering.schedule import schedules
from cptransform.lowering.collectives import lower_and_count
from cptransform.lowering.context_parallel_attention import ContextParallelError, \
    context_parallel_attention

AXES = ("uly", "ring")


@pytest.mark.slow
@pytest.mark.parametrize("kind,layout,seq,explicit", [
    ("causal", "zigzag", 29, False), ("window", "striped", 29, False),
    ("topk", "contiguous", 32, False), ("causal", "striped", 29, True)])
def test_positions_over_groups(rng, kind, layout, seq, explicit):
    """The ring over groups derives the positions of a group's U shards from the layout of
    all U·R shards (uneven lengths padded); the caller's positions still travel."""
    check_schedule(position_case(rng, kind, seq, explicit), mesh=make_mesh((2, 2), AXES),
                   axes=AXES, schedule="hybrid", layout=layout)


@pytest.mark.slow
@pytest.mark.parametrize("shape,seq,layout", [((1, 4), 12, "striped"), ((8, 1), 32, "zigzag")])
def test_degenerate_factorisations_and_odd_blocks(rng, shape, seq, layout):
    """(1, 4) with 12 tokens: the ring sees odd blocks of 3 keys (its 1 × 1 tiling)."""
    case = make_case(rng, "causal_window", "gqa", seq=seq, dtype=jnp.bfloat16,
                     empty_rows="uniform")
    check_schedule(case, mesh=make_mesh(shape, AXES), axes=AXES, schedule="hybrid",
                   layout=layout)


def test_ulysses_axis_must_divide_heads(rng):
    case = make_case(rng, "causal", "mha")
    q, k, v = (x[:, :, :6] for x in case.operands)
    with pytest.raises(ContextParallelError, match=r"hybrid: 6 query heads .* 'uly' of size 4"):
        context_parallel_attention(q, k, v, spec=case.spec.replace(groups=1),
                                   mesh=make_mesh((4, 2), AXES), axes=AXES, schedule="hybrid")


@pytest.mark.slow
@pytest.mark.parametrize("shape,heads,explicit", [((2, 4), "gqa", False),
                                                  ((4, 2), "mqa", True)])
def test_communication_on_each_axis(shape, heads, explicit):
    u, r = shape
    s, d, dv = 64, 8, 12
    h, hkv = HEAD_KINDS[heads]
    case = make_case(np.random.default_rng(0), "causal", heads, seq=s, dv=dv,
                     dtype=jnp.bfloat16)
    if explicit:
        pos = jnp.arange(s, dtype=jnp.int32)[None]
        case = Case(case.operands[:3] + (pos, pos), case.spec.replace(positions=True))
    mesh = make_mesh(shape, AXES)
    abstract = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in case.operands]

    def forward(*xs):
        return context_parallel_attention(*xs, spec=case.spec, mesh=mesh, axes=AXES,
                                          schedule="hybrid", layout="zigzag",
                                          in_layout_order=True)

    report = lower_and_count(forward, *abstract)
    expected = schedules()["hybrid"].volume(AttentionShape(
        seq_len=s, heads=h, kv_heads=hkv, head_dim=d, v_head_dim=dv, cp=u * r, ulysses=u,
        batch=2, dtype_bytes=2, explicit_positions=explicit))
    # The ring sends K and V as one collective-permute per step, the caller's positions as
    # another; layout kv positions are neither gathered nor sent (the ring derives them).
    assert report.counts() == {"all_to_all": 4, "all_gather": 1 + explicit,
                               "collective_permute": (1 + explicit) * (r - 1)}
    assert report.bytes_by_kind() == expected.forward
    ids = np.arange(u * r).reshape(u, r)
    ulysses_groups = {tuple(ids[:, j]) for j in range(r)}
    ring_pairs = {(int(ids[i, j]), int(ids[i, (j + 1) % r])) for i in range(u) for j in range(r)}
    for c in report.collectives:
        if c.kind == "collective_permute":
            assert set(c.groups) == ring_pairs
        else:
            assert set(c.groups) == ulysses_groups

    def loss(*xs):
        return jnp.sum(forward(*xs).astype(jnp.float32))

    grad_report = lower_and_count(jax.value_and_grad(loss, argnums=(0, 1, 2)), *abstract)
    assert grad_report.per_device_bytes == expected.forward_total + expected.backward_total
