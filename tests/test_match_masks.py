"""match-attention mask classification: causal/window/segments stay analytic, data stays dense."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import fast_every

from test_match_support import check, randn, specs

B, T, H, D = 2, 8, 2, 8


def attend(q, k, v, visible, fill=-jnp.inf):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * D ** -0.5
    s = jnp.where(visible, s, fill)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)


def positions():
    i = jax.lax.broadcasted_iota(jnp.int32, (T, T), 0)
    j = jax.lax.broadcasted_iota(jnp.int32, (T, T), 1)
    return i, j


ANALYTIC = {
    "tril": (lambda: jnp.tril(jnp.ones((T, T), bool)), (None, 0)),
    "tril_offset": (lambda: jnp.tril(jnp.ones((T, T), bool), 2), (None, 2)),
    "tril_negative": (lambda: jnp.tril(jnp.ones((T, T), bool), -1), (None, -1)),
    "triu_transposed": (lambda: jnp.triu(jnp.ones((T, T), bool)).T, (None, 0)),
    "tri": (lambda: jnp.tri(T, dtype=bool), (None, 0)),
    "iota_compare": (lambda: positions()[1] <= positions()[0], (None, 0)),
    "arange_compare": (lambda: jnp.arange(T)[None, :] <= jnp.arange(T)[:, None] + 1, (None, 1)),
    "window_triu_tril": (lambda: jnp.triu(jnp.tril(jnp.ones((T, T))), -3) > 0, (-3, 0)),
    "window_difference": (lambda: (positions()[0] - positions()[1] < 4)
                          & (positions()[1] <= positions()[0]), (-3, 0)),
    "two_sided_window": (lambda: (positions()[0] - positions()[1] <= 2)
                         & (positions()[1] - positions()[0] <= 2), (-2, 2)),
    "or_of_bands": (lambda: (positions()[1] <= positions()[0])
                    | (positions()[1] == positions()[0] + 1), (None, 1)),
    "numpy_constant": (lambda: np.tril(np.ones((T, T), bool)), (None, 0)),
}


@pytest.mark.parametrize("name", fast_every(list(ANALYTIC), 3))
def test_analytic(name, rng):
    make, band = ANALYTIC[name]
    q, k, v = (randn(rng, B, T, H, D) for _ in range(3))
    (spec,) = specs(check(lambda q, k, v: attend(q, k, v, make()), q, k, v, analytic=True))
    assert spec.mask.band() == band, spec.mask


def test_segments(rng):
    q, k, v = (randn(rng, B, T, H, D) for _ in range(3))
    seg = jnp.asarray(np.sort(rng.integers(0, 3, (B, T)), axis=1))

    def fn(q, k, v, seg):
        same = seg[:, None, :, None] == seg[:, None, None, :]
        causal = jnp.tril(jnp.ones((T, T), bool))
        return attend(q, k, v, same & causal)

    (spec,) = specs(check(fn, q, k, v, seg, analytic=True))
    assert spec.mask.segments and spec.mask.causal


@pytest.mark.slow
def test_key_padding_becomes_a_key_padding_term(rng):
    """A key-only padding mask needs no T×T operand: its ``[B, T]`` vector is the key
    padding term's operand."""
    q, k, v = (randn(rng, B, T, H, D) for _ in range(3))
    valid = jnp.asarray(rng.random((B, T)) > 0.2)

    def fn(q, k, v, valid):
        return attend(q, k, v, valid[:, None, None, :] & jnp.tril(jnp.ones((T, T), bool)),
                      fill=-1e9)

    (spec,) = specs(check(fn, q, k, v, valid, analytic=True))
    assert spec.mask.kv_padding and not spec.mask.segments and not spec.mask.q_padding
    assert spec.mask.causal and spec.mask.empty_rows == "uniform"


@pytest.mark.slow
@pytest.mark.parametrize("fill", [-1e9, -jnp.inf])
def test_query_and_key_padding_with_documents(rng, fill):
    """Query padding (fully masked rows), key padding and document ids together become the
    query and key padding terms beside the segment ids; masked rows follow the original's
    fill (uniform, or NaN for -inf)."""
    q, k, v = (randn(rng, B, T, H, D) for _ in range(3))
    valid = jnp.asarray(rng.random((B, T)) > 0.3)
    docs = jnp.asarray(np.cumsum(rng.random((B, T)) < 0.2, axis=1) - 1)  # ids from -1

    def fn(q, k, v, valid, docs):
        same = docs[:, None, :, None] == docs[:, None, None, :]
        keep = valid[:, None, :, None] & valid[:, None, None, :]
        return attend(q, k, v, same & keep, fill=fill)

    module = check(fn, q, k, v, valid, docs, analytic=True)  # NaN rows included
    if fill == -jnp.inf:
        padded = ~np.asarray(valid)
        assert padded.any() and np.isnan(np.asarray(module(q, k, v, valid, docs))[padded]).all()
    (spec,) = specs(module)
    assert spec.mask.segments and spec.mask.q_padding and spec.mask.kv_padding
    assert not spec.mask.dense


def test_dense_input_mask(rng):
    q, k, v = (randn(rng, B, T, H, D) for _ in range(3))
    mask = jnp.asarray(rng.random((B, H, T, T)) > 0.5)
    (spec,) = specs(check(lambda q, k, v, m: attend(q, k, v, m), q, k, v, mask))
    assert spec.mask.dense and not spec.mask.causal


def test_topk_indexer_mask(rng):
    """A sparse-attention indexer: top-k of scores scattered into a boolean mask becomes
    the top-k indices (no S×S operand)."""
    q, k, v = (randn(rng, B, T, H, D) for _ in range(3))
    w = randn(rng, D, 4)

    def fn(q, k, v):
        scores = jnp.einsum("bqd,bkd->bqk", q[:, :, 0] @ w, k[:, :, 0] @ w)
        scores = jnp.where(jnp.tril(jnp.ones((T, T), bool)), scores, -jnp.inf)
        _, idx = jax.lax.top_k(scores, 3)
        mask = jnp.zeros((B, T, T), bool)
        mask = mask.at[jnp.arange(B)[:, None, None], jnp.arange(T)[None, :, None], idx].set(True)
        return attend(q, k, v, mask[:, None] & jnp.tril(jnp.ones((T, T), bool)))

    (spec,) = specs(check(fn, q, k, v))
    assert spec.mask.topk and spec.mask.causal and not spec.mask.dense


@pytest.mark.slow
def test_additive_bias_from_data(rng):
    q, k, v = (randn(rng, B, T, H, D) for _ in range(3))
    bias = randn(rng, H, T, T)

    def fn(q, k, v, bias):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * D ** -0.5 + bias
        s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s, -jnp.inf)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)

    (spec,) = specs(check(fn, q, k, v, bias))
    assert spec.mask.bias and spec.mask.causal


@pytest.mark.slow
def test_cross_attention_lengths(rng):
    q = randn(rng, B, 4, H, D)
    k, v = randn(rng, B, T, H, D), randn(rng, B, T, H, D)

    def fn(q, k, v):  # bottom-right aligned causal: query i sees keys <= i + (T - 4)
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k)
        s = jnp.where(jnp.tril(jnp.ones((4, T), bool), T - 4), s, -jnp.inf)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)

    (spec,) = specs(check(fn, q, k, v, analytic=True))
    assert spec.mask.band() == (None, T - 4)
