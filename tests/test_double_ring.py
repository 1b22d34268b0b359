"""Double ring (an inner ring per group, an outer ring across groups, on two mesh axes):
the cases the conformance suite does not meet (a dense mask with sinks, uniform empty
rows, explicit positions), the rotation it states, and the planner, ``explain()`` and the
plan chart reading it from its record. Every mask kind and layout against the reference,
and its bytes against the cost model: ``test_conformance.py``."""
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh
from schedule_cases import check_schedule, make_case, position_case

from cptransform import attention, context_parallel
from cptransform.api.plan_chart import charts_for, render_text
from cptransform.lowering.double_ring import source_shards
from cptransform.op.layouts import SequenceLayout

AXES = ("inner", "outer")


def double_ring(shape, layout):
    """Keyword arguments of context_parallel_attention for the double ring on ``shape``."""
    return dict(mesh=make_mesh(shape, AXES), axes=AXES, schedule="double_ring", layout=layout)


#: (mesh shape, layout, case builder): what ``test_conformance.py`` does not run (two
#: features together, a fill other than zero, the caller's positions).
CASES = [
    ((2, 2), "striped", lambda rng: make_case(rng, "dense", "mha", sinks=True)),
    ((2, 4), "striped", lambda rng: make_case(rng, "dense_causal", "gqa",
                                              empty_rows="uniform")),
    ((2, 2), "zigzag", lambda rng: position_case(rng, "window", 29, explicit=True)),
]
FAST = (0,)


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
