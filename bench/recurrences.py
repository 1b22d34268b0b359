"""Recurrent layers in a hybrid block: exact, and what their recurrence adds to communication.

Each layer of ``examples/recurrent_layers.py`` (Mamba's selective scan, causal linear
attention by cumsum, chunked GLA, RG-LRU by ``associative_scan``, DeltaNet's matrix state,
an EMA by cumprod, a GRU) sits before a causal attention in a residual block
(``hybrid_block``). Under ``context_parallel`` (``auto``, and ``ring`` with ``zigzag``) this
prints, per layer:

* the loss and gradients' worst error relative to the single-device run (float32);
* each recurrence's method (``explain()``'s);
* the bytes per device of every collective in the *compiled* forward+backward program
  (GSPMD's included: a gathered recurrence's all-gathers exist only there), for the block,
  for its ``cut`` twin (the same layer with each step's state started afresh: a token-wise
  op in the recurrence's place) and for the block with the token-wise control op; "added"
  is the block's bytes minus the cut twin's, in units of one ``[B, S, D]`` float32
  activation.

Then the per-device temporary memory (abstract compile, no arrays) of the linear-attention
block at ``--memory-seq`` tokens with ``recurrences="auto"`` (prefix of totals) and
``recurrences="gather"``.

Bytes per device, as ``cptransform/lowering/collectives.py`` counts them: all-gather and
all-to-all ``b·(n-1)/n`` of their result, reduce-scatter ``b·(n-1)`` of its result,
all-reduce ``2·b·(n-1)/n``, collective-permute ``b``; a collective inside a while loop
counts once per trip (``known_trip_count``).

    .venv/bin/python bench/recurrences.py                       # S = 4096, cp = 8
    .venv/bin/python bench/recurrences.py --seq 512 --layers mamba,gru --memory-seq 8192
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "collective-permute", "all-to-all")
_COLLECTIVE = re.compile(r"=\s*(?P<type>.*?)\s(?P<kind>" + "|".join(KINDS) + r")(?:-start)?\(")
_ARRAY = re.compile(r"\b(?P<dtype>[a-z]+\d*)\[(?P<dims>[\d,]*)\]")
_MESH = re.compile(r"replica_groups=mesh\[(?P<axes>[^\]]*)\]\s*\{(?P<used>[^}]*)\}")
_GROUPS = re.compile(r"replica_groups=\{\{(?P<first>[\d,]*)\}")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%(?P<name>[\w.-]+)\s.*\{\s*$")
_WHILE = re.compile(r"\swhile\(.*body=%(?P<body>[\w.-]+)")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(?P<n>\d+)"')
_CALLS = re.compile(r"(?:to_apply|calls|body|condition)=%(?P<callee>[\w.-]+)")
ITEMSIZE = {"f32": 4, "bf16": 2, "f16": 2, "f64": 8, "s32": 4, "u32": 4, "s8": 1, "u8": 1,
            "pred": 1, "s64": 8, "u64": 8}


def _group(line: str) -> int:
    mesh = _MESH.search(line)
    if mesh:
        sizes = dict((a.strip().strip("'"), int(n)) for a, n in
                     (item.split("=") for item in mesh["axes"].split(",") if "=" in item))
        used = [a.strip().strip("'") for a in mesh["used"].split(",") if a.strip()]
        return math.prod(sizes[a] for a in used)
    groups = _GROUPS.search(line)
    return len(groups["first"].split(",")) if groups else 1


def _bytes(line: str, kind: str, type_text: str) -> int:
    data = sum(math.prod(int(d) for d in m["dims"].split(",") if d) * ITEMSIZE.get(m["dtype"], 4)
               for m in _ARRAY.finditer(type_text))
    if kind == "collective-permute":
        return data
    n = _group(line)
    if n <= 1:
        return 0
    return {"all-gather": data * (n - 1) // n, "all-to-all": data * (n - 1) // n,
            "reduce-scatter": data * (n - 1), "all-reduce": 2 * data * (n - 1) // n}[kind]


def collective_bytes(hlo: str) -> dict[str, int]:
    """Bytes per device of each kind of collective in compiled HLO text ``hlo``."""
    computations: dict[str, list[str]] = {}
    current = None
    for line in hlo.splitlines():
        head = _COMPUTATION.match(line)
        if head:
            current = head["name"]
            computations[current] = []
        elif current is not None:
            computations[current].append(line)
    trips: dict[str, int] = {}
    for lines in computations.values():
        for line in lines:
            loop = _WHILE.search(line)
            if loop:
                found = _TRIPS.search(line)
                trips[loop["body"]] = int(found["n"]) if found else 1
    totals = {k: 0 for k in KINDS}

    def visit(name: str, times: int, seen: tuple):
        for line in computations.get(name, ()):
            hit = _COLLECTIVE.search(line)
            if hit:
                totals[hit["kind"]] += times * _bytes(line, hit["kind"], hit["type"])
            for callee in _CALLS.findall(line):
                if callee in computations and callee not in seen:
                    visit(callee, times * trips.get(callee, 1), seen + (callee,))

    entry = next((m["name"] for line in hlo.splitlines()
                  if (m := _COMPUTATION.match(line)) and line.startswith("ENTRY")), None)
    visit(entry, 1, (entry,))
    return totals


def run(args) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    sys.path.insert(0, str(ROOT / "examples"))
    import recurrent_layers as R
    from cptransform import context_parallel

    b, s, d = args.batch, args.seq, args.dim
    activation = b * s * d * 4
    configs = {"auto": dict(schedule="auto", load_balance="auto"),
               "ring/zigzag": dict(schedule="ring", load_balance="zigzag")}
    x = jax.random.normal(jax.random.key(1), (b, s, d))
    rows = []
    for name in args.layers.split(","):
        layer = R.LAYERS[name]
        params = R.block_params(name, jax.random.key(0), d)
        loss = R.hybrid_block(layer)
        ref_loss, ref_grads = jax.jit(jax.value_and_grad(loss))(params, x)
        for config, options in configs.items():
            start = time.perf_counter()
            f = context_parallel(loss, cp=args.cp, **options)
            got_loss, got_grads = jax.jit(jax.value_and_grad(f))(params, x)
            error = max([abs(float(got_loss - ref_loss)) / abs(float(ref_loss))] + [
                float(jnp.max(jnp.abs(g - r)) / jnp.max(jnp.abs(r)))
                for g, r in zip(jax.tree.leaves(got_grads), jax.tree.leaves(ref_grads))])
            module = f.module(params, x)
            methods = [f"{r.what.split(' axis')[0]}: {r.method}" for r in module.facts.recurrences]
            chosen = {"schedules": [a.schedule for a in module.facts.plan],
                      "layout": module.facts.layout.name if module.facts.layout
                      else "contiguous"}
            sent = {}
            control = R.block_params("token_wise", jax.random.key(0), d)
            for variant, fn, p in (("block", loss, params),
                                   ("cut", R.hybrid_block(layer, cut=True), params),
                                   ("token_wise", R.hybrid_block(R.token_wise), control)):
                cp_fn = context_parallel(fn, cp=args.cp, **options)
                hlo = jax.jit(jax.value_and_grad(cp_fn)).lower(p, x).compile().as_text()
                sent[variant] = collective_bytes(hlo)
            total = {k: sum(v.values()) for k, v in sent.items()}
            added = total["block"] - total["cut"]
            rows.append(dict(layer=name, config=config, **chosen, error=error, methods=methods,
                             bytes=sent, totals=total, added_bytes=added,
                             added_activations=added / activation,
                             over_token_wise=(total["block"] - total["token_wise"]) / activation,
                             seconds=time.perf_counter() - start))
            print(f"{name:>16} {config:>11} ({'+'.join(chosen['schedules'])}, "
                  f"{chosen['layout']})  error {error:.1e}  added "
                  f"{added / 2**20:7.3f} MiB = {added / activation:5.2f} act "
                  f"(vs token-wise {rows[-1]['over_token_wise']:5.2f} act)  "
                  f"{'; '.join(methods)}", flush=True)
    memory = {}
    if args.memory_seq:
        spec = jax.ShapeDtypeStruct((b, args.memory_seq, d), jnp.float32)
        params = R.block_params("linear_attention", jax.random.key(0), d)
        loss = R.hybrid_block(R.linear_attention)
        for mode in ("auto", "gather"):
            f = context_parallel(loss, cp=args.cp, recurrences=mode)
            compiled = jax.jit(jax.value_and_grad(f)).lower(params, spec).compile()
            memory[mode] = int(compiled.memory_analysis().temp_size_in_bytes)
        print(f"linear-attention block at {args.memory_seq} tokens, cp={args.cp}: temporary "
              f"memory per device {memory['auto'] / 2**20:.1f} MiB passing totals, "
              f"{memory['gather'] / 2**20:.1f} MiB gathered "
              f"({memory['auto'] / memory['gather']:.3f}x)")
    del np
    return dict(seq=s, batch=b, dim=d, cp=args.cp, activation_bytes=activation, rows=rows,
                memory_seq=args.memory_seq, temp_bytes=memory)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--cp", type=int, default=8)
    parser.add_argument("--layers", default="mamba,linear_attention,gla,rg_lru,deltanet,ema,gru")
    parser.add_argument("--memory-seq", type=int, default=65536)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "recurrences.json"))
    args = parser.parse_args()
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={args.cp}")
    sys.path.insert(0, str(ROOT))
    result = run(args)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
