"""What match-attention must leave alone, strict mode, reports and rule statistics."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cptransform.analysis.match_report import MatchReport
from cptransform.ir.module import trace
from cptransform.ir.pipeline import Pipeline
from cptransform.ir.errors import MatchAttentionError
from cptransform.passes import get_all_passes

PASSES = get_all_passes()
from test_match_support import check, check_refused, randn, rewrite, specs

B, T, H, D, V = 2, 8, 2, 8, 16


def scores(q, k):
    return jnp.einsum("bqhd,bkhd->bhqk", q, k) * D ** -0.5


@pytest.mark.slow
def test_vocabulary_classifier(rng):
    h, w = randn(rng, B, T, D), randn(rng, D, V)
    fn = lambda h, w: jax.nn.softmax(h @ w, axis=-1)  # noqa: E731
    check_refused(fn, h, w, reason="probabilities")


@pytest.mark.slow
def test_gating_softmax(rng):
    x, wg, experts = randn(rng, B, T, D), randn(rng, D, 4), randn(rng, 4, D, D)

    def fn(x, wg, experts):
        gates = jax.nn.softmax(x @ wg, axis=-1)
        outs = jnp.einsum("btd,edf->btef", x, experts)
        return jnp.einsum("bte,btef->btf", gates, outs)

    check_refused(fn, x, wg, experts, reason="batch dims differ")


@pytest.mark.slow
def test_returned_weights(rng):
    q, k, v = (randn(rng, B, T, H, D) for _ in range(3))

    def fn(q, k, v):
        p = jax.nn.softmax(scores(q, k))
        return jnp.einsum("bhqk,bkhd->bqhd", p, v), p

    check_refused(fn, q, k, v, reason="also used elsewhere")


@pytest.mark.slow
def test_a_keep_mask_given_as_data(rng):
    """A multiplier of the probabilities that is data (no bits drawn with ``jax.random``,
    which ``test_dropout_attention`` shards): left whole."""
    q, k, v = (randn(rng, B, T, H, D) for _ in range(3))
    keep = jnp.asarray(rng.random((B, H, T, T)) > 0.1)

    def fn(q, k, v, keep):
        p = jax.nn.softmax(scores(q, k)) * keep / 0.9
        return jnp.einsum("bhqk,bkhd->bqhd", p, v)

    check_refused(fn, q, k, v, keep, reason="go through mul before the value product")


@pytest.mark.parametrize("spelling", ["take_along_axis", "indexing"])
def test_keys_gathered_per_query(rng, spelling):
    """DeepSeek-V3.2's selected keys gathered per query (``k_sel [B, Q, k, H, D]``, both
    products' operands carry the query dim): left alone with the reason and the way to
    shard it, never a crash; the program is unchanged."""
    q, k, v = (randn(rng, B, T, H, D) for _ in range(3))
    idx = jnp.asarray(rng.integers(0, T, (B, T, 3)), jnp.int32)

    def gathered(x, idx):
        if spelling == "take_along_axis":
            return jnp.take_along_axis(x[:, None], idx[:, :, :, None, None], axis=2)
        return x[jnp.arange(B)[:, None, None], idx]

    def fn(q, k, v, idx):
        k_sel, v_sel = gathered(k, idx), gathered(v, idx)
        p = jax.nn.softmax(jnp.einsum("bqhd,bqkhd->bhqk", q, k_sel) * D ** -0.5, axis=-1)
        return jnp.einsum("bhqk,bqkhd->bqhd", p, v_sel)

    check_refused(fn, q, k, v, idx, reason="gathered per query")


def test_a_matcher_failure_leaves_the_softmax_alone(rng, monkeypatch):
    """An unforeseen failure while reading a candidate is a refusal with its cause, not a
    crash: the attention stays as written."""
    from cptransform.passes.match_attention import matcher

    def broken(*args, **kwargs):
        raise IndexError("tuple index out of range")

    monkeypatch.setattr(matcher, "build_candidate", broken)
    q, k, v = (randn(rng, B, T, H, D) for _ in range(3))
    fn = lambda q, k, v: jnp.einsum(  # noqa: E731
        "bhqk,bkhd->bqhd", jax.nn.softmax(scores(q, k), axis=-1), v)
    check_refused(fn, q, k, v, reason="could not read this candidate (IndexError")


@pytest.mark.slow
def test_softmax_over_query_axis(rng):
    q, k, v = (randn(rng, B, T, H, D) for _ in range(3))

    def fn(q, k, v):
        p = jax.nn.softmax(scores(q, k), axis=-2)
        return jnp.einsum("bhqk,bkhd->bqhd", p, v)

    check_refused(fn, q, k, v, reason="does not contract the softmax axis")


@pytest.mark.slow
def test_mask_before_softcap(rng):
    """``tanh`` after a ``-1e9`` mask turns masked logits into ``-cap``: no mask hides
    them, they keep that finite logit (``MaskSpec.fill``)."""
    q, k, v = (randn(rng, B, T, H, D) for _ in range(3))

    def fn(q, k, v):
        s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), scores(q, k), -1e9)
        s = jnp.tanh(s / 5.0) * 5.0
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)

    (spec,) = specs(check(fn, q, k, v))
    assert spec.mask.causal and spec.mask.fill == -5.0 and spec.softcap == 5.0


def test_a_product_with_the_mask_keeps_no_fill(rng):
    """``s · mask`` gives masked keys the logit ``0·s``, NaN where ``s`` is infinite, which
    a kept fill of 0 would not reproduce: refused with the spelling that works."""
    q, k, v = (randn(rng, B, T, H, D) for _ in range(3))

    def fn(q, k, v):
        s = scores(q, k) * jnp.tril(jnp.ones((T, T), jnp.float32))
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)

    check_refused(fn, q, k, v, reason="by a product with the mask")


def test_strict_raises_on_attention_like_refusal(rng):
    q, k, v = (randn(rng, B, T, H, D) for _ in range(3))

    def fn(q, k, v):
        p = jax.nn.softmax(scores(q, k))
        return jnp.einsum("bhqk,bkhd->bqhd", p, v), p

    with pytest.raises(MatchAttentionError, match="not rewritten"):
        Pipeline.parse("canonicalize,match-attention{strict=true}", available=PASSES).run(trace(fn, q, k, v))
    h, w = randn(rng, B, T, D), randn(rng, D, V)
    module = Pipeline.parse("canonicalize,match-attention{strict=true}", available=PASSES).run(
        trace(lambda h, w: jax.nn.softmax(h @ w), h, w)).module
    assert not module.facts.matches[0].rewritten


def test_reports_and_stats(rng):
    q, k, v = (randn(rng, B, T, H, D) for _ in range(3))
    h, w = randn(rng, B, T, D), randn(rng, D, V)

    def fn(q, k, v, h, w):
        s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), scores(q, k), -jnp.inf)
        o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)
        return o, jax.nn.softmax(h @ w)

    m = rewrite(fn, q, k, v, h, w)
    reports = m.facts.matches
    assert [r.status for r in reports] == ["rewritten", "refused"]
    assert all(isinstance(r, MatchReport) and "test_match_refusals.py" in r.source
               for r in reports)
    assert reports[0].mask_kind == "causal" and "causal" in str(reports[0])
    assert "refused" in str(reports[1]) and reports[1].reason
    stats = m.facts.match_stats
    assert stats["softmax"]["attempts"] == 2 and stats["softmax"]["hits"] == 2
    assert stats["mask"]["hits"] == 1
    assert stats["chain:select_n"] == {**stats["chain:select_n"], "attempts": 1, "hits": 1}
    assert all(entry["seconds"] >= 0 for entry in stats.values())
    np.testing.assert_allclose(jax.jit(m.as_function())(q, k, v, h, w)[0],
                               fn(q, k, v, h, w)[0], rtol=1e-6, atol=1e-6)
