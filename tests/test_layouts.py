"""Layouts through reshapes, pooling, routing and shifted slices: under zigzag and striped
every program below ends with the single-device loss and gradients (NaN/Inf pattern
included) or one clear ``CPTransformError``. Each case fails on the release before the
layout analysis (silent wrong answers, NaN gradients, raw JAX errors)."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cptransform import context_parallel
from cptransform.ir.errors import CPTransformError
from cptransform.op.layouts import SequenceLayout

B, S, D, H = 2, 32, 8, 2


def attend(x, w):
    """Causal self-attention on ``x [B, S, D]`` with a fused qkv weight ``w [D, 3D]``."""
    q, k, v = jnp.split(x @ w, 3, axis=-1)
    heads = lambda t: t.reshape(B, S, H, D // H)  # noqa: E731
    o = jax.nn.dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
    return o.reshape(B, S, D) + x


def assert_same(actual, expected, rtol=1e-5):
    """Each leaf equal within ``rtol`` of its largest finite magnitude, NaN/Inf included."""
    for a, e in zip(jax.tree_util.tree_leaves(actual), jax.tree_util.tree_leaves(expected)):
        a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
        np.testing.assert_array_equal(np.isnan(a), np.isnan(e))
        np.testing.assert_array_equal(np.isposinf(a), np.isposinf(e))
        np.testing.assert_array_equal(np.isneginf(a), np.isneginf(e))
        finite = np.isfinite(e)
        scale = float(np.max(np.abs(e[finite]), initial=0.0)) or 1.0
        err = float(np.max(np.abs(a[finite] - e[finite]), initial=0.0))
        assert err <= rtol * scale, f"{err} > {rtol} * {scale}"


def check(loss, args, load_balance="zigzag", cp=4, argnums=None):
    """``loss`` through ``context_parallel`` equals the plain function, value and grads."""
    argnums = tuple(range(len(args))) if argnums is None else argnums
    ref = jax.value_and_grad(loss, argnums)(*args)
    f = context_parallel(loss, cp=cp, load_balance=load_balance)
    got = jax.value_and_grad(f, argnums)(*args)
    assert_same(got, ref)
    return f


def rand(seed, *shapes, scale=1.0):
    keys = jax.random.split(jax.random.key(seed), len(shapes))
    return [scale * jax.random.normal(k, s) for k, s in zip(keys, shapes)]


def tokens_mlp(x, w, m):
    h = attend(x, w)
    return jnp.mean(((h.reshape(B * S, D) @ m[:, :D]).reshape(B, S, D) + h) ** 2)


def chunk_mean(c):
    def loss(x, w, m):
        h = attend(x, w)
        pooled = h.reshape(B, S // c, c, D).mean(2)
        return jnp.mean(jnp.tanh(pooled @ m) * jnp.arange(S // c)[None, :, None])
    return loss


def dense_head(x, w, m):
    h = attend(x, w)
    return jnp.mean(jnp.tanh(h.reshape(B, S * D) @ m.reshape(S * D, -1)))


def moe(x, w, m):
    """Mixtral-style top-2 routing over flattened tokens, one-hot dispatch and combine."""
    h = attend(x, w)
    t = h.reshape(B * S, D)
    router = m[:, :4]
    probs = jax.nn.softmax(t @ router, axis=-1)
    top, idx = jax.lax.top_k(probs, 2)
    onehot = jax.nn.one_hot(idx, 4)                       # [T, 2, E]
    gate = jnp.einsum("tk,tke->te", top, onehot)
    experts = jnp.tanh(jnp.einsum("td,edf->tef", t, m[:, 4:].reshape(4, D, 2)))
    out = jnp.einsum("te,tef->tf", gate, experts)
    return jnp.mean((out.reshape(B, S, 2) - h[..., :2]) ** 2) + jnp.mean(probs.mean(0) ** 2)


def moe_capacity(x, w, m):
    """Top-1 routing with a capacity: tokens past it (by cumsum in token order) drop."""
    h = attend(x, w)
    t = h.reshape(B * S, D)
    probs = jax.nn.softmax(t @ m[:, :4], axis=-1)
    onehot = jax.nn.one_hot(jnp.argmax(probs, -1), 4)
    kept = onehot * (jnp.cumsum(onehot, axis=0) <= (B * S) // 6)
    return jnp.mean((kept * probs).sum(-1)[:, None] * t)


def moe_sorted(x, w, m):
    """Sort-based dispatch: tokens sorted by expert, processed, scattered back."""
    h = attend(x, w)
    t = h.reshape(B * S, D)
    expert = jnp.argmax(t @ m[:, :4], -1)
    order = jnp.argsort(expert)
    ts = t[order] * (1.0 + expert[order][:, None])
    back = jnp.zeros_like(ts).at[order].set(ts)
    return jnp.mean(jnp.tanh(back).reshape(B, S, D) * h)


MERGES = {"tokens-mlp": tokens_mlp, "chunk-mean-2": chunk_mean(2), "chunk-mean-8": chunk_mean(8),
          "dense-head": dense_head, "moe-top2": moe, "moe-capacity": moe_capacity,
          "moe-sorted": moe_sorted}


#: One case per kind in the fast tier; the rest of the (kind, layout) matrix is slow.
FAST = {("tokens-mlp", "zigzag"), ("chunk-mean-2", "zigzag"), ("dense-head", "zigzag"),
        ("moe-capacity", "zigzag"), ("cls", "zigzag"), ("logsumexp", "zigzag")}


def matrix(names, layouts=("zigzag", "striped")):
    """``(name, layout)`` params, those outside :data:`FAST` marked slow."""
    return [pytest.param(n, lb, id=f"{lb}-{n}",
                         marks=() if (n, lb) in FAST else pytest.mark.slow)
            for n in names for lb in layouts]


@pytest.mark.slow
@pytest.mark.parametrize("name,load_balance", matrix(sorted(MERGES)))
def test_merged_and_routed_tokens(name, load_balance):
    x, w, m = rand(1, (B, S, D), (D, 3 * D), (D, 12), scale=0.5)
    if name == "dense-head":
        m = rand(2, (S * D * 3,), scale=0.1)[0].reshape(S * D, 3)
    if name.startswith("chunk"):
        m = rand(2, (D, 3))[0]
    check(MERGES[name], (x, w, m), load_balance)


def lse_shift(x, w, bump):
    t = attend(x, w).sum(-1) + bump
    return jnp.sum(jax.nn.logsumexp(t[:, :-1], axis=-1))


def sqrt_shift(x, w, bump):
    r = (attend(x, w) ** 2).sum(-1) * bump
    return jnp.sum(jnp.sqrt(r[:, 1:]))


SHIFTS = {"logsumexp": (lse_shift, -1, 1e30), "sqrt": (sqrt_shift, 0, 0.0)}


@pytest.mark.slow
@pytest.mark.parametrize("name,load_balance", matrix(sorted(SHIFTS)))
def test_shift_excluded_extreme_token(name, load_balance):
    loss, index, value = SHIFTS[name]
    x, w = rand(3, (B, S, D), (D, 3 * D), scale=0.5)
    bump = (jnp.zeros((B, S)) if loss is lse_shift else jnp.ones((B, S))).at[:, index].set(value)
    check(loss, (x, w, bump), load_balance)


POOLING = {
    "cls": lambda h: h[:, 0],
    "last": lambda h: h[:, -1],
    "indexed": lambda h: h[:, 5] - h[:, S - 3],
    "mean": lambda h: h.mean(1),
}


@pytest.mark.parametrize("pool,load_balance", matrix(sorted(POOLING)))
def test_token_pooling(pool, load_balance):
    x, w, m = rand(4, (B, S, D), (D, 3 * D), (D, 3), scale=0.5)

    def loss(x, w, m):
        return jnp.mean(jnp.tanh(POOLING[pool](attend(x, w)) @ m))
    check(loss, (x, w, m), load_balance)


@pytest.mark.parametrize("load_balance", ["zigzag", pytest.param("striped",
                                                                 marks=pytest.mark.slow)])
@pytest.mark.slow
def test_segment_sum_pooling(load_balance):
    x, w = rand(5, (B, S, D), (D, 3 * D), scale=0.5)
    seg = jnp.asarray(np.random.default_rng(5).integers(0, 4, (B, S)), jnp.int32)

    def loss(x, w, seg):
        h = attend(x, w)
        pooled = jax.vmap(lambda hb, sb: jax.ops.segment_sum(hb, sb, num_segments=4))(h, seg)
        return jnp.mean(jnp.tanh(pooled) ** 2)
    check(loss, (x, w, seg), load_balance, argnums=(0, 1))


def test_conversion_priced_in_explain_and_refused_by_strict():
    """Capacity by cumsum over flattened tokens runs in natural order: explain lists the
    un-permute with its bytes; strict refuses it, naming the op."""
    x, w, m = rand(6, (B, S, D), (D, 3 * D), (D, 12), scale=0.5)
    text = context_parallel(moe_capacity, cp=4, load_balance="zigzag").explain(x, w, m)
    assert re.search(r"layout conversions: \d+, \d+ bytes: .*un-permute for cumsum at "
                     r".*test_layouts.py:\d+ \(moe_capacity\): 1024 bytes", text), text
    f = context_parallel(moe_capacity, cp=4, load_balance="zigzag", strict=True)
    with pytest.raises(CPTransformError, match="cumsum at .*strict=True refuses"):
        jax.grad(f)(x, w, m)


@pytest.mark.slow
def test_merged_rows_keep_layout_without_conversion():
    x, w, m = rand(7, (B, S, D), (D, 3 * D), (D, D), scale=0.5)
    f = context_parallel(tokens_mlp, cp=4, load_balance="zigzag", strict=True)
    assert_same(jax.value_and_grad(f, (0, 1, 2))(x, w, m),
                jax.value_and_grad(tokens_mlp, (0, 1, 2))(x, w, m))


@pytest.mark.parametrize("name", ["contiguous", "striped", "zigzag"])
@pytest.mark.parametrize("dtype", [jnp.int32, jnp.uint32, jnp.float32])
def test_traced_positions_match_the_permutation(name, dtype):
    """The traced slot ↔ position maps (every layer's iota goes through them, in the
    transform's cheap non-negative division) agree exactly with the layout's NumPy
    permutation, for integer and whole-number float indices, under jit."""
    for n, cp in ((16, 2), (64, 8), (96, 4)):
        layout = SequenceLayout(name, n, cp)
        slots = jnp.arange(n, dtype=dtype)
        pos = jax.jit(layout.position_of_slot)(slots)
        np.testing.assert_array_equal(np.asarray(pos).astype(np.int64), layout.permutation())
        back = jax.jit(layout.slot_of_position)(jnp.asarray(layout.permutation(), dtype))
        np.testing.assert_array_equal(np.asarray(back).astype(np.int64), np.arange(n))
