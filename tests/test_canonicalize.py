"""The ``canonicalize`` pass: round trips, inlining, scale folding, no-op removal."""
import functools
import importlib.util
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from cptransform import trace
from cptransform.ir.module import iter_eqns
from cptransform.ir.pipeline import Pipeline, PipelineError, make_pass
from cptransform.passes import get_all_passes

PASSES = get_all_passes()

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load_llama():
    spec = importlib.util.spec_from_file_location("llama_example", EXAMPLES / "llama.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while defining
    spec.loader.exec_module(module)
    return module


def canonicalize(fn, *args, options=""):
    module = trace(fn, *args)
    result = Pipeline.parse("canonicalize" + options, available=PASSES).run(module)
    return module, result


def prims(module):
    return [e.primitive.name for e in iter_eqns(module.jaxpr)]


def rand(shape, seed=0):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


@pytest.mark.slow
def test_llama_round_trip_values_and_grads():
    llama = load_llama()
    cfg = llama.Config(dim=32, layers=2, mlp_dim=64)
    fn = functools.partial(llama.loss, cfg=cfg)
    params, tokens = llama.example_args(cfg, seq=32)
    module, result = canonicalize(fn, params, tokens)
    assert result.changed
    assert "jit" not in prims(result.module) and "pjit" not in prims(result.module)
    assert "scan" in prims(result.module)
    back = result.module.as_function()
    p, t = llama.example_args(cfg, seq=32, seed=1)
    got, got_grad = jax.jit(jax.value_and_grad(back))(p, t)
    want, want_grad = jax.jit(jax.value_and_grad(fn))(p, t)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for g, w in zip(jax.tree.leaves(got_grad), jax.tree.leaves(want_grad)):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)


def test_scale_chain_folds_into_one_multiply():
    def f(x):
        y = (x * 2.0) / jnp.sqrt(64.0)
        return jnp.float32(0.5) * (y / math.sqrt(128.0))

    x = rand((4, 8))
    _, result = canonicalize(f, x)
    eqns = result.module.eqns
    assert [e.primitive.name for e in eqns] == ["mul"]
    factor = float(eqns[0].invars[1].val)
    assert factor == np.float32(2.0 * 0.5 / 8.0 / np.float32(math.sqrt(128.0)))
    # one non-power-of-two divisor: within 1 ulp of the original
    np.testing.assert_array_max_ulp(result.module(x), f(x), maxulp=1)


def test_exact_mode_keeps_inexact_division():
    f = lambda x: (x / 3.0) * 4.0  # noqa: E731
    _, exact = canonicalize(f, rand((8,)), options="{fold_scales=exact}")
    assert prims(exact.module) == ["div", "mul"]
    _, ulp = canonicalize(f, rand((8,)))
    assert prims(ulp.module) == ["mul"]
    x = rand((64,), seed=3)
    np.testing.assert_array_max_ulp(ulp.module(x), f(x), maxulp=1)


def test_exact_mode_folds_powers_of_two_bit_exactly():
    f = lambda x: ((x * 3.0) / 4.0) * 0.5  # noqa: E731
    x = rand((64,), seed=4)
    _, result = canonicalize(f, x, options="{fold_scales=exact}")
    assert prims(result.module) == ["mul"]
    np.testing.assert_array_equal(result.module(x), f(x))


def test_two_inexact_constants_are_not_folded():
    f = lambda x: (x * 3.0) * 5.0  # noqa: E731
    _, result = canonicalize(f, rand((8,)))
    assert prims(result.module) == ["mul", "mul"]


def test_fold_off_and_integers_untouched():
    _, off = canonicalize(lambda x: (x * 2.0) / 4.0, rand((8,)), options="{fold_scales=off}")
    assert prims(off.module) == ["mul", "div"]
    _, ints = canonicalize(lambda i: (i * 2) // 4, jnp.arange(8))
    assert "mul" in prims(ints.module)


def test_noops_are_dropped():
    def f(x, i):
        y = x.astype(jnp.float32).reshape(x.shape) + 0.0
        y = jnp.transpose(y, (0, 1)) * 1.0 - 0.0
        y = lax.squeeze(y, ()) / 1.0
        y = jnp.broadcast_to(y, y.shape)
        return jnp.copy(y.T.T), i * 1

    x, i = rand((4, 8)), jnp.arange(8)
    module, result = canonicalize(f, x, i)
    assert result.module.eqns == [], str(result.module)
    out = result.module(x, i)
    np.testing.assert_array_equal(out[0], x)
    np.testing.assert_array_equal(out[1], i)


def test_weak_type_change_is_not_a_noop():
    f = lambda x: lax.convert_element_type(x, jnp.float32) * 2  # noqa: E731
    module = trace(lambda: f(jnp.float32(1.5) * 1.0 + 0))
    assert module.out_avals == Pipeline.parse("canonicalize", available=PASSES).run(module).module.out_avals


def test_unchanged_is_honest():
    x = rand((4, 8))
    _, once = canonicalize(lambda x: jnp.tanh(x @ x.T), x)
    assert not once.changed
    twice = Pipeline.parse("canonicalize", available=PASSES).run(
        Pipeline.parse("canonicalize", available=PASSES).run(trace(lambda x: jax.jit(jnp.sin)(x) * 1.0, x)).module)
    assert not twice.changed


@pytest.mark.slow
def test_structured_control_flow_kept_and_canonicalized_inside():
    def f(x, w):
        @jax.checkpoint
        def layer(h, wi):
            return jnp.tanh(jax.jit(lambda a: a / 2.0)(h) @ wi) * 1.0, None

        h, _ = lax.scan(layer, x, w)
        h = lax.cond(h.sum() > 0, lambda a: jax.jit(jnp.cos)(a) + 0.0, lambda a: a * 4.0, h)
        return jax.nn.relu(h).sum()

    x, w = rand((4, 8)), rand((3, 8, 8), seed=1) * 0.3
    module, result = canonicalize(f, x, w)
    names = prims(result.module)
    for kept in ("scan", "remat2", "cond", "custom_jvp_call"):
        assert kept in names
    assert "jit" not in names and "div" not in names
    np.testing.assert_allclose(result.module(x, w), f(x, w), rtol=1e-6)
    g = jax.grad(result.module.as_function(), argnums=(0, 1))(x, w)
    want = jax.grad(f, argnums=(0, 1))(x, w)
    for a, b in zip(g, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_cond_on_a_constant_is_its_branch():
    """A ``cond`` whose index is known while tracing (gemma's ``lax.cond`` on static
    lengths) is the branch it takes, canonicalized."""
    x = rand((4, 8))
    for taken, want in ((True, jnp.cos(x) / 2.0), (False, jnp.sin(x))):
        def f(a, taken=taken):
            return lax.cond(taken, lambda b: jax.jit(jnp.cos)(b) / 2.0, jnp.sin, a)

        _, result = canonicalize(f, x)
        names = set(prims(result.module))
        assert not names & {"cond", "jit", "div"}, names
        np.testing.assert_allclose(result.module(x), want, rtol=1e-6)


def test_while_body_canonicalized_inside():
    def f(x, n):
        return lax.fori_loop(0, n, lambda i, a: jax.jit(jnp.sin)(a) / 4.0, x)

    x = rand((4, 8))
    _, result = canonicalize(f, x, 3)
    names = prims(result.module)
    assert "while" in names and "jit" not in names and "div" not in names
    np.testing.assert_allclose(result.module(x, 3), f(x, 3), rtol=1e-6)


def test_inlining_can_be_turned_off_and_verify_checks_it():
    f = lambda x: jax.jit(lambda a: a * 1.0)(x) + 1.0  # noqa: E731
    x = rand((8,))
    _, kept = canonicalize(f, x, options="{inline_jit=false}")
    assert prims(kept.module) == ["jit", "add"]  # the body's no-op multiply is gone
    make_pass("canonicalize", {"inline_jit": "false"}, available=PASSES).verify(kept.module)
    with pytest.raises(AssertionError, match="jit"):
        make_pass("canonicalize", available=PASSES).verify(kept.module)


def test_bad_fold_mode_is_a_pipeline_error():
    with pytest.raises(PipelineError, match="fold_scales must be one of off, exact, ulp"):
        Pipeline.parse("canonicalize{fold_scales=maybe}", available=PASSES)
