"""Shared checks for the match-attention tests (no tests here)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from cptransform.op.attention import attention_p
from cptransform.ir.module import iter_eqns, trace
from cptransform.ir.pipeline import Pipeline
from cptransform.passes import get_all_passes

PASSES = get_all_passes()

PIPELINE = "canonicalize,match-attention"
#: Rewritten attention vs the original in float32. The rewrite only reassociates the
#: scale (q·c)·k vs c·(q·k) and the order of masked-softmax steps, a few ulps of the
#: logits; relative to the output's largest entry that stays below 1e-6.
RTOL = 1e-6


def randn(rng, *shape, dtype=jnp.float32):
    return jnp.asarray(rng.standard_normal(shape), dtype)


def rewrite(fn, *args, pipeline: str = PIPELINE):
    """The module of ``fn`` after canonicalize and match-attention."""
    return Pipeline.parse(pipeline, available=PASSES).run(trace(fn, *args)).module


def specs(module) -> list:
    return [e.params["spec"] for e in iter_eqns(module.jaxpr) if e.primitive is attention_p]


def primitives(module) -> set:
    return {e.primitive.name for e in iter_eqns(module.jaxpr)}


def assert_close(got, want, rtol: float = RTOL):
    """Close relative to ``want``'s largest entry, NaN where the original is NaN (a query
    that sees no key under a ``-inf`` mask: ``empty_rows="nan"``)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    got, want = np.where(nan, 0.0, got), np.where(nan, 0.0, want)
    scale = max(np.max(np.abs(want)), 1e-30)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * scale)


def check(fn, *args, count: int = 1, analytic: bool = False, rtol: float = RTOL):
    """Rewrite ``fn``; assert ``count`` attentions, equal outputs, and for ``analytic``
    masks no iota/compare and no mask operand left. Returns the rewritten module."""
    module = rewrite(fn, *args)
    assert module.count(attention_p) == count, (
        f"expected {count} attention_p, found {module.count(attention_p)}; reports:\n" +
        "\n".join(map(str, (module.facts.matches or []))) + f"\n{module}")
    for report in module.facts.matches:
        assert report.rewritten, str(report)
    if analytic:
        left = primitives(module) & {"iota", "ge", "gt", "le", "lt", "eq", "ne"}
        assert not left, f"analytic mask left {left} in\n{module}"
        assert not any(s.mask.dense for s in specs(module))
    want = fn(*args)
    got = jax.jit(module.as_function())(*args)
    jax.tree.map(lambda g, w: assert_close(g, w, rtol), got, want)
    return module


def check_refused(fn, *args, reason: str):
    """``fn`` stays as it is, with a refusal whose reason contains ``reason``."""
    module = rewrite(fn, *args)
    assert module.count(attention_p) == 0, str(module)
    reports = module.facts.matches
    assert reports and all(not r.rewritten for r in reports), reports
    assert any(reason in r.reason for r in reports), [r.reason for r in reports]
    assert all(r.source != "?" for r in reports)
    # canonicalize may still fold scales: equal up to rounding.
    jax.tree.map(assert_close, jax.jit(module.as_function())(*args), fn(*args))
    return module
