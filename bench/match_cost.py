"""Cost of matching attention vs tracing, for unrolled transformers of growing depth.

Builds a plain-JAX transformer (no scan: every layer is unrolled into the jaxpr) with
causal attention, RMSNorm and a gated MLP, then times ``jax.make_jaxpr`` against the
``canonicalize,match-attention`` pipeline. Prints a table and writes
``bench/results/match_cost.json``.

    python bench/match_cost.py [--layers 4 8 16 32] [--repeats 7]
"""
from __future__ import annotations

import argparse
import gc
import json
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np

from cptransform.op.attention import attention_p
from cptransform.ir.module import trace
from cptransform.ir.pipeline import Pipeline
from cptransform.passes import get_all_passes

PASSES = get_all_passes()

B, T, D, HEADS = 1, 64, 64, 4


def make_params(layers: int):
    rng = np.random.default_rng(0)
    w = lambda *s: jnp.asarray(rng.standard_normal(s) * 0.05, jnp.float32)  # noqa: E731
    return [dict(qkv=w(D, 3 * D), o=w(D, D), up=w(D, 4 * D), gate=w(D, 4 * D),
                 down=w(4 * D, D)) for _ in range(layers)]


def rms_norm(x):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def transformer(params, x):
    hd = D // HEADS
    causal = jnp.tril(jnp.ones((T, T), bool))
    for p in params:
        q, k, v = jnp.split(rms_norm(x) @ p["qkv"], 3, axis=-1)
        q, k, v = (t.reshape(B, T, HEADS, hd) for t in (q, k, v))
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(hd)
        s = jnp.where(causal, s, jnp.finfo(s.dtype).min)
        a = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)
        x = x + a.reshape(B, T, D) @ p["o"]
        h = rms_norm(x)
        x = x + (jax.nn.silu(h @ p["gate"]) * (h @ p["up"])) @ p["down"]
    return x


def best_of(fn, repeats: int) -> float:
    """Fastest of ``repeats`` runs (the machine is shared; the minimum is the least noisy)."""
    times = []
    for _ in range(repeats):
        gc.collect()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def measure(layers: int, repeats: int) -> dict:
    params = make_params(layers)
    x = jnp.ones((B, T, D), jnp.float32)
    # A fresh function object per run: make_jaxpr caches traces by function identity.
    trace_s = best_of(lambda: jax.make_jaxpr(lambda p, x: transformer(p, x))(params, x),
                      repeats)
    module = trace(transformer, params, x)
    canon = Pipeline.parse("canonicalize", available=PASSES)
    match = Pipeline.parse("match-attention", available=PASSES)
    canonical = canon.run(module).module
    canon_s = best_of(lambda: canon.run(module), repeats)
    match_s = best_of(lambda: match.run(canonical), repeats)
    out = match.run(canonical).module
    found = out.count(attention_p)
    if found != layers:
        raise SystemExit(f"{layers} layers: matched {found} attentions")
    stats = out.facts.match_stats
    return dict(layers=layers, trace_ms=trace_s * 1e3, canonicalize_ms=canon_s * 1e3,
                match_ms=match_s * 1e3, pipeline_ms=(canon_s + match_s) * 1e3,
                match_over_trace=match_s / trace_s,
                pipeline_over_trace=(canon_s + match_s) / trace_s,
                match_ms_per_layer=match_s * 1e3 / layers,
                equations=len(canonical.eqns),
                rule_seconds={k: v["seconds"] for k, v in stats.items()})


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[4, 8, 16, 32])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results" /
                                         "match_cost.json"))
    args = ap.parse_args(argv)
    rows = [measure(n, args.repeats) for n in args.layers]
    print(f"{'layers':>6} {'eqns':>6} {'trace ms':>9} {'canon ms':>9} {'match ms':>9} "
          f"{'match/trace':>11} {'(canon+match)/trace':>19} {'match ms/layer':>14}")
    for r in rows:
        print(f"{r['layers']:>6} {r['equations']:>6} {r['trace_ms']:>9.1f} "
              f"{r['canonicalize_ms']:>9.1f} {r['match_ms']:>9.1f} "
              f"{r['match_over_trace']:>11.2f} {r['pipeline_over_trace']:>19.2f} "
              f"{r['match_ms_per_layer']:>14.2f}")
    path = pathlib.Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(model=dict(batch=B, seq=T, d_model=D, heads=HEADS),
                                    rows=rows), indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
