"""match-attention on ``jax.nn.dot_product_attention`` (XLA path) and hand-written einsum."""
import jax
import jax.numpy as jnp
import pytest

from cptransform.op.attention import attention_p
from test_match_support import assert_close, check, randn, rewrite, specs

B, T, H, D = 2, 8, 4, 8


@pytest.fixture
def qkv(rng):
    return randn(rng, B, T, H, D), randn(rng, B, T, H, D), randn(rng, B, T, H, D)


def test_plain(qkv):
    m = check(lambda q, k, v: jax.nn.dot_product_attention(q, k, v), *qkv, analytic=True)
    (spec,) = specs(m)
    assert spec.mask.is_trivial and spec.groups == 1
    assert spec.scale == pytest.approx(D ** -0.5)


def test_is_causal(qkv):
    m = check(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True), *qkv,
              analytic=True)
    (spec,) = specs(m)
    assert spec.mask.causal and spec.mask.causal_offset == 0
    assert spec.mask.empty_rows == "uniform"


def test_local_window(qkv):
    fn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,  # noqa: E731
                                                      local_window_size=(3, 0))
    (spec,) = specs(check(fn, *qkv, analytic=True))
    assert spec.mask.band() == (-3, 0)


@pytest.mark.slow
def test_scale(qkv):
    fn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, scale=0.7)  # noqa: E731
    (spec,) = specs(check(fn, *qkv))
    assert spec.scale == pytest.approx(0.7)


@pytest.mark.slow
def test_dense_mask_and_bias(qkv, rng):
    mask = jnp.asarray(rng.random((B, 1, T, T)) > 0.3)
    bias = randn(rng, B, H, T, T)
    fn = lambda q, k, v, m, b: jax.nn.dot_product_attention(q, k, v, mask=m, bias=b)  # noqa
    (spec,) = specs(check(fn, *qkv, mask, bias))
    assert spec.mask.dense and spec.mask.bias


@pytest.mark.slow
def test_gqa(rng):
    q = randn(rng, B, T, H, D)
    k, v = randn(rng, B, T, 2, D), randn(rng, B, T, 2, D)
    fn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    (spec,) = specs(check(fn, q, k, v, analytic=True))
    assert spec.groups == 2


@pytest.mark.slow
def test_hand_written_causal_einsum(qkv):
    def fn(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(D)
        s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s, -jnp.inf)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v)

    (spec,) = specs(check(fn, *qkv, analytic=True))
    assert spec.mask.causal and spec.mask.empty_rows == "nan"


@pytest.mark.slow
def test_gradient_matches(qkv):
    fn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    m = rewrite(fn, *qkv)
    loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))  # noqa: E731
    got = jax.grad(loss(m.as_function()), argnums=(0, 1, 2))(*qkv)
    want = jax.grad(loss(fn), argnums=(0, 1, 2))(*qkv)
    for g, w in zip(got, want):
        assert_close(g, w, 1e-5)
    assert m.count(attention_p) == 1
