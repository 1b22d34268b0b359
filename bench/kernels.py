"""Local-step kernel throughput: the Pallas kernel next to cuDNN and XLA attention.

Forward and forward+backward TFLOP/s at B=1, H=16, D=128, bf16, S ∈ {8K, 32K}, for a causal
mask, no mask, a random block-sparse mask (128 × 128 blocks, 10% of them visible), and a
DeepSeek-style top-k indexer mask (each query's ``S/64`` indices among its causal keys, half
of them in its own and the previous 128-block, half anywhere before), for

* ``pallas``: this package's ``"pallas"`` kernel (the GPU variant on a GPU), forward then
  backward from the forward's ``o``/``lse`` (what a schedule runs); the top-k mask as
  ``topk_indices`` (the kernels' selection of each call's keys, tiles no index reaches
  skipped);
* ``cudnn`` / ``xla``: ``jax.nn.dot_product_attention(implementation=...)``, ``jax.grad`` for
  the backward (the block-sparse and top-k masks go in as dense boolean masks);
* ``cudnn-step`` (on a GPU): this package's ``"cudnn"`` kernel, forward then backward from
  the forward's ``o``/``lse`` as a schedule runs it (cuDNN's backward fed that o and lse,
  plus the kernel's step classification and its ``0·V`` terms of masked keys); causal and
  full masks only (it hands the others to the XLA kernel).

FLOPs count only the visible fraction of the score matrix (causal ½, block-sparse the drawn
density): forward ``4·B·H·S²·D·fraction``, backward 2.5× that (the flash-attention
convention). Every implementation's forward output is checked against XLA's before it is timed (the
script exits 1 on a mismatch).
Reference points on an H200: cuDNN forward 490–590 TFLOP/s, fwd+bwd 420–550.

    python bench/kernels.py                      # on the GPU
    python bench/kernels.py --interpret --small  # on CPU: tiny shapes, Pallas interpreted

The Pallas kernel runs with its own tile choice (``pallas_gpu.table_block``: 64 at D=128 in
bf16) unless ``--kernel-block`` sets one. Issue 32's table (S=8K, causal and full, fwd and
fwd+bwd, against cuDNN; before the GPU kernels' loop split and tuning, at 128-tiles: Pallas
67 / 51 / 137 / 61 TFLOP/s, cuDNN 328 / 387 / 567 / 540) is re-measured on an H200 by

    python bench/kernels.py --seqs 8192 --masks causal,full --iters 20
    python bench/kernels.py --seqs 8192 --masks causal,full --iters 20 --kernel-block 128

Each row also states its compile time (forward and forward+backward together).

On a GPU the ``pallas`` top-k rows gather each query's picks (``pallas_topk.py``: cost
follows ``k``, not ``S``). Issue 32's goal row (S=32K, 2048 picks a query, forward+backward
at least 4× faster than cuDNN given the same mask as a dense boolean), for 16 K/V heads and
for DeepSeek's one (MQA, the picks then serve all 16 query heads in one program):

    python bench/kernels.py --seqs 32768 --masks topk --topk-k 2048 --iters 10
    python bench/kernels.py --seqs 32768 --masks topk --topk-k 2048 --iters 10 --kv-heads 1

Prints a table and writes ``bench/results/kernels-<device>-<date>.json``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from cptransform.op.attention_spec import AttentionSpec, Layout, MaskSpec  # noqa: E402
from cptransform.lowering.block import Block  # noqa: E402
from cptransform.lowering.kernels.cudnn import CudnnKernel  # noqa: E402
from cptransform.lowering.kernels.pallas import PallasKernel  # noqa: E402

BTHD = Layout.parse("BTHD")
MASKS = ("causal", "full", "block_sparse", "topk")


def block_sparse_mask(seq: int, block: int, density: float, seed: int = 0):
    """Bool ``[1, 1, S, S]``: whole ``block × block`` tiles visible with probability
    ``density`` (the diagonal always, so no query row is empty); and the drawn density."""
    nb = seq // block
    tiles = np.random.default_rng(seed).random((nb, nb)) < density
    np.fill_diagonal(tiles, True)
    dense = np.kron(tiles, np.ones((block, block), bool))
    return jnp.asarray(dense)[None, None], float(tiles.mean())


def topk_mask(seq: int, block: int, seed: int = 0, k: int | None = None):
    """``(indices [1, 1, S, k] int32, the same as a dense bool [1, 1, S, S], density)``:
    ``k`` (default ``max(S // 64, 2)``) causal keys per query, half drawn from its own and
    the previous ``block`` keys, half from all earlier ones (an indexer's mix of local and
    far picks; a query with fewer earlier keys repeats some)."""
    rng = np.random.default_rng(seed)
    k = max(seq // 64, 2) if k is None else k
    rows = np.arange(seq)[:, None]
    near = rows - (rng.random((seq, k // 2)) * np.minimum(rows + 1, 2 * block)).astype(int)
    far = (rng.random((seq, k - k // 2)) * (rows + 1)).astype(int)
    idx = np.concatenate([near, far], axis=1).astype(np.int32)
    dense = np.zeros((seq, seq), bool)
    dense[rows, idx] = True
    return jnp.asarray(idx)[None, None], jnp.asarray(dense)[None, None], float(dense.mean())


def problem(seq: int, heads: int, dim: int, mask: str, block: int, dtype, kv_heads=None,
            topk_k=None):
    """``(q, k, v, dense_mask | None, topk_indices | None, fraction of the score matrix
    visible)``; ``kv_heads`` K/V heads (default ``heads``), ``topk_k`` picks per query of
    the top-k mask (default ``S/64``)."""
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (1, seq, heads, dim), dtype)
    k, v = (jax.random.normal(key, (1, seq, kv_heads or heads, dim), dtype) for key in keys[1:])
    if mask == "block_sparse":
        dense, fraction = block_sparse_mask(seq, block, 0.10)
        return q, k, v, dense, None, fraction
    if mask == "topk":
        idx, dense, fraction = topk_mask(seq, block, k=topk_k)
        return q, k, v, dense, idx, fraction
    return q, k, v, None, None, 0.5 if mask == "causal" else 1.0


def pallas_fns(kernel, mask: str, seq: int, scale: float, groups: int = 1):
    """``(forward, forward+backward)`` of a local-step kernel (the Pallas kernel, or the
    cuDNN one) on ``(q, k, v, dense, topk)``;
    the top-k mask reads ``topk`` (indices, an argument: as a closed-over constant XLA
    spends tens of seconds constant-folding its sort) and ignores ``dense``."""
    spec = AttentionSpec(BTHD, BTHD, BTHD, scale=scale, positions=True, groups=groups,
                         mask=MaskSpec(causal=mask in ("causal", "topk"),
                                       dense=mask == "block_sparse", topk=mask == "topk"))
    pos = jnp.arange(seq, dtype=jnp.int32)[None]

    def block(q, k, v, dense, topk):
        if topk is not None:
            return Block(q, k, v, pos, pos, topk=topk)
        return Block(q, k, v, pos, pos, mask=dense)

    def fwd(q, k, v, dense, topk):
        return kernel.forward(block(q, k, v, dense, topk), spec)[0]

    def fwd_bwd(q, k, v, dense, topk):
        b = block(q, k, v, dense, topk)
        o, lse = kernel.forward(b, spec)
        return kernel.backward(b, o, lse, o, spec)[:3]  # dO = O: any cotangent will do

    return fwd, fwd_bwd


def nn_fns(implementation: str, mask: str, scale: float):
    """``(forward, forward+backward)`` of ``jax.nn.dot_product_attention`` (the top-k mask
    as the dense boolean ``dense``; ``topk`` is not read)."""
    def fwd(q, k, v, dense, topk=None):
        return jax.nn.dot_product_attention(q, k, v, mask=dense, scale=scale,
                                            is_causal=mask == "causal",
                                            implementation=implementation)

    def fwd_bwd(q, k, v, dense, topk=None):
        loss = lambda q, k, v: jnp.sum(fwd(q, k, v, dense).astype(jnp.float32))  # noqa: E731
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    return fwd, fwd_bwd


def timed(fn, args, iters: int) -> float:
    """Median seconds of ``fn(*args)`` (compiled and warmed up first)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(seqs, masks, heads, dim, block, kernel, iters, budget_s=None, kv_heads=None,
            topk_k=None):
    """``(rows, failures)``: each (implementation, S, mask) forward checked against XLA's,
    then its forward and forward+backward compile time and median run time. Rows past
    ``budget_s`` seconds are recorded as skipped, not run."""
    kv_heads = kv_heads or heads
    impls = ["xla", "pallas"] + ([] if jax.default_backend() == "cpu" else
                                 ["cudnn", "cudnn-step"])
    rows, failures, start = [], [], time.perf_counter()
    for seq in seqs:
        for mask in masks:
            q, k, v, dense, topk, fraction = problem(seq, heads, dim, mask, block,
                                                     jnp.bfloat16, kv_heads, topk_k)
            flops = 4 * heads * seq * seq * dim * fraction
            scale = dim ** -0.5
            want = None
            for impl in impls:
                row = dict(impl=impl, seq=seq, mask=mask, fraction=fraction, kv_heads=kv_heads,
                           topk_k=None if topk is None else int(topk.shape[-1]))
                if budget_s is not None and time.perf_counter() - start > budget_s:
                    rows.append(dict(row, skipped=f"past the {budget_s:.0f} s budget"))
                    continue
                if impl == "cudnn-step" and mask not in ("causal", "full"):
                    rows.append(dict(row, skipped="the cuDNN kernel hands this mask to XLA"))
                    continue
                local = {"pallas": kernel, "cudnn-step": CudnnKernel()}.get(impl)
                fns = nn_fns(impl, mask, scale) if local is None else \
                    pallas_fns(local, mask, seq, scale, heads // kv_heads)
                fwd, fwd_bwd = (jax.jit(f) for f in fns)
                args = (q, k, v, dense, topk)
                try:
                    began = time.perf_counter()
                    fwd_c = fwd.lower(*args).compile()
                    fwd_bwd_c = fwd_bwd.lower(*args).compile()
                    row["compile_s"] = time.perf_counter() - began
                    out = np.asarray(fwd_c(*args), np.float32)
                except Exception as err:  # cuDNN refuses some shapes/masks: report, go on
                    rows.append(dict(row, error=f"{type(err).__name__}: {str(err)[:200]}"))
                    continue
                want = out if want is None else want  # the first, XLA, is the reference
                err = float(np.max(np.abs(out - want)))
                row["max_abs_err_vs_xla"] = err
                if err > 5e-2:
                    failures.append(f"{impl} {mask} S={seq}: max |error| {err:.3g}")
                t_f = timed(fwd_c, args, iters)
                t_fb = timed(fwd_bwd_c, args, iters)
                row.update(fwd_ms=t_f * 1e3, fwd_bwd_ms=t_fb * 1e3,
                           fwd_tflops=flops / t_f / 1e12, fwd_bwd_tflops=3.5 * flops / t_fb / 1e12)
                rows.append(row)
    return rows, failures


def table(rows) -> str:
    """The rows as a fixed-width table."""
    lines = [f"{'impl':10} {'S':>6} {'mask':13} {'compile s':>9} {'fwd ms':>9} {'fwd TF/s':>9} "
             f"{'f+b ms':>9} {'f+b TF/s':>9}  err"]
    for r in rows:
        head = f"{r['impl']:10} {r['seq']:6} {r['mask']:13}"
        if "error" in r or "skipped" in r:
            lines.append(f"{head} {r.get('error') or 'skipped: ' + r['skipped']}")
            continue
        lines.append(f"{head} {r['compile_s']:9.1f} {r['fwd_ms']:9.3f} {r['fwd_tflops']:9.2f} "
                     f"{r['fwd_bwd_ms']:9.3f} {r['fwd_bwd_tflops']:9.2f}  "
                     f"{r['max_abs_err_vs_xla']:.1e}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--interpret", action="store_true",
                        help="run the Pallas kernel in interpret mode (CPU)")
    parser.add_argument("--small", action="store_true",
                        help="tiny shapes (S=256, H=2, D=32, 64-blocks) for a CPU check")
    parser.add_argument("--seqs", default=None,
                        help="comma-separated sequence lengths (default 8192,32768)")
    parser.add_argument("--masks", default=",".join(MASKS),
                        help=f"comma-separated masks among {', '.join(MASKS)}")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="skip the rows that would start after this many seconds")
    parser.add_argument("--kernel-block", type=int, default=None,
                        help="the Pallas kernel's block_q = block_kv (default: its own choice)")
    parser.add_argument("--kv-heads", type=int, default=None,
                        help="K/V heads (default: as many as the 16 query heads; 1 is "
                             "DeepSeek's MQA, where an indexer's picks serve every head)")
    parser.add_argument("--topk-k", type=int, default=None,
                        help="picks per query of the top-k mask (default S/64; issue 32's "
                             "goal row is 2048 at S=32K)")
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    masks = args.masks.split(",")
    unknown = [m for m in masks if m not in MASKS]
    if unknown:
        parser.error(f"unknown mask {unknown[0]!r}; choose among {', '.join(MASKS)}")
    seqs, heads, dim, block = ((256,), 2, 32, 64) if args.small else ((8192, 32768), 16, 128, 128)
    if args.seqs:
        seqs = tuple(int(x) for x in args.seqs.split(","))
    iters = args.iters or (1 if args.small else 10)
    kernel_block = args.kernel_block or (block if args.small else None)
    kernel = PallasKernel(block_q=kernel_block, block_kv=kernel_block,
                          interpret=True if args.interpret else None)
    device = jax.devices()[0].device_kind.replace(" ", "_")
    rows, failures = measure(seqs, masks, heads, dim, block, kernel, iters, args.budget_s,
                             args.kv_heads, args.topk_k)
    print(table(rows))
    date = datetime.date.today().isoformat()
    out = Path(args.out or ROOT / "bench" / "results" / f"kernels-{device}-{date}.json")
    out.write_text(json.dumps(dict(date=date, device=device, backend=jax.default_backend(),
                                   jax=jax.__version__, heads=heads, dim=dim, block=block,
                                   kernel_block=kernel_block,
                                   interpret=args.interpret, rows=rows), indent=1))
    print(f"wrote {out}")
    for failure in failures:
        print("MISMATCH:", failure)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
