"""match-attention on hand-written attention: spellings, scale placements, layouts, GQA."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from test_match_support import assert_close, check, randn, rewrite, specs

B, T, H, D = 2, 8, 4, 8
CAUSAL = np.tril(np.ones((T, T), bool))


def softmax_written_out(s):
    e = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))
    return e / jnp.sum(e, axis=-1, keepdims=True)


def bthd_einsum(q, k, v):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * D ** -0.5
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)


def bhtd_matmul(q, k, v):  # inputs BTHD, attention in BHTD via q @ k.T
    q, k, v = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
    s = q @ k.swapaxes(-1, -2) / np.sqrt(D)
    return (softmax_written_out(s) @ v).transpose(0, 2, 1, 3)


def scale_on_q(q, k, v):
    s = jnp.einsum("bqhd,bkhd->bhqk", q * D ** -0.5, k)
    s = jnp.where(CAUSAL, s, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)


def scale_after_mask(q, k, v):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k)
    s = jnp.where(CAUSAL, s, -1e9) / np.sqrt(D)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)


def arithmetic_mask(q, k, v):
    m = jnp.tril(jnp.ones((T, T), jnp.float32))
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.3
    s = s * m - 1e10 * (1 - m)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)


def additive_neg_inf(q, k, v):
    bias = jnp.where(CAUSAL, 0.0, -jnp.inf)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D) + bias
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)


def additive_finfo_min(q, k, v):
    bias = jnp.where(CAUSAL, 0.0, jnp.finfo(jnp.float32).min)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D) + bias[None, None]
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)


def select_mask(q, k, v):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k)
    s = jax.lax.select(jnp.broadcast_to(CAUSAL, s.shape), s, jnp.full_like(s, -jnp.inf))
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)


def no_batch(q, k, v):
    q, k, v = q[0], k[0], v[0]
    s = jnp.einsum("qhd,khd->hqk", q, k) / np.sqrt(D)
    return jnp.einsum("hqk,khd->qhd", jax.nn.softmax(s), v)[None]


def single_head(q, k, v):
    q, k, v = q[0, :, 0], k[0, :, 0], v[0, :, 0]
    s = jnp.where(CAUSAL, q @ k.T, -jnp.inf)
    return (jax.nn.softmax(s) @ v)[None, :, None]


def heads_under_vmap(q, k, v):
    def one(q, k, v):  # (T, D) each
        s = jnp.where(CAUSAL, q @ k.T / np.sqrt(D), -jnp.inf)
        return jax.nn.softmax(s) @ v
    return jax.vmap(jax.vmap(one, in_axes=(1, 1, 1), out_axes=1))(q, k, v)


def softcap(q, k, v):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * D ** -0.5
    s = jnp.tanh(s / 2.0) * 2.0
    s = jnp.where(CAUSAL, s, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)


def float32_upcast(q, k, v):
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / np.sqrt(D)
    p = jax.nn.softmax(jnp.where(CAUSAL, s, -jnp.inf)).astype(jnp.bfloat16)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v).astype(jnp.float32)


def deferred_normalization(q, k, v):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D)
    s = jnp.where(CAUSAL, s, -jnp.inf)
    e = jnp.exp(s - jax.lax.stop_gradient(s.max(-1, keepdims=True)))
    o = jnp.einsum("bhqk,bkhd->bhqd", e, v) / e.sum(-1)[..., None]
    return o.transpose(0, 2, 1, 3)


SPELLINGS = [bthd_einsum, bhtd_matmul, scale_on_q, scale_after_mask, arithmetic_mask,
             additive_neg_inf, additive_finfo_min, select_mask, no_batch, single_head,
             heads_under_vmap, softcap, deferred_normalization]
CAUSAL_SPELLINGS = {scale_on_q, scale_after_mask, arithmetic_mask, additive_neg_inf,
                    additive_finfo_min, select_mask, single_head, heads_under_vmap, softcap,
                    deferred_normalization}


# Every fourth spelling in the fast tier; the rest are slow.
@pytest.mark.parametrize("fn", [pytest.param(f, marks=() if i % 4 == 0 else pytest.mark.slow)
                                for i, f in enumerate(SPELLINGS)], ids=lambda f: f.__name__)
def test_spelling(fn, rng):
    q, k, v = (randn(rng, B, T, H, D) for _ in range(3))
    (spec,) = specs(check(fn, q, k, v, analytic=True))
    assert spec.mask.causal == (fn in CAUSAL_SPELLINGS)
    assert not spec.mask.bias


@pytest.mark.slow
def test_uniform_vs_zero(rng):
    q, k, v = (randn(rng, B, T, H, D) for _ in range(3))
    assert specs(check(scale_after_mask, q, k, v))[0].mask.empty_rows == "uniform"
    assert specs(check(additive_neg_inf, q, k, v))[0].mask.empty_rows == "nan"
    assert specs(check(arithmetic_mask, q, k, v))[0].mask.empty_rows == "uniform"


@pytest.mark.slow
def test_softcap_and_scale(rng):
    q, k, v = (randn(rng, B, T, H, D) for _ in range(3))
    (spec,) = specs(check(softcap, q, k, v))
    assert spec.softcap == pytest.approx(2.0)
    assert spec.scale == pytest.approx(D ** -0.5)


@pytest.mark.slow
def test_float32_upcast(rng):
    q, k, v = (randn(rng, B, T, H, D) for _ in range(3))
    check(float32_upcast, q, k, v, rtol=1e-2)  # bf16 operands on both sides


def test_gqa_by_reshape(rng):
    q, k, v = randn(rng, B, T, H, D), randn(rng, B, T, 2, D), randn(rng, B, T, 2, D)

    def fn(q, k, v):
        qg = q.reshape(B, T, 2, H // 2, D)
        s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k) / np.sqrt(D)
        s = jnp.where(CAUSAL, s, -jnp.inf)
        o = jnp.einsum("bhgqk,bkhd->bqhgd", jax.nn.softmax(s), v)
        return o.reshape(B, T, H, D)

    (spec,) = specs(check(fn, q, k, v, analytic=True))
    assert spec.groups == 2


@pytest.mark.slow
def test_gqa_by_repeat(rng):
    q, k, v = randn(rng, B, T, H, D), randn(rng, B, T, 2, D), randn(rng, B, T, 2, D)

    def fn(q, k, v):
        k, v = jnp.repeat(k, 2, axis=2), jnp.repeat(v, 2, axis=2)
        s = jnp.where(CAUSAL, jnp.einsum("bqhd,bkhd->bhqk", q, k), -jnp.inf)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)

    m = check(fn, q, k, v, analytic=True)
    (spec,) = specs(m)
    assert spec.groups == 2
    assert "broadcast_in_dim" not in {e.primitive.name for e in m.eqns
                                      if len(e.outvars[0].aval.shape) == 5}


@pytest.mark.slow
def test_gradient_of_hand_written(rng):
    q, k, v = (randn(rng, B, T, H, D) for _ in range(3))
    m = rewrite(arithmetic_mask, q, k, v)
    loss = lambda f: lambda *a: jnp.sum(f(*a) ** 2)  # noqa: E731
    got = jax.grad(loss(m.as_function()), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(loss(arithmetic_mask), argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(got, want):
        assert_close(g, w, 1e-5)
