"""The JAX-internal accessors of ``cptransform.ir.compat``, on whichever JAX runs the tests
(CI runs this file on 0.10.2, 0.11.2 and the newest release): each answers the same for the
same program, whatever the params are called on this version."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from cptransform.ir import compat
from cptransform.lowering.collectives import lower_and_count

from conftest import make_mesh


def _eqn(fn, *args, name):
    (eqn,) = [e for e in compat.open_jaxpr(jax.make_jaxpr(fn)(*args)).eqns
              if e.primitive.name == name]
    return eqn


def _random(*shape, seed=0):
    return jax.random.normal(jax.random.key(seed), shape)


def test_scan_counts_and_body_roles():
    """A scan with two closed-over constants, a carried tree and two scanned inputs: the
    body's inputs split into consts, carry and xs; ys pair with the scanned outputs."""
    w, b = _random(3, seed=1), _random(3, seed=2)

    def fn(c0, xs, zs):
        def body(c, x):
            z = x[1]
            return ({"a": c["a"] * w + x[0], "b": c["b"] + z * b}, (x[0] * 2, z.sum()))
        return lax.scan(body, {"a": c0, "b": c0 + 1}, (xs, zs))

    eqn = _eqn(fn, _random(3), _random(4, 3, seed=3), _random(4, 3, seed=4), name="scan")
    nc, nk = compat.scan_counts(eqn)
    assert nk == 2 and nc + nk + 2 == len(eqn.invars)
    (body,) = compat.bodies(eqn)
    assert len(body.carry_in) == len(body.carry_out) == len(body.carry_init) == 2
    assert [a is None for a in body.inputs] == [False] * nc + [True] * 4
    assert [o.aval.shape for o, _ in body.scanned_in] == [(4, 3), (4, 3)]
    assert [(o.aval.shape, i.aval.shape) for o, i in body.scanned_out] == \
        [((4, 3), (3,)), ((4,), ())]
    assert [o for o, _ in body.outputs] == list(eqn.outvars[:2])
    assert all(i.aval.shape == (3,) for _, i in body.scanned_in)


def test_while_counts_and_bodies():
    limit, step = jnp.float32(5.0), jnp.float32(1.5)

    def fn(x):
        return lax.while_loop(lambda c: c[0] < limit, lambda c: (c[0] + step, c[1] * 2),
                              (jnp.float32(0), x))

    eqn = _eqn(fn, _random(3), name="while")
    cn, bn = compat.while_counts(eqn)
    assert (cn, bn) == (1, 1)
    cond, body = compat.bodies(eqn)
    assert len(cond.carry_in) == 2 and cond.carry_out == ()
    assert len(body.carry_in) == len(body.carry_out) == 2
    assert cond.inputs[0] is eqn.invars[0] and body.inputs[0] is eqn.invars[1]
    assert [o for o, _ in body.outputs] == list(eqn.outvars)


def test_cond_branches_and_call_bodies():
    def fn(p, x):
        return lax.cond(p, lambda y: y + 1, lambda y: jnp.sin(y), x)

    eqn = _eqn(fn, True, _random(3), name="cond")
    assert len(compat.cond_branches(eqn)) == 2
    assert [b.inputs for b in compat.bodies(eqn)] == [tuple(eqn.invars[1:])] * 2

    call = compat.open_jaxpr(jax.make_jaxpr(lambda x: jax.jit(jnp.cos)(x) * 2)(_random(3)))
    (jit,) = [e for e in call.eqns if compat.bodies(e)]
    (body,) = compat.bodies(jit)
    assert body.inputs == tuple(jit.invars) and body.carry_in == ()
    assert compat.open_jaxpr(compat.call_body(jit)) is body.jaxpr

    @jax.custom_vjp
    def clipped(x):
        return jnp.clip(x, -1, 1)

    clipped.defvjp(lambda x: (clipped(x), None), lambda _, g: (g,))
    custom = compat.open_jaxpr(jax.make_jaxpr(clipped)(_random(3)))
    (eqn,) = custom.eqns
    body = compat.open_jaxpr(compat.call_body(eqn))
    assert [v.aval.shape for v in body.invars + body.outvars] == [(3,), (3,)]
    assert compat.call_body(custom.eqns[0]) is not None and compat.call_body(
        compat.open_jaxpr(jax.make_jaxpr(jnp.sin)(_random(3))).eqns[0]) is None


def test_ppermute_numbers_ranks_in_the_axes_order_given():
    """Ranks over ("r", "u") on a ("u", "r") mesh are numbered as ``axis_index(("r", "u"))``
    numbers them: the permute is the same program whichever way JAX orders its axes."""
    mesh = make_mesh((2, 4), ("u", "r"))
    x = _random(8, 2)
    shift = [(j, (j + 1) % 8) for j in range(8)]

    def local(shard):
        rank = lax.axis_index(("r", "u"))
        moved = compat.ppermute(shard + 0 * rank, ("r", "u"), shift)
        return jnp.concatenate([moved, jnp.broadcast_to(rank, moved.shape[:1])[:, None]
                                .astype(moved.dtype)], axis=1)

    out = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P(("r", "u")),
                                out_specs=P(("r", "u"))))(x)
    np.testing.assert_array_equal(out[:, :2], jnp.roll(x, 1, axis=0))
    np.testing.assert_array_equal(out[:, 2], jnp.arange(8))


def test_collective_groups_read_on_this_jax():
    """Replica groups are dense device ids on JAX 0.10 and mesh axes on 0.12: both read as
    the same device groups."""
    mesh = make_mesh((2, 4), ("u", "r"))

    def local(x):
        a = lax.all_to_all(x, "u", 0, 0, tiled=True)
        g = lax.all_gather(x, ("r", "u"), tiled=True)
        return a + g[:x.shape[0]]

    report = lower_and_count(jax.shard_map(local, mesh=mesh, in_specs=P(("u", "r")),
                                           out_specs=P(("u", "r"))), _random(16, 4))
    by_kind = {c.kind: c for c in report.collectives}
    assert by_kind["all_to_all"].groups == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert by_kind["all_gather"].groups == ((0, 4, 1, 5, 2, 6, 3, 7),)


@pytest.mark.parametrize("version, ok", [("0.10.2", True), ("0.11.2", True),
                                         ("0.12.0.1", True), ("0.10.1", False),
                                         ("0.13.0", False), ("0.9.2", False)])
def test_unsupported_jax_is_refused_with_the_range(version, ok, monkeypatch):
    monkeypatch.delenv(compat.ALLOW_UNTESTED_JAX, raising=False)
    if ok:
        compat.check_jax_version(version)
        return
    with pytest.raises(compat.UnsupportedJaxError, match=r"JAX >= 0\.10\.2, < 0\.13.*pip"):
        compat.check_jax_version(version)
    monkeypatch.setenv(compat.ALLOW_UNTESTED_JAX, "1")
    with pytest.warns(UserWarning, match=version.replace(".", r"\.")):
        compat.check_jax_version(version)


def test_this_jax_is_supported():
    compat.check_jax_version(jax.__version__)


#: Array functions models call, whose primitives differ between JAX versions (0.12 traces
#: ``jnp.stack`` to its own ``stack`` and its gradient to ``unstack``; ``jnp.log2`` and the
#: tanh derivative got primitives of their own).
MODEL_OPS = {
    "stack": lambda x: jnp.stack([x, -x], axis=-1).reshape(x.shape[0], -1),
    "unstack": lambda x: sum(jnp.unstack(x, axis=0)),
    "log2": lambda x: jnp.log2(jnp.abs(x) + 1),
    "tanh_grad": jax.grad(lambda x: jnp.tanh(x).sum()),
    "split": lambda x: jnp.split(x, 2, axis=-1)[0],
    "roll": lambda x: jnp.roll(x, 1, axis=0),
    "softmax_grad": jax.grad(lambda x: jax.nn.softmax(x).max()),
}


@pytest.mark.parametrize("name", sorted(MODEL_OPS))
def test_primitives_models_use_have_a_row_on_this_jax(name):
    """Every primitive those functions and their gradients trace to on this JAX has a row in
    the primitives table: a missing row is handled positionally (correct, but a conversion
    of the whole sequence on every call), which is how 0.12's ``stack`` cost keras-hub's
    RoPE two un-permutes per layer."""
    from cptransform.analysis.primitives import facts
    from cptransform.ir.module import iter_eqns
    fn = MODEL_OPS[name]
    x = _random(4, 6)
    jaxpr = jax.make_jaxpr(lambda x: jax.vjp(fn, x)[1](fn(x)))(x)
    missing = sorted({e.primitive.name for e in iter_eqns(jaxpr)
                      if facts(e.primitive.name) is None})
    assert not missing, f"no row for {missing} on JAX {jax.__version__}"


def test_canonical_params_are_python_at_every_depth():
    """NumPy integers in params (JAX 0.12.1 writes ``axes=(np.int64(1),)``) become Python
    ints in the top jaxpr and in bodies; a jaxpr with nothing to change is returned as it
    is; the program computes the same."""
    def fn(x):
        def body(c, row):
            return c + row.sum(), jnp.max(row, axis=0)
        c, ys = lax.scan(body, 0.0, x)
        return c + jnp.sum(x, axis=1).sum(), ys

    closed = jax.make_jaxpr(fn)(_random(4, 3))
    jaxpr = compat.open_jaxpr(closed)
    reduce_sum = next(e for e in jaxpr.eqns if e.primitive.name == "reduce_sum"
                      and tuple(e.params["axes"]) == (1,))
    (scan,) = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
    body = compat.open_jaxpr(scan.params["jaxpr"])
    (inner_max,) = [e for e in body.eqns if e.primitive.name == "reduce_max"]
    # Spell them as 0.12.1 does, whatever this JAX traced.
    inner = body.replace(eqns=[e.replace(params={**e.params, "axes": (np.int64(0),)})
                               if e is inner_max else e for e in body.eqns])
    inner_closed = compat.close_jaxpr(inner, compat.consts_of(scan.params["jaxpr"]))
    spelled = jaxpr.replace(eqns=[
        e.replace(params={**e.params, "axes": (np.int64(1),)}) if e is reduce_sum else
        e.replace(params={**e.params, "jaxpr": inner_closed}) if e is scan else e
        for e in jaxpr.eqns])
    spelled = compat.close_jaxpr(spelled, compat.consts_of(closed))
    canonical = compat.canonical_params(spelled)
    new = compat.open_jaxpr(canonical)
    new_sum = new.eqns[jaxpr.eqns.index(reduce_sum)]
    (new_scan,) = [e for e in new.eqns if e.primitive.name == "scan"]
    (new_max,) = [e for e in compat.open_jaxpr(new_scan.params["jaxpr"]).eqns
                  if e.primitive.name == "reduce_max"]
    assert new_sum.params["axes"] == (1,) and type(new_sum.params["axes"][0]) is int
    assert new_max.params["axes"] == (0,) and type(new_max.params["axes"][0]) is int
    assert compat.canonical_params(canonical) is canonical
    np.testing.assert_allclose(compat.eval_jaxpr(canonical, np.ones((4, 3), np.float32))[0],
                               fn(jnp.ones((4, 3)))[0])


def test_stable_params_read_a_scans_structure_and_drop_added_defaults():
    """What the canonical text prints: a scan's consts and carry counts under one name on
    every release; ``top_k``'s ``is_stable=True`` (0.10.2's top-k is stable) absent."""
    w = _random(3, seed=1)
    scan = _eqn(lambda c, xs: lax.scan(lambda a, x: (a * w + x, a), c, xs), _random(3),
                _random(4, 3), name="scan")
    params = compat.stable_params(scan)
    assert (params["num_consts"], params["num_carry"]) == compat.scan_counts(scan) == (1, 1)
    assert not {"ft_in", "ft_out", "linear"} & set(params)
    top_k = _eqn(lambda x: lax.top_k(x, 2), _random(5), name="top_k")
    assert "is_stable" not in compat.stable_params(top_k)
    assert compat.stable_params(top_k)["k"] == 2
