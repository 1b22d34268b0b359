"""Double ring (an inner ring per group, an outer ring across groups, on two mesh axes):
outputs and every gradient against the unsharded reference for each mask kind and layout,
the rotation it states, its communication to the byte, and the planner, ``explain()``
and the plan chart reading it from its record."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh
from schedule_cases import Case, check_schedule, make_case, position_case

from cptransform import attention, context_parallel
from cptransform.analysis.attention_shape import AttentionShape
from cptransform.api.plan_chart import charts_for, render_text
from cptransform.lowering.collectives import lower_and_count
from cptransform.lowering.context_parallel_attention import context_parallel_attention
from cptransform.lowering.double_ring import source_shards
from cptransform.lowering.schedule import schedules
from cptransform.op.layouts import SequenceLayout

AXES = ("inner", "outer")


def double_ring(shape, layout):
    """Keyword arguments of context_parallel_attention for the double ring on ``shape``."""
    return dict(mesh=make_mesh(shape, AXES), axes=AXES, schedule="double_ring", layout=layout)


def chunked(rng, heads, seq):
    """A causal mask cut into chunks of 8 positions (Llama-4 chunked attention)."""
    case = make_case(rng, "causal", heads, seq=seq)
    return Case(case.operands, case.spec.replace(mask=case.spec.mask.replace(chunk=8)))


#: (mesh shape, layout, case builder): every mask kind, every layout, both axis orders.
CASES = [
    ((2, 2), "zigzag", lambda rng: make_case(rng, "causal", "gqa")),
    ((2, 2), "striped", lambda rng: make_case(rng, "dense", "mha", sinks=True)),
    ((4, 2), "contiguous", lambda rng: make_case(rng, "segments", "mqa")),
    ((2, 2), "contiguous", lambda rng: position_case(rng, "topk", 32, explicit=False)),
    ((2, 4), "zigzag", lambda rng: make_case(rng, "window", "gqa")),
    ((2, 2), "striped", lambda rng: chunked(rng, "mha", 32)),
    ((2, 4), "striped", lambda rng: make_case(rng, "dense_causal", "gqa",
                                              empty_rows="uniform")),
    ((4, 2), "zigzag", lambda rng: make_case(rng, "bias", "mha")),
    ((2, 2), "zigzag", lambda rng: position_case(rng, "window", 29, explicit=True)),
    ((2, 2), "contiguous", lambda rng: make_case(rng, "causal_window", "mqa")),
    ((2, 2), "striped", lambda rng: make_case(rng, "none", "gqa")),
]
FAST = (0, 1)


@pytest.mark.parametrize("index", [pytest.param(i, marks=() if i in FAST else pytest.mark.slow)
                                   for i in range(len(CASES))])
def test_matches_reference(rng, index):
    shape, layout, build = CASES[index]
    check_schedule(build(rng), **double_ring(shape, layout))


def test_every_step_holds_a_different_block_and_the_outer_axis_moves_once_per_group():
    sources = source_shards(2, 4)
    assert all(sorted(row) == list(range(8)) for row in sources)
    # Inside an outer step the blocks stay in one group (shard // inner).
    assert all(len(set(row[j * 2:(j + 1) * 2] // 2)) == 1 for row in sources for j in range(4))
    assert sources[5].tolist() == [5, 4, 3, 2, 1, 0, 7, 6]


def test_communication_equals_the_formula():
    """Inner and outer hops of K and V (one send), the segment ids, and the float32 dK/dV
    backward, to the byte of the cost model's volume."""
    seq, dv, shape = 32, 12, (2, 2)
    case = make_case(np.random.default_rng(0), "segments", "gqa", seq=seq, dv=dv,
                     dtype=jnp.bfloat16)
    kw = double_ring(shape, "zigzag")
    abstract = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in case.operands]

    def forward(*xs):
        return context_parallel_attention(*xs, spec=case.spec, **kw, in_layout_order=True)

    def loss(*xs):
        return jnp.sum(forward(*xs).astype(jnp.float32))

    expected = schedules()["double_ring"].volume(AttentionShape(
        seq_len=seq, heads=8, kv_heads=2, head_dim=8, v_head_dim=dv, cp=4, ulysses=2, batch=2,
        positions=False, segments=True, segment_batch=2))
    assert lower_and_count(forward, *abstract).bytes_by_kind() == expected.forward
    both = lower_and_count(jax.value_and_grad(loss, argnums=(0, 1, 2)), *abstract)
    assert both.per_device_bytes == expected.forward_total + expected.backward_total


CHART = """double_ring over 4 devices, contiguous layout (# full, + partial, . skipped, \
? data-dependent)
     step  0  1  2  3
device  0  +  .  .  .
device  1  +  #  .  .
device  2  +  .  #  #
device  3  +  #  #  #
work/mean  0.33 0.78 1.22 1.67
slowest device: 1.67x the mean"""


def test_planned_explained_and_drawn_from_its_record(rng):
    """Asked for with only cp, the planner builds its two axes (inner ring size chosen by
    the cost model); the result is the single-device one, ``explain()`` names it with its
    predicted time and the chart draws its rotation."""
    x = jnp.asarray(rng.normal(size=(1, 64, 4, 16)), jnp.float32)

    def loss(q, k, v):
        return jnp.sum(attention(q, k, v, causal=True) ** 2)

    f = context_parallel(loss, cp=4, schedule="double_ring", load_balance="none",
                         hardware="h100")
    np.testing.assert_allclose(f(x, x, x), loss(x, x, x), rtol=1e-5)
    text = f.explain(x, x, x)
    assert "schedule: double_ring — double_ring inner ring size 2 (outer ring 2) on h100" in text
    assert "predicted per device: double_ring:" in text
    (plan,) = f.module(x, x, x).facts.plan
    charts = charts_for(plan, SequenceLayout("contiguous", 64, 4))
    assert "\n".join(render_text(c) for c in charts) == CHART


def test_asked_for_on_a_two_axis_mesh_it_is_what_runs(rng):
    """On a mesh with two CP axes, ``schedule="double_ring"`` is the schedule planned and run
    (not hybrid), matching one device; a one-axis schedule there is one clear error."""
    from cptransform.ir.errors import ContextParallelOptionError

    x = jnp.asarray(rng.normal(size=(1, 64, 4, 16)), jnp.float32)

    def loss(q, k, v):
        return jnp.sum(attention(q, k, v, causal=True) ** 2)

    mesh = make_mesh((2, 2), ("inner", "outer"))
    f = context_parallel(loss, mesh=mesh, axis=("inner", "outer"), schedule="double_ring",
                         load_balance="none")
    np.testing.assert_allclose(f(x, x, x), loss(x, x, x), rtol=1e-5)
    assert [p.schedule for p in f.module(x, x, x).facts.plan] == ["double_ring"]
    with pytest.raises(ContextParallelOptionError, match="need a two-axis schedule"):
        context_parallel(loss, mesh=mesh, axis=("inner", "outer"), schedule="ring")(x, x, x)
