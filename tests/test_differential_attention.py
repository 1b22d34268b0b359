"""Differential attention (two attention maps combined before one value product) is two
attentions, sharded: the value product is distributed over the combination
(``match-attention``'s ``distribute`` step). Spellings: two softmaxes, the reference code's one softmax
over twice the heads viewed as ``[B, H, 2, Q, K]`` and indexed, a per-head ``λ``, the
logsumexp softmax, and a three-term combination; a combination with a leaf that is no
softmax stays whole (exact, logged)."""
import jax
import jax.numpy as jnp
from jax import lax
import numpy as np
import pytest

from conftest import assert_tree_close, sharded_only
from cptransform import PartlyShardedWarning, context_parallel
from cptransform.ir.pipeline import Pipeline
from cptransform.passes import get_all_passes
from cptransform.passes.match_attention.distribute import distribute_value_products
from cptransform.ir.module import trace

B, S, H, D = 2, 32, 2, 8
CAUSAL = jnp.tril(jnp.ones((S, S), bool))


def _softmax(q, k, how="nn"):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    s = jnp.where(CAUSAL, s, -jnp.inf)
    if how == "lse":
        return jnp.exp(s - jax.nn.logsumexp(s, axis=-1, keepdims=True))
    return jax.nn.softmax(s, axis=-1)


def _heads(x, w, n):
    return (x @ w).reshape(x.shape[0], S, n, D)


def two_softmaxes(x, w, lam, how="nn"):
    q1, q2, k1, k2 = (_heads(x, w[i], H) for i in range(4))
    v = _heads(x, w[4], H)
    p = _softmax(q1, k1, how) - jax.nn.sigmoid(lam[0]) * _softmax(q2, k2, how)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)


def viewed(x, w, lam):
    """The Diff Transformer's reference spelling: one softmax over ``2H`` heads, viewed as
    ``[B, H, 2, Q, K]``, its halves combined, then ``@ v`` with ``v`` in ``[B, H, K, D]``."""
    q = jnp.concatenate([_heads(x, w[0], H), _heads(x, w[1], H)], axis=2)
    k = jnp.concatenate([_heads(x, w[2], H), _heads(x, w[3], H)], axis=2)
    p = _softmax(q, k).reshape(x.shape[0], H, 2, S, S)
    p = p[:, :, 0] - (lam[0] + 0.1) * p[:, :, 1]
    v = _heads(x, w[4], H).transpose(0, 2, 1, 3)
    return (p @ v).transpose(0, 2, 1, 3)


def per_head(x, w, lam):
    q1, q2, k1, k2 = (_heads(x, w[i], H) for i in range(4))
    v = _heads(x, w[4], H)
    p = 0.5 * _softmax(q1, k1) - lam[:H, None, None] * _softmax(q2, k2)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)


def three_terms(x, w, lam):
    qs = [_heads(x, w[i], H) for i in range(4)]
    v = _heads(x, w[4], H)
    p = _softmax(qs[0], qs[1]) - lam[0] * _softmax(qs[2], qs[3]) + \
        lam[1] * _softmax(qs[1], qs[2])
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)


SPELLINGS = {"two_softmaxes": two_softmaxes, "viewed": viewed, "per_head": per_head,
             "logsumexp": lambda x, w, lam: two_softmaxes(x, w, lam, "lse"),
             "three_terms": three_terms}


def _loss(layer):
    def loss(x, w, lam):
        o = layer(x, w, lam).reshape(x.shape[0], S, H * D)
        return jnp.mean(jnp.tanh(o) ** 2)
    return loss


def _args(seed=0):
    ks = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(ks[0], (B, S, H * D)),
            jax.random.normal(ks[1], (5, H * D, H * D)) / 4,
            jax.random.normal(ks[2], (4,)) * 0.3)


def _attention_lines(f, args):
    text = f.explain(*args)
    return ([line for line in text.splitlines() if "unsharded attention" in line],
            f.module(*args).facts.matches)


@pytest.mark.parametrize("spelling", [
    "two_softmaxes", *(pytest.param(s, marks=pytest.mark.slow)
                       for s in ("viewed", "per_head", "logsumexp", "three_terms"))])
@pytest.mark.parametrize("load_balance", ["zigzag"])
def test_differential_attention_is_sharded_and_exact(spelling, load_balance):
    loss = _loss(SPELLINGS[spelling])
    args = _args()
    f = context_parallel(loss, cp=4, load_balance=load_balance)
    with sharded_only():
        got = jax.value_and_grad(f, argnums=(0, 1, 2))(*args)
    unsharded, matches = _attention_lines(f, args)
    assert not unsharded, unsharded
    want_attentions = 3 if spelling == "three_terms" else 1 if spelling == "viewed" else 2
    assert sum(m.rewritten for m in matches) == want_attentions, matches
    want = jax.value_and_grad(loss, argnums=(0, 1, 2))(*args)
    assert_tree_close(got, want, rtol=2e-5)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["ulysses", "allgather"])
def test_viewed_differential_attention_under_other_schedules(schedule):
    loss = _loss(viewed)
    args = _args(1)
    got = jax.value_and_grad(context_parallel(loss, cp=2, schedule=schedule),
                             argnums=(0, 1, 2))(*args)
    assert_tree_close(got, jax.value_and_grad(loss, argnums=(0, 1, 2))(*args),
                      rtol=2e-5)


@pytest.mark.parametrize("spelling", ["two_softmaxes", "viewed"])
def test_a_batch_of_one_through_matmul(spelling):
    """``p @ v`` over a batch of one squeezes it before the product (``jnp.matmul``): the
    squeeze is distributed too."""
    def layer(x, w, lam):
        if spelling == "viewed":
            return viewed(x, w, lam)
        q1, q2, k1, k2 = (_heads(x, w[i], H) for i in range(4))
        v = _heads(x, w[4], H).transpose(0, 2, 1, 3)
        p = _softmax(q1, k1) - lam[0] * _softmax(q2, k2)
        return (p @ v).transpose(0, 2, 1, 3)

    loss = _loss(layer)
    x, w, lam = _args(4)
    args = (x[:1], w, lam)
    f = context_parallel(loss, cp=4)
    assert sum(m.rewritten for m in f.module(*args).facts.matches) == \
        (1 if spelling == "viewed" else 2)
    assert_tree_close(jax.value_and_grad(f, argnums=(0, 1, 2))(*args),
                      jax.value_and_grad(loss, argnums=(0, 1, 2))(*args), rtol=2e-5)


def _distributed(fn, *args):
    """``fn`` traced and canonicalized, then distributed: (module, how many products)."""
    module = Pipeline.parse("canonicalize", available=get_all_passes()).run(
        trace(fn, *args)).module
    new, count = distribute_value_products(module.jaxpr)
    return module.with_jaxpr(new), count


def test_a_combination_with_a_leaf_that_is_no_softmax_stays_whole():
    """``(softmax - w) @ v`` is not two attentions: nothing is distributed, and beside a
    sharded attention the softmax is logged as unsharded; the numbers are one device's."""
    def layer(x, w, lam):
        q, k, v = (_heads(x, w[i], H) for i in range(3))
        o = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        p = _softmax(o, k) - jax.nn.sigmoid(jnp.tile(w[3], (2, 2)))[None, None]
        return jnp.einsum("bhqk,bkhd->bqhd", p, v)

    loss = _loss(layer)
    args = _args(2)
    assert _distributed(loss, *args)[1] == 0
    f = context_parallel(loss, cp=4)
    with pytest.warns(PartlyShardedWarning, match=r"1 attention\(s\) run unsharded"):
        unsharded, matches = _attention_lines(f, args)
    assert len(unsharded) == 1, unsharded
    assert sum(m.rewritten for m in matches) == 1, matches
    assert_tree_close(jax.value_and_grad(f, argnums=(0, 1))(*args),
                      jax.value_and_grad(loss, argnums=(0, 1))(*args), rtol=2e-5)


def test_the_distributed_program_equals_the_written_one():
    """The distribution alone (no sharding) gives the written program's numbers, for every
    spelling, and distributes one product per spelling."""
    args = _args(3)
    for name, layer in SPELLINGS.items():
        module, count = _distributed(layer, *args)
        assert count == 1, name
        np.testing.assert_allclose(module(*args), layer(*args), rtol=1e-5, atol=1e-6,
                                   err_msg=name)


@pytest.mark.slow
def test_differential_attention_inside_a_scan_over_layers():
    """The distribution reaches bodies: a scan over two stacked differential layers."""
    def loss(x, w, lam):
        def layer(h, wl):
            return h + 0.5 * jnp.tanh(two_softmaxes(h, wl, lam).reshape(h.shape)), None
        return jnp.mean(lax.scan(layer, x, jnp.stack([w, w[::-1]]))[0] ** 2)

    args = _args(5)
    f = context_parallel(loss, cp=4)
    assert sum(m.rewritten for m in f.module(*args).facts.matches) == 2
    assert_tree_close(jax.value_and_grad(f, argnums=(0, 1, 2))(*args),
                      jax.value_and_grad(loss, argnums=(0, 1, 2))(*args), rtol=2e-5)
