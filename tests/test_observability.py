"""Observability: the ``cptransform`` logger (INFO per pass with its wall time, DEBUG the
IR), per-pass timings readable from Python, and the ``jax.named_scope`` names schedules,
ring steps and kernels run under, found in the lowered program's op metadata."""
import logging
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cptransform import PartlyShardedWarning, UnshardedWarning, attention, context_parallel
from cptransform.passes import get_all_passes

#: The decorator runs every built-in pass, in the registry's order.
PASSES = list(get_all_passes())


def one_layer(q):
    return jnp.sum(attention(q, q, q, causal=True))


def _operand():
    return jnp.asarray(np.random.default_rng(0).normal(size=(1, 32, 2, 8)), jnp.float32)


def _ring():
    return context_parallel(one_layer, cp=4, schedule="ring", load_balance="none")


def test_logger_and_pass_timings(caplog):
    assert any(isinstance(h, logging.NullHandler)
               for h in logging.getLogger("cptransform").handlers)
    fn = _ring()
    assert fn.last_transform_stats is None
    with caplog.at_level(logging.DEBUG, logger="cptransform"):
        fn.module(_operand())

    stats = fn.last_transform_stats
    assert [p.name for p in stats.passes] == PASSES
    assert all(p.seconds >= 0 for p in stats.passes) and stats.total_s >= stats.trace_s
    lowered = stats.passes[-1]
    assert lowered.changed and lowered.equations_after > lowered.equations_before

    info = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    for i, name in enumerate(PASSES):
        assert any(re.match(rf"pass {i + 1}/{len(PASSES)} {re.escape(name)}(\{{.*\}})?: running$", m)
                   for m in info), name
        assert any(re.match(rf"pass {name}: [\d.]+ ms, (un)?changed, \d+ -> \d+ equations$", m)
                   for m in info), name
    assert any("attention #0" in m and "ring (requested)" in m for m in info)
    assert any(m.startswith("one_layer: transformed in") for m in info)
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG
             and r.name.startswith("cptransform")]
    assert any(m.startswith("IR after lower-context-parallel:\n") and "shard_map" in m
               for m in debug)


def _scope_names(text: str) -> set[str]:
    return set(re.findall(r"cptransform/[A-Za-z0-9#_/]+", text))


def test_profile_names_in_the_lowered_program():
    names = _scope_names(_ring().lower(_operand()).as_text(debug_info=True))
    for scope in ("cptransform/attention#0/ring/", "cptransform/ring/step/",
                  "cptransform/ring/step/cptransform/kernel/xla/forward/"):
        assert any(n.startswith(scope) for n in names), scope
    assert "cptransform/ring/step/ppermute" in names


@pytest.mark.slow
def test_profile_names_of_the_backward():
    text = jax.jit(jax.grad(_ring())).lower(_operand()).as_text(debug_info=True)
    assert any(n.startswith("cptransform/ring/step/cptransform/kernel/xla/backward/")
               for n in _scope_names(text))


def _beside_a_sharded_attention(kind: str):
    """A causal attention (sharded), then a second one over the same tokens (``kind``:
    with its probabilities multiplied by a mask given as data, which the matcher leaves
    whole, or differential
    attention: two softmaxes subtracted, two attentions once the value product is
    distributed), and a softmax over the vocabulary (no attention)."""
    s = 32
    causal = jnp.tril(jnp.ones((s, s), bool))

    def probs(a, b):
        return jax.nn.softmax(jnp.where(causal, jnp.einsum("bqhd,bkhd->bhqk", a, b), -1e9))

    def loss(q, w, key):
        o = jax.nn.dot_product_attention(q, q, q, is_causal=True)
        p = probs(o, q)
        if kind == "given_mask":
            p = p * (jnp.sin(w[0, :1] * jnp.arange(s)) > 0) / 0.9
        else:
            p = p - 0.3 * probs(q, o)
        o = o + jnp.einsum("bhqk,bkhd->bqhd", p, q)
        return jnp.mean(jax.nn.log_softmax(o @ w, axis=-1))

    return loss


@pytest.mark.parametrize("kind", ["given_mask", "differential"])
def test_an_attention_left_whole_beside_sharded_ones_is_logged(kind):
    """No attention runs unsharded silently: beside a sharded one, the attention the
    matcher leaves whole (a mask given as data) is warned about (``PartlyShardedWarning``,
    at the user's line) and listed by ``explain``; differential attention is sharded, so
    nothing is warned; the vocabulary's softmax, which is no attention, is not either; the
    numbers are one device's."""
    loss = _beside_a_sharded_attention(kind)
    q = jax.random.normal(jax.random.key(4), (2, 32, 2, 8))
    w = jax.random.normal(jax.random.key(5), (8, 11))
    key = jax.random.key(6)
    f = context_parallel(loss, cp=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UnshardedWarning)
        got = jax.value_and_grad(f, argnums=(0, 1))(q, w, key)
    warned = [str(w.message) for w in caught if w.category is PartlyShardedWarning]
    assert [w.category for w in caught if issubclass(w.category, UnshardedWarning)] == \
        [PartlyShardedWarning] * len(warned)
    assert len(warned) == (1 if kind == "given_mask" else 0), warned
    assert all("1 attention(s) run unsharded" in m and "test_observability.py" in m
               for m in warned), warned
    listed = [line for line in f.explain(q, w, key).splitlines()
              if "unsharded attention" in line]
    assert len(listed) == len(warned), listed
    want = jax.value_and_grad(loss, argnums=(0, 1))(q, w, key)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6), got, want)
