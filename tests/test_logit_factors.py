"""Data factors on the logits (a learned temperature per head, a scalar, a scale per query
computed from the data): folded into the queries, so the attention runs sharded, with the
single-device value and every gradient, the factor's included. Factors that cannot be
folded (after a mask, where one device's gradient of the factor is NaN; along the keys;
outside a soft-cap) are refused with the reason and left whole."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_rewritten, assert_tree_close
from test_match_support import check, check_refused, randn

from cptransform import context_parallel

B, T, H, D = 2, 32, 4, 8


def normalized(x):
    return x / jnp.linalg.norm(x, axis=-1, keepdims=True)


def cosine_attention(q, k, v, t, *, factor: str = "head"):
    """Cosine attention (Swin v2, ViT-22B style): normalised q and k, the logits times a
    data factor ``t`` (``factor``: per head ``[H]``, a scalar, a clamped per-head one, per
    query from the data, or a divisor), then the causal ``-inf`` mask."""
    s = jnp.einsum("bqhd,bkhd->bhqk", normalized(q), normalized(k))
    causal = jnp.tril(jnp.ones((q.shape[1], k.shape[1]), bool))

    def scaled(s):
        if factor == "head":
            return s * t[None, :, None, None]
        if factor == "scalar":
            return s * t
        if factor == "clamped":
            return s * jnp.maximum(t, 0.1)[None, :, None, None]
        if factor == "query":   # log-length scaling from the queries' own norms
            return s * jnp.log1p(jnp.linalg.norm(q, axis=-1)).transpose(0, 2, 1)[..., None]
        return s / t[None, :, None, None]

    s = jnp.where(causal, scaled(s), -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def data(seed: int = 0, scalar: bool = False):
    rng = np.random.default_rng(seed)
    q, k, v = (randn(rng, B, T, H, D) for _ in range(3))
    t = jnp.asarray(rng.uniform(2, 10, () if scalar else (H,)), jnp.float32)
    return q, k, v, t


def check_sharded(fn, args, schedule="ring", load_balance="zigzag"):
    loss = lambda *a: jnp.sum(jnp.tanh(fn(*a)) ** 2)  # noqa: E731
    f = context_parallel(loss, cp=8, schedule=schedule, load_balance=load_balance)
    assert_rewritten(f, *args, count=1)
    grad = lambda g: jax.value_and_grad(g, argnums=tuple(range(len(args))))  # noqa: E731
    assert_tree_close(grad(f)(*args), grad(loss)(*args))


def test_a_learned_temperature_per_head_is_folded_into_the_queries():
    check_sharded(cosine_attention, data())


@pytest.mark.slow
@pytest.mark.parametrize("factor,schedule,load_balance", [
    ("scalar", "auto", "auto"),
    ("clamped", "ring", "zigzag"),
    ("query", "allgather", "striped"),
    ("divisor", "ring", "none"),
])
def test_factors_scalar_clamped_per_query_and_divisors(factor, schedule, load_balance):
    fn = lambda q, k, v, t: cosine_attention(q, k, v, t, factor=factor)  # noqa: E731
    check_sharded(fn, data(1, scalar=factor == "scalar"), schedule, load_balance)


@pytest.mark.slow
def test_a_per_head_factor_on_grouped_query_logits():
    """GQA logits ``[B, Hkv, G, T, S]`` merged to ``[B, H, T, S]`` by a reshape, then a
    factor per (merged) head: split back into its parts for the queries."""
    hkv = 2

    def gqa(q, k, v, t):
        qg = q.reshape(B, T, hkv, H // hkv, D)
        s = jnp.einsum("bqkgd,bskd->bkgqs", qg, k[:, :, :hkv]).reshape(B, H, T, T)
        s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s * t[None, :, None, None], -jnp.inf)
        p = jax.nn.softmax(s, axis=-1).reshape(B, hkv, H // hkv, T, T)
        return jnp.einsum("bkgqs,bskd->bqkgd", p, v[:, :, :hkv]).reshape(B, T, H, D)

    check_sharded(gqa, data(2))


def test_factor_rewrite_matches_and_inside_a_soft_cap(rng):
    """At the match level: per-head factors before the mask, and inside a soft-cap. The
    fold reassociates ``(q·t)·k`` and ``(q·k)·t``: a few ulps of logits as large as 50 here,
    hence a tolerance of ``1e-5`` instead of the matcher tests' ``1e-6``."""
    q, k, v, t = data(3)

    def capped(q, k, v, t):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * t[None, :, None, None]
        s = 20.0 * jnp.tanh(s / 20.0)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)

    check(cosine_attention, q, k, v, t, rtol=1e-5)
    check(capped, q, k, v, t, rtol=1e-5)


@pytest.mark.parametrize("case,reason", [
    ("after_mask", "after a mask"),
    ("finite_fill_after_mask", "after a mask"),
    ("along_keys", "varies along the keys"),
    ("outside_softcap", "outside the tanh"),
])
def test_factors_that_cannot_be_folded_are_refused(case, reason):
    """Refused, and why: after a ``-inf`` mask one device's gradient of the factor is NaN
    (``0·(-inf)`` at every hidden pair), after a finite fill the scaled fill may stop
    hiding; a factor along the keys is no temperature; one outside a soft-cap is no
    constant cap."""
    q, k, v, t = data(4)
    causal = jnp.tril(jnp.ones((T, T), bool))

    def fn(q, k, v, t):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(D)
        if case == "after_mask":
            s = jnp.where(causal, s, -jnp.inf) * t[None, :, None, None]
        elif case == "along_keys":
            s = s * jnp.linalg.norm(k, axis=-1).transpose(0, 2, 1)[:, :, None, :]
        elif case == "outside_softcap":
            s = 20.0 * jnp.tanh(s / 20.0) * t[None, :, None, None]
        else:
            s = jnp.where(causal, s, -1e9) * jnp.maximum(t, 0.1)[None, :, None, None]
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)

    check_refused(fn, q, k, v, t, reason=reason)
