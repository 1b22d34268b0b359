"""One process of the multi-process test (``tests/test_multiprocess.py`` starts two).

    python tests/multiprocess_worker.py PROCESS_ID NUM_PROCESSES PORT OUT_DIR

The parent sets ``JAX_PLATFORMS=cpu`` and ``XLA_FLAGS=--xla_force_host_platform_device_count=4``
so that each process has 4 CPU devices: 8 global devices over loopback, cross-process
collectives by gloo. Every process runs the same ``context_parallel(cp=8)`` program over a
mesh of ``jax.devices()``; process 0 writes the loss and the gathered gradients to
``OUT_DIR/result_<schedule>.npz``.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: (schedule, load_balance) pairs run under one distributed initialisation.
CONFIGS = (("ring", "zigzag"), ("allgather", "striped"))


def model():
    """(loss_fn, params, tokens) as NumPy: a small Llama (RMSNorm, RoPE, GQA, SwiGLU, scan)."""
    import jax
    import numpy as np
    from examples import llama
    cfg = llama.Config(vocab=64, dim=32, layers=2, heads=4, kv_heads=2, mlp_dim=64)
    params, tokens = llama.example_args(cfg, batch=2, seq=32, seed=1)
    params = jax.tree_util.tree_map(np.asarray, params)
    return (lambda p, t: llama.loss(p, t, cfg)), params, np.asarray(tokens)


def main(process_id: int, num_processes: int, port: int, out_dir: str) -> None:
    import jax
    import numpy as np
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}",
                               num_processes=num_processes, process_id=process_id,
                               initialization_timeout=60)
    from jax.experimental import multihost_utils
    from jax.sharding import AxisType, NamedSharding, PartitionSpec

    from cptransform import context_parallel

    assert jax.process_count() == num_processes, jax.process_count()
    assert jax.device_count() == 8 and jax.local_device_count() == 8 // num_processes
    mesh = jax.make_mesh((8,), ("cp",), axis_types=(AxisType.Auto,), devices=jax.devices())
    loss, params, tokens = model()

    def global_array(x):   # the same value on every process: a replicated global jax.Array
        return jax.make_array_from_callback(x.shape, NamedSharding(mesh, PartitionSpec()),
                                            lambda index: x[index])

    gparams = jax.tree_util.tree_map(global_array, params)
    gtokens = global_array(tokens)
    for schedule, load_balance in CONFIGS:
        f = context_parallel(loss, cp=8, mesh=mesh, schedule=schedule,
                             load_balance=load_balance)
        value, grads = jax.jit(jax.value_and_grad(f))(gparams, gtokens)
        value, grads = multihost_utils.process_allgather((value, grads), tiled=True)
        if process_id == 0:
            flat = {jax.tree_util.keystr(k): np.asarray(v)
                    for k, v in jax.tree_util.tree_flatten_with_path(grads)[0]}
            np.savez(Path(out_dir) / f"result_{schedule}_{load_balance}.npz",
                     loss=np.asarray(value), **flat)
        print(f"process {process_id}: {schedule}/{load_balance} loss {float(value):.6f}",
              flush=True)
    multihost_utils.sync_global_devices("done")
    print(f"process {process_id}: done", flush=True)
    # Both processes are past their last collective; jax.distributed.shutdown() can then
    # wait on the coordination service for a minute or more, which tells nothing here.
    os._exit(0)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
