"""The read-only use-def ``Graph`` view, including sub-jaxprs."""
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from cptransform import Graph, trace


def names(eqns):
    return [e.primitive.name for e in eqns]


def test_producer_users_and_order():
    f = lambda x, y: (jnp.sin(x) * y, jnp.sin(x) + 1.0)  # noqa: E731
    module = trace(f, jnp.ones(4), jnp.ones(4))
    g = Graph(module.jaxpr)
    assert names(g.eqns) == ["sin", "mul", "sin", "add"]
    x, y = g.invars
    assert g.producer(x) is None and g.is_input(x)
    assert names(g.users(x)) == ["sin", "sin"]
    mul = g.eqns[1]
    assert g.producer(mul.invars[0]) is g.eqns[0]
    assert names(g.users(y)) == ["mul"]
    assert g.is_output(mul.outvars[0]) and not g.is_output(g.eqns[0].outvars[0])
    assert [g.index(e) for e in g.eqns] == [0, 1, 2, 3]
    assert names(g.ancestors(mul)) == ["sin"]
    assert names(g.descendants(g.eqns[2])) == ["add"]
    literal = g.eqns[3].invars[1]
    assert g.producer(literal) is None and g.const_value(literal) == 1.0


def test_constants_are_readable():
    table = np.arange(6.0, dtype=np.float32).reshape(2, 3)
    module = trace(lambda x: x + jnp.asarray(table), jnp.ones((2, 3)))
    g = Graph(module.jaxpr)
    (const,) = g.constvars
    assert g.is_const(const) and not g.is_input(const)
    np.testing.assert_array_equal(g.const_value(const), table)


def test_subgraphs_of_jit_scan_cond():
    def f(x, w):
        x = jax.jit(jnp.tanh)(x)
        x, _ = lax.scan(lambda h, wi: (jnp.sin(h @ wi), None), x, w)
        return lax.cond(x.sum() > 0, jnp.exp, jnp.cos, x)

    module = trace(f, jnp.ones((2, 4)), jnp.ones((3, 4, 4)))
    g = Graph(module.jaxpr)
    by_name = {e.primitive.name: e for e in g.eqns}
    jit_eqn = by_name.get("jit", by_name.get("pjit"))
    (body,) = g.subgraphs(jit_eqn)
    assert names(body.eqns) == ["tanh"] and body.parent == (g, jit_eqn)
    (scan_body,) = g.subgraphs(by_name["scan"])
    assert names(scan_body.eqns) == ["dot_general", "sin"]
    branches = g.subgraphs(by_name["cond"])
    assert sorted(n for b in branches for n in names(b.eqns)) == ["cos", "exp"]
    walked = [n for sub in g.walk() for n in names(sub.eqns)]
    for inner in ("tanh", "sin", "exp", "cos"):
        assert inner in walked
    assert len(g) == len(g.eqns)
