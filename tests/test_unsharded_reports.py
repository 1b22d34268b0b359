"""No softmax over a q·k product is left alone silently: whatever reason the matcher
gives, an attention it leaves whole beside sharded ones is a ``PartlyShardedWarning``
naming its line and reason, and an ``explain()`` line; alone, an ``UnshardedError``
whose advice (``allow_unsharded=True``) runs the function as on one device."""
import ast
import math
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_tree_close

from cptransform import (PartlyShardedWarning, UnshardedError, UnshardedWarning,
                         context_parallel)
from cptransform.ir.module import trace
from cptransform.passes.canonicalize import Canonicalize
from cptransform.passes.match_attention import MatchAttention, matcher
from cptransform.passes.match_attention.stats import NotAttention

MATCHER = Path(__file__).resolve().parents[1] / "passes" / "match_attention"
B, T, H, D = 2, 32, 4, 8


def _text(node: ast.AST) -> str | None:
    """The message a ``NotAttention(...)`` argument spells (f-string fields as ``{}``)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _text(node.left), _text(node.right)
        return None if left is None or right is None else left + right
    return None


def refusal_reasons() -> list[tuple[str, str]]:
    """``(module, reason)`` of every ``NotAttention`` the matcher's modules raise."""
    found = []
    for path in sorted(MATCHER.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "NotAttention" \
                    and node.args:
                found.append((path.stem, _text(node.args[0])))
    return found


REASONS = refusal_reasons()


def test_the_reasons_are_read_from_the_matcher():
    modules = {m for m, _ in REASONS}
    assert {"anchor", "chain", "candidate", "logits", "value_product", "dropout",
            "matcher"} <= modules
    assert len(REASONS) > 60 and all(reason for _, reason in REASONS)


def two_attentions(q, k, v):
    """A causal attention, then a second one over its output (the one refusals hit)."""
    o = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    s = jnp.einsum("bqhd,bkhd->bhqk", o, k) / math.sqrt(D)
    s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


@pytest.fixture(scope="module")
def canonical():
    args = [jnp.ones((B, T, H, D))] * 3
    return Canonicalize().run(trace(two_attentions, *args)).module


@pytest.mark.parametrize("where,reason", REASONS,
                         ids=[f"{m}-{i}" for i, (m, _) in enumerate(REASONS)])
def test_every_refusal_reason_marks_the_attention_left_whole(canonical, monkeypatch, where,
                                                             reason):
    """Each reason the matcher can give, raised for the second attention (by the softmax
    anchor, or by the match after it), leaves a report that runs unsharded: what the
    warning and ``explain()`` list. Which reason it is never decides that."""
    calls = []
    if where == "anchor":
        found = matcher.find_softmax

        def refuse(graph, eqn):
            softmax = found(graph, eqn)
            calls.append(softmax)
            if len(calls) == 2:
                raise NotAttention(reason)
            return softmax
        monkeypatch.setattr(matcher, "find_softmax", refuse)
    else:
        attention = matcher.Matcher._attention

        def refuse(self, softmax):
            calls.append(softmax)
            if len(calls) == 2:
                raise NotAttention(reason)
            return attention(self, softmax)
        monkeypatch.setattr(matcher.Matcher, "_attention", refuse)
    reports = MatchAttention().run(canonical).module.facts.matches
    assert [r.rewritten for r in reports] == [True, False], reports
    assert reports[1].reason == reason and reports[1].runs_unsharded, reports[1]


def two_fills(causal, s):
    """The logits ``s`` filled with ``-1e9`` by ``causal`` and ``-inf`` by a window: a row
    the window empties is uniform on one device where the causal mask hides a key, else
    NaN, which no single fill gives."""
    window = jnp.triu(jnp.ones_like(causal), -3)
    return jnp.where(causal, jnp.where(window, s, -jnp.inf), -1e9)


def refused_beside_a_sharded_one(kind: str):
    """A sharded causal attention, then one the matcher refuses for ``kind``."""
    causal = jnp.tril(jnp.ones((T, T), bool))

    def fn(q, k, v, t):
        o = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        s = jnp.einsum("bqhd,bkhd->bhqk", o, k) / math.sqrt(D)
        if kind == "factor_after_mask":        # chain/logits: the factor's NaN gradient
            s = jnp.where(causal, s, -jnp.inf) * t[None, :, None, None]
        elif kind == "two_fills":              # logits: masks that fill differently
            s = two_fills(causal, s)
        elif kind == "power":                  # walk: a primitive no chain reads
            s = jnp.where(causal, s ** 3, -jnp.inf)
        elif kind == "keys_factor":            # candidate: data along the keys
            norms = jnp.linalg.norm(k, axis=-1).transpose(0, 2, 1)[:, :, None, :]
            s = jnp.where(causal, s * norms, -jnp.inf)
        return jnp.sum(jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v) ** 2)

    return fn


def data(seed: int = 0):
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.standard_normal((B, T, H, D)), jnp.float32) for _ in range(3))
    return q, k, v, jnp.asarray(rng.uniform(1, 3, (H,)), jnp.float32)


@pytest.mark.parametrize("kind,reason", [
    ("factor_after_mask", "after a mask"),
    pytest.param("two_fills", "different values depending on which mask hides them",
                 marks=pytest.mark.slow),
    pytest.param("power", "does not come from a q·k product", marks=pytest.mark.slow),
    pytest.param("keys_factor", "varies along the keys", marks=pytest.mark.slow),
])
def test_an_attention_left_whole_warns_and_is_explained(kind, reason):
    fn, args = refused_beside_a_sharded_one(kind), data()
    f = context_parallel(fn, cp=8, schedule="ring", load_balance="zigzag")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UnshardedWarning)
        got = jax.value_and_grad(f, argnums=(0, 1, 2, 3))(*args)
    warned = [str(w.message) for w in caught if w.category is PartlyShardedWarning]
    assert len(warned) == 1 and reason in warned[0] and "test_unsharded_reports.py" in warned[0]
    listed = [line for line in f.explain(*args).splitlines() if "unsharded attention" in line]
    assert len(listed) == 1 and reason in listed[0], listed
    want = jax.value_and_grad(fn, argnums=(0, 1, 2, 3))(*args)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5), got, want)


@pytest.mark.slow
def test_alone_it_is_an_error_whose_advice_runs_the_function():
    """Masks filling with different values (``-1e9`` and ``-inf``): alone in the function
    nothing is sharded, an ``UnshardedError``; its advice, ``allow_unsharded=True``, runs
    it as on one device, with an ``UnshardedWarning``."""
    causal = jnp.tril(jnp.ones((T, T), bool))

    def fn(q, k, v, t):
        s = two_fills(causal, jnp.einsum("bqhd,bkhd->bhqk", q, k))
        return jnp.sum(jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v) ** 2)

    args = data(1)
    with pytest.raises(UnshardedError, match="(?s)different values.*allow_unsharded=True"):
        context_parallel(fn, cp=8)(*args)
    f = context_parallel(fn, cp=8, allow_unsharded=True)
    with pytest.warns(UnshardedWarning, match="different values"):
        got = jax.value_and_grad(f, argnums=(0, 1, 2))(*args)
    assert_tree_close(got, jax.value_and_grad(fn, argnums=(0, 1, 2))(*args))
