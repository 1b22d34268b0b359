"""The pieces of recurrence sharding without a mesh: which scans are affine and the shape of
their linear part, associative scans proved from their traced form, a chunked scan's axis
followed back to the sequence, and a chunk's summary (its composed map) against the map
applied step by step."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from cptransform import trace
from cptransform.analysis.affine_carry import affine_carries
from cptransform.analysis.recurrence_axes import along_sequence
from cptransform.analysis.seq_axes import infer_seq_axes
from cptransform.ir import compat
from cptransform.ir.module import iter_eqns
from cptransform.lowering.recurrence import _apply, _summary
from cptransform.op.recurrence import CarryMap, Kind, recurrence_p
from cptransform.passes.canonicalize import Canonicalize
from cptransform.passes.match_recurrences import MatchRecurrences

B, T, H, d = 2, 8, 2, 4


def scan_of(step, init, xs):
    """The scan equation of ``lax.scan(step, init, xs)`` traced."""
    jaxpr = jax.make_jaxpr(lambda i, x: lax.scan(step, i, x))(init, xs)
    return next(e for e in iter_eqns(jaxpr) if e.primitive.name == "scan")


def structure(step, init, xs):
    eqn = scan_of(step, init, xs)
    return affine_carries(eqn.params["jaxpr"], *compat.scan_counts(eqn))


def delta_step(state, t):
    k, v, beta = t
    error = jnp.einsum("bhk,bhkv->bhv", k, state) - v
    state = state - jnp.einsum("bhk,bhv->bhkv", beta[..., None] * k, error)
    return state, jnp.tanh(state).sum(-1)


def delta_inputs(key=0):
    keys = jax.random.split(jax.random.key(key), 4)
    k = jax.random.normal(keys[0], (T, B, H, d)) / 3
    return (jax.random.normal(keys[3], (B, H, d, d)),
            (k, jax.random.normal(keys[1], (T, B, H, d)), jax.random.uniform(keys[2], (T, B, H))))


def test_affine_structure_of_carries():
    x = jnp.ones((T, B, d))
    gate = jnp.ones((d,))
    diagonal = structure(lambda h, xt: (xt * h + xt, jnp.tanh(h)), jnp.zeros((B, d)), x)
    assert diagonal == ((CarryMap(True, (), ()),), "")
    # A gate broadcast over the batch is one map for every batch entry: a free dim.
    broadcast = structure(lambda h, xt: (jax.nn.sigmoid(gate) * h + xt, h), jnp.zeros((B, d)), x)
    assert broadcast == ((CarryMap(True, (), (0,)),), "")
    # DeltaNet: the key dim is mixed, the value dim one map for all, batch and heads vary.
    assert structure(delta_step, *delta_inputs()) == ((CarryMap(True, (2,), (3,)),), "")
    # A carry that does not read itself, and two independent leaves.
    two = structure(lambda h, xt: ((h[0] * xt, xt), h[0]), (jnp.zeros((B, d)),) * 2, x)
    assert two == ((CarryMap(True, (), ()), CarryMap(False)), "")


@pytest.mark.parametrize("step,why", [
    (lambda h, xt: (jnp.tanh(h + xt), h), "not linear (tanh"),
    (lambda h, xt: (h * h + xt, h), "multiplies itself"),
    (lambda h, xt: (xt / h, h), "the carry divides"),
])
def test_carries_that_are_not_affine(step, why):
    maps, reason = structure(step, jnp.zeros((B, d)), jnp.ones((T, B, d)))
    assert maps is None and why in reason, reason


def test_coupled_leaves_and_integer_carries_are_not_affine():
    x = jnp.ones((T, B, d))
    _, coupled = structure(lambda h, xt: ((h[1], h[0] + xt), h[0]), (jnp.zeros((B, d)),) * 2, x)
    assert "computed from carry" in coupled
    _, counter = structure(lambda h, xt: ((h[0] + 1, h[1] * xt), h[1]),
                           (jnp.int32(0), jnp.zeros((B, d))), x)
    assert "int32" in counter


def _wrapped(fn, *args):
    module = Canonicalize().run(trace(fn, *args)).module
    module = MatchRecurrences().run(module).module
    return module, [e.params["recurrence"] for e in iter_eqns(module.jaxpr)
                    if e.primitive is recurrence_p]


def _pair(left, right):
    return left[0] * right[0], right[0] * left[1] + right[1]


@pytest.mark.parametrize("reverse", [False, True])
def test_associative_scan_is_proved_and_runs_at_any_length(reverse):
    """The traced scan becomes one recurrence with the same numbers (bit for bit: the
    reconstruction binds the same equations); its combine, a broadcast constant included,
    runs at other lengths."""
    def fn(a, x):
        def combine(left, right):
            one = jnp.ones_like(right[0])
            return left[0] * right[0] * one, right[0] * left[1] + right[1]
        return lax.associative_scan(combine, (a, x), axis=1, reverse=reverse)[1]

    a, x = (jax.random.uniform(jax.random.key(i), (B, 12, d)) for i in range(2))
    module, found = _wrapped(fn, a, x)
    (rec,) = found
    assert rec.kind is Kind.PREFIX and rec.axis == 1 and rec.reverse == reverse
    np.testing.assert_array_equal(module(a, x), fn(a, x))
    short = [t[:, :5] for t in (a, x)]
    np.testing.assert_allclose(lax.associative_scan(rec.combine, tuple(short), axis=1)[1],
                               lax.associative_scan(_pair, tuple(short), axis=1)[1], rtol=1e-6)


def test_strided_slices_that_are_no_scan_stay():
    def fn(x):
        return x[:, 0:-1:2] * x[:, 1::2] + jnp.cumsum(x, axis=1)[:, ::2]

    x = jax.random.normal(jax.random.key(0), (B, 12, d))
    module, found = _wrapped(fn, x)
    assert [r.name for r in found] == ["cumsum"]
    np.testing.assert_allclose(module(x), fn(x), rtol=1e-6)


def test_chunked_scan_runs_along_the_sequence_by_chunks():
    """A scan across the chunks of ``x.reshape(B, S // 4, 4, D)`` moved to the front runs
    along the sequence, four tokens per step; a scan over the features does not."""
    def fn(x):
        chunks = jnp.moveaxis(x.reshape(B, 4, 4, d), 1, 0)
        _, ys = lax.scan(lambda h, c: (0.5 * h + c.sum(1), h), jnp.zeros((B, d)), chunks)
        _, zs = lax.scan(lambda h, c: (0.5 * h + c, h), jnp.zeros((B, 16)),
                         jnp.moveaxis(x, 2, 0))
        return jnp.moveaxis(ys, 0, 1).sum() + zs.sum()

    module, found = _wrapped(fn, jnp.ones((B, 16, d)))
    assert len(found) == 2
    jaxpr = module.jaxpr
    axes = infer_seq_axes(jaxpr, {0: (1,)})
    producers = {v: e for e in iter_eqns(jaxpr) for v in e.outvars}
    eqns = [e for e in iter_eqns(jaxpr) if e.primitive is recurrence_p]
    along = [along_sequence(axes, producers, e.invars[-1], 0) for e in eqns]
    assert along[0] is not None and along[0].chunk == 4 and along[1] is None


def test_summary_is_the_chunk_map():
    """The summary ``(A, b)`` of a chunk of DeltaNet steps, applied to a carry, is the
    chunk run from that carry (the key dim mixed, value columns packed)."""
    init, xs = delta_inputs()
    _, found = _wrapped(lambda h, x: lax.scan(delta_step, h, x), init, xs)
    (rec,) = found
    maps, offsets = _summary(rec, [], list(xs))
    (leaf,) = rec.carries
    got = _apply(init.shape, leaf, maps[0], init) + offsets[0]
    want, _ = lax.scan(delta_step, init, xs)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
