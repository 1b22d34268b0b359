"""What one ring step's collective-permute costs on this machine, with no attention around it.

A ``lax.scan`` of ``n`` ring rotations (rank r → r + 1) of a ``[1, S/cp, H, 2·D]`` K/V
shard (fp32; what one ring step sends), for n in ``--steps``; the time per step is the
slope. On simulated CPU devices every permute is a rendezvous of all device threads, so
this is the floor a ring pays per step whatever its kernel does (the peers too: the
``ringattention`` package sends K and V as two permutes per step).

    python bench/permute_latency.py [--seq 2048] [--steps 1,7,14] [--reps 20]

Prints a table and writes ``bench/results/permute_latency.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CP = 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--steps", default="1,7,14")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "permute_latency.json"))
    args = parser.parse_args()
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={CP}")
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((CP,), ("cp",), axis_types=(jax.sharding.AxisType.Auto,))
    kv = jnp.ones((1, args.seq, args.heads, 2 * args.head_dim), jnp.float32)
    perm = [(j, (j + 1) % CP) for j in range(CP)]
    rows = []
    for n in [int(x) for x in args.steps.split(",")]:
        def local(x, n=n):
            # The multiply keeps XLA from folding consecutive permutes into one.
            return lax.scan(lambda c, _: (lax.ppermute(c, "cp", perm) * 1.0001, None), x,
                            None, length=n)[0]
        ring = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P(None, "cp"),
                                     out_specs=P(None, "cp")))
        jax.block_until_ready(ring(kv))
        times = []
        for _ in range(args.reps):
            start = time.perf_counter()
            jax.block_until_ready(ring(kv))
            times.append(time.perf_counter() - start)
        rows.append(dict(steps=n, median_s=statistics.median(times), min_s=min(times)))
        print(f"{n:>3} permutes: median {rows[-1]['median_s'] * 1e3:7.2f} ms, "
              f"min {rows[-1]['min_s'] * 1e3:7.2f} ms", flush=True)
    first, last = rows[0], rows[-1]
    per_step = (last["median_s"] - first["median_s"]) / max(1, last["steps"] - first["steps"])
    print(f"per permute (slope of the medians): {per_step * 1e3:.2f} ms")
    Path(args.out).write_text(json.dumps(dict(
        measured=time.strftime("%Y-%m-%dT%H:%M:%S"), cp=CP, seq=args.seq, heads=args.heads,
        head_dim=args.head_dim, per_permute_s=per_step, rows=rows), indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
