"""KV caches under CP: the prompt's keys written into a longer cache (a prefill, as Gemma and
MaxText write it) or a cache concatenated to the new keys. The keys are a sequence of their
own length, derived from the queries' by the write, and the attention runs sharded as a
cross-attention between the two; values, every gradient and the returned caches match
one device."""
import math

import jax
import jax.numpy as jnp
import pytest
from conftest import assert_rewritten, assert_tree_close

from cptransform import context_parallel
from cptransform.passes.reorder_sequence import ReorderError

B, PROMPT, MAX_LEN, HEADS, KV_HEADS, HEAD_DIM, DIM = 2, 32, 64, 4, 2, 8, 16


def _write(cache, new, spelling: str):
    """``new`` written at position 0 of ``cache`` along the sequence."""
    if spelling == "dynamic_update_slice":
        return jax.lax.dynamic_update_slice(cache, new, (0, 0, 0, 0))
    return cache.at[:, :new.shape[1]].set(new)


def prefill(params, x, cache_k, cache_v, *, spelling="dynamic_update_slice"):
    """The prompt's K/V written into the caches, its queries attending over the whole cache
    (``key < prompt & key <= query``); returns the loss and the written caches."""
    b, s, _ = x.shape
    q = (x @ params["wq"]).reshape(b, s, HEADS, HEAD_DIM)
    k = (x @ params["wk"]).reshape(b, s, KV_HEADS, HEAD_DIM)
    v = (x @ params["wv"]).reshape(b, s, KV_HEADS, HEAD_DIM)
    cache_k, cache_v = _write(cache_k, k, spelling), _write(cache_v, v, spelling)
    keys = jnp.repeat(cache_k, HEADS // KV_HEADS, axis=2)
    values = jnp.repeat(cache_v, HEADS // KV_HEADS, axis=2)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, keys) / math.sqrt(HEAD_DIM)
    query, key = jnp.arange(s)[:, None], jnp.arange(cache_k.shape[1])[None, :]
    logits = jnp.where((key < s) & (key <= query), logits, -jnp.inf)
    o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), values)
    loss = jnp.mean(jnp.tanh(o.reshape(b, s, -1) @ params["wo"]) ** 2)
    return loss, (cache_k, cache_v)


def prefill_args(seed: int = 0):
    keys = jax.random.split(jax.random.key(seed), 7)
    shapes = {"wq": (DIM, HEADS * HEAD_DIM), "wk": (DIM, KV_HEADS * HEAD_DIM),
              "wv": (DIM, KV_HEADS * HEAD_DIM), "wo": (HEADS * HEAD_DIM, DIM)}
    params = {n: jax.random.normal(k, s) / 4 for (n, s), k in zip(shapes.items(), keys)}
    x = jax.random.normal(keys[4], (B, PROMPT, DIM))
    cache_k, cache_v = (jax.random.normal(k, (B, MAX_LEN, KV_HEADS, HEAD_DIM))
                        for k in keys[5:])
    return params, x, cache_k, cache_v


def check_prefill(schedule: str, load_balance: str, spelling: str):
    fn = lambda *a: prefill(*a, spelling=spelling)  # noqa: E731
    args = prefill_args()
    f = context_parallel(fn, cp=8, schedule=schedule, load_balance=load_balance)
    assert_rewritten(f, *args, count=1)
    grad = lambda g: jax.value_and_grad(g, argnums=(0, 1, 2, 3), has_aux=True)  # noqa: E731
    assert_tree_close(grad(f)(*args), grad(fn)(*args))
    module = f.module(*args)
    (plan,) = module.facts.plan
    # The prompt and the cache are two sequences; the mask is causal alone (the bound
    # ``key < prompt`` is implied by it), no S×S array and no padding ids.
    assert module.facts.seq_axes.lengths == (PROMPT, MAX_LEN)
    assert (plan.shape.seq_len, plan.shape.kv_len) == (PROMPT, MAX_LEN)
    assert plan.mask.causal and not plan.mask.dense and not plan.mask.segments


def test_prefill_into_a_longer_cache_runs_sharded():
    check_prefill("ring", "zigzag", "dynamic_update_slice")


@pytest.mark.slow
@pytest.mark.parametrize("schedule,load_balance,spelling", [
    ("auto", "auto", "dynamic_update_slice"),
    ("allgather", "striped", "at_set"),
    ("ring", "none", "at_set"),
])
def test_prefill_schedules_and_spellings(schedule, load_balance, spelling):
    check_prefill(schedule, load_balance, spelling)


@pytest.mark.slow
def test_keep_permuted_is_refused_for_the_cache():
    """Two sequences run zigzag inside the attentions only: the caches cannot be returned
    in the layout, and ``keep_permuted=True`` says so (dropping it is the fix, which the
    tests above run)."""
    f = context_parallel(prefill, cp=8, schedule="ring", load_balance="zigzag",
                         keep_permuted=True)
    with pytest.raises(ReorderError, match="inside the attentions only.*drop keep_permuted"):
        f.module(*prefill_args())


@pytest.mark.slow
def test_keys_concatenated_to_a_cache_run_sharded():
    """A cache of 8 tokens concatenated before the 16 new ones: keys of length 24 derived
    from the queries' 16 by the concatenation, causal with the cache's offset."""
    def cached(params, x, cache):
        memory = jnp.concatenate([cache, x], axis=1)
        q = (x @ params["wq"]).reshape(B, x.shape[1], HEADS, -1)
        k = (memory @ params["wk"]).reshape(B, memory.shape[1], HEADS, -1)
        v = (memory @ params["wv"]).reshape(B, memory.shape[1], HEADS, -1)
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k)
        offset = memory.shape[1] - x.shape[1]
        visible = jnp.arange(memory.shape[1])[None, :] <= jnp.arange(x.shape[1])[:, None] + offset
        logits = jnp.where(visible, logits, -jnp.inf)
        o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), v)
        return jnp.mean(jnp.tanh(o.reshape(B, x.shape[1], -1)) ** 2)

    keys = jax.random.split(jax.random.key(1), 5)
    params = {n: jax.random.normal(k, (DIM, DIM)) / 4 for n, k in zip(("wq", "wk", "wv"), keys)}
    x, cache = jax.random.normal(keys[3], (B, 16, DIM)), jax.random.normal(keys[4], (B, 8, DIM))
    f = context_parallel(cached, cp=8, schedule="ring", load_balance="zigzag")
    assert_rewritten(f, params, x, cache, count=1)
    grad = lambda g: jax.value_and_grad(g, argnums=(0, 1, 2))  # noqa: E731
    assert_tree_close(grad(f)(params, x, cache), grad(cached)(params, x, cache))
    assert f.module(params, x, cache).facts.seq_axes.lengths == (16, 24)
