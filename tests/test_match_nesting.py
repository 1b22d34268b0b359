"""match-attention inside scan, checkpoint, nested jit, custom_jvp and vmap bodies."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from test_match_support import assert_close, check, randn, rewrite, specs

B, T, H, D = 2, 8, 2, 8
CAUSAL = np.tril(np.ones((T, T), bool))


def attend(q, k, v):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * D ** -0.5
    s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)


def layer(x, w):
    q, k, v = (jnp.einsum("bthd,de->bthe", x, w[i]) for i in range(3))
    return x + attend(q, k, v)


def test_scan_over_layers(rng):
    x, ws = randn(rng, B, T, H, D), randn(rng, 3, 3, D, D) * 0.3
    fn = lambda x, ws: jax.lax.scan(lambda h, w: (layer(h, w), None), x, ws)[0]  # noqa: E731
    m = check(fn, x, ws, analytic=True)
    assert [r.depth for r in m.facts.matches] == [1]


@pytest.mark.slow
def test_checkpoint(rng):
    x, w = randn(rng, B, T, H, D), randn(rng, 3, D, D) * 0.3
    check(lambda x, w: jax.checkpoint(layer)(x, w), x, w, analytic=True)


@pytest.mark.slow
def test_nested_jit(rng):
    q, k, v = (randn(rng, B, T, H, D) for _ in range(3))
    check(jax.jit(lambda q, k, v: jax.jit(attend)(q, k, v) * 2.0), q, k, v, analytic=True)


@pytest.mark.slow
def test_custom_jvp(rng):
    q, k, v = (randn(rng, B, T, H, D) for _ in range(3))
    f = jax.custom_jvp(attend)
    f.defjvp(lambda primals, tangents: jax.jvp(attend, primals, tangents))
    check(f, q, k, v, analytic=True)


def test_vmap_over_batch(rng):
    q, k, v = (randn(rng, B, T, H, D) for _ in range(3))
    one = lambda q, k, v: attend(q[None], k[None], v[None])[0]  # noqa: E731
    check(jax.vmap(one), q, k, v, analytic=True)


@pytest.mark.slow
def test_gradient_through_scan(rng):
    x, ws = randn(rng, B, T, H, D), randn(rng, 2, 3, D, D) * 0.3
    fn = lambda x, ws: jax.lax.scan(lambda h, w: (layer(h, w), None), x, ws)[0]  # noqa: E731
    m = rewrite(fn, x, ws)
    loss = lambda f: lambda x, ws: jnp.sum(f(x, ws) ** 2)  # noqa: E731
    got = jax.grad(loss(m.as_function()), argnums=(0, 1))(x, ws)
    want = jax.grad(loss(fn), argnums=(0, 1))(x, ws)
    for g, w in zip(got, want):
        assert_close(g, w, 1e-5)
    assert len(specs(m)) == 1
