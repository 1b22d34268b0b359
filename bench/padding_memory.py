"""Padded batches of stock models at a long sequence: no array of ``S/cp × S`` per device.

For each family of ``tests/model_families.py`` whose mask comes from a padding mask (the
packages' own mask builders; DeepMind gemma and keras-hub, boolean and int masks; and
``int_minimum_layer``, keras-hub's int merge written out, which needs no package), the
loss-and-gradient program under ``context_parallel(cp=...)`` is compiled at ``--seq``
tokens (8K by default) and its largest arrays are read from the compiled HLO: a padding
mask kept as an ``S×S`` data term shows as a ``[B, (H,) S/cp, S]`` array per device. Prints
a table and writes ``bench/results/padding_memory.json``. Nothing runs: only shapes are
compiled (a few minutes on 2 cores).

    python bench/padding_memory.py [--seq 8192] [--cp 8] [--families a,b]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("KERAS_BACKEND", "jax")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import model_families as mf  # noqa: E402
from cptransform import context_parallel  # noqa: E402

def int_minimum_layer():
    """keras-hub's attention over an int ``padding_mask`` without the package: the mask
    merged by ``minimum`` with the causal one, tested ``!= 0`` (its ``dot_product_attention``
    path), entries beyond 0/1 and negative ones included (the region padding term)."""
    rng = np.random.default_rng(0)
    n, heads, dim = mf.SEQ, 4, 8
    params = jnp.asarray(rng.standard_normal((dim * heads, 3 * heads * dim)) * 0.1,
                         jnp.float32)
    h = jnp.asarray(rng.standard_normal((1, n, dim * heads)), jnp.float32)
    mask = jnp.asarray(np.where(np.arange(n) < n // 8, 0, rng.integers(-1, 3, n))[None],
                       jnp.int32)

    def loss(w, h, mask):
        q, k, v = jnp.split((h @ w).reshape(1, n, 3 * heads, dim), 3, axis=2)
        causal = jnp.tril(jnp.ones((n, n), jnp.int32))
        merged = jnp.minimum(mask[:, None, :], causal[None])
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(dim)
        s = jnp.where(merged[:, None] != 0, s, -1e9)
        return jnp.sum(jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v) ** 2)
    return loss, (params, h, mask)


#: The padded families of ``model_families.FAMILIES``, boolean and int padding masks
#: (keras-hub merges an int ``padding_mask`` by ``minimum``, some layers test it ``!= 0``:
#: the region padding term, ``docs/contract.md``), and T5's (its relative-position bias is a
#: dense bias operand: ``S/cp × S`` per head, no mask; given padding masks its
#: self-attentions are left whole).
BUILDERS = {**{name: mf.FAMILIES[name] for name in mf.FAMILIES if name.endswith(
    ("_padded", "_padded_int")) and name.startswith(("gemma", "keras"))},
    "int_minimum_layer": int_minimum_layer,
    # transformers' Flax T5: its padding fill summed into the relative-position bias
    **{name: mf.FAMILIES[name] for name in ("t5", "t5_decoder_inputs")}}
#: DeepMind gemma's params do not depend on the length: built short, the inputs tiled.
_SHORT = ("gemma_padded", "gemma_padded_int")
_ARRAY = re.compile(r"\b(pred|[su](?:8|16|32|64)|bf16|f(?:16|32|64))\[([0-9,]*)\]")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
          "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}


def largest(hlo: str, count: int = 3) -> list[tuple[str, int]]:
    """The ``count`` largest array types in ``hlo`` (``"f32[2,1024,64]"``, bytes)."""
    seen = {}
    for dtype, dims in _ARRAY.findall(hlo):
        shape = [int(n) for n in dims.split(",") if n]
        seen[f"{dtype}[{dims}]"] = int(np.prod(shape, dtype=np.int64)) * _BYTES[dtype]
    return sorted(seen.items(), key=lambda kv: -kv[1])[:count]


def pair_arrays(hlo: str, seq: int, cp: int) -> list[str]:
    """Array types holding a ``S/cp × S`` (or larger) block of (query, key) pairs."""
    out = []
    for dtype, dims in _ARRAY.findall(hlo):
        shape = [int(n) for n in dims.split(",") if n]
        if seq in shape and any(n >= seq // cp for i, n in enumerate(shape)
                                if i != shape.index(seq)):
            out.append(f"{dtype}[{dims}]")
    return sorted(set(out))


def build(family: str, seq: int):
    """``(loss, args)`` of ``family`` at ``seq`` tokens."""
    mf.SEQ = mf.SEQ if family in _SHORT else seq
    loss, args = BUILDERS[family]()
    if family in _SHORT:
        reps = seq // args[1].shape[1]
        args = (args[0], *(np.tile(np.asarray(a), (1, reps)) for a in args[1:]))
    mf.SEQ = seq
    return loss, args


def measure(family: str, seq: int, cp: int) -> dict:
    loss, args = build(family, seq)
    f = context_parallel(loss, cp=cp, schedule="ring", load_balance="zigzag")
    start = time.perf_counter()
    compiled = jax.jit(jax.value_and_grad(f)).lower(*args).compile()
    hlo = compiled.as_text()
    facts = f.module(*args).facts
    plans = facts.plan
    return {"family": family, "seq": seq, "cp": cp,
            "dense_masks": sum(p.mask.dense for p in plans), "attentions": len(plans),
            "left_whole": sum(m.runs_unsharded for m in facts.matches or ()),
            "largest": largest(hlo), "pair_arrays": pair_arrays(hlo, seq, cp),
            "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes),
            "compile_s": round(time.perf_counter() - start, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--cp", type=int, default=8)
    parser.add_argument("--families", default=",".join(BUILDERS))
    parser.add_argument("--out", default=str(ROOT / "bench/results/padding_memory.json"))
    a = parser.parse_args()
    rows = []
    print(f"{'family':24} {'dense':>5} {'whole':>5} {'S/cp x S arrays':>16} {'temp MiB':>9}  "
          "largest")
    for family in a.families.split(","):
        row = measure(family, a.seq, a.cp)
        rows.append(row)
        print(f"{family:24} {row['dense_masks']:>2}/{row['attentions']:<2} "
              f"{row['left_whole']:>5} {len(row['pair_arrays']):>16} "
              f"{row['temp_bytes'] / 2**20:>9.1f}  "
              f"{row['largest'][0][0]}", flush=True)
    Path(a.out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
