"""Factorised space-time attention: the communication of the planner's one-model plan
against the plan that shards every attention along its own sequence.

The program is ``tests/test_vision_video.py``'s ``space_time_loss`` (per layer, spatial
attention within each frame, then temporal attention across the frames of each patch, as
5-D einsums on ``[B, T, P, C]``, RoPE through a ``[B·T, P]`` reshape). With one value
holding both sequences, ``plan-context-parallel`` shards one of them and runs the
attention whose batch holds it locally (``cptransform/analysis/sharded_sequence.py``);
without that decision (``choose`` answering ``None``, what the planner did before) each
attention is sharded along its own sequence and XLA moves q, k, v and o between the two
shardings. Counts the collectives of the *compiled* forward + backward (the all-to-alls
the partitioner inserts between shardings appear only there) and the bytes of their
results, per device. Writes ``bench/results/space_time.json``.

    python bench/space_time.py [--frames 16] [--patches 16] [--layers 2]
"""
from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import re  # noqa: E402
from unittest import mock  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
import test_vision_video as model  # noqa: E402

from cptransform import context_parallel  # noqa: E402

RESULTS = pathlib.Path(__file__).parent / "results" / "space_time.json"
KINDS = ("all-to-all", "all-gather", "collective-permute", "reduce-scatter", "all-reduce")
DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "pred": 1}


def collectives(hlo: str) -> dict:
    """Per kind of collective in compiled HLO text: how many, and the bytes of their
    results (per device)."""
    out = {k: {"count": 0, "bytes": 0} for k in KINDS}
    for line in hlo.splitlines():
        for kind in KINDS:
            match = re.search(rf"= (.*?) {kind}(?:-start)?\(", line)
            if match:
                out[kind]["count"] += 1
                out[kind]["bytes"] += sum(
                    DTYPE_BYTES.get(t, 4) * int(np.prod([int(d) for d in dims.split(",") if d]))
                    for t, dims in re.findall(r"(\w+)\[([\d,]*)\]", match.group(1)))
    return out


def measure(args, schedule: str, load_balance: str, one_model: bool) -> dict:
    loss = model.space_time_loss
    if one_model:
        f = context_parallel(loss, cp=8, schedule=schedule, load_balance=load_balance)
        hlo = jax.jit(jax.value_and_grad(f)).lower(*args).compile().as_text()
        plan = [p.schedule for p in f.module(*args).facts.plan]
    else:
        with mock.patch("cptransform.passes.plan_context_parallel.choose",
                        lambda *a, **k: None):
            f = context_parallel(loss, cp=8, schedule=schedule, load_balance=load_balance)
            hlo = jax.jit(jax.value_and_grad(f)).lower(*args).compile().as_text()
            plan = [p.schedule for p in f.module(*args).facts.plan]
    return {"schedule": schedule, "load_balance": load_balance,
            "plan": "one model" if one_model else "each along its own sequence",
            "attentions": plan, "collectives": collectives(hlo)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--frames", type=int, default=16)
    parser.add_argument("--patches", type=int, default=16)
    parser.add_argument("--layers", type=int, default=2)
    opts = parser.parse_args()
    model.FRAMES, model.PATCHES = opts.frames, opts.patches
    args = model.space_time_args(np.random.default_rng(0), layers=opts.layers)
    rows = [measure(args, schedule, balance, one)
            for schedule, balance in (("ring", "none"), ("ring", "zigzag"), ("auto", "auto"))
            for one in (False, True)]
    print(f"factorised space-time attention, B={model.B} T={opts.frames} P={opts.patches} "
          f"C={model.C}, {opts.layers} layers, cp=8; compiled fwd+bwd, per device")
    print(f"{'schedule':>16} {'plan':>28} " + " ".join(f"{k:>20}" for k in KINDS))
    for row in rows:
        cells = " ".join(f"{c['count']:>5} / {c['bytes'] / 2**10:>9.1f} KiB"
                         for c in row["collectives"].values())
        print(f"{row['schedule'] + '/' + row['load_balance']:>16} {row['plan']:>28} {cells}")
    RESULTS.write_text(json.dumps({"frames": opts.frames, "patches": opts.patches,
                                   "layers": opts.layers, "rows": rows}, indent=1))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
