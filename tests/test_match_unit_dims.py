"""Size-1 batch and head dims (batch 1 is the usual long-context batch) in every logits
spelling: einsum, matmul of transposes (``jnp.matmul`` drops size-1 batch dims, einsum keeps
them), dot_general, ``jax.nn.dot_product_attention`` and flax; matched, and equal to one
device under context_parallel (loss and every gradient)."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from conftest import fast_every
from jax import lax

from cptransform import context_parallel
from test_match_support import check, randn, specs
from test_nan_inf import assert_same

T, D = 16, 8


def causal(s):
    return jnp.where(jnp.tril(jnp.ones((T, T), bool)), s * D ** -0.5, -1e9)


def einsum(q, k, v):
    p = jax.nn.softmax(causal(jnp.einsum("bqhd,bkhd->bhqk", q, k)))
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)


def matmul(q, k, v):
    p = jax.nn.softmax(causal(q.transpose(0, 2, 1, 3) @ k.transpose(0, 2, 3, 1)))
    return (p @ v.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)


def matmul_then_einsum(q, k, v):
    p = jax.nn.softmax(causal(q.transpose(0, 2, 1, 3) @ k.transpose(0, 2, 3, 1)))
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)


def einsum_then_matmul(q, k, v):
    p = jax.nn.softmax(causal(jnp.einsum("bqhd,bkhd->bhqk", q, k)))
    return jnp.swapaxes(p @ jnp.swapaxes(v, 1, 2), 1, 2)


def dot_general(q, k, v):
    s = lax.dot_general(q, k, (((3,), (3,)), ((0, 2), (0, 2))))  # [b, h, q, k]
    p = jax.nn.softmax(causal(s))
    o = lax.dot_general(p, v, (((3,), (1,)), ((0, 1), (0, 2))))  # [b, h, q, d]
    return o.transpose(0, 2, 1, 3)


def jax_nn(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)


def flax_linen(q, k, v):
    return nn.dot_product_attention(q, k, v, mask=nn.make_causal_mask(jnp.ones(q.shape[:2])))


SPELLINGS = {f.__name__: f for f in (einsum, matmul, matmul_then_einsum, einsum_then_matmul,
                                     dot_general, jax_nn, flax_linen)}
SHAPES = {"batch1": (1, 2), "heads1": (2, 1), "both1": (1, 1)}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", fast_every(SPELLINGS, 4))
def test_matched_causal(rng, name, shape):
    b, h = SHAPES[shape]
    q, k, v = (randn(rng, b, T, h, D) for _ in range(3))
    (spec,) = specs(check(SPELLINGS[name], q, k, v, analytic=True))
    assert spec.mask.causal and not spec.mask.dense


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["ring", "ulysses", "allgather"])
@pytest.mark.parametrize("name", ["matmul", "matmul_then_einsum", "einsum_then_matmul"])
def test_batch1_loss_and_grads(rng, name, schedule):
    """Batch 1 under ring+zigzag, Ulysses and all-gather (2 heads over cp=2 for Ulysses)."""
    q, k, v = (randn(rng, 1, T, 2, D) for _ in range(3))
    fn = SPELLINGS[name]
    loss = lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v)))  # noqa: E731
    cp = context_parallel(loss, cp=2 if schedule == "ulysses" else 4, schedule=schedule,
                          load_balance="zigzag" if schedule == "ring" else "none")
    got = jax.value_and_grad(cp, (0, 1, 2))(q, k, v)
    want = jax.value_and_grad(loss, (0, 1, 2))(q, k, v)
    jax.tree.map(assert_same, got, want)


@pytest.mark.parametrize("name", ["matmul", "matmul_then_einsum"])
def test_batch1_heads_stay_heads(rng, name):
    """``jnp.matmul`` drops the size-1 batch: the remaining shared dim is still the heads
    (Ulysses can split them), not a batch."""
    q, k, v = (randn(rng, 1, T, 4, D) for _ in range(3))
    (spec,) = specs(check(SPELLINGS[name], q, k, v, analytic=True))
    assert spec.k.heads is not None and spec.groups == 1, spec
