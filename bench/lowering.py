"""How long each Pallas kernel takes to lower for its real targets, from this CPU.

Every case of ``lowering/kernels/lowering_check.py`` (target × mask term × dtype, with GQA
groupings and head dims in turn): the forward, dQ and KV-major dK/dV kernels of one
attention lowered together through Pallas → Triton IR (H200, A100) or Pallas → Mosaic
(TPU v5e, v6e). The time is tracing plus lowering on the host; compiling to PTX or by libtpu
happens on the device and is not included. A case that fails to lower is a row with its
error and makes the script exit 1.

    python bench/lowering.py                 # every case
    python bench/lowering.py --targets h200  # one target

Prints a table (per case, then per target: median and max) and writes
``bench/results/lowering-jax<version>-<date>.json``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402

from cptransform.lowering.kernels.lowering_check import TARGETS, cases, lower_case  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", default=",".join(TARGETS),
                        help=f"comma-separated, among {', '.join(TARGETS)}")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    targets = args.targets.split(",")
    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        parser.error(f"unknown target {unknown[0]!r}; choose among {', '.join(TARGETS)}")
    rows = []
    for case in cases(tuple(targets)):
        row = dict(case=case.id, target=case.target, mask=case.mask, dtype=case.dtype,
                   groups=case.groups, head_dim=case.head_dim)
        try:
            seconds, lowered = lower_case(case)
            row.update(seconds=seconds, stablehlo_chars=len(lowered.as_text()))
        except Exception as err:  # noqa: BLE001 - a failed lowering is a row of the table
            row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
        rows.append(row)
        print(f"{row['case']:45} " + (f"{row['seconds']:6.2f} s" if "seconds" in row
                                      else row["error"]), flush=True)
    print(f"\n{'target':10} {'cases':>5} {'median s':>9} {'max s':>7} {'failed':>6}")
    for target in targets:
        times = [r["seconds"] for r in rows if r["target"] == target and "seconds" in r]
        failed = sum(1 for r in rows if r["target"] == target and "error" in r)
        print(f"{target:10} {len(times) + failed:5} {statistics.median(times or [0]):9.2f} "
              f"{max(times or [0]):7.2f} {failed:6}")
    date = datetime.date.today().isoformat()
    out = Path(args.out or ROOT / "bench" / "results" / f"lowering-jax{jax.__version__}-{date}.json")
    out.write_text(json.dumps(dict(date=date, jax=jax.__version__, host="cpu", rows=rows),
                              indent=1))
    print(f"wrote {out}")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
