"""What the planner predicts per schedule for real models, and how its CPU ranking compares
with measured times.

Part 1: for Llama-3 8B and 70B (GQA, 8 KV heads), Gemma-style local (window 4096) and
global layers, and DeepSeek-style MLA (128 heads, d=192 for q/k and 128 for v), bf16,
batch 1, causal on the zigzag layout, at s in {32K, 128K, 1M} and cp in {8, 16, 64} on H100
(NVLink within 8 GPUs, InfiniBand across) and TPU v5p: per schedule the predicted forward
bytes, FLOPs (slowest device, fwd+bwd), peak local-step memory and fwd+bwd time, and the
schedule ``auto`` would choose (the hybrid at its best Ulysses degree).

Part 2: the ``cpu-sim`` row against the measured ``bench/results/peers*.json`` (8 simulated
CPU devices; causal and full masks, the newest file's rows per case): predicted against
measured ranking of our schedules per (S, heads, mask),
forward and forward+backward. ``--calibrate`` refits the ``cpu-sim`` row's FLOP/s, the
relative FLOP/s of tiles that fold a GQA query-head group (forward and backward apart), the
cost per kernel call, the bandwidth and the cost per FLOP of each MiB of score tile to the
measured forward and backward times (least squares, ``--cores`` host cores) and prints them.

    python bench/planner.py [--calibrate [--cores N]] [--peers bench/results/peers.json ...]
                            [--out bench/results/planner.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cptransform.analysis.attention_shape import AttentionShape  # noqa: E402
from cptransform.analysis.hardware import HARDWARE, GiB, Hardware, LinkClass  # noqa: E402
from cptransform.lowering.schedule import schedules  # noqa: E402

K = 1024
CAUSAL = (None, 0)
MODELS = {
    "llama3-8b": dict(heads=32, kv_heads=8, head_dim=128, band=CAUSAL),
    "llama3-70b": dict(heads=64, kv_heads=8, head_dim=128, band=CAUSAL),
    "gemma-local": dict(heads=16, kv_heads=8, head_dim=256, band=(-4096, 0)),
    "gemma-global": dict(heads=16, kv_heads=8, head_dim=256, band=CAUSAL),
    "deepseek-mla": dict(heads=128, kv_heads=128, head_dim=192, v_head_dim=128, band=CAUSAL),
}
SEQS = (32 * K, 128 * K, 1024 * K)
CPS = (8, 16, 64)
MACHINES = ("h100", "tpu-v5p")
# The peers bench: fp32, batch 1, 8 heads of 64, cp=8; its variants as (schedule, layout).
PEERS = {"ring-zigzag": ("ring", "zigzag"), "ring-contiguous": ("ring", "contiguous"),
         "ulysses": ("ulysses", "contiguous"), "allgather": ("allgather", "zigzag"),
         "hybrid-2x4": ("hybrid", "zigzag")}


def candidates(shape: AttentionShape, hardware):
    """``{name: Prediction}`` of every feasible schedule (hybrid at its fastest degree)."""
    out = {}
    for name, schedule in schedules().items():
        if schedule.mesh_axes == 2:
            options = [replace(shape, ulysses=u) for u in range(2, shape.cp)
                       if shape.cp % u == 0 and shape.kv_heads % u == 0]
            options = [s for s in options if schedule.feasible(s) is None]
            if options:
                out[name] = min((schedule.predict(s, hardware) for s in options),
                                key=lambda p: p.time_s)
        elif schedule.feasible(shape) is None:
            out[name] = schedule.predict(shape, hardware)
    return out


def real_configs() -> list[dict]:
    rows = []
    for machine in MACHINES:
        hardware = HARDWARE[machine]
        for model, dims in MODELS.items():
            for s in SEQS:
                for cp in CPS:
                    shape = AttentionShape(seq_len=s, cp=cp, layout="zigzag", **dims)
                    predictions = candidates(shape, hardware)
                    fits = {n: p for n, p in predictions.items()
                            if p.memory_bytes <= hardware.memory_bytes}
                    choice = min(fits, key=lambda n: fits[n].time_s) if fits else None
                    for name, p in predictions.items():
                        rows.append(dict(
                            hardware=machine, model=model, seq=s, cp=cp, schedule=name,
                            bytes=p.bytes, gflops=p.flops / 1e9,
                            memory_gib=p.memory_bytes / 2 ** 30, time_ms=p.time_s * 1e3,
                            hidden=None if p.overlap_tokens is None
                            else p.block_tokens >= p.overlap_tokens,
                            chosen=name == choice))
    return rows


def measured_rows(paths=None) -> tuple[list[dict], list[str]]:
    """The timed rows of our schedules for the masks the comparison models (causal and
    full) from ``paths`` (default: every ``bench/results/peers*.json``), and the files they
    came from. A case (S, heads, mask) measured in several files is taken from the newest
    (its ``measured`` date; git checkouts keep no modification times); a ``--no-time``
    file has none."""
    paths = sorted((ROOT / "bench" / "results").glob("peers*.json")) if paths is None \
        else [Path(p) for p in paths]
    cases = {}
    for path in paths:
        data = json.loads(path.read_text())
        for row in data["rows"]:
            if row["variant"] in PEERS and row.get("fwd_s") and row["mask"] in ("causal", "full"):
                case = (row["seq"], row["heads"], row["mask"])
                stamp = (data.get("measured", ""), path.name)
                if case not in cases or cases[case][0] < stamp:
                    cases[case] = (stamp, [])
                if cases[case][0] == stamp:
                    cases[case][1].append(row)
    if not cases:
        raise SystemExit("no bench/results/peers*.json with times: run bench/peers.py")
    rows = [row for _, case_rows in cases.values() for row in case_rows]
    return rows, sorted({stamp[1] for stamp, _ in cases.values()})


def peers_shape(row, schedule: str, layout: str) -> AttentionShape:
    kv = 8 if row["heads"] == "mha" else 2
    return AttentionShape(seq_len=row["seq"], heads=8, kv_heads=kv, head_dim=64, cp=8,
                          dtype_bytes=4, band=CAUSAL if row["mask"] == "causal" else
                          (None, None), layout=layout, ulysses=2 if schedule == "hybrid" else 1)


def features(shape: AttentionShape, name: str, backward: bool = False, cores: int = 2):
    """The terms a ``shared_compute`` row with ``cores`` host cores prices one pass of
    schedule ``name`` with: (FLOPs of one-head tiles, FLOPs of tiles folding a query-head
    group in the forward, the same in the backward, kernel calls, bytes, FLOPs times the
    score tile's MiB), the FLOPs the mean device's as its steps pace them
    (:meth:`~cptransform.analysis.block_work.Work.paced`); priced by its FLOP/s, the
    forward's and the backward's grouped-tile efficiencies, per-call cost, bandwidth and
    per-tile-MiB cost."""
    schedule = schedules()[name]
    volume, work = schedule.volume(shape), schedule.work(shape)
    paced = work.paced(max(1.0, shape.cp / cores)) / work.balance
    flops = (work.backward_flops if backward else work.forward_flops) * paced
    grouped = work.group > 1
    nbytes = volume.backward_total if backward else volume.forward_total
    return (0.0 if grouped else flops, flops if grouped and not backward else 0.0,
            flops if grouped and backward else 0.0, work.calls, nbytes,
            flops * work.tile_bytes / 2 ** 20)


def fit(rows, cores: int = 2) -> tuple[np.ndarray, float]:
    """Least squares of the measured forward and backward (forward+backward minus forward)
    times of ``rows`` on :func:`features`, relative errors weighted equally (the times span
    100x): the coefficients and the relative rms error."""
    x, y = [], []
    for row in rows:
        if row["variant"] in PEERS and row.get("fwd_s") and row.get("fwdbwd_s"):
            schedule, layout = PEERS[row["variant"]]
            shape = peers_shape(row, schedule, layout)
            for backward, seconds in ((False, row["fwd_s"]),
                                      (True, row["fwdbwd_s"] - row["fwd_s"])):
                x.append(np.array(features(shape, schedule, backward, cores)) / seconds)
                y.append(1.0)
    x, y = np.array(x, float), np.array(y)
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    return coef, float(np.sqrt(np.mean((x @ coef - y) ** 2)))


def fitted_row(coef, name: str, cores: int) -> Hardware:
    """The ``shared_compute`` row of :func:`fit`'s coefficients."""
    inv_flops, inv_grouped, inv_grouped_bwd, call_s, inv_bw, tile_s = coef
    return Hardware(name, {2: 1 / inv_flops, 4: 1 / inv_flops}, 8 * GiB,
                    (LinkClass("memcpy", 1 / inv_bw, 0.0),), efficiency=1.0, call_s=call_s,
                    shared_compute=True, grouped_efficiency=inv_flops / inv_grouped,
                    grouped_backward_efficiency=inv_flops / inv_grouped_bwd,
                    host_cores=cores, tile_s=tile_s)


def calibrate(rows, name: str = "cpu-sim", cores: int = 2) -> None:
    """Prints the row :func:`fit` gives. A per-step link latency was tried before: it comes
    out negative, so the row has none."""
    coef, error = fit(rows, cores)
    row = fitted_row(coef, name, cores)
    rate = row.flops[4]
    print(f"{name} fit over {sum(r['variant'] in PEERS and bool(r.get('fwdbwd_s')) for r in rows)}"
          f" forward and backward times ({cores} host cores): {rate:.3g} FLOP/s per device "
          f"(grouped tiles at {row.grouped_efficiency:.3g} of it forward, "
          f"{row.grouped_backward_efficiency:.3g} backward), {row.call_s * 1e3:.3g} ms per "
          f"kernel call, {row.links[0].bytes_per_s:.3g} B/s, {row.tile_s:.3g} s per FLOP per "
          f"MiB of score tile; relative rms error {error:.2f}")
    print("as a row (register it with HARDWARE[row.name] = row, then hardware=row.name):\n"
          f'    Hardware("{name}", {{2: {rate:.3g}, 4: {rate:.3g}}}, 8 * GiB, '
          f'(LinkClass("memcpy", {row.links[0].bytes_per_s:.3g}, 0.0),), efficiency=1.0, '
          f"call_s={row.call_s:.3g}, shared_compute=True, "
          f"grouped_efficiency={row.grouped_efficiency:.3g}, "
          f"grouped_backward_efficiency={row.grouped_backward_efficiency:.3g}, "
          f"host_cores={cores}, tile_s={row.tile_s:.3g})")


def cpu_comparison(rows) -> list[dict]:
    hardware = HARDWARE["cpu-sim"]
    out = []
    cases = sorted({(r["seq"], r["heads"], r["mask"]) for r in rows})
    for seq, heads, mask in cases:
        measured = {r["variant"]: r for r in rows if (r["seq"], r["heads"], r["mask"]) ==
                    (seq, heads, mask) and r["variant"] in PEERS and r.get("fwd_s")}
        predicted = {v: schedules()[s].predict(peers_shape(measured[v], s, lay), hardware,
                                               (2, 8) if s == "hybrid" else (8,))
                     for v, (s, lay) in PEERS.items() if v in measured}
        for kind, key, reps_key, attr in (("fwd", "fwd_s", "fwd_reps_s", "forward_s"),
                                          ("fwd+bwd", "fwdbwd_s", "fwdbwd_reps_s", "time_s")):
            m_rank = sorted(measured, key=lambda v: measured[v][key])
            p_rank = sorted(predicted, key=lambda v: getattr(predicted[v], attr))
            pairs = [(a, b) for i, a in enumerate(m_rank) for b in m_rank[i + 1:]]
            # Pairs the measurement orders: every repetition of a faster than every one of b
            # (a file without repetitions: its medians).
            reps = lambda v: measured[v].get(reps_key) or [measured[v][key]]  # noqa: E731
            apart = [(a, b) for a, b in pairs if max(reps(a)) < min(reps(b))]
            agree = lambda ps: sum(p_rank.index(a) < p_rank.index(b) for a, b in ps)  # noqa: E731
            out.append(dict(seq=seq, heads=heads, mask=mask, kind=kind, measured=m_rank,
                            predicted=p_rank, agree_first=m_rank[0] == p_rank[0],
                            agree_pairs=agree(pairs), pairs=len(pairs),
                            agree_apart=agree(apart), apart=len(apart),
                            measured_s={v: measured[v][key] for v in m_rank},
                            predicted_s={v: getattr(predicted[v], attr) for v in p_rank}))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calibrate", action="store_true")
    parser.add_argument("--name", default="cpu-sim", help="the calibrated row's name")
    parser.add_argument("--cores", type=int, default=os.cpu_count(), help="the cores the "
                        "simulated devices of the measurement shared (default: this host's)")
    parser.add_argument("--peers", nargs="+", default=None, help="bench/peers.py results to "
                        "compare with (default: every bench/results/peers*.json; the newest "
                        "file's rows where two measured the same case)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "planner.json"))
    args = parser.parse_args()
    peers, peers_files = measured_rows(args.peers)
    if args.calibrate:
        calibrate(peers, args.name, args.cores)
        return
    rows = real_configs()
    print(f"{'hw':8} {'model':13} {'S':>6} {'cp':>3} {'schedule':10} {'fwd+bwd MiB':>11} "
          f"{'TFLOP':>8} {'mem GiB':>8} {'ms':>9} hidden chosen")
    for r in rows:
        print(f"{r['hardware']:8} {r['model']:13} {r['seq'] // K:>5}K {r['cp']:>3} "
              f"{r['schedule']:10} {r['bytes'] / 2**20:>11.0f} {r['gflops'] / 1e3:>8.2f} "
              f"{r['memory_gib']:>8.2f} {r['time_ms']:>9.2f} {str(r['hidden']):6} "
              f"{'<-' if r['chosen'] else ''}")
    cpu = cpu_comparison(peers)
    print(f"\ncpu-sim predicted vs measured ({', '.join(peers_files)}):")
    for c in cpu:
        mark = "" if c["measured"] == c["predicted"] else "  DIFFERENT ORDER"
        print(f"  S={c['seq']} {c['heads']} {c['mask']} {c['kind']:8} measured "
              f"{' < '.join(c['measured'])}\n{'':30}predicted {' < '.join(c['predicted'])}{mark}")
    agree = sum(c["agree_first"] for c in cpu)
    print(f"  fastest schedule agrees in {agree} of {len(cpu)} cases; ordered pairs agree in "
          f"{sum(c['agree_pairs'] for c in cpu)} of {sum(c['pairs'] for c in cpu)}; of the pairs "
          f"whose repetitions do not overlap, {sum(c['agree_apart'] for c in cpu)} of "
          f"{sum(c['apart'] for c in cpu)}")
    Path(args.out).write_text(json.dumps(dict(peers=peers_files, configs=rows,
                                              cpu_sim=cpu), indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
