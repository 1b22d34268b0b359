"""Differential fuzzer, the long run: N random programs around attention, each checked
against the undecorated single-device program (loss and every gradient).

    python -m bench.fuzz --seed 0 --json bench/results/fuzz.json       # 2,000 cases
    python -m bench.fuzz --first 1000 --cases 1000 --json half.json    # its second half
    python -m bench.fuzz --merge first.json half.json --json all.json   # one table
    python -m bench.fuzz --classes masked_rows,nan_weight --cases 40
    python -m bench.fuzz --repro "FuzzCase(cls='mask_causal', seed=3, ...)"

Classes are taken round-robin (every class gets about N / #classes cases), including the
ones ``tests/fuzz_programs.KNOWN_BROKEN`` lists (the CI fuzzer skips those). Prints a table
by class: cases, passed, unmatched (right numbers, but no attention found: ran unsharded),
refused (clearly), wrong numbers, crashed (unclear), then the unmatched cases by spelling
with their refusal reasons, and one reproduction line per failing class; ``--json`` gets every outcome, written after each case
so a run stopped by ``--minutes`` keeps what it did.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

if os.environ.get("JAX_PLATFORMS", "cpu") in ("", "cpu"):
    os.environ["JAX_PLATFORMS"] = "cpu"
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   " --xla_force_host_platform_device_count=8").strip()

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import fuzz_programs as fp  # noqa: E402

STATUSES = ("passed", "unmatched", "refused", "wrong", "crashed")


def summarize(records):
    table = {}
    for r in records:
        row = table.setdefault(r["cls"], {"cases": 0, **{s: 0 for s in STATUSES},
                                          "example": None, "known_broken": r["cls"] in
                                          fp.KNOWN_BROKEN})
        row["cases"] += 1
        row[r["status"]] += 1
        if r["status"] in ("wrong", "crashed") and row["example"] is None:
            row["example"] = {"status": r["status"], "repro": r["repro"], "detail": r["detail"]}
    return table


def unmatched_reasons(records):
    """``{(class, spelling, gqa style): {reason: count}}`` of the unmatched cases."""
    out: dict = {}
    for r in records:
        if r["status"] == "unmatched":
            # Drop the source location: the same spelling is one line wherever it sits.
            reason = r["detail"].split("refused: ", 1)[-1]
            key = (r["cls"], r["spelling"], r.get("gqa_style", ""))
            out.setdefault(key, {}).setdefault(reason, 0)
            out[key][reason] += 1
    return out


def print_table(table, out=sys.stdout, records=()):
    cols = ("cases",) + STATUSES
    head = f"{'class':18s} " + " ".join(f"{c:>9s}" for c in cols) + "  known-broken"
    print(head, file=out)
    print("-" * len(head), file=out)
    for cls in fp.ALL_CLASSES:
        if cls not in table:
            continue
        r = table[cls]
        print(f"{cls:18s} " + " ".join(f"{r[c]:9d}" for c in cols) +
              f"  {'yes' if r['known_broken'] else ''}", file=out)
    total = {s: sum(r[s] for r in table.values()) for s in cols}
    print("-" * len(head), file=out)
    print(f"{'total':18s} " + " ".join(f"{total[c]:9d}" for c in cols), file=out)
    reasons = unmatched_reasons(records)
    if reasons:
        print("\nUnmatched (ran unsharded) by class, spelling, GQA style:", file=out)
    for (cls, spelling, style), why in sorted(reasons.items()):
        for reason, n in sorted(why.items(), key=lambda kv: -kv[1]):
            print(f"  {cls:18s} {spelling:7s} {style:8s} {n:3d}  {reason[:160]}", file=out)
    failing = [c for c in fp.ALL_CLASSES if c in table and table[c]["example"]]
    if failing:
        print("\nOne reproduction per failing class:", file=out)
    for cls in failing:
        ex = table[cls]["example"]
        print(f"  [{cls}] {ex['status']}: {ex['detail'][:240]}\n    {ex['repro']}", file=out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--first", type=int, default=0, help="index of the first case: processes "
                    "with disjoint ranges split one sweep (--first 1000 --cases 1000 is the "
                    "second half of the default run)")
    ap.add_argument("--json", default=None, help="write every outcome and the table here")
    ap.add_argument("--classes", default=None, help="comma-separated classes (default: all)")
    ap.add_argument("--minutes", type=float, default=None, help="stop after this much time")
    ap.add_argument("--repro", default=None, help="run one printed FuzzCase(...) and report")
    ap.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                    help="print the table of earlier runs' --json files together (and write "
                         "them as one to --json) instead of running cases")
    args = ap.parse_args(argv)

    if args.merge:
        runs = [json.loads(Path(f).read_text()) for f in args.merge]
        records = sorted((r for run in runs for r in run["records"]), key=lambda r: r["index"])
        print_table(summarize(records), records=records)
        if args.json:
            Path(args.json).write_text(json.dumps(
                {"merged": args.merge, "seed": runs[0]["seed"], "cases_run": len(records),
                 "seconds": round(sum(run["seconds"] for run in runs), 1),
                 "jax": runs[0]["jax"], "known_broken": fp.KNOWN_BROKEN,
                 "by_class": summarize(records), "records": records}, indent=1) + "\n")
        return 0

    if args.repro:
        case = eval(args.repro, {"FuzzCase": fp.FuzzCase})  # noqa: S307 - a printed record
        print(case)
        print(fp.run_case(case))
        return 0

    classes = tuple(args.classes.split(",")) if args.classes else fp.ALL_CLASSES
    unknown = set(classes) - set(fp.ALL_CLASSES)
    if unknown:
        ap.error(f"unknown classes {sorted(unknown)}; known: {', '.join(fp.ALL_CLASSES)}")
    records, start = [], time.time()
    for i in range(args.first, args.first + args.cases):
        if args.minutes is not None and time.time() - start > 60 * args.minutes:
            print(f"stopping after {i - args.first} cases: --minutes={args.minutes} reached",
                  flush=True)
            break
        cls = classes[i % len(classes)]
        rng = np.random.default_rng([args.seed, i])
        case = fp.draw_case(fp.numpy_chooser(rng), cls, seed=args.seed * 1_000_003 + i)
        t = time.time()
        try:
            out = fp.run_case(case)
        except Exception as exc:  # noqa: BLE001 - the reference itself failed: generator bug
            out = fp.Outcome("crashed", f"GENERATOR (reference failed): {type(exc).__name__}: "
                                        f"{exc}"[:300])
        records.append({"index": i, "cls": cls, "status": out.status, "detail": out.detail,
                        "seconds": round(time.time() - t, 2), "case": repr(case),
                        "repro": case.repro(), "schedule": case.schedule,
                        "load_balance": case.load_balance, "cp": case.cp, "mask": case.mask,
                        "spelling": case.spelling, "gqa_style": case.gqa_style})
        print(f"[{i:4d}] {cls:18s} {out.status:8s} {time.time() - t:5.1f}s "
              f"{out.detail[:120]}", flush=True)
        if args.json and (i % 5 == 4 or i == args.first + args.cases - 1):
            _write(args, records, start)
        if i % 50 == 49:
            jax.clear_caches()
    table = summarize(records)
    print()
    print_table(table, records=records)
    if args.json:
        _write(args, records, start)
    return 0


def _write(args, records, start):
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"seed": args.seed, "first": args.first, "cases_requested": args.cases,
            "cases_run": len(records),
            "seconds": round(time.time() - start, 1), "jax": jax.__version__,
            "known_broken": fp.KNOWN_BROKEN, "by_class": summarize(records),
            "records": records}
    path.write_text(json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
