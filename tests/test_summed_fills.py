"""A mask's fill summed into a bias before the logits take it (transformers' Flax T5:
``s + (bias + where(mask > 0, 0, finfo.min))``): read as the bias and the mask, sharded
where every row sees a key, refused where a row may see none (left whole beside other
attentions: ``tests/test_models_integration.py``'s T5 given padding masks).

Read as one bias, a row the fill hides wholly has every logit within rounding of the fill;
a float32 log-sum-exp there loses the row's ``log n``, so the schedules' output (merged
across ring steps) and every gradient of that row came out wrong.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import assert_rewritten, assert_tree_close
from cptransform import UnshardedError, context_parallel

B, S, H, D = 2, 32, 4, 8
FILL = float(jnp.finfo(jnp.float32).min)


def _data(seed=0):
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.standard_normal((B, S, H, D)), jnp.float32) for _ in range(3))
    bias = jnp.asarray(rng.standard_normal((1, H, S, S)), jnp.float32)
    # left padding: under causal masking the first rows of the second sequence see no key
    valid = jnp.asarray(np.arange(S)[None, :] >= np.array([[0], [5]]))
    return q, k, v, bias, valid


def _visible(valid, causal: bool, padded: bool):
    i, j = jnp.arange(S)[:, None], jnp.arange(S)[None, :]
    vis = (j <= i)[None, None] if causal else jnp.ones((1, 1, S, S), bool)
    return vis & valid[:, None, None, :] if padded else vis


def t5_attention(causal: bool, padded: bool):
    """T5's spelling: the fill summed into the bias, the sum added to the scores once."""
    def loss(q, k, v, bias, valid):
        summed = bias + jnp.where(_visible(valid, causal, padded), 0.0, FILL)
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) + summed
        o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)
        return jnp.sum(o * jnp.cos(o))
    return loss


def viewed_bias_attention(causal: bool, padded: bool):
    """The sum handed to ``jax.nn.dot_product_attention``, which reshapes it per KV head
    before adding it: it cannot be split there, the bias operand carries the fill."""
    def loss(q, k, v, bias, valid):
        summed = bias + jnp.where(_visible(valid, causal, padded), 0.0, FILL)
        o = jax.nn.dot_product_attention(q, k, v, bias=summed)
        return jnp.sum(o * jnp.cos(o))
    return loss


def _check(loss, args, schedule, load_balance):
    f = context_parallel(loss, cp=4, schedule=schedule, load_balance=load_balance)
    grad = jax.grad(lambda *a: f(*a), argnums=(0, 1, 2, 3))
    want = jax.grad(loss, argnums=(0, 1, 2, 3))(*args)
    assert_tree_close(f(*args), loss(*args))
    assert_tree_close(grad(*args), want)
    return f


@pytest.mark.parametrize("schedule,load_balance", [
    ("ring", "zigzag"),
    pytest.param("allgather", "none", marks=pytest.mark.slow),
    pytest.param("ulysses", "none", marks=pytest.mark.slow)])
def test_causal_fill_summed_into_a_bias_is_read_as_the_mask(schedule, load_balance):
    args = _data()
    f = _check(t5_attention(causal=True, padded=False), args, schedule, load_balance)
    assert_rewritten(f, *args, count=1)
    (plan,) = f.module(*args).facts.plan
    assert plan.mask.causal and plan.mask.bias and not plan.mask.added_fill


@pytest.mark.parametrize("build", [t5_attention, pytest.param(viewed_bias_attention,
                                                              marks=pytest.mark.slow)])
def test_padding_fill_summed_into_a_bias_is_refused(build):
    """A padding fill in the bias: a row may see no key, whose gradient to the bias one
    device gives and the schedules would not (or, behind a reshape, whose scores the
    kernels cannot hold): refused with the reason, never sharded wrong."""
    args = _data(1)
    f = context_parallel(build(causal=True, padded=True), cp=4, schedule="ring",
                         load_balance="zigzag")
    with pytest.raises(UnshardedError, match="a row may see no key"):
        f(*args)


@pytest.mark.slow
def test_causal_fill_in_a_viewed_bias_stays_in_the_bias():
    """Behind jax.nn's reshape the causal fill stays in the bias operand: no row is empty,
    so the bias alone is exact."""
    args = _data(2)
    f = _check(viewed_bias_attention(causal=True, padded=False), args, "ring", "zigzag")
    assert_rewritten(f, *args, count=1)
