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

    python bench/compile_cost.py [--layers 8 16 32] [--seq 131072] [--cp 8] [--phases]

``--kernels xla,one-call`` compiles the transformed loss once per local-step kernel. Besides
the registered kernels, ``one-call`` is a stand-in registered by this bench only: each local
step's forward and backward is one opaque call (a ``jax.pure_callback`` of the right shapes,
never run), as a cuDNN or Pallas kernel is one custom call on a GPU or TPU. Against the
chunked XLA kernel (a CPU user's default, whose loops and branches XLA compiles per call
site) it separates what the schedule itself costs to compile from what the kernel costs.

``--phases`` also splits each XLA compile into its phases, read from a ``jax.profiler``
trace of the compile (:data:`PHASES`: Shardy and the SPMD partitioner, the HLO passes
around layout assignment, the backend's fusion compiles, LLVM code generation and the
thunk emission; they overlap where the backend compiles fusions in parallel), for three
programs: ``jax.jit``, ``jax.jit`` with the tokens sharded over the same ``cp`` devices
(XLA's own SPMD partitioning of the sequence: what a multi-device program pays anyway)
and ``@context_parallel``.

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


#: Compile phases read from the profiler trace: (label, event-name prefix).
PHASES = (("shardy", "shardy-xla"), ("spmd partitioner", "spmd-partitioner"),
          ("HLO passes to layout", "HLO passes through layout assignment"),
          ("HLO passes after layout", "HLO passes after layout assignment"),
          ("fusion compiles", "FusionCompiler::Compile"), ("LLVM codegen", "Codegen"),
          ("thunk emission", "ThunkEmitter::EmitEntryComputation"))


def compile_phases(lowered) -> dict:
    """``lowered.compile()`` under ``jax.profiler``: seconds per :data:`PHASES` entry, the
    whole compile as ``"total"`` and the fusions compiled as ``"fusions"``."""
    import glob
    import tempfile

    import jax
    from jax.profiler import ProfileData

    with tempfile.TemporaryDirectory() as trace:
        jax.profiler.start_trace(trace)
        _, total = _timed(lowered.compile)
        jax.profiler.stop_trace()
        data = ProfileData.from_file(sorted(glob.glob(f"{trace}/**/*.xplane.pb",
                                                      recursive=True))[-1])
    seconds = {label: 0.0 for label, _ in PHASES}
    fusions = 0
    for plane in data.planes:
        for line in plane.lines:
            for event in line.events:
                for label, prefix in PHASES:
                    if event.name.startswith(prefix):
                        seconds[label] += event.duration_ns / 1e9
                        fusions += label == "fusion compiles"
    return dict(seconds, total=total, fusions=fusions)


def register_one_call_kernel() -> str:
    """Register the ``one-call`` stand-in kernel (module doc) and return its name."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from cptransform.lowering.kernels import added_to, merged_into, register_kernel
    from cptransform.lowering.kernels.capabilities import Capabilities

    def opaque(shapes, *operands):
        shapes = tuple(jax.ShapeDtypeStruct(shape, jnp.float32) for shape in shapes)
        return jax.pure_callback(
            lambda *_: tuple(np.zeros(s.shape, np.float32) for s in shapes), shapes,
            *[x for x in operands if x is not None])

    class OneCallKernel:
        """Each local step one opaque call reading the step's operands."""

        name = "one-call"
        capabilities = Capabilities(dropout=False)

        def forward(self, block, spec, running=None):
            b, tq, h, _ = block.q.shape
            return merged_into(running, *opaque(
                [(b, tq, h, block.v.shape[-1]), (b, h, tq)],
                block.q, block.k, block.v, block.q_pos, block.kv_pos))

        def backward(self, block, o, lse, do, spec, dlse=None, delta=None, dq=None,
                     dk=None, dv=None):
            grads = opaque([block.q.shape, block.k.shape, block.v.shape], block.q, block.k,
                           block.v, o, lse, do, block.q_pos, block.kv_pos)
            return (*(added_to(running, g) for running, g in zip((dq, dk, dv), grads)),
                    None)

    return register_kernel(OneCallKernel()).name


def phase_table(phases: dict) -> str:
    """``{program: compile_phases(...)}`` as a table, one column per program."""
    names = list(phases)
    lines = [f"{'phase':26}" + "".join(f"{n:>14}" for n in names)]
    for label in [label for label, _ in PHASES] + ["total", "fusions"]:
        cells = [phases[n][label] for n in names]
        lines.append(f"{label:26}" + "".join(
            f"{c:14d}" if label == "fusions" else f"{c:13.2f}s" for c in cells))
    return "\n".join(lines)


def same_mesh_phases(args, loss, params, tokens) -> dict:
    """:func:`compile_phases` of ``jax.jit`` of ``value_and_grad(loss)``, alone and with the
    tokens sharded over ``args.cp`` devices by XLA's own SPMD partitioner."""
    import jax
    from jax.sharding import AxisType, NamedSharding, PartitionSpec

    mesh = jax.make_mesh((args.cp,), ("cp",), axis_types=(AxisType.Auto,))
    same_mesh = jax.jit(jax.value_and_grad(loss), in_shardings=(
        jax.tree.map(lambda _: NamedSharding(mesh, PartitionSpec()), params),
        NamedSharding(mesh, PartitionSpec(None, "cp"))))
    return {"jit": compile_phases(jax.jit(jax.value_and_grad(loss)).lower(params, tokens)),
            f"jit-{args.cp}dev": compile_phases(same_mesh.lower(params, tokens))}


def _row(layers, kind, kernel, args, stats, jit, cp) -> dict:
    """One result row (printed as it is made): ``jit`` and ``cp`` are (lower, compile)
    seconds."""
    row = dict(layers=layers, kind=kind, kernel=kernel, seq=args.seq, cp=args.cp,
               jit_lower_s=jit[0], jit_compile_s=jit[1], cp_lower_s=cp[0], cp_compile_s=cp[1],
               transform_s=stats.total_s, trace_s=stats.trace_s,
               passes_s={p.name: p.seconds for p in stats.passes}, ratio=sum(cp) / sum(jit))
    slowest = max(row["passes_s"].items(), key=lambda kv: kv[1])
    print(f"{layers:>3} {kind:<4} {kernel:<8}  jit {jit[0]:6.2f} + {jit[1]:6.2f} s   "
          f"cp {cp[0]:6.2f} + {cp[1]:6.2f} s (transform {stats.total_s:5.2f}, "
          f"slowest pass {slowest[0]} {slowest[1]:.2f})   ratio {row['ratio']:.2f}",
          flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--seq", type=int, default=131072)
    parser.add_argument("--cp", type=int, default=8)
    parser.add_argument("--schedule", default="ring")
    parser.add_argument("--kernels", default="xla",
                        help="comma-separated local-step kernels, each compiled: a registered "
                             "kernel or one-call (module doc)")
    parser.add_argument("--phases", action="store_true",
                        help="split each compile into XLA's phases (profiler trace)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "compile_cost.json"))
    args = parser.parse_args()
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={args.cp}")
    sys.path.insert(0, str(ROOT))
    import jax
    import jax.numpy as jnp

    from cptransform import context_parallel
    from examples import llama

    kernels = args.kernels.split(",")
    if "one-call" in kernels:
        register_one_call_kernel()

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
            lowered, jit_lower = _timed(
                lambda: jax.jit(jax.value_and_grad(loss)).lower(params, tokens))
            _, jit_compile = _timed(lowered.compile)
            baselines = same_mesh_phases(args, loss, params, tokens) if args.phases else {}
            phases = dict(baselines)
            for kernel in kernels:
                cp_fn = context_parallel(loss, cp=args.cp, schedule=args.schedule,
                                         kernel=kernel)
                lowered, cp_lower = _timed(
                    lambda: jax.jit(jax.value_and_grad(cp_fn)).lower(params, tokens))
                _, cp_compile = _timed(lowered.compile)
                row = _row(layers, kind, kernel, args, cp_fn.last_transform_stats,
                           jit=(jit_lower, jit_compile), cp=(cp_lower, cp_compile))
                if args.phases:
                    # Lowered again: a second compile of the same lowering may hit a cache.
                    phases[f"cp {kernel}"] = compile_phases(
                        jax.jit(jax.value_and_grad(cp_fn)).lower(params, tokens))
                    row["phases"] = {**baselines, f"cp {kernel}": phases[f"cp {kernel}"]}
                rows.append(row)
            if args.phases:
                print(phase_table(phases), flush=True)
    Path(args.out).write_text(json.dumps({"schedule": args.schedule, "rows": rows}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
