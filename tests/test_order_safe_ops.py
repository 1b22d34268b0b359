"""Positional ops acting only on non-sequence dims keep the load-balanced token order: no
un-permute around a split of a fused qkv projection, a feature slice, pad, reversal,
running sum, sort or gather, and the same loss and gradients as one device."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cptransform import context_parallel
from cptransform.ir.module import iter_eqns
from test_transform import assert_tree_close

pytestmark = pytest.mark.slow

B, S, H, HD = 2, 32, 2, 8
F = H * HD
FEATURE_ORDER = np.random.default_rng(0).permutation(F)


def heads(t):
    return t.reshape(B, S, H, HD)


def qkv_by_split(qkv):
    return jnp.split(qkv, 3, axis=-1)


def qkv_by_slices(qkv):
    return qkv[..., :F], qkv[..., F:2 * F], qkv[..., 2 * F:]


def qkv_concatenated(qkv):
    q, k, v = qkv_by_slices(qkv)
    return jnp.concatenate([q[..., F // 2:], q[..., :F // 2]], axis=-1), k, v


def qkv_padded(qkv):
    q, k, v = qkv_by_slices(qkv)
    return jnp.pad(q[..., 2:], ((0, 0), (0, 0), (1, 1))), k, v


def qkv_reversed(qkv):
    q, k, v = qkv_by_slices(qkv)
    return jnp.flip(q, axis=-1), k, v


def qkv_cumsum(qkv):
    q, k, v = qkv_by_slices(qkv)
    return jnp.cumsum(q, axis=-1) / 4, k, v


def qkv_sorted(qkv):
    q, k, v = qkv_by_slices(qkv)
    return jnp.sort(q, axis=-1), k, v


def qkv_gathered(qkv):
    q, k, v = qkv_by_slices(qkv)
    return q[..., FEATURE_ORDER], k, v


#: primitive name -> how q, k, v come out of the fused projection
CASES = {"split": qkv_by_split, "slice": qkv_by_slices, "concatenate": qkv_concatenated,
         "pad": qkv_padded, "rev": qkv_reversed, "cumsum": qkv_cumsum, "sort": qkv_sorted,
         "gather": qkv_gathered}


def model(pieces):
    def loss(x, w):
        q, k, v = pieces(x @ w)
        o = jax.nn.dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
        return jnp.mean(jnp.tanh(o.reshape(B, S, F) + x[..., :F]) ** 2)
    return loss


@pytest.mark.parametrize("prim", sorted(CASES))
def test_op_on_features_keeps_layout_order(prim):
    keys = jax.random.split(jax.random.key(31), 2)
    x = jax.random.normal(keys[0], (B, S, 3 * F))
    w = jax.random.normal(keys[1], (3 * F, 3 * F)) / 8
    fn = model(CASES[prim])
    names = {e.primitive.name for e in iter_eqns(jax.make_jaxpr(fn)(x, w))}
    assert prim in names, f"the case is spelled with {sorted(names)}"
    ref_v, ref_g = jax.value_and_grad(fn, argnums=(0, 1))(x, w)
    f = context_parallel(fn, cp=4, load_balance="zigzag")
    value, grads = jax.value_and_grad(f, argnums=(0, 1))(x, w)
    np.testing.assert_allclose(value, ref_v, rtol=1e-5)
    assert_tree_close(grads, ref_g)
    log = f.module(x, w).facts.reorder_log
    assert not [m for m in log if "un-permute" in m], log


def rope_by_stack(x):
    """keras-hub's rotary embedding pairs halves with ``stack`` (JAX 0.12: a ``stack``
    primitive; its gradient an ``unstack``)."""
    half = x.shape[-1] // 2
    angle = jnp.arange(x.shape[1])[:, None] / (1 + jnp.arange(half))
    cos, sin = jnp.cos(angle)[None, :, None], jnp.sin(angle)[None, :, None]
    x1, x2 = x[..., :half], x[..., half:]
    rotated = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.reshape(x.shape)


def test_rope_by_stack_keeps_layout_order():
    keys = jax.random.split(jax.random.key(32), 2)
    x = jax.random.normal(keys[0], (B, S, 3 * F))
    w = jax.random.normal(keys[1], (3 * F, 3 * F)) / 8

    def loss(x, w):
        q, k, v = (heads(t) for t in qkv_by_split(x @ w))
        o = jax.nn.dot_product_attention(rope_by_stack(q), rope_by_stack(k), v, is_causal=True)
        return jnp.mean(jnp.tanh(o.reshape(B, S, F)) ** 2)

    f = context_parallel(loss, cp=4, load_balance="zigzag")
    assert_tree_close(jax.value_and_grad(f, argnums=(0, 1))(x, w),
                      jax.value_and_grad(loss, argnums=(0, 1))(x, w))
    log = f.module(x, w).facts.reorder_log
    assert not [m for m in log if "un-permute" in m], log
