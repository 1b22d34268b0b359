"""Per-device communication of every schedule: counted from StableHLO vs the closed form.

Lowers ``context_parallel_attention`` (causal, zigzag, inputs in layout order) for each
schedule with abstract shapes (``jax.ShapeDtypeStruct``: nothing is allocated) on a mesh
of ``cp`` simulated CPU devices, counts the collectives of the lowered StableHLO (forward,
and forward + backward of ``jax.value_and_grad`` w.r.t. q, k, v), and prints them next to
:mod:`cptransform.analysis.cost_model`. Writes ``bench/results/comm.json``.

    python bench/comm.py [--seq 131072] [--heads 32] [--kv-heads 8 32] [--head-dim 128]
                         [--cp 8] [--dtype bfloat16] [--window W]

Writes ``bench/results/comm_window.json`` instead with ``--window``.

Each ``--kv-heads`` value is one configuration (the default runs GQA with 8 KV heads and
MHA). Hybrid runs every factorisation ``cp = u × r`` with ``1 < u, r`` and ``u | heads``.
``--window W`` makes the mask a causal sliding window of ``W`` keys back and adds the halo
schedule (when the window fits a zigzag chunk).
"""
from __future__ import annotations

import argparse
import os
import sys



def _device_count(argv) -> int:
    """``--cp`` from the command line, needed before JAX is imported."""
    for i, arg in enumerate(argv):
        if arg == "--cp" and i + 1 < len(argv):
            return int(argv[i + 1])
        if arg.startswith("--cp="):
            return int(arg.split("=", 1)[1])
    return 8


os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_"
                           f"device_count={_device_count(sys.argv)}").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json  # noqa: E402
import math  # noqa: E402
import pathlib  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import AxisType  # noqa: E402

from cptransform.op.attention_spec import AttentionSpec, Layout, MaskSpec  # noqa: E402
from cptransform.analysis.attention_shape import AttentionShape  # noqa: E402
from cptransform.lowering.schedule import schedules  # noqa: E402
from cptransform.lowering.collectives import lower_and_count  # noqa: E402
from cptransform.lowering.context_parallel_attention import \
    context_parallel_attention  # noqa: E402

MiB = 2 ** 20
RESULTS = pathlib.Path(__file__).parent / "results" / "comm.json"


def plans(cp: int, heads: int, window: int | None = None, seq: int = 0):
    """``(schedule, mesh shape, axis names)`` for every schedule that fits."""
    out = [("ring", (cp,), ("cp",)), ("allgather", (cp,), ("cp",))]
    if window is not None and window <= seq // (2 * cp):
        out.append(("halo", (cp,), ("cp",)))
    if heads % cp == 0:
        out.insert(1, ("ulysses", (cp,), ("cp",)))
    for u in range(2, cp):
        if cp % u == 0 and cp // u > 1 and heads % u == 0:
            out.append(("hybrid", (u, cp // u), ("uly", "ring")))
    return out


def measure(schedule, shape, names, *, seq, heads, kv_heads, head_dim, dtype,
            window=None) -> dict:
    """Counted and closed-form bytes per device of one schedule."""
    devices = jax.devices()[:math.prod(shape)]
    mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape),
                         devices=devices)
    bthd = Layout.parse("BTHD")
    spec = AttentionSpec(q=bthd, k=bthd, v=bthd, scale=1.0 / math.sqrt(head_dim),
                         groups=heads // kv_heads,
                         mask=MaskSpec(causal=True, window=None if window is None else
                                       (window, None)))
    abstract = [jax.ShapeDtypeStruct((1, seq, n, head_dim), dtype)
                for n in (heads, kv_heads, kv_heads)]
    axes = names[0] if len(names) == 1 else names

    def forward(q, k, v):
        return context_parallel_attention(q, k, v, spec=spec, mesh=mesh, axes=axes,
                                          schedule=schedule, layout="zigzag",
                                          in_layout_order=True)

    def loss(q, k, v):
        return jnp.sum(forward(q, k, v).astype(jnp.float32))

    fwd = lower_and_count(forward, *abstract)
    both = lower_and_count(jax.value_and_grad(loss, argnums=(0, 1, 2)), *abstract)
    formula = schedules()[schedule].volume(AttentionShape(
        seq_len=seq, heads=heads, kv_heads=kv_heads, head_dim=head_dim, cp=math.prod(shape),
        ulysses=shape[0] if schedule == "hybrid" else 1, dtype_bytes=jnp.dtype(dtype).itemsize,
        layout="zigzag", band=spec.mask.band()))
    counted_bwd = both.per_device_bytes - fwd.per_device_bytes
    return {
        "schedule": schedule, "mesh": dict(zip(names, shape)),
        "forward_bytes": fwd.per_device_bytes, "forward_formula": formula.forward_total,
        "forward_payload_formula": formula.payload_bytes(),
        "backward_bytes": counted_bwd, "backward_formula": formula.backward_total,
        "forward_by_kind": fwd.bytes_by_kind(), "forward_counts": fwd.counts(),
        "backward_by_kind": {k: both.bytes_by_kind().get(k, 0) - fwd.bytes_by_kind().get(k, 0)
                             for k in both.bytes_by_kind()},
        "equal": fwd.per_device_bytes == formula.forward_total
        and counted_bwd == formula.backward_total
        and fwd.bytes_by_kind() == formula.forward,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=128 * 1024)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--cp", type=int, default=8)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--window", type=int, default=None,
                        help="causal sliding window of this many keys back (adds halo)")
    args = parser.parse_args(argv)
    if len(jax.devices()) < args.cp:
        parser.error(f"--cp {args.cp} needs {args.cp} devices, JAX sees {len(jax.devices())}")
    dtype = jnp.dtype(args.dtype)
    rows = []
    header = (f"{'kv heads':>8} {'schedule':<10} {'mesh':<14} {'fwd counted':>16} "
              f"{'fwd formula':>16} {'fwd MiB':>9} {'payload MiB':>11} {'bwd counted':>16} {'bwd formula':>16} "
              f"{'bwd MiB':>9}  equal")
    mask = "causal" if args.window is None else f"causal window {args.window}"
    print(f"s={args.seq} heads={args.heads} head_dim={args.head_dim} cp={args.cp} {dtype.name}; "
          f"bytes per device per attention ({mask}, zigzag); payload = q/k/v/o only, "
          "without positions")
    print(header)
    for kv_heads in args.kv_heads:
        for schedule, shape, names in plans(args.cp, args.heads, args.window, args.seq):
            row = measure(schedule, shape, names, seq=args.seq, heads=args.heads,
                          kv_heads=kv_heads, head_dim=args.head_dim, dtype=dtype,
                          window=args.window)
            row.update(kv_heads=kv_heads, seq=args.seq, heads=args.heads,
                       head_dim=args.head_dim, cp=args.cp, dtype=dtype.name)
            rows.append(row)
            mesh = "x".join(f"{n}{s}" for n, s in row["mesh"].items())
            print(f"{kv_heads:>8} {schedule:<10} {mesh:<14} {row['forward_bytes']:>16,} "
                  f"{row['forward_formula']:>16,} {row['forward_bytes'] / MiB:>9.2f} "
                  f"{row['forward_payload_formula'] / MiB:>11.2f} "
                  f"{row['backward_bytes']:>16,} {row['backward_formula']:>16,} "
                  f"{row['backward_bytes'] / MiB:>9.2f}  {row['equal']}")
    out = RESULTS if args.window is None else RESULTS.with_name("comm_window.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1) + "\n")
    print(f"wrote {out}")
    return 0 if all(r["equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
