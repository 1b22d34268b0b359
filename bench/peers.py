"""Our schedules against the JAX peers' rings on the CPU: the ``ringattention`` package's
pure-JAX ring and ejkernel's XLA ring attention.

One run, 8 simulated devices (cp=8), fp32, B=1, H=8, D=64; MHA (8 KV heads) and GQA
(2 KV heads, repeated to 8 for the peers, whose cores are MHA-only); causal and full masks,
a causal sliding window of ``--window`` keys (``window``: halo included; ejkernel's window,
``ringattention`` has none) and packed documents (``docs``: causal within 8 documents of
random lengths, as segment ids; both peers).
For each variant: time of the forward and of forward+backward (median of interleaved
repetitions: every variant runs once per round), per-device temporary memory from XLA's
memory analysis of the compiled program, and executed score entries of the slowest device
over the ideal per-device share (counted from the chunk classification for our
schedules, from the peers' chunk rule for theirs, everything for the dense
all-gather baseline). Ratios are against the best peer of each row (the faster one for
time, the leaner one for memory).

    python bench/peers.py [--seqs 2048,4096] [--reps 3] [--heads mha,gqa]
                          [--masks causal,full,window,docs] [--window 64] [--no-time]
                          [--skip allgather-dense] [--check]

``--check`` first compares every variant's output and q/k/v gradients with the one-device
dense attention (``attention_reference``; it holds ``S x S`` scores, so small S only) and
prints the worst error per row.

Prints a table and writes ``bench/results/peers.json``. The ``ringattention`` package
(``pip install --no-deps ringattention`` plus ``einops``) is imported with a stand-in for
``jax.lib.xla_bridge``, which its package init reads and current JAX no longer has.
ejkernel (``pip install ejkernel``; 0.0.80 supports JAX 0.10) is called through its
``_ring_attention`` with an explicit ``causal_block_size``: its public ``ring_attention``
passes none, and its causal gradients are then wrong (dQ off by 4.2 on unit-normal
inputs, forward exact).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CP = 8


def _import_ringattention():
    """``ringattention.ringattention_jax.ring_attention``, or ``None`` when not installed."""
    import jax
    if not hasattr(jax.lib, "xla_bridge"):
        # The package init asks jax.lib.xla_bridge for the platform (removed from JAX).
        jax.lib.xla_bridge = types.SimpleNamespace(get_backend=jax.extend.backend.get_backend)
    try:
        from ringattention.ringattention_jax import ring_attention
    except ImportError as err:
        print(f"ringattention unavailable ({err}); comparing against all-gather only")
        return None
    return ring_attention


def _import_ejkernel():
    """ejkernel's ``_ring_attention`` (the custom-VJP core), or ``None`` when not installed."""
    try:
        from ejkernel.kernels._xla.ring_attention._interface import _ring_attention
    except ImportError as err:
        print(f"ejkernel unavailable ({err})")
        return None
    return _ring_attention


#: The peers' variant names; ratios are against the best of them per row.
PEERS = ("ringattention", "ejkernel-ring")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", default="2048,4096")
    parser.add_argument("--heads", default="mha,gqa")
    parser.add_argument("--masks", default="causal,full")
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--no-time", action="store_true", help="memory and FLOPs only")
    parser.add_argument("--check", action="store_true", help="compare every variant's "
                        "output and gradients with the one-device dense attention (small S)")
    parser.add_argument("--skip", default="", help="comma-separated variants not to run "
                        "(allgather-dense holds S x S/cp scores: 32 GiB at 32K on 8 devices)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "peers.json"))
    args = parser.parse_args()
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={CP}")
    sys.path.insert(0, str(ROOT))
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from jax.sharding import PartitionSpec as P

    from cptransform.lowering.block import Block
    from cptransform.lowering.context_parallel_attention import context_parallel_attention
    from cptransform.analysis.block_work import DEFAULT_CHUNK, chunk_size
    from cptransform.lowering.halo import NO_KEY, pieces
    from cptransform.lowering.kernels.chunked import chunk_kinds
    from cptransform.op.mask_terms import BlockKind
    from cptransform.op.attention_reference import attention_reference
    from cptransform.op.attention_spec import AttentionSpec, Layout, MaskSpec
    from cptransform.op.layouts import SequenceLayout

    ring_attention = _import_ringattention()
    ej_ring = _import_ejkernel()
    h, d, batch = 8, 64, 1
    auto = jax.sharding.AxisType.Auto
    mesh = jax.make_mesh((CP,), ("cp",), axis_types=(auto,))
    mesh2 = jax.make_mesh((2, 4), ("uly", "ring"), axis_types=(auto, auto))
    bthd = Layout.parse("BTHD")
    masks = {"causal": MaskSpec(causal=True), "full": MaskSpec(),
             "window": MaskSpec(causal=True, window=(args.window, None)),
             "docs": MaskSpec(causal=True, segments=True)}

    def ours(schedule, layout):
        def run(q, k, v, mask, seg):
            spec = AttentionSpec(q=bthd, k=bthd, v=bthd, scale=1 / math.sqrt(d),
                                 groups=h // k.shape[2], mask=masks[mask])
            hybrid = schedule == "hybrid"
            return context_parallel_attention(
                q, k, v, *(() if seg is None else (seg, seg)), spec=spec,
                mesh=mesh2 if hybrid else mesh, axes=("uly", "ring") if hybrid else "cp",
                schedule=schedule, layout=layout)
        return run

    def repeat_heads(k, v):
        return (jnp.repeat(x, h // x.shape[2], axis=2) for x in (k, v))

    def peer_ring(q, k, v, mask, seg):
        causal = mask != "full"
        s_loc = q.shape[1] // CP
        chunk = min(512, s_loc)
        kwargs = dict(causal_block_size=1 if causal else None, query_chunk_size=chunk,
                      key_chunk_size=chunk, deterministic=True, dropout_rng=None,
                      attn_pdrop=0.0, dtype=jnp.float32, policy=None, precision=None,
                      prevent_cse=True)

        def local(q, k, v, seg):
            k, v = repeat_heads(k, v)
            return ring_attention(q, k, v, None, seg, None, "cp", True, kwargs)
        # The package predates varying-axis checks (its lax.cond branches disagree). Its
        # segment ids are the whole sequence's (it slices them at global chunk offsets).
        return jax.shard_map(local, mesh=mesh, in_specs=(P(None, "cp"),) * 3 + (P(),),
                             out_specs=P(None, "cp"), check_vma=False)(q, k, v, seg)

    def peer_ejkernel(q, k, v, mask, seg):
        chunk = min(512, q.shape[1] // CP)
        causal = mask != "full"
        # ejkernel's window is (left, right) on q - k; ours (window, None) under causal.
        window = (args.window, 0) if mask == "window" else None

        def local(q, k, v, seg):
            k, v = repeat_heads(k, v)   # the core is MHA-only (its public wrapper repeats)
            # Positional arguments of _ring_attention: bias, segment ids, positions, sinks,
            # axis, float32 logits, scale, chunks, causal block, deterministic, dropout
            # rng/rate, dtype, remat policy, precision, prevent_cse, window, soft-cap,
            # sink size, causal.
            # Its segment ids are the local shards (they travel with K/V).
            return ej_ring(q, k, v, None, seg, seg, None, None, None, "cp", True,
                           1 / math.sqrt(d), chunk, chunk, chunk if causal else None, True,
                           None, 0.0, jnp.float32, jax.checkpoint_policies.nothing_saveable,
                           lax.Precision.DEFAULT, True, window, None, 0, causal)
        return jax.shard_map(local, mesh=mesh, in_specs=P(None, "cp"),
                             out_specs=P(None, "cp"), check_vma=False)(q, k, v, seg)

    def dense_allgather(q, k, v, mask, seg):
        if mask in ("window", "docs"):
            raise NotImplementedError("the dense baseline has causal and full masks only")
        causal = mask == "causal"
        def local(q, k, v):
            k, v = (lax.all_gather(x, "cp", axis=1, tiled=True) for x in repeat_heads(k, v))
            s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
            if causal:
                t = q.shape[1]
                rows = lax.axis_index("cp") * t + jnp.arange(t)
                s = jnp.where(jnp.arange(k.shape[1])[None] <= rows[:, None], s, -jnp.inf)
            return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)
        return jax.shard_map(local, mesh=mesh, in_specs=P(None, "cp"),
                             out_specs=P(None, "cp"))(q, k, v)

    variants = {"ring-zigzag": ours("ring", "zigzag"),
                "ring-contiguous": ours("ring", "contiguous"),
                "ulysses": ours("ulysses", "contiguous"),
                "allgather": ours("allgather", "zigzag"),
                "hybrid-2x4": ours("hybrid", "zigzag"),
                "allgather-dense": dense_allgather,
                "halo-contiguous": ours("halo", "contiguous"),
                "halo-zigzag": ours("halo", "zigzag")}
    if ring_attention is not None:
        variants["ringattention"] = peer_ring
    if ej_ring is not None:
        variants["ejkernel-ring"] = peer_ejkernel

    skipped = set(filter(None, args.skip.split(",")))
    if skipped - set(variants):
        parser.error(f"unknown variants {sorted(skipped - set(variants))}; known: "
                     f"{', '.join(variants)}")

    def runs(name, mask):
        if name in skipped:
            return False
        if name.startswith("halo"):   # halo needs a window
            return mask == "window"
        # The dense baseline knows causal and full masks; ringattention has no window.
        return {"window": name not in ("allgather-dense", "ringattention"),
                "docs": name != "allgather-dense"}.get(mask, True)

    spec_of = lambda mask: AttentionSpec(q=bthd, k=bthd, v=bthd, scale=1.0,  # noqa: E731
                                         mask=masks[mask])

    def computed(q_pos, kv_pos, mask, seg):
        """Score entries the chunked kernel computes for one call (``seg``: the sequence's
        segment ids by position, or ``None``)."""
        z = lambda t: jnp.zeros((1, t, 1, 1))  # noqa: E731
        tq, tkv = len(q_pos), len(kv_pos)
        ids = lambda pos: None if seg is None else jnp.asarray(seg[pos])[None]  # noqa: E731
        block = Block(z(tq), z(tkv), z(tkv), jnp.asarray(q_pos)[None],
                      jnp.asarray(kv_pos)[None], ids(q_pos), ids(kv_pos))
        kinds = np.asarray(chunk_kinds(block, spec_of(mask)))
        return int(np.sum(kinds != BlockKind.SKIP)) * chunk_size(tq, DEFAULT_CHUNK) * \
            chunk_size(tkv, DEFAULT_CHUNK)

    def executed(name, s, mask, seg):
        """Score entries × heads of the slowest device, over the ideal per-device share."""
        causal = mask != "full"
        w = min(args.window, s - 1)
        lengths = np.bincount(seg) if seg is not None else np.array([s])
        visible = {"causal": s * (s + 1) / 2, "full": s * s,
                   "window": s * (w + 1) - w * (w + 1) / 2,
                   "docs": float(np.sum(lengths * (lengths + 1) / 2))}[mask]
        ideal = visible * h / CP
        if name == "allgather-dense":
            return s * s * h / CP / ideal
        if name in PEERS:   # both skip whole chunks above the diagonal (nothing else)
            loc, c = s // CP, min(512, s // CP)
            rows = np.arange(s // c)
            grid = rows[:, None] >= rows[None, :] if causal else np.ones((s // c,) * 2, bool)
            per = [grid[r * loc // c:(r + 1) * loc // c].sum() * c * c * h for r in range(CP)]
            return max(per) / ideal
        layout = "contiguous" if name in ("ring-contiguous", "ulysses", "halo-contiguous") \
            else "zigzag"
        pos = SequenceLayout(layout, s, CP).permutation()
        shard = lambda r, n=1: pos[r * s // CP:(r + n) * s // CP]  # noqa: E731
        work = lambda q_pos, kv_pos: computed(q_pos, kv_pos, mask, seg)  # noqa: E731
        if name == "ulysses":
            return work(pos, pos) * (h // CP) / ideal
        if name == "allgather":
            return max(work(shard(r), pos) for r in range(CP)) * h / ideal
        if name.startswith("halo"):
            def keys(r):   # the kernel's keys on rank r: halos and local keys
                return np.concatenate([
                    shard(r + p.shift)[p.offset:p.offset + p.width] if 0 <= r + p.shift < CP
                    else np.full(p.width, NO_KEY) for p in pieces(layout, s // CP, w, 0)])
            return max(work(shard(r), keys(r)) for r in range(CP)) * h / ideal
        if name == "ring-zigzag" or name == "ring-contiguous":
            return max(sum(work(shard(r), shard((r - i) % CP)) for i in range(CP))
                       for r in range(CP)) * h / ideal
        u, groups = 2, CP // 2   # hybrid: a Ulysses group holds U consecutive shards
        group = lambda g: shard(g * u, u)  # noqa: E731
        return max(sum(work(group(g), group((g - i) % groups))
                       for i in range(groups)) for g in range(groups)) * (h // u) / ideal

    def documents(s):
        """Segment ids ``[s]`` of 8 packed documents of random lengths (seeded by ``s``)."""
        cuts = np.sort(np.random.default_rng(s).choice(np.arange(1, s), 7, replace=False))
        return np.searchsorted(cuts, np.arange(s), side="right").astype(np.int32)

    def reference(q, k, v, mask, seg):
        """The one-device dense attention of the row, for ``--check``."""
        spec = AttentionSpec(q=bthd, k=bthd, v=bthd, scale=1 / math.sqrt(d),
                             groups=h // k.shape[2], mask=masks[mask])
        return attention_reference(q, k, v, *(() if seg is None else (seg, seg)), spec=spec)

    def compile_pair(fn, mask, *args):
        """``fn``'s forward and its q/k/v gradient (of ``sum(o * q)``), compiled on
        ``args = (q, k, v, seg)``."""
        fwd = jax.jit(lambda q, k, v, seg: fn(q, k, v, mask, seg))
        grad = jax.jit(jax.grad(lambda q, k, v, seg: jnp.sum(fn(q, k, v, mask, seg) * q),
                                argnums=(0, 1, 2)))
        return tuple(f.lower(*args).compile() for f in (fwd, grad))

    rng = np.random.default_rng(0)
    rows, timings = [], {}
    for s in [int(x) for x in args.seqs.split(",")]:
        for heads in args.heads.split(","):
            hkv = {"mha": h, "gqa": 2}[heads]
            q, k, v = (jnp.asarray(rng.normal(size=(batch, s, n, d)), jnp.float32)
                       for n in (h, hkv, hkv))
            for mask in args.masks.split(","):
                seg_np = documents(s) if mask == "docs" else None
                seg = None if seg_np is None else jnp.asarray(seg_np)[None]
                if args.check:
                    expected = [f(q, k, v, seg)
                                for f in compile_pair(reference, mask, q, k, v, seg)]
                compiled = {}
                for name, fn in variants.items():
                    if not runs(name, mask):
                        continue
                    fwd_c, grad_c = compiled[name] = compile_pair(fn, mask, q, k, v, seg)
                    row = dict(
                        seq=s, heads=heads, mask=mask, variant=name,
                        fwd_temp_mib=fwd_c.memory_analysis().temp_size_in_bytes / 2**20,
                        fwdbwd_temp_mib=grad_c.memory_analysis().temp_size_in_bytes / 2**20,
                        flops_over_ideal=executed(name, s, mask, seg_np))
                    if args.check:   # worst error of the output and q, k, v's gradients
                        got = (fwd_c(q, k, v, seg), grad_c(q, k, v, seg))
                        row["max_error"] = max(float(jnp.max(jnp.abs(a - b))) for a, b in
                                               zip(jax.tree.leaves(got),
                                                   jax.tree.leaves(expected)))
                    rows.append(row)
                if args.no_time:
                    continue
                for f in [c for pair in compiled.values() for c in pair]:
                    jax.block_until_ready(f(q, k, v, seg))  # warm up
                for _ in range(args.reps):   # interleaved: every variant once per round
                    for name, (fwd_c, grad_c) in compiled.items():
                        for kind, f in (("fwd", fwd_c), ("fwdbwd", grad_c)):
                            t0 = time.perf_counter()
                            jax.block_until_ready(f(q, k, v, seg))
                            timings.setdefault((s, heads, mask, name, kind), []).append(
                                time.perf_counter() - t0)
    for row in rows:
        for kind in ("fwd", "fwdbwd"):
            ts = timings.get((row["seq"], row["heads"], row["mask"], row["variant"], kind))
            row[f"{kind}_s"] = statistics.median(ts) if ts else None
            row[f"{kind}_reps_s"] = ts   # every repetition: the planner bench reads the spread
    def best_peer(key, r):
        """The best peer's ``key`` in ``r``'s row (seq, heads, mask), or ``None``."""
        got = [p[key] for p in rows if p["variant"] in PEERS and p.get(key)
               and (p["seq"], p["heads"], p["mask"]) == (r["seq"], r["heads"], r["mask"])]
        return min(got) if got else None

    for r in rows:
        for key in ("fwd_s", "fwdbwd_s", "fwd_temp_mib", "fwdbwd_temp_mib"):
            best = best_peer(key, r)
            r[f"{key}_over_best_peer"] = r[key] / best if best and r.get(key) else None
    header = (f"{'S':>5} {'heads':5} {'mask':6} {'variant':16} {'fwd s':>7} {'f+b s':>7} "
              f"{'f+b/peer':>8} {'fwd MiB':>8} {'f+b MiB':>8} {'mem/peer':>8} {'FLOPs/ideal':>11}")
    print(header)
    for r in rows:
        ratio = lambda key: ("-" if r[f"{key}_over_best_peer"] is None  # noqa: E731
                             else f"{r[f'{key}_over_best_peer']:.2f}")
        fmt = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
        print(f"{r['seq']:>5} {r['heads']:5} {r['mask']:6} {r['variant']:16} "
              f"{fmt(r['fwd_s']):>7} {fmt(r['fwdbwd_s']):>7} {ratio('fwdbwd_s'):>8} "
              f"{r['fwd_temp_mib']:>8.1f} {r['fwdbwd_temp_mib']:>8.1f} "
              f"{ratio('fwdbwd_temp_mib'):>8} {r['flops_over_ideal']:>11.3f}"
              + (f"  max error {r['max_error']:.1e}" if "max_error" in r else ""))
    Path(args.out).write_text(json.dumps(dict(
        measured=time.strftime("%Y-%m-%dT%H:%M:%S"),
        cp=CP, heads=h, head_dim=d, batch=batch, dtype="float32", chunk=DEFAULT_CHUNK,
        reps=args.reps, argv=sys.argv[1:], rows=rows), indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
