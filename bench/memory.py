"""Per-device temporary memory of the Llama example under cp=8 vs one device.

Compiles ``value_and_grad`` of the loss with abstract shapes (nothing is allocated) and
reads XLA's memory analysis. Also lists the collectives of the compiled cp=8 program, to
check that no activation is all-gathered along the sequence (only the schedule's own
collectives and the gradient reductions appear).

    python bench/memory.py [--seq 32768] [--cp 8]

Prints a table and writes ``bench/results/memory.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=32768)
    parser.add_argument("--cp", type=int, default=8)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--schedule", default="ring")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "memory.json"))
    args = parser.parse_args()
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={args.cp}")
    sys.path.insert(0, str(ROOT))
    import jax
    import jax.numpy as jnp

    from cptransform import context_parallel
    from examples import llama

    cfg = llama.Config(vocab=256, dim=64, layers=args.layers, heads=8, kv_heads=2, mlp_dim=128)
    params = jax.eval_shape(lambda k: llama.init_params(k, cfg), jax.random.key(0))
    tokens = jax.ShapeDtypeStruct((1, args.seq), jnp.int32)
    loss = lambda p, t: llama.loss(p, t, cfg)  # noqa: E731

    single = jax.jit(jax.value_and_grad(loss)).lower(params, tokens).compile()
    cp_fn = context_parallel(loss, cp=args.cp, schedule=args.schedule)
    sharded = jax.jit(jax.value_and_grad(cp_fn)).lower(params, tokens).compile()
    m1, m2 = single.memory_analysis(), sharded.memory_analysis()
    hlo = sharded.as_text()
    collectives = {}
    for op in ("all-gather", "all-to-all", "collective-permute", "reduce-scatter",
               "all-reduce"):
        collectives[op] = len(re.findall(rf"= \S+ {op}(?:-start)?\(", hlo))
    gathers = [line.strip()[:160] for line in hlo.splitlines()
               if re.search(r"= \S+ all-gather(?:-start)?\(", line)]
    row = {
        "seq": args.seq, "cp": args.cp, "layers": args.layers, "schedule": args.schedule,
        "single_temp_bytes": m1.temp_size_in_bytes, "cp_temp_bytes": m2.temp_size_in_bytes,
        "ratio": m2.temp_size_in_bytes / m1.temp_size_in_bytes,
        "cp_collectives": collectives, "cp_all_gathers": gathers,
    }
    print(f"{'program':<22}{'temp bytes/device':>20}")
    print(f"{'single device':<22}{m1.temp_size_in_bytes:>20,}")
    print(f"{f'cp={args.cp} ({args.schedule})':<22}{m2.temp_size_in_bytes:>20,}")
    print(f"ratio: {row['ratio']:.4f}")
    print("collectives in the cp program:", collectives)
    for g in gathers:
        print("  all-gather:", g)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(row, indent=2))


if __name__ == "__main__":
    main()
