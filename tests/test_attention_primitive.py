"""``attention_p`` and ``cptransform.attention`` against ``jax.nn.dot_product_attention``."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import fast_every

from cptransform import AttentionShapeError, attention, attention_p, trace

B, T, H, HKV, D = 2, 16, 4, 2, 8
TOL = dict(rtol=2e-5, atol=2e-5)


def qkv(rng, *, heads=H, kv_heads=HKV, t=T, dtype=jnp.float32):
    q = rng.standard_normal((B, t, heads, D)).astype(np.float32)
    k = rng.standard_normal((B, t, kv_heads, D)).astype(np.float32)
    v = rng.standard_normal((B, t, kv_heads, D)).astype(np.float32)
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


def xla_attention(q, k, v, **kw):
    """``jax.nn.dot_product_attention`` (XLA path) with K/V heads repeated for GQA/MQA."""
    reps = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, reps, axis=2), jnp.repeat(v, reps, axis=2)
    return jax.nn.dot_product_attention(q, k, v, implementation="xla", **kw)


def dense_mask(rng, *, empty_row=True):
    m = rng.random((B, H, T, T)) < 0.6
    if empty_row:
        m[0, 1, 3, :] = False  # a query that sees nothing: "uniform" like jax
    return jnp.asarray(m)


@pytest.mark.parametrize("kind", ["none", "causal", "window", "window_causal", "dense",
                                  "bias", "causal_bias", "dense_bias"])
@pytest.mark.slow
def test_reference_matches_jax(rng, kind):
    q, k, v = qkv(rng)
    bias = jnp.asarray(rng.standard_normal((B, H, T, T)), jnp.float32)
    mask = dense_mask(rng)
    ours_kw, jax_kw = {}, {}
    if "causal" in kind:
        ours_kw["causal"] = jax_kw["is_causal"] = True
    if kind.startswith("window"):
        ours_kw["window"] = (3, 0) if "causal" in kind else (3, 2)
        jax_kw["local_window_size"] = ours_kw["window"]
    if "dense" in kind:
        ours_kw["mask"] = jax_kw["mask"] = mask
        ours_kw["empty_rows"] = "uniform"
    if "bias" in kind:
        ours_kw["bias"] = jax_kw["bias"] = bias
    out = attention(q, k, v, **ours_kw)
    want = xla_attention(q, k, v, **jax_kw)
    np.testing.assert_allclose(out, want, **TOL)


@pytest.mark.parametrize("kv_heads", fast_every([4, 2, 1], 2), ids=["mha", "gqa", "mqa"])
def test_gqa_mqa(rng, kv_heads):
    q, k, v = qkv(rng, kv_heads=kv_heads)
    np.testing.assert_allclose(attention(q, k, v, causal=True),
                               xla_attention(q, k, v, is_causal=True), **TOL)


@pytest.mark.slow
def test_scale(rng):
    q, k, v = qkv(rng)
    np.testing.assert_allclose(attention(q, k, v, scale=0.37),
                               xla_attention(q, k, v, scale=0.37), **TOL)


@pytest.mark.slow
def test_softcap_matches_formula(rng):
    q, k, v = qkv(rng, kv_heads=H)
    cap, scale = 2.5, D ** -0.5
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
    p = jax.nn.softmax(cap * jnp.tanh(s / cap), axis=-1)
    want = jnp.einsum("bhqk,bkhd->bqhd", p, v)
    np.testing.assert_allclose(attention(q, k, v, softcap=cap), want, **TOL)


@pytest.mark.slow
def test_segment_ids_equal_explicit_mask(rng):
    q, k, v = qkv(rng)
    seg = jnp.asarray(np.sort(rng.integers(0, 3, (B, T)), axis=1), jnp.int32)
    explicit = seg[:, None, :, None] == seg[:, None, None, :]
    out = attention(q, k, v, segment_ids=seg, causal=True)
    np.testing.assert_allclose(out, attention(q, k, v, mask=explicit, causal=True), **TOL)
    np.testing.assert_allclose(out, xla_attention(q, k, v, mask=explicit, is_causal=True),
                               **TOL)


def test_valid_tokens_equal_explicit_padding_mask(rng):
    """``valid=`` (one vector, or a ``(q_valid, kv_valid)`` pair) is the padding mask
    ``valid[q] & valid[kv]``, carried as two ``[B, T]`` operands."""
    q, k, v = qkv(rng)
    valid = jnp.asarray(rng.random((B, T)) < 0.7)
    explicit = valid[:, None, :, None] & valid[:, None, None, :]
    out = attention(q, k, v, valid=valid, causal=True)
    np.testing.assert_allclose(out, attention(q, k, v, mask=explicit, causal=True), **TOL)
    keys_only = attention(q, k, v, valid=(jnp.ones_like(valid), valid))
    keys = jnp.broadcast_to(valid[:, None, None, :], (B, 1, T, T))
    np.testing.assert_allclose(keys_only, attention(q, k, v, mask=keys), **TOL)


@pytest.mark.slow
def test_empty_rows_zero_by_default(rng):
    q, k, v = qkv(rng)
    mask = dense_mask(rng)
    out = attention(q, k, v, mask=mask)
    np.testing.assert_array_equal(out[0, 3, 1], jnp.zeros(D))
    uniform = attention(q, k, v, mask=mask, empty_rows="uniform")
    np.testing.assert_allclose(uniform[0, 3, 1], v[0, :, 1 // (H // HKV)].mean(0), **TOL)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["causal", "bias"])
def test_grads_match_jax(rng, kind):
    q, k, v = qkv(rng)
    bias = jnp.asarray(rng.standard_normal((B, H, T, T)), jnp.float32)
    ct = jnp.asarray(rng.standard_normal((B, T, H, D)), jnp.float32)
    causal = kind == "causal"

    def ours(q, k, v, bias):
        return jnp.sum(attention(q, k, v, bias=bias, causal=causal) * ct)

    def theirs(q, k, v, bias):
        return jnp.sum(xla_attention(q, k, v, bias=bias, is_causal=causal) * ct)

    got = jax.jit(jax.grad(ours, argnums=(0, 1, 2, 3)))(q, k, v, bias)
    want = jax.jit(jax.grad(theirs, argnums=(0, 1, 2, 3)))(q, k, v, bias)
    for name, g, w in zip("q k v bias".split(), got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4, err_msg=f"d{name}")


def test_vmap_leading_axis(rng):
    n = 3
    qs, ks, vs = zip(*(qkv(rng) for _ in range(n)))
    q, k, v = jnp.stack(qs), jnp.stack(ks), jnp.stack(vs)
    out = jax.vmap(lambda a, b, c: attention(a, b, c, causal=True))(q, k, v)
    for i in range(n):
        np.testing.assert_allclose(out[i], xla_attention(qs[i], ks[i], vs[i], is_causal=True),
                                   **TOL)


@pytest.mark.slow
def test_vmap_non_leading_axis_and_unbatched_kv(rng):
    n = 3
    qs = [qkv(rng)[0] for _ in range(n)]
    _, k, v = qkv(rng)
    q = jnp.stack(qs, axis=2)  # [B, T, n, H, D]
    out = jax.vmap(lambda a: attention(a, k, v, causal=True), in_axes=2, out_axes=2)(q)
    assert out.shape == q.shape
    for i in range(n):
        np.testing.assert_allclose(out[:, :, i], xla_attention(qs[i], k, v, is_causal=True),
                                   **TOL)


@pytest.mark.slow
def test_bf16_inputs(rng):
    q, k, v = qkv(rng, dtype=jnp.bfloat16)
    out = attention(q, k, v, causal=True)
    assert out.dtype == jnp.bfloat16
    want = xla_attention(*(x.astype(jnp.float32) for x in (q, k, v)), is_causal=True)
    np.testing.assert_allclose(out.astype(jnp.float32), want, rtol=2e-2, atol=2e-2)


def test_jit_equals_eager_and_binds_one_equation(rng):
    q, k, v = qkv(rng)
    fn = lambda a, b, c: attention(a, b, c, causal=True, window=(4, 0))  # noqa: E731
    np.testing.assert_allclose(jax.jit(fn)(q, k, v), fn(q, k, v), **TOL)
    module = trace(fn, q, k, v)
    assert module.count(attention_p) == 1
    assert "attention[causal window=(4,0) gqa=2" in str(module)


@pytest.mark.slow
def test_layout_bhtd(rng):
    q, k, v = qkv(rng)
    t = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731  BTHD <-> BHTD
    out = attention(t(q), t(k), t(v), causal=True, layout="BHTD")
    np.testing.assert_allclose(t(out), xla_attention(q, k, v, is_causal=True), **TOL)


@pytest.mark.parametrize("change, message", [
    (lambda q, k, v: (q, k[..., :4], v), "head dims differ"),
    (lambda q, k, v: (q, k, v[:, :8]), "sequence lengths differ"),
    (lambda q, k, v: (q[:, :, :3], k, v), "multiple"),
    (lambda q, k, v: (q, k[:1], v[:1]), "batch dims differ"),
    (lambda q, k, v: (q, k[..., :1, :], v), "heads"),
])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_shape_errors(rng, change, message, jit):
    q, k, v = change(*qkv(rng))
    fn = jax.jit(attention) if jit else attention
    with pytest.raises(AttentionShapeError, match=message):
        fn(q, k, v)


def test_mask_shape_error(rng):
    q, k, v = qkv(rng)
    with pytest.raises(AttentionShapeError, match="last two dims"):
        attention(q, k, v, mask=jnp.ones((B, H, T, T - 1), bool))
