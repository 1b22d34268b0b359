"""``kernel="pallas"`` through every schedule, in interpret mode, against the unsharded
reference — outputs and all gradients.

The full matrix is the schedule equivalence suite (:func:`pairwise_cases`: every mask kind,
MHA/GQA/MQA, Dv ≠ D, each layout, several cp) for each schedule, with the variant
alternating between the TPU-style and the GPU-style kernel so both meet every schedule.
Interpreted Pallas is slow (the whole matrix takes about 7 CPU-minutes), so by default each
schedule runs a rotating ninth of it; ``CPTRANSFORM_PALLAS_FULL=1`` runs all of it. The
kernel-level tests are in ``test_pallas_kernels.py``.
"""
import os

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh
from schedule_cases import check_schedule, make_case, pairwise_cases

from cptransform.lowering.schedule import schedules

#: Schedule → (mesh shapes to cycle through, mesh axis names, axes argument).
MESHES = {
    "ring": ((2, 4, 8), ("cp",), "cp"),
    "ulysses": ((2, 4, 8), ("cp",), "cp"),
    "allgather": ((2, 4, 8), ("cp",), "cp"),
    "hybrid": (((2, 2), (2, 4), (4, 2)), ("uly", "ring"), ("uly", "ring")),
    "halo": ((4,), ("cp",), "cp"),  # windows only: its own cases below
    # Its own small case below: a pairwise case on two ring axes costs minutes interpreted.
    "double_ring": (((2, 2),), ("inner", "outer"), ("inner", "outer")),
}
OWN_CASES = ("halo", "double_ring")
VARIANTS = ("tpu", "gpu")
FULL = os.environ.get("CPTRANSFORM_PALLAS_FULL") == "1"


def cases():
    out = []
    pairwise = {name: mesh for name, mesh in MESHES.items() if name not in OWN_CASES}
    for s, (schedule, (shapes, _, _)) in enumerate(pairwise.items()):
        for i, (shape, layout, kind, heads, dv) in enumerate(pairwise_cases(cps=shapes)):
            if FULL or i % 3 == s % 3 and i // 3 == s % 3:
                out.append(pytest.param(
                    schedule, shape, layout, kind, heads, dv, VARIANTS[(i + s) % 2],
                    id=f"{schedule}-{shape}-{layout}-{kind}-{heads}-dv{dv}"))
    return out


def run(schedule, shape, layout, case, monkeypatch, variant):
    monkeypatch.setenv("CPTRANSFORM_PALLAS_VARIANT", variant)
    _, names, axes = MESHES[schedule]
    shape = shape if isinstance(shape, tuple) else (shape,)
    check_schedule(case, mesh=make_mesh(shape, names), axes=axes, schedule=schedule,
                   layout=layout, kernel="pallas")


def test_every_schedule_is_covered():
    assert set(MESHES) == set(schedules())


@pytest.mark.slow
@pytest.mark.parametrize("schedule,shape,layout,kind,heads,dv,variant", cases())
def test_pallas_matches_reference(rng, monkeypatch, schedule, shape, layout, kind, heads, dv,
                                  variant):
    run(schedule, shape, layout, make_case(rng, kind, heads, dv=dv), monkeypatch, variant)


@pytest.mark.slow
@pytest.mark.parametrize("schedule,empty_rows,variant", [
    ("ring", "uniform", "tpu"), ("ring", "nan", "gpu"),
    ("ulysses", "uniform", "gpu"), ("allgather", "nan", "tpu")])
def test_pallas_empty_rows(rng, monkeypatch, schedule, empty_rows, variant):
    """A dense mask with a query that sees no key, under each ``empty_rows`` contract."""
    case = make_case(rng, "dense_causal", "gqa", seq=16, empty_rows=empty_rows)
    run(schedule, 4, "zigzag", case, monkeypatch, variant)


@pytest.mark.slow
@pytest.mark.parametrize("schedule,variant,operand", [
    ("ring", "tpu", 2), ("allgather", "gpu", 2), ("ring", "gpu", 1), ("ring", "tpu", 0)])
def test_pallas_nan_in_one_token(rng, monkeypatch, schedule, variant, operand):
    """A NaN in one token's value (key, query) reaches what it reaches on one device —
    including through the tiles the kernel skips, as ``0·NaN`` does in a dense softmax."""
    case = make_case(rng, "causal", "mha", seq=16)
    operands = [np.asarray(x).copy() for x in case.operands]
    operands[operand][0, 9, 1, 3] = np.nan
    run(schedule, 4, "contiguous", type(case)(tuple(map(jnp.asarray, operands)), case.spec),
        monkeypatch, variant)


@pytest.mark.slow
@pytest.mark.parametrize("layout,kind,variant", [
    ("contiguous", "window", "tpu"), ("zigzag", "causal_window", "gpu")])
def test_pallas_halo(rng, monkeypatch, layout, kind, variant):
    """Halo's one kernel call per device (halos ‖ local keys) with the Pallas kernels."""
    run("halo", 4, layout, make_case(rng, kind, "gqa", seq=48), monkeypatch, variant)


@pytest.mark.slow
def test_pallas_double_ring(rng, monkeypatch):
    """The double ring's two rotations (inner ring per group, outer across groups) with the
    Pallas kernels: a causal GQA case under zigzag, every gradient."""
    run("double_ring", (2, 2), "zigzag", make_case(rng, "causal", "gqa", seq=16), monkeypatch,
        "gpu")
