"""What the transform costs at compile time, against ``jax.jit`` of the same loss.

For the Llama example (RoPE, GQA, SwiGLU) with ``L`` layers, run as a Python loop (every
layer unrolled into the program) and as a ``lax.scan`` (one layer body), with abstract
inputs (nothing is allocated), times

* ``jax.jit(jax.value_and_grad(loss))``: lowering, then XLA's compile;
* the same of ``context_parallel(loss, cp=..., schedule=...)``: lowering (which traces the
  function, runs the pipeline and lowers the result; the transform's own part is read from
  ``fn.last_transform_stats``: tracing and each pass), then XLA's compile.

One run, the two programs interleaved per row; the table gives each phase in seconds and
the ratio of the totals. Transform time should grow linearly in the layers of a loop and
stay flat for a scan.

    python bench/compile_cost.py [--layers 8 16 32] [--seq 131072] [--cp 8]

Prints a table and writes ``bench/results/compile_cost.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--seq", type=int, default=131072)
    parser.add_argument("--cp", type=int, default=8)
    parser.add_argument("--schedule", default="ring")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "compile_cost.json"))
    args = parser.parse_args()
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={args.cp}")
    sys.path.insert(0, str(ROOT))
    import jax
    import jax.numpy as jnp

    from cptransform import context_parallel
    from examples import llama

    def unrolled_loss(params, tokens, cfg):
        """``llama.loss`` with its layers in a Python loop instead of ``lax.scan``."""
        x = params["embed"][tokens]
        for i in range(cfg.layers):
            x = llama.block(x, jax.tree.map(lambda w: w[i], params["layers"]), cfg)
        logits = (llama.rms_norm(x, params["final_norm"], cfg.norm_eps)
                  @ params["unembed"]).astype(jnp.float32)[:, :-1]
        logp = jax.nn.log_softmax(logits, axis=-1)
        picked = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
        return -jnp.mean(picked)

    rows = []
    for layers in args.layers:
        cfg = llama.Config(vocab=256, dim=128, layers=layers, heads=8, kv_heads=2,
                           mlp_dim=256)
        params = jax.eval_shape(lambda k, c=cfg: llama.init_params(k, c), jax.random.key(0))
        tokens = jax.ShapeDtypeStruct((1, args.seq), jnp.int32)
        for kind, body in (("scan", llama.loss), ("loop", unrolled_loss)):
            def loss(p, t, body=body, cfg=cfg):
                return body(p, t, cfg)
            cp_fn = context_parallel(loss, cp=args.cp, schedule=args.schedule)
            lowered, jit_lower = _timed(
                lambda: jax.jit(jax.value_and_grad(loss)).lower(params, tokens))
            _, jit_compile = _timed(lowered.compile)
            lowered, cp_lower = _timed(
                lambda: jax.jit(jax.value_and_grad(cp_fn)).lower(params, tokens))
            _, cp_compile = _timed(lowered.compile)
            stats = cp_fn.last_transform_stats
            row = dict(layers=layers, kind=kind, seq=args.seq, cp=args.cp,
                       jit_lower_s=jit_lower, jit_compile_s=jit_compile,
                       cp_lower_s=cp_lower, cp_compile_s=cp_compile,
                       transform_s=stats.total_s, trace_s=stats.trace_s,
                       passes_s={p.name: p.seconds for p in stats.passes},
                       ratio=(cp_lower + cp_compile) / (jit_lower + jit_compile))
            rows.append(row)
            slowest = max(row["passes_s"].items(), key=lambda kv: kv[1])
            print(f"{layers:>3} {kind:<4}  jit {jit_lower:6.2f} + {jit_compile:6.2f} s   "
                  f"cp {cp_lower:6.2f} + {cp_compile:6.2f} s (transform {stats.total_s:5.2f}, "
                  f"slowest pass {slowest[0]} {slowest[1]:.2f})   ratio {row['ratio']:.2f}",
                  flush=True)
    Path(args.out).write_text(json.dumps({"schedule": args.schedule, "rows": rows}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
