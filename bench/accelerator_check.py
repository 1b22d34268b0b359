"""One command for a GPU or TPU machine: the accelerator tier, then the kernel table.

1. ``pytest -m accelerator`` (``tests/test_accelerator.py``) on the device: every kernel
   compiled there against a float32 host reference, per mask term and dtype; ``auto``'s
   self-check; the demo model and a stock Flax NNX model under ``@context_parallel`` with
   each kernel; the schedules across the slice when it has several devices. Four pytest
   workers share the device (memory is not preallocated), so compiles overlap.
2. ``bench/kernels.py`` at 8K and 32K tokens: ours (Pallas), cuDNN (on NVIDIA) and XLA, per
   mask, each row with its compile time; rows that would start past the time budget are
   recorded as skipped.

Prints one table at the end and writes ``bench/results/accelerator-<device>-<date>.json``
(date, device, JAX version, the tier's outcome per test, the kernel rows). Needs only what
the GPU machines have (JAX, pytest, pytest-xdist, flax, hypothesis); the whole run keeps
within ``--budget-s`` (default 480 s: 8 minutes on one H200, compiles included).

Without a GPU or TPU it is a dry run: the tier skips every test with its reason, the kernel
table is not measured, and nothing is written. ``--dry-run`` instead runs the tier on the CPU
at small sizes with the Pallas kernels interpreted (minutes), to check the tier itself.

    python bench/accelerator_check.py            # on the GPU / TPU machine
    python bench/accelerator_check.py --dry-run  # on a CPU: the tier, interpreted
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEVICE_BACKENDS = {"gpu": "cuda", "cuda": "cuda", "rocm": "rocm", "tpu": "tpu"}


def probe() -> dict:
    """The default backend, device kind and count and the JAX version, read in a fresh
    process (the tests' ``conftest.py`` pins the CPU unless ``JAX_PLATFORMS`` names one)."""
    code = ("import json, jax; d = jax.devices(); print(json.dumps(dict(backend="
            "jax.default_backend(), device=d[0].device_kind, devices=len(d), "
            "jax=jax.__version__)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_tier(platform: str | None, timeout_s: float, dry_run: bool) -> dict:
    """Run ``pytest -m accelerator``; ``{test id: outcome}``, the summary line, the exit
    status and the seconds it took."""
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    if platform:
        env["JAX_PLATFORMS"] = platform
    if dry_run:
        env["CPTRANSFORM_ACCELERATOR_DRY_RUN"] = "1"
    workers = ["-n", "2" if dry_run or not platform else "4"]
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "accelerator", "-rA", "-p",
           "no:cacheprovider", *workers, "tests/test_accelerator.py"]
    print("+", " ".join(cmd), flush=True)
    began = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout_s)
        text, status = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as err:
        text = (err.stdout or b"").decode() if isinstance(err.stdout, bytes) else (err.stdout or "")
        status = f"timed out after {timeout_s:.0f} s"
    # -rA writes "KIND test-id" per test, and "SKIPPED [count] where: reason" for skips.
    outcomes = {test: kind.lower() for kind, test in re.findall(
        r"^(PASSED|FAILED|ERROR|XFAIL|XPASS)\s+(\S+)", text, re.M)}
    skipped = re.findall(r"^SKIPPED \[\d+\] (.*)$", text, re.M)
    summary = next((line for line in reversed(text.splitlines())
                    if re.search(r"\d+ (passed|failed|skipped|error)", line)), "no summary")
    failures = [line for line in text.splitlines() if line.startswith(("FAILED", "ERROR"))]
    return dict(outcomes=outcomes, skipped=skipped, summary=summary.strip("= "), status=status,
                seconds=time.perf_counter() - began, failures=failures)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true",
                        help="on a CPU: run the tier interpreted at small sizes")
    parser.add_argument("--budget-s", type=float, default=480.0,
                        help="seconds for the whole run (default 480)")
    parser.add_argument("--seqs", default="8192,32768")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    info = probe()
    platform = DEVICE_BACKENDS.get(info["backend"])
    print(f"device: {info['device']} x{info['devices']} ({info['backend']}), "
          f"JAX {info['jax']}", flush=True)
    if platform is None and not args.dry_run:
        tier = run_tier(None, args.budget_s, dry_run=False)
        print(f"accelerator tier: {tier['summary']}")
        print(f"no GPU or TPU here (jax.default_backend() is {info['backend']!r}): every "
              "accelerator test skips, the kernel table is not measured, nothing is written. "
              "--dry-run runs the tier on this CPU, interpreted.")
        return 0 if tier["status"] in (0, 5) else 1
    tier = run_tier(platform, 0.6 * args.budget_s, dry_run=args.dry_run)
    print(f"accelerator tier: {tier['summary']} in {tier['seconds']:.0f} s")
    rows = []
    if platform is not None:
        sys.path.insert(0, str(ROOT / "bench"))
        import kernels  # noqa: E402 - beside this file
        from cptransform.lowering.kernels.pallas import PallasKernel  # noqa: E402

        left = args.budget_s - (time.perf_counter() - start)
        seqs = tuple(int(s) for s in args.seqs.split(","))
        rows, mismatches = kernels.measure(seqs, kernels.MASKS, 16, 128, 128,
                                           PallasKernel(block_q=128, block_kv=128), 5,
                                           budget_s=max(left - 60, 0))
        tier["failures"] += [f"kernel mismatch: {m}" for m in mismatches]
        print(kernels.table(rows))
    for failure in tier["failures"]:
        print(failure)
    if platform is not None:
        date = datetime.date.today().isoformat()
        device = info["device"].replace(" ", "_")
        out = Path(args.out or ROOT / "bench" / "results" / f"accelerator-{device}-{date}.json")
        out.write_text(json.dumps(dict(date=date, **info, tier=tier, kernels=rows), indent=1))
        print(f"wrote {out}")
    print(f"total {time.perf_counter() - start:.0f} s")
    return 0 if tier["status"] == 0 and not tier["failures"] else 1


if __name__ == "__main__":
    sys.exit(main())
