"""``kernel="pallas"`` through the schedules in interpret mode, where the conformance
suite (``test_conformance.py``: every schedule × layout × mask term with each kernel) does
not go: the ``empty_rows`` contracts, NaN in one token, halo at 48 tokens and the double
ring under the GPU-style variant. The kernel-level tests are in ``test_pallas_kernels.py``.
"""
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh
from schedule_cases import check_schedule, make_case, schedule_axes


def run(schedule, shape, layout, case, monkeypatch, variant):
    monkeypatch.setenv("CPTRANSFORM_PALLAS_VARIANT", variant)
    axes = schedule_axes(schedule)
    shape = shape if isinstance(shape, tuple) else (shape,)
    check_schedule(case, mesh=make_mesh(shape, axes), axes=axes, schedule=schedule,
                   layout=layout, kernel="pallas")


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
