"""``context_parallel(cp=8)`` under ``jax.distributed``: 2 processes x 4 CPU devices on
loopback (gloo CPU collectives) give the same loss and gradients as one device.

The pytest process already initialised JAX with 8 simulated devices, so the two workers
(``tests/multiprocess_worker.py``) run as fresh subprocesses with a clean environment;
the reference is computed here, on one device.
"""
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import multiprocess_worker as worker

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
TIMEOUT_S = 120


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_env() -> dict:
    keep = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "PYTHONHASHSEED")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4",
               PYTHONPATH=str(HERE.parent), OMP_NUM_THREADS="1")
    return env


def test_two_processes_match_one_device(tmp_path):
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, str(HERE / "multiprocess_worker.py"), str(i),
                               "2", str(port), str(tmp_path)],
                              env=_worker_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=TIMEOUT_S)
            outputs.append(out)
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        logs = [p.communicate()[0] for p in procs]
        pytest.fail(f"workers exceeded {TIMEOUT_S} s:\n" + "\n".join(l[-3000:] for l in logs))
    for i, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"worker {i} exited {p.returncode}:\n{out[-6000:]}"

    loss, params, tokens = worker.model()
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(loss))(params, tokens)
    ref = {jax.tree_util.keystr(k): np.asarray(v)
           for k, v in jax.tree_util.tree_flatten_with_path(ref_grads)[0]}
    for schedule, load_balance in worker.CONFIGS:
        got = np.load(tmp_path / f"result_{schedule}_{load_balance}.npz")
        np.testing.assert_allclose(got["loss"], ref_loss, rtol=1e-5)
        assert set(got.files) == set(ref) | {"loss"}
        for name, r in ref.items():
            np.testing.assert_allclose(got[name], r, rtol=1e-5,
                                       atol=1e-5 * float(np.abs(r).max()),
                                       err_msg=f"{schedule}/{load_balance} {name}")
