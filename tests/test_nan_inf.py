"""NaN and Inf propagate under context parallelism exactly as on one device (docs/contract.md).

Each test runs a small model once undecorated and once under ``context_parallel`` with every
schedule, and compares the NaN pattern as well as the finite values: a NaN in a weight, a
NaN in one token's value vector, an ``+inf`` logit, and fully masked rows with a ``-inf``
fill (NaN on one device) and a finite one (finite, unchanged).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import make_mesh
from cptransform import context_parallel
from cptransform.op.attention_reference import merge
from cptransform.op.attention_spec import MaskSpec

B, S, H, D = 2, 16, 4, 8
E = H * D
RTOL = 1e-5

SCHEDULES = {
    "ring-zigzag": dict(cp=4, schedule="ring", load_balance="zigzag"),
    "ring-none": dict(cp=4, schedule="ring", load_balance="none"),
    "ulysses": dict(cp=4, schedule="ulysses", load_balance="none"),
    "allgather": dict(cp=4, schedule="allgather", load_balance="none"),
    "hybrid": "hybrid",
}


def options(name):
    """``context_parallel`` options for a schedule name of :data:`SCHEDULES`."""
    opts = SCHEDULES[name]
    if opts == "hybrid":
        return dict(mesh=make_mesh((2, 2), ("uly", "ring")), axis=("uly", "ring"),
                    schedule="hybrid", load_balance="none")
    return opts

FINFO_MIN = float(jnp.finfo(jnp.float32).min)


def params(rng):
    w = lambda: jnp.asarray(rng.normal(size=(E, E)) / np.sqrt(E), jnp.float32)  # noqa: E731
    return {"wq": w(), "wk": w(), "wv": w(), "wo": w()}


def attention_out(p, x, v_extra, valid, *, causal=True, fill=None, additive=False):
    """Multi-head attention of ``x [B, S, E]``; returns the attention output
    ``[B, S, H, D]`` (before ``wo``). ``v_extra`` is added to the values; ``valid [B, S]``
    masks padded queries and keys with ``fill`` (default: ``jax.nn.dot_product_attention``),
    selected in place of the logits or, with ``additive``, added to them as a bias."""
    heads = lambda y: y.reshape(B, S, H, D)  # noqa: E731
    q, k = heads(x @ p["wq"]), heads(x @ p["wk"])
    v = heads(x @ p["wv"] + v_extra)
    if fill is None:
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D)
    keep = valid[:, None, :, None] & valid[:, None, None, :]
    if causal:
        keep = keep & jnp.tril(jnp.ones((S, S), bool))
    s = s + jnp.where(keep, 0.0, fill) if additive else jnp.where(keep, s, fill)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def loss(p, x, v_extra, valid, **kw):
    o = attention_out(p, x, v_extra, valid, **kw).reshape(B, S, E) @ p["wo"]
    return jnp.sum(jnp.sin(o))


def inputs(rng):
    x = jnp.asarray(rng.normal(size=(B, S, E)), jnp.float32)
    return x, jnp.zeros((B, S, E), jnp.float32), jnp.ones((B, S), bool)


def assert_same(got, want, rtol=RTOL):
    """Equal NaN pattern (and ±Inf), finite entries close relative to the largest one."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg="NaN pattern differs")
    finite = np.isfinite(want)
    scale = max(float(np.max(np.abs(want[finite]), initial=0.0)), 1e-30)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * scale, equal_nan=True)


def compare(fn, args, schedule, *, grads=True, **kw):
    """Run ``fn`` (output) and ``loss`` (value and grads) undecorated and under
    ``context_parallel``; NaN patterns and values must agree. Returns the reference output."""
    out = lambda *a: fn(*a, **kw)  # noqa: E731
    want = jax.jit(out)(*args)
    assert_same(context_parallel(out, **options(schedule))(*args), want)
    if grads:
        f = lambda *a: loss(*a, **kw)  # noqa: E731
        want_l, want_g = jax.jit(jax.value_and_grad(f))(*args)
        got_l, got_g = jax.value_and_grad(context_parallel(f, **options(schedule)))(*args)
        assert_same(got_l, want_l)
        for name in want_g:
            assert_same(got_g[name], want_g[name])
    return want


@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_nan_weight(rng, schedule):
    """One NaN entry of wq: NaN loss and the same NaN gradients (not a hidden NaN)."""
    p = params(rng)
    p["wq"] = p["wq"].at[3, 5].set(jnp.nan)
    x, extra, valid = inputs(rng)
    want = compare(attention_out, (p, x, extra, valid), schedule)
    assert np.isnan(want).any()


@pytest.mark.slow
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_nan_in_one_value(rng, schedule, causal):
    """A NaN in one token's value vector. On one device masked probabilities are exact
    zeros and ``0·NaN = NaN``, so every row of that head's features is NaN, also the rows
    before the token under a causal mask; skipped blocks must say the same."""
    p = params(rng)
    x, extra, valid = inputs(rng)
    extra = extra.at[1, 11, 8:16].set(jnp.nan)  # batch 1, token 11, head 1
    want = compare(attention_out, (p, x, extra, valid), schedule, causal=causal)
    assert np.isnan(want[1, :, 1]).all() and not np.isnan(want[0]).any()


@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_inf_logit(rng, schedule):
    """Huge weights overflow logits to ±inf (1e30·1e30, far from the overflow edge, so
    summation order cannot matter): softmax of a row holding +inf is NaN."""
    p = params(rng)
    p["wq"] = p["wq"].at[2, 0].set(1e30)
    p["wk"] = p["wk"].at[2, 0].set(1e30)
    x, extra, valid = inputs(rng)
    want = compare(attention_out, (p, x, extra, valid), schedule, causal=False)
    assert np.isnan(want).any() and not np.isnan(want).all()


@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_inf_logit_in_one_block(rng, schedule):
    """One huge token: only its own logit overflows to +inf, in one key block. Its row is
    NaN on one device; a merge that weighted the +inf partial 0 would hide it.

    ``wk = wq`` makes that logit ``Σ q_i²``: every term +inf, so it is +inf in any
    summation order (with independent weights, terms of both signs overflow and whether
    the sum is +inf or NaN depends on the order the dot product accumulates in, which
    differs between kernels and XLA versions)."""
    p = params(rng)
    p["wk"] = p["wq"]
    x, extra, valid = inputs(rng)
    x = x.at[1, 3].multiply(1e30)
    want = compare(attention_out, (p, x, extra, valid), schedule, grads=False)
    assert np.isnan(want[1, 3]).any() and not np.isnan(want[0]).any()


def _padded(rng):
    x, extra, valid = inputs(rng)
    valid = valid.at[0, 5].set(False).at[1, 12:].set(False)
    return x, extra, valid


@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_neg_inf_fill_masked_row_is_nan(rng, schedule):
    """``where(mask, s, -inf)``: a query that sees no key is NaN on one device, and so are
    the V gradients; under context parallelism too (``empty_rows="nan"``)."""
    p = params(rng)
    args = (p, *_padded(rng))
    want = compare(attention_out, args, schedule, fill=-jnp.inf)
    assert np.isnan(want[0, 5]).all() and np.isnan(want[1, 12:]).all()
    assert not np.isnan(want[0, :5]).any()


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["ring-zigzag", "allgather"])
def test_neg_inf_fill_without_empty_rows_is_finite(rng, schedule):
    """A causal ``-inf`` fill with no fully masked row: finite output and gradients (the
    NaN of ``empty_rows="nan"`` must not leak into other rows' gradients)."""
    p = params(rng)
    x, extra, valid = inputs(rng)
    compare(attention_out, (p, x, extra, valid), schedule, fill=-jnp.inf)
    grads = jax.grad(context_parallel(lambda *a: loss(*a, fill=-jnp.inf), cp=4))(
        p, x, extra, valid)
    assert all(np.isfinite(g).all() for g in grads.values())


@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_finite_fill_masked_row_is_finite(rng, schedule):
    """A finite fill (``-1e9``): a fully masked row is the mean of V, finite as before."""
    p = params(rng)
    args = (p, *_padded(rng))
    want = compare(attention_out, args, schedule, fill=-1e9)
    assert np.isfinite(want).all()


@pytest.mark.parametrize("schedule", [pytest.param(s, marks=() if s == "ring-zigzag"
                                                  else pytest.mark.slow) for s in SCHEDULES])
def test_additive_finite_fill_masked_row_gradients(rng, schedule):
    """A finite fill added as a bias (``logits + where(mask, 0, finfo.min)``, transformers'
    attention bias): a fully masked row is the mean of V, and the one-device gradient flows
    through its logits to its query and every key."""
    p = params(rng)
    args = (p, *_padded(rng))
    f = context_parallel(lambda *a: attention_out(*a, fill=FINFO_MIN, additive=True), cp=4)
    assert "empty=uniform(added)" in f.explain(*args)
    compare(attention_out, args, schedule, fill=FINFO_MIN, additive=True)


def test_additive_fill_gradient_is_not_the_selected_fills():
    """The same masks with the fill selected (``where(mask, x, finfo.min)``) send a fully
    masked row no logit gradient: the two gradients differ, so each test above can fail."""
    p = params(rng := np.random.default_rng(3))
    args = (p, *_padded(rng))
    grads = [jax.grad(lambda *a, add=add: loss(*a, fill=FINFO_MIN, additive=add))(*args)
             for add in (False, True)]
    assert float(jnp.max(jnp.abs(grads[0]["wq"] - grads[1]["wq"]))) > 1e-3


def test_merge_propagates_nan():
    """``merge`` never weights a NaN partial 0, and keeps empty (``-inf``) rows finite."""
    o1 = jnp.ones((1, 4, 1, 2), jnp.float32)
    o2 = 2 * o1
    lse1 = jnp.asarray([[[0.0, jnp.nan, -jnp.inf, 1.0]]], jnp.float32)
    lse2 = jnp.asarray([[[0.0, 0.0, -jnp.inf, jnp.nan]]], jnp.float32)
    o, lse = merge(o1, lse1, o2, lse2)
    o, lse = np.asarray(o)[0, :, 0, 0], np.asarray(lse)[0, 0]
    np.testing.assert_allclose(o, [1.5, np.nan, 0.0, np.nan], equal_nan=True)
    np.testing.assert_allclose(lse, [np.log(2), np.nan, -np.inf, np.nan], equal_nan=True)
    # NaN carried in an empty partial's o (a NaN in V) is not dropped either.
    o, _ = merge(o1.at[0, 0, 0, 0].set(jnp.nan), lse1.at[0, 0, 0].set(-jnp.inf), o2, lse2)
    assert np.isnan(o[0, 0, 0, 0]) and not np.isnan(o[0, 0, 0, 1])


@pytest.mark.slow
def test_neg_inf_fill_is_recorded_and_described(rng):
    """The matcher records a ``-inf`` fill as ``empty_rows="nan"`` and ``describe`` says so."""
    p = params(rng)
    f = context_parallel(lambda *a: attention_out(*a, fill=-jnp.inf), cp=4)
    assert "empty=nan" in f.explain(p, *_padded(rng))
    assert MaskSpec(causal=True, empty_rows="nan").describe() == "causal empty=nan"
