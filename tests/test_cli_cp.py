"""The CLI's context-parallel side: opt --cp/--grad and plan, run as a user would."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def cli(*args):
    return subprocess.run([sys.executable, "-m", "cptransform.api.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_plan_draws_the_ring_and_balance():
    out = cli("plan", "examples/llama.py:make", "--cp", "4", "--load-balance", "none",
              "--schedule", "ring")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    start = lines.index("attention #0 (ring):")
    chart = lines[start + 1:start + 9]
    assert chart[1].split() == ["step", "0", "1", "2", "3"]
    assert chart[2].split() == ["device", "0", "+", ".", ".", "."]
    assert chart[5].split() == ["device", "3", "+", "#", "#", "#"]
    # Executed tiles (8-token tiles on 16-token shards: 3, 7, 11, 15), as the planner counts.
    assert "slowest device: 1.67x the mean" in out.stdout
    assert "* contiguous 0.33 0.78 1.22 1.67  max/mean 1.67x" in out.stdout
    assert "  zigzag     1.00 1.00 1.00 1.00  max/mean 1.00x" in out.stdout
    assert "schedule: ring — requested" in out.stdout and "llama.py" in out.stdout
    assert "predicted per device: ring: " in out.stdout  # the chosen one; --verbose: all


@pytest.mark.slow
def test_plan_prices_on_the_named_hardware():
    out = cli("plan", "examples/llama.py:make", "--cp", "4", "--hardware", "h100",
              "--memory-limit", "50%")
    assert out.returncode == 0, out.stderr
    assert "least predicted time on h100" in out.stdout


@pytest.mark.slow
def test_opt_with_cp_lowers_and_prints_the_gradient_program():
    out = cli("opt", "examples/llama.py:make", "--cp", "4", "--schedule", "ulysses",
              "--print-ir-after=lower-context-parallel", "--grad")
    assert out.returncode == 0, out.stderr
    assert "# ----- IR after lower-context-parallel -----" in out.stdout
    lowered, grad = out.stdout.split("# ----- IR of jax.grad (w.r.t. argument 0) -----")
    assert "shard_map[" in lowered and "all_to_all[" in lowered
    assert "attention[" not in lowered
    assert grad.count("all_to_all[") >= 8  # forward q, k, v, o and their transposes


@pytest.mark.slow
def test_grad_program_shows_the_pallas_dq_and_dkv_kernels():
    """--kernel pallas --grad: the backward holds the Q-major dQ and the KV-major dK/dV
    pallas_calls (named, with their grids), besides the forward's."""
    out = cli("opt", "examples/llama.py:make", "--cp", "4", "--schedule", "ulysses",
              "--kernel", "pallas", "--grad")
    assert out.returncode == 0, out.stderr
    grad = out.stdout.split("# ----- IR of jax.grad (w.r.t. argument 0) -----")[1]
    calls = grad.split("pallas_call[")[1:]
    names = {call.split("name=")[1].split()[0] for call in calls}
    assert {"cp_attention_fwd", "cp_attention_dq", "cp_attention_dkv"} <= names
    assert all("grid_mapping=GridMapping(grid=(" in call for call in calls)


@pytest.mark.slow
def test_bad_schedule_is_one_line():
    out = cli("opt", "examples/llama.py:make", "--cp", "8", "--schedule", "ulysses")
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1
    assert "Ulysses splits the 4 query heads over cp=8" in out.stderr


@pytest.mark.slow
def test_hybrid_over_two_named_axes():
    out = cli("opt", "examples/llama.py:make", "--axis", "uly,ring", "--mesh", "2,4",
              "--load-balance", "zigzag", "--print-ir-after=plan-context-parallel")
    assert out.returncode == 0, out.stderr
    assert "schedule=hybrid layout=zigzag" in out.stdout


@pytest.mark.slow
def test_mesh_sizes_must_match_axes():
    out = cli("opt", "examples/llama.py:make", "--axis", "uly,ring", "--mesh", "8")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "cptransform: error: --mesh '8' must give one positive size per --axis name uly,ring"]


@pytest.mark.slow
def test_plan_png(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "plan.png"
    out = cli("plan", "examples/llama.py:make", "--cp", "4", "--png", str(png))
    assert out.returncode == 0, out.stderr
    assert f"wrote {png}" in out.stdout and png.read_bytes()[:4] == b"\x89PNG"
