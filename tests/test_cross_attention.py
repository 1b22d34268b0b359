"""Cross-attention under CP: queries and keys of different lengths, each sharded on its own
sequence with its own layout (and padding), exact against the single-device function."""
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh
from schedule_cases import BTHD, HEAD_KINDS, Case, check_schedule

from cptransform import context_parallel
from cptransform.ir.module import iter_eqns
from cptransform.lowering.sharding_leaks import sequence_all_gathers
from cptransform.op.attention import attention_p
from cptransform.op.attention_spec import AttentionSpec, MaskSpec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from examples import encoder_decoder  # noqa: E402

RTOL = 1e-5


def cross_case(rng, tq: int, tkv: int, kind: str, heads: str = "gqa",
               empty_rows: str = "zero") -> Case:
    """Random queries ``[1, tq]`` against keys ``[1, tkv]`` with the mask ``kind``:
    ``causal`` (the KV-cache offset ``kv - q <= tkv - tq``), ``window``, ``segments``,
    ``dense`` or ``bias``."""
    h, hkv = HEAD_KINDS[heads]
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)  # noqa: E731
    operands = [normal(1, tq, h, 8), normal(1, tkv, hkv, 8), normal(1, tkv, hkv, 8)]
    mask = MaskSpec(causal=kind == "causal", causal_offset=tkv - tq if kind == "causal" else 0,
                    window=(4, 3) if kind == "window" else None,
                    segments=kind == "segments", dense=kind == "dense", bias=kind == "bias",
                    empty_rows=empty_rows)
    if mask.segments:
        operands += [jnp.asarray(np.sort(rng.integers(0, 3, size=(1, t)), axis=1), jnp.int32)
                     for t in (tq, tkv)]
    if mask.dense:
        operands.append(jnp.asarray(rng.random((1, h, tq, tkv)) < 0.4))
    if mask.bias:
        operands.append(normal(1, 1, tq, tkv))
    spec = AttentionSpec(q=BTHD, k=BTHD, v=BTHD, scale=1 / math.sqrt(8), groups=h // hkv,
                         mask=mask)
    return Case(tuple(operands), spec)


@pytest.mark.slow
@pytest.mark.parametrize("schedule,layout,tq,tkv,kind,empty_rows", [
    ("ring", "contiguous", 16, 32, "causal", "zero"),      # both lengths divisible
    ("ring", "zigzag", 19, 40, "causal", "nan"),           # queries padded, offset 21
    ("ring", "zigzag", 27, 11, "window", "uniform"),       # more queries than keys
    ("allgather", "contiguous", 13, 24, "segments", "uniform"),
    ("allgather", "zigzag", 5, 32, "dense", "zero"),
    ("ulysses", "zigzag", 24, 19, "causal", "uniform"),    # negative offset: empty rows
    ("ulysses", "contiguous", 13, 40, "bias", "nan"),
])
def test_schedules_run_cross_attention(rng, schedule, layout, tq, tkv, kind, empty_rows):
    case = cross_case(rng, tq, tkv, kind, empty_rows=empty_rows)
    check_schedule(case, mesh=make_mesh((8,), ("cp",)), axes="cp", schedule=schedule,
                   layout=layout)


# -- the transform --

def decoder_over_memory(params, x, memory, *, causal: bool):
    """Cross-attention written by hand from ``x [B, Tq, d]`` to ``memory [B, Tkv, d]``;
    ``causal``: query ``i`` sees keys ``j <= i + Tkv - Tq`` (an iota mask with an offset)."""
    b, tq, d = x.shape
    tkv = memory.shape[1]
    heads = lambda y, w: (y @ params[w]).reshape(b, y.shape[1], 8, d // 8)  # noqa: E731
    q, k, v = heads(x, "wq"), heads(memory, "wk"), heads(memory, "wv")
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d // 8)
    if causal:
        visible = jnp.arange(tkv)[None, :] - jnp.arange(tq)[:, None] <= tkv - tq
        logits = jnp.where(visible, logits, -jnp.inf)
    o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), v).reshape(b, tq, d)
    return jnp.mean(jnp.tanh(x + o @ params["wo"]) ** 2)


def cross_args(tq: int, tkv: int):
    keys = jax.random.split(jax.random.key(2), 6)
    params = {n: jax.random.normal(k, (16, 16)) / 4
              for n, k in zip(("wq", "wk", "wv", "wo"), keys)}
    return params, jax.random.normal(keys[4], (2, tq, 16)), jax.random.normal(keys[5], (2, tkv, 16))


@pytest.mark.slow
@pytest.mark.parametrize("schedule,load_balance,tq,tkv,causal", [
    ("ring", "zigzag", 19, 40, True),
    ("allgather", "none", 16, 24, False),
    ("ulysses", "zigzag", 16, 16, True),   # equal lengths, still two sequences: one layout
])
def test_transform_shards_each_sequence(schedule, load_balance, tq, tkv, causal):
    args = cross_args(tq, tkv)
    fn = lambda p, x, m: decoder_over_memory(p, x, m, causal=causal)  # noqa: E731
    want = jax.value_and_grad(fn, argnums=(0, 1, 2))(*args)
    f = context_parallel(fn, cp=8, schedule=schedule, load_balance=load_balance)
    got = jax.value_and_grad(f, argnums=(0, 1, 2))(*args)
    np.testing.assert_allclose(got[0], want[0], rtol=RTOL)
    for g, w in zip(jax.tree_util.tree_leaves(got[1]), jax.tree_util.tree_leaves(want[1])):
        np.testing.assert_allclose(g, w, rtol=0, atol=RTOL * float(jnp.max(jnp.abs(w))))
    module = f.module(*args)
    names = [e.primitive.name for e in iter_eqns(module.jaxpr)]
    assert attention_p.name not in names and "shard_map" in names
    (plan,) = module.facts.plan
    assert (plan.schedule, plan.shape.seq_len, plan.shape.kv_len) == (schedule, tq, tkv)
    assert plan.mask.causal == causal and plan.mask.causal_offset == (tkv - tq if causal else 0)
    # Two sequences, found by dataflow: the queries' and the memory's.
    assert module.facts.seq_axes.lengths == (tq, tkv)
    assert module.facts.seq_axes.inputs[-2:] == ((1,), (1,))
    if tq == tkv and load_balance != "none":
        # One common length: both sequences share the permutation and the program runs in
        # layout order (an attention permuting its own operands would make GSPMD
        # all-gather the whole sequence around it).
        assert module.facts.layout is not None and module.facts.layout.name == load_balance
        hlo = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2))).lower(*args).compile()
        assert sequence_all_gathers(hlo.as_text(), tq) == []


@pytest.mark.slow
def test_encoder_decoder_example():
    """``examples/encoder_decoder.py`` at its smallest: encoder 16 tokens, decoder 11
    (not a multiple of 2·cp = 16), zigzag over cp=8; loss and every gradient."""
    cfg = encoder_decoder.Config(vocab=32, dim=16, heads=8, mlp_dim=16)
    assert encoder_decoder.check(cfg, src_len=16, tgt_len=11, verbose=False) <= RTOL
