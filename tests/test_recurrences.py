"""Recurrences over the tokens next to attention under load-balanced layouts: a loop whose
iterations follow the sequence (a scan over time after ``swapaxes`` / ``moveaxis``, a
``fori_loop`` indexing the tokens by its counter) runs in token order, converted once
around it, and gives one device's numbers; loops that do not follow the tokens (a scan
over layers, ``lax.map`` over tokens) keep the layout order; ``strict=True`` refuses the
conversion with the cause and the fix. The fuzzer's ``recurrence`` class covers the class
with more spellings and placements."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from conftest import assert_tree_close
from cptransform import context_parallel
from cptransform.ir.errors import ReorderError

B, S, E, H = 2, 32, 8, 2
TOKEN_ORDER = "runs in token order"


def linear_scan(x, a, reverse=False):
    def step(h, xt):
        h = jax.nn.sigmoid(a) * h + xt
        return h, h
    _, ys = lax.scan(step, jnp.zeros_like(x[:, 0]), x.swapaxes(0, 1), reverse=reverse)
    return ys.swapaxes(0, 1)


def rnn_moveaxis(x, a):
    def step(h, xt):
        h = jnp.tanh(h * a + xt)
        return h, 0.5 * h
    _, ys = lax.scan(step, jnp.zeros_like(x[:, 0]), jnp.moveaxis(x, 1, 0))
    return jnp.moveaxis(ys, 0, 1)


def matrix_state(x, a):
    """A linear-attention / Mamba-style state ``[B, H, d, d]`` carried over the tokens."""
    k = jnp.moveaxis(x.reshape(B, S, H, E // H), 1, 0)

    def step(c, kt):
        c = jax.nn.sigmoid(a[0]) * c + jnp.einsum("bhd,bhf->bhdf", kt, kt)
        return c, jnp.einsum("bhd,bhdf->bhf", kt, c)
    _, ys = lax.scan(step, jnp.zeros((B, H, E // H, E // H)), k)
    return jnp.moveaxis(ys, 0, 1).reshape(B, S, E) / S


def fori_index(x, a):
    def body(i, carry):
        h, out = carry
        h = jnp.tanh(a * h + lax.dynamic_index_in_dim(x, i, 1, keepdims=False))
        return h, lax.dynamic_update_index_in_dim(out, h, i, 1)
    return lax.fori_loop(0, S, body, (jnp.zeros_like(x[:, 0]), jnp.zeros_like(x)))[1]


RECURRENCES = {"scan_swapaxes": linear_scan,
               "scan_reverse": lambda x, a: linear_scan(x, a, reverse=True),
               "rnn_moveaxis": rnn_moveaxis, "matrix_state": matrix_state,
               "fori_index": fori_index}


def model(recurrence):
    def loss(p):
        x = p["x"] + recurrence(p["x"], p["a"])
        q, k, v = ((x @ p[w]).reshape(B, S, H, E // H) for w in ("wq", "wk", "wv"))
        y = x + jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(B, S, E)
        y = y + recurrence(y, p["a"])
        return jnp.mean(jnp.tanh(y) ** 2)
    return loss


def params(seed=0):
    keys = jax.random.split(jax.random.key(seed), 5)
    p = {w: jax.random.normal(k, (E, E)) / np.sqrt(E)
         for w, k in zip(("wq", "wk", "wv"), keys)}
    return {**p, "x": jax.random.normal(keys[3], (B, S, E)),
            "a": jax.random.normal(keys[4], (E,))}


def check(recurrence, load_balance, **options):
    loss, p = model(recurrence), params()
    f = context_parallel(loss, cp=4, load_balance=load_balance, **options)
    got = jax.jit(jax.value_and_grad(f))(p)
    assert_tree_close(got, jax.jit(jax.value_and_grad(loss))(p))
    return f.module(p).facts.reorder_log


@pytest.mark.parametrize("load_balance", ["zigzag", "striped"])
@pytest.mark.parametrize("name", [pytest.param(n, marks=[] if n == "scan_swapaxes"
                                               else [pytest.mark.slow])
                                  for n in RECURRENCES])
def test_recurrence_over_tokens_runs_in_token_order(name, load_balance):
    log = check(RECURRENCES[name], load_balance)
    converted = [m for m in log if TOKEN_ORDER in m]
    assert len(converted) == 2, log   # one loop before the attention, one after
    if name == "fori_index":
        assert all("would convert on every iteration" in m for m in converted), converted
    else:
        assert all("carries state across iterations" in m for m in converted), converted


@pytest.mark.slow
def test_map_over_tokens_and_scan_over_layers_keep_the_layout():
    """No carry (``lax.map`` over tokens) or iterations that are layers, not tokens: the
    loop runs in layout order, nothing is converted."""
    def over_tokens(x, a):
        return lax.map(lambda t: jnp.tanh(t * a), x.swapaxes(0, 1)).swapaxes(0, 1)

    assert not [m for m in check(over_tokens, "zigzag") if "un-permute" in m]

    def layers(p):
        def layer(x, w):
            q, k, v = ((x @ w[i]).reshape(B, S, H, E // H) for i in range(3))
            o = jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(B, S, E)
            return x + o, None
        y, _ = lax.scan(layer, p["x"], p["w"])
        return jnp.mean(y ** 2)

    key = jax.random.key(3)
    p = {"x": jax.random.normal(key, (B, S, E)),
         "w": jax.random.normal(jax.random.fold_in(key, 1), (2, 3, E, E)) / np.sqrt(E)}
    f = context_parallel(layers, cp=4, load_balance="zigzag")
    assert_tree_close(jax.jit(jax.value_and_grad(f))(p),
                      jax.jit(jax.value_and_grad(layers))(p))
    assert not [m for m in f.module(p).facts.reorder_log if "un-permute" in m]


def test_strict_refuses_a_recurrence_over_tokens():
    f = context_parallel(model(linear_scan), cp=4, load_balance="zigzag", strict=True)
    with pytest.raises(ReorderError, match="carries state across iterations.*strict=True.*"
                       "associative_scan.*load_balance='none'"):
        f(params())
