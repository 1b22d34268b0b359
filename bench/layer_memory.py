"""Per-device temporary memory of one 8B-like attention layer at very long lengths.

Compiles ``grad`` of ``sum(dot_product_attention(q, k, v, is_causal=True))`` for an
8B-like layer (32 query heads, 8 KV heads, head dim 128, bf16, batch 1) under
``@context_parallel`` with abstract shapes (nothing is allocated) on ``cp`` simulated CPU
devices, and reads XLA's memory analysis: temp bytes per device beside the arguments'.

    python bench/layer_memory.py [--cases 1048576:64,4194304:256] [--schedule ring]

Each case runs in its own process (the simulated device count is fixed per process).
Prints a table and writes ``bench/results/layer_memory.json``.

XLA's CPU backend runs bf16 collectives in float32 (it converts before and after each
collective-permute), so these figures hold float32 copies a GPU or TPU program does not:
they bound the accelerator's from above.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: The layer: query heads, KV heads, head dim.
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128

_ONE_CASE = """
import json, os, sys
seq, cp, schedule, load_balance = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={cp}"
import jax, jax.numpy as jnp
from cptransform import context_parallel
heads, kv_heads, head_dim = (int(x) for x in sys.argv[5:8])
def loss(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True).astype(jnp.float32).sum()
shapes = [jax.ShapeDtypeStruct((1, seq, h, head_dim), jnp.bfloat16)
          for h in (heads, kv_heads, kv_heads)]
f = context_parallel(loss, cp=cp, schedule=schedule, load_balance=load_balance)
m = jax.jit(jax.grad(f, argnums=(0, 1, 2))).lower(*shapes).compile().memory_analysis()
print(json.dumps(dict(temp=m.temp_size_in_bytes, arguments=m.argument_size_in_bytes,
                      outputs=m.output_size_in_bytes)))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="1048576:64,4194304:256",
                        help="comma-separated SEQ:CP pairs")
    parser.add_argument("--schedule", default="ring")
    parser.add_argument("--load-balance", default="zigzag")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "layer_memory.json"))
    args = parser.parse_args()
    rows = []
    print(f"{'tokens':>9} {'cp':>4} {'tokens/dev':>10} {'temp GiB':>9} {'args GiB':>9}")
    for case in args.cases.split(","):
        seq, cp = (int(x) for x in case.split(":"))
        out = subprocess.run(
            [sys.executable, "-c", _ONE_CASE, str(seq), str(cp), args.schedule,
             args.load_balance, str(HEADS), str(KV_HEADS), str(HEAD_DIM)],
            capture_output=True, text=True, check=True, cwd=ROOT)
        m = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append(dict(seq=seq, cp=cp, schedule=args.schedule,
                         load_balance=args.load_balance, temp_bytes=m["temp"],
                         argument_bytes=m["arguments"], output_bytes=m["outputs"]))
        print(f"{seq:>9} {cp:>4} {seq // cp:>10} {m['temp'] / 2**30:>9.3f} "
              f"{m['arguments'] / 2**30:>9.3f}")
    Path(args.out).write_text(json.dumps(dict(
        heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype="bfloat16", batch=1,
        backend="cpu (simulated devices, abstract shapes)", argv=sys.argv[1:], rows=rows),
        indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
