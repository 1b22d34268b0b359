"""match-attention on spellings from public code: grouped-query attention with reshapes
between the products (Gemma), ``q @ k.T`` on 2-D per-head arrays under ``vmap`` with
``exp(s - logsumexp(s))``, and the two-sided window ``|i - j| <= w`` — and their near misses.
"""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cptransform import context_parallel
from cptransform.api.context_parallel import UnshardedWarning
from test_match_support import assert_close, check, check_refused, randn, specs

B, T, K, G, H = 2, 16, 2, 3, 8
N = K * G
#: Gemma's fill for masked logits (``gemma/gm/nn/_modules.py``).
K_MASK = -2.3819763e38
GRAD_RTOL = 1e-5


def sliding_mask(positions, window):
    """Gemma's local-attention mask: ``|kv - q| < window`` on ``[B, T]`` positions."""
    kv, q = positions[..., None, :], positions[..., :, None]
    mask = kv > q - window
    mask *= kv < q + window
    return mask


def gemma_attention(q, k, v, attn_mask, softcap=None):
    """Gemma's GQA attention: q ``[B,T,N,H]``, k/v ``[B,S,K,H]``, mask ``[B,T,S]``."""
    b, t, kg, h = q.shape
    q = q.reshape((b, t, K, kg // K, h))
    logits = jnp.einsum("BTKGH,BSKH->BTKGS", q, k)
    b, t, k_, g, s = logits.shape
    logits = logits.reshape((b, t, k_ * g, s))
    if softcap is not None:
        logits = jnp.tanh(logits / softcap) * softcap
    padded = jnp.where(jnp.expand_dims(attn_mask, -2), logits, K_MASK)
    probs = jax.nn.softmax(padded, axis=-1).astype(k.dtype)
    b, t, kg, h = probs.shape
    probs = probs.reshape((b, t, K, kg // K, h))
    encoded = jnp.einsum("BTKGS,BSKH->BTKGH", probs, v)
    b, t, k_, g, h = encoded.shape
    return encoded.reshape((b, t, k_ * g, h))


def gemma_global(q, k, v):
    causal = jnp.tril(jnp.ones((T, T), bool))
    return gemma_attention(q * H ** -0.5, k, v, jnp.broadcast_to(causal, (q.shape[0], T, T)))


def gemma_local(q, k, v):
    positions = jnp.broadcast_to(jnp.arange(T), (q.shape[0], T))
    causal = jnp.tril(jnp.ones((T, T), bool))
    mask = causal[None] * sliding_mask(positions, 4)
    return gemma_attention(q * H ** -0.5, k, v, mask, softcap=50.0)


def gqa_inputs(rng, batch=B):
    return randn(rng, batch, T, N, H), randn(rng, batch, T, K, H), randn(rng, batch, T, K, H)


def assert_grads_close(fn, module, args):
    """Gradients of a random projection of the output, rewritten vs original."""
    w = jnp.asarray(np.random.default_rng(7).standard_normal(jax.eval_shape(fn, *args).shape),
                    jnp.float32)
    argnums = tuple(range(len(args)))
    want = jax.grad(lambda *a: jnp.sum(fn(*a) * w), argnums)(*args)
    got = jax.grad(lambda *a: jnp.sum(module.as_function()(*a) * w), argnums)(*args)
    jax.tree.map(lambda g, x: assert_close(g, x, GRAD_RTOL), got, want)


def assert_context_parallel_equal(fn, args, cp=4):
    """``context_parallel(fn, cp=cp)`` finds the attention and equals ``fn``."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnshardedWarning)
        got = jax.jit(context_parallel(fn, cp=cp))(*args)
    jax.tree.map(assert_close, got, fn(*args))


@pytest.mark.parametrize("fn, band, softcap", [(gemma_global, (None, 0), None),
                                               (gemma_local, (-3, 0), 50.0)],
                         ids=["global", "local_softcap"])
@pytest.mark.slow
def test_gemma_grouped_query_reshapes(fn, band, softcap, rng):
    """Logits ``[B,T,K,G,S]`` reshaped to ``[B,T,N,S]`` for the mask and softmax and back
    for the value product: one attention over K KV heads with G query heads each."""
    args = gqa_inputs(rng)
    module = check(fn, *args, analytic=True)
    (spec,) = specs(module)
    assert spec.groups == G and spec.mask.band() == band and spec.mask.empty_rows == "uniform"
    assert spec.softcap == softcap and not spec.mask.dense
    assert spec.scale == pytest.approx(1.0)  # Gemma scales q before its reshape: kept in q
    assert_grads_close(fn, module, args)


@pytest.mark.slow
def test_gemma_end_to_end(rng):
    assert_context_parallel_equal(gemma_local, gqa_inputs(rng))


def per_head(lse, window=2):
    """2-D single-head attention: ``q @ k.T``, a two-sided window, softmax via logsumexp."""
    def f(q, k, v):
        s = q @ k.T / jnp.sqrt(q.shape[-1]).astype(q.dtype)
        i, j = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
        s = jnp.where(jnp.abs(i - j) <= window, s, -jnp.inf)
        return lse(s) @ v
    return jax.vmap(jax.vmap(f, in_axes=1, out_axes=1))


LSE = {
    "jax_nn_keepdims": lambda s: jnp.exp(s - jax.nn.logsumexp(s, axis=-1, keepdims=True)),
    "scipy": lambda s: jnp.exp(s - jax.scipy.special.logsumexp(s, axis=-1)[:, None]),
    "log_softmax": lambda s: jnp.exp(jax.nn.log_softmax(s, axis=-1)),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LSE))
def test_vmapped_2d_logsumexp_two_sided_window(name, rng):
    """Batch and heads from ``vmap``; ``|i - j| <= 2`` is ``window=(2, 2)``, not data."""
    fn = per_head(LSE[name])
    args = tuple(randn(rng, B, T, N, H) for _ in range(3))
    module = check(fn, *args, analytic=True)
    (spec,) = specs(module)
    assert spec.mask.window == (2, 2) and not spec.mask.causal and not spec.mask.dense
    assert spec.groups == 1 and spec.scale == pytest.approx(H ** -0.5)
    assert_grads_close(fn, module, args)


@pytest.mark.slow
def test_vmapped_2d_end_to_end(rng):
    args = tuple(randn(rng, B, T, N, H) for _ in range(3))
    assert_context_parallel_equal(per_head(LSE["jax_nn_keepdims"]), args)


@pytest.mark.slow
@pytest.mark.parametrize("compare, window", [
    (lambda d, w: jnp.abs(d) < w, (1, 1)),
    (lambda d, w: w >= jnp.abs(-d), (2, 2)),
    (lambda d, w: ~(jnp.abs(d) > w), (2, 2)),
], ids=["lt", "flipped", "not_gt"])
def test_abs_window_forms(compare, window, rng):
    q, k, v = (randn(rng, B, N, T, H) for _ in range(3))

    def fn(q, k, v):
        s = jnp.einsum("bhqd,bhkd->bhqk", q, k)
        i, j = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
        return jax.nn.softmax(jnp.where(compare(i - j, 2), s, -1e9)) @ v

    (spec,) = specs(check(fn, q, k, v, analytic=True))
    assert spec.mask.window == window and not spec.mask.causal


@pytest.mark.slow
def test_matmul_with_unit_batch(rng):
    """``jnp.matmul`` squeezes a size-1 batch for the product and broadcasts it back."""
    q, k, v = (randn(rng, 1, N, T, H) for _ in range(3))
    fn = lambda q, k, v: jax.nn.softmax(q @ jnp.swapaxes(k, -1, -2)) @ v  # noqa: E731
    check(fn, q, k, v)


@pytest.mark.slow
def test_grouped_query_reshape_with_one_kv_head(rng):
    """``[B, 1, G, T, S]`` logits merged to ``[B, G, T, S]``: the size-1 KV-heads dim is a
    part of the merge, and the split of the probabilities must give it back."""
    q, k, v = randn(rng, B, T, G, H), randn(rng, B, T, 1, H), randn(rng, B, T, 1, H)

    def fn(q, k, v):
        s = jnp.einsum("bqkgd,bskd->bkgqs", q.reshape(B, T, 1, G, H), k)
        p = jax.nn.softmax(s.reshape(B, G, T, T), axis=-1)
        o = jnp.einsum("bkgqs,bskd->bqkgd", p.reshape(B, 1, G, T, T), v)
        return o.reshape(B, T, G, H)

    (spec,) = specs(check(fn, q, k, v))
    assert spec.groups == G


# -- near misses -------------------------------------------------------------------------------

@pytest.mark.slow
def test_probabilities_regrouped_differently(rng):
    """Logits merged as (K, G) but the probabilities split as (G, K): not attention."""
    q, k, v = gqa_inputs(rng)

    def fn(q, k, v):
        logits = jnp.einsum("BTKGH,BSKH->BTKGS", q.reshape(B, T, K, G, H), k)
        probs = jax.nn.softmax(logits.reshape(B, T, N, T), axis=-1)
        probs = probs.reshape(B, T, G, K, T)
        return jnp.einsum("BTGKS,BSKH->BTGKH", probs, v)

    check_refused(fn, q, k, v, reason="different grouping")


def test_logsumexp_over_the_wrong_axis(rng):
    q, k, v = (randn(rng, T, H) for _ in range(3))

    def fn(q, k, v):
        s = q @ k.T
        return jnp.exp(s - jax.nn.logsumexp(s, axis=0, keepdims=True)) @ v

    check_refused(fn, q, k, v, reason="softmax axis")


@pytest.mark.slow
def test_logsumexp_of_other_logits(rng):
    """``exp(2s - logsumexp(s))`` is not a softmax of either."""
    q, k, v = (randn(rng, T, H) for _ in range(3))

    def fn(q, k, v):
        s = q @ k.T
        return jnp.exp(2.0 * s - jax.nn.logsumexp(s, axis=-1, keepdims=True)) @ v

    check_refused(fn, q, k, v, reason="other logits")


@pytest.mark.slow
@pytest.mark.parametrize("index", ["square", "data"])
def test_abs_window_of_non_affine_index(index, rng):
    """``|i - j*j| <= w`` or ``|i - pos[j]| <= w`` is no band: the mask stays data."""
    q, k, v = (randn(rng, B, N, T, H) for _ in range(3))
    pos = jnp.asarray(rng.permutation(T), jnp.int32)

    def fn(q, k, v, pos):
        s = jnp.einsum("bhqd,bhkd->bhqk", q, k)
        i, j = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
        other = j * j if index == "square" else pos[None, :]
        return jax.nn.softmax(jnp.where(jnp.abs(i - other) <= 2, s, -1e9)) @ v

    (spec,) = specs(check(fn, q, k, v, pos))
    assert spec.mask.dense and spec.mask.window is None and not spec.mask.causal


@pytest.mark.slow
def test_abs_window_with_a_traced_width(rng):
    q, k, v = (randn(rng, B, N, T, H) for _ in range(3))

    def fn(q, k, v, w):
        s = jnp.einsum("bhqd,bhkd->bhqk", q, k)
        i, j = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
        return jax.nn.softmax(jnp.where(jnp.abs(i - j) <= w, s, -1e9)) @ v

    (spec,) = specs(check(fn, q, k, v, jnp.int32(2)))
    assert spec.mask.dense and spec.mask.window is None


def test_bias_along_merged_heads_is_refused(rng):
    """A per-head bias on the merged ``[B,T,N,S]`` logits cannot be split back into
    (K, G) by the rewrite yet: refused with the reason."""
    q, k, v = gqa_inputs(rng)
    bias = randn(rng, 1, 1, N, T)

    def fn(q, k, v, bias):
        logits = jnp.einsum("BTKGH,BSKH->BTKGS", q.reshape(B, T, K, G, H), k)
        probs = jax.nn.softmax(logits.reshape(B, T, N, T) + bias, axis=-1)
        return jnp.einsum("BTKGS,BSKH->BTKGH", probs.reshape(B, T, K, G, T), v)

    check_refused(fn, q, k, v, bias, reason="merged by a reshape")
