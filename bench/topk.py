"""Top-k attention's local step: the dense sweep against the gather path, as S grows at fixed k.

One device, the XLA kernel (``ChunkedKernel``), a causal top-k mask of ``k`` picks per query
(``bench/kernels.py``'s indexer mix: half near the query, half anywhere before it), shared by
the heads as DeepSeek-V3.2's indexer shares them. For each ``S`` it times forward then
backward from the forward's ``o``/``lse`` (what a schedule runs) for

* ``sweep``: ``ChunkedKernel(gather_topk=False)``, the chunk-pair sweep that computes every
  ``[cq, ck]`` tile some pick reaches (cost ``~S²``: an indexer's picks reach almost every
  key chunk);
* ``gather``: ``ChunkedKernel()``, which computes the ``k`` picks of each query
  (``lowering/kernels/topk_gather.py``, cost ``~S·k``).

The two are checked against each other (forward and the three gradients, relative error)
before timing. Each row gives the median wall time of ``--repeats`` runs after one warm-up,
the compile time, and the time per score entry computed: ``sweep / S²`` and
``gather / (S·k)``, roughly constant when the cost follows those.

    python bench/topk.py                     # S = 1K, 2K, 4K, 8K at k = 64 (CPU: minutes)
    python bench/topk.py --seqs 512 1024     # quicker

Prints a table and writes ``bench/results/topk-<device>.json``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from kernels import topk_mask  # noqa: E402
from cptransform.lowering.block import Block  # noqa: E402
from cptransform.lowering.kernels.chunked import ChunkedKernel  # noqa: E402
from cptransform.op.attention_spec import AttentionSpec, Layout, MaskSpec  # noqa: E402
from cptransform.op.layouts import SequenceLayout  # noqa: E402

BTHD = Layout.parse("BTHD")
PATHS = {"sweep": ChunkedKernel(gather_topk=False), "gather": ChunkedKernel()}


def problem(seq: int, k: int, heads: int, kv_heads: int, dim: int):
    """``(block, spec, do)``: random float32 operands of one device holding all ``seq``
    tokens, positions built as a schedule builds them (so no run-time position check)."""
    rng = np.random.default_rng(0)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    idx, _, _ = topk_mask(seq, 128, k=k)
    pos = jnp.arange(seq, dtype=jnp.int32)[None]
    block = Block(q=normal(1, seq, heads, dim), k=normal(1, seq, kv_heads, dim),
                  v=normal(1, seq, kv_heads, dim), q_pos=pos, kv_pos=pos, topk=idx)
    spec = AttentionSpec(BTHD, BTHD, BTHD, scale=dim ** -0.5, groups=heads // kv_heads,
                         mask=MaskSpec(causal=True, topk=True), positions=True,
                         kv_positions_layout=SequenceLayout("contiguous", seq, 1))
    return block, spec, normal(1, seq, heads, dim)


def step(kernel, spec):
    """Forward, then the backward from its ``o``/``lse``: ``(o, dq, dk, dv)``."""
    def run(block, do):
        o, lse = kernel.forward(block, spec)
        dq, dk, dv, _ = kernel.backward(block, o, lse, do, spec)
        return o, dq, dk, dv
    return jax.jit(run)


def relative(got, want) -> float:
    return float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))


def measure(seq: int, args) -> dict:
    """One row: both paths' compile and run times at ``seq`` tokens, and their agreement."""
    block, spec, do = problem(seq, args.k, args.heads, args.kv_heads, args.dim)
    row = {"seq": seq, "k": args.k}
    outputs = {}
    for name, kernel in PATHS.items():
        fn = step(kernel, spec)
        start = time.perf_counter()
        compiled = fn.lower(block, do).compile()
        row[f"{name}_compile_s"] = time.perf_counter() - start
        outputs[name] = jax.block_until_ready(compiled(block, do))
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            jax.block_until_ready(compiled(block, do))
            times.append(time.perf_counter() - start)
        row[f"{name}_s"] = statistics.median(times)
    row["max_relative_error"] = max(relative(g, w) for g, w in
                                    zip(outputs["gather"], outputs["sweep"]))
    row["sweep_ns_per_s2"] = row["sweep_s"] / seq ** 2 * 1e9
    row["gather_ns_per_sk"] = row["gather_s"] / (seq * args.k) * 1e9
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--k", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=1)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    device = jax.devices()[0].device_kind.replace(" ", "_").lower()
    print(f"{device}, B=1 H={args.heads} Hkv={args.kv_heads} D={args.dim} k={args.k}, "
          "forward + backward, float32")
    print(f"{'S':>6} {'sweep s':>9} {'gather s':>9} {'speedup':>8} {'sweep ns/S²':>12} "
          f"{'gather ns/(S·k)':>16} {'max rel err':>12}")
    rows = []
    for seq in args.seqs:
        row = measure(seq, args)
        rows.append(row)
        print(f"{seq:>6} {row['sweep_s']:>9.3f} {row['gather_s']:>9.3f} "
              f"{row['sweep_s'] / row['gather_s']:>8.1f} {row['sweep_ns_per_s2']:>12.3f} "
              f"{row['gather_ns_per_sk']:>16.3f} {row['max_relative_error']:>12.1e}", flush=True)
    out = args.out or ROOT / "bench" / "results" / f"topk-{device}.json"
    config = {k: v for k, v in vars(args).items() if k != "out"}
    out.write_text(json.dumps({"device": device, "jax": jax.__version__, "config": config,
                               "rows": rows}, indent=1) + "\n")
    print(f"wrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")
    bad = [r["seq"] for r in rows if r["max_relative_error"] > 1e-4]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
