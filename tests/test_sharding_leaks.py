"""No sharding leaks: the compiled (GSPMD-partitioned) loss-and-gradient program of a
context-parallel model holds no floating-point all-gather of the whole sequence outside
its attention schedules' ``shard_map`` islands."""
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from cptransform import context_parallel
from cptransform.lowering.sharding_leaks import sequence_all_gathers
from test_order_safe_ops import CASES as FEATURE_OPS, B, F, S, model
from test_sequence_contractions import (W_MIX, W_POOL, X, learned_pooling, token_mixer,
                                        weighted_token_loss)
from test_transform import cumulative_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from examples import llama  # noqa: E402

pytestmark = pytest.mark.slow


def gpt_inputs():
    keys = jax.random.split(jax.random.key(41), 2)
    return (jax.random.normal(keys[0], (B, S, 3 * F)),
            jax.random.normal(keys[1], (3 * F, 3 * F)) / 8)


def llama_inputs():
    cfg = llama.Config(vocab=64, dim=32, layers=2, heads=4, kv_heads=2, mlp_dim=64)
    return (lambda p, t: llama.loss(p, t, cfg)), llama.example_args(cfg, batch=2, seq=64)


def leaks(fn, args, seq_len, **options):
    f = context_parallel(fn, cp=4, **options)
    floats = tuple(i for i, a in enumerate(args)
                   if not isinstance(a, jax.Array) or jnp.issubdtype(a.dtype, jnp.floating))
    grad = jax.value_and_grad(f, argnums=floats)
    return sequence_all_gathers(jax.jit(grad).lower(*args).compile().as_text(), seq_len)


@pytest.mark.parametrize("case", ["gpt_fused_qkv_split", "llama", "pooling", "token_loss"])
def test_no_sequence_all_gather_outside_the_schedules(case):
    """The ``[S]`` pooling weight needs none either: each device contracts its own tokens
    with its own slice of the weight (both in layout order, both sharded) and XLA
    all-reduces the small ``[B, H, D]`` partial sums."""
    fn, args = {"gpt_fused_qkv_split": (model(FEATURE_OPS["split"]), gpt_inputs()),
                "llama": llama_inputs(),
                "pooling": (learned_pooling, (X, W_POOL)),
                "token_loss": (weighted_token_loss, (X, W_POOL))}[case]
    seq_len = 64 if case == "llama" else S
    assert leaks(fn, args, seq_len, load_balance="zigzag") == []


def test_token_mixing_gathers_only_for_its_weight_gradient():
    """A dense ``[S, S]`` mixer couples every pair of tokens: the forward contracts local
    tokens and reduce-scatters, but the weight's gradient is an outer product over two
    sequence dims, so one full-sequence operand must reach every device (as K/V do for
    attention). That all-gather is the model's, not a leak of the transform: nothing
    else may gather."""
    found = leaks(token_mixer, (X, {"mix": W_MIX}), S, load_balance="zigzag")
    # One gather, in the backward (transpose(jvp(...))), of the activations the weight
    # gradient's einsum contracts, [S, B, H·D] on the sequence dim. JAX 0.10 and 0.11 name it
    # after that einsum (.../bsd,st->btd/dot_general), 0.12 after the sharding constraint
    # the einsum's operand passes through.
    assert len(found) == 1, found
    (gather,) = found
    assert "transpose(" in gather.op_name and gather.dim == 0, gather
    assert gather.shape == (S, X.shape[0], X.shape[2] * X.shape[3]), gather
    assert "bsd,st->btd" in gather.op_name or gather.op_name.endswith("/sharding_constraint")


def test_allgather_schedule_is_not_a_leak():
    fn, args = llama_inputs()
    assert leaks(fn, args, 64, schedule="allgather", load_balance="striped") == []


def test_positional_op_leaks_and_explain_says_so():
    """A running sum over the sequence gathered (``recurrences="gather"``, instead of state
    passed) is un-permuted around: GSPMD gathers the sequence for it, and
    ``explain(leaks=True)`` names the all-gather."""
    x = jax.random.normal(jax.random.key(5), (1, 32, 2, 8))
    found = leaks(cumulative_model, (x,), 32, load_balance="zigzag", recurrences="gather")
    assert found and all(g.shape[g.dim] == 32 and g.dtype == "f32" for g in found)
    f = context_parallel(cumulative_model, cp=4, load_balance="zigzag", recurrences="gather")
    text = f.explain(x, leaks=True)
    assert "sharding leaks: " in text and "all-gather f32[1,32,2,8] on dim 1" in text
    assert "sharding leaks" not in f.explain(x)
    gpt = context_parallel(model(FEATURE_OPS["split"]), cp=4, load_balance="zigzag")
    assert "sharding leaks: none" in gpt.explain(*gpt_inputs(), leaks=True)
