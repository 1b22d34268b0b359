"""The re-tracing ``Rewriter``: equation rules, inlining, sub-jaxprs and replacements."""
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from cptransform import Graph, trace
from cptransform.analysis.primitives import INLINABLE
from cptransform.ir.module import iter_eqns
from cptransform.ir.rewrite import Replacement, Rewriter


def rand(shape, seed=0):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def prims(jaxpr):
    return [e.primitive.name for e in iter_eqns(jaxpr)]


def sin_to_cos(eqn, invals):
    return [jnp.cos(invals[0])]


def test_rule_table_replaces_and_none_keeps():
    f = lambda x: jnp.sin(x) + jnp.exp(x)  # noqa: E731
    x = rand((8,))
    module = trace(f, x)
    new = Rewriter(rules={"sin": sin_to_cos, "exp": lambda eqn, invals: None}).run(module.jaxpr)
    assert prims(new) == ["cos", "exp", "add"]
    np.testing.assert_allclose(module.with_jaxpr(new)(x), jnp.cos(x) + jnp.exp(x), rtol=1e-6)


def test_inline_predicate_controls_jit():
    f = lambda x: jax.jit(jnp.sin)(x) * 2.0  # noqa: E731
    x = rand((8,))
    jaxpr = trace(f, x).jaxpr
    inlined = Rewriter(inline=lambda eqn: eqn.primitive.name in ("jit", "pjit"),
                       inlinable=INLINABLE).run(jaxpr)
    assert prims(inlined) == ["sin", "mul"]
    inside = Rewriter(rules={"sin": sin_to_cos}).run(jaxpr)
    names = prims(inside)
    assert names[0] in ("jit", "pjit") and "cos" in names and "sin" not in names


def test_rules_reach_remat_scan_cond_while_bodies():
    def program(act):
        def f(x, w):
            body = jax.checkpoint(lambda h, wi: (act(h @ wi), None))
            h, _ = lax.scan(body, x, w)
            h = lax.cond(h.sum() > 0, act, jnp.tanh, h)
            return lax.while_loop(lambda c: c[0] < 2, lambda c: (c[0] + 1, act(c[1])),
                                  (0, h))[1]
        return f

    x, w = rand((4, 8)), rand((3, 8, 8), seed=1) * 0.3
    module = trace(program(jnp.sin), x, w)
    new = Rewriter(rules={"sin": sin_to_cos}).run(module.jaxpr)
    names = prims(new)
    assert "sin" not in names and names.count("cos") == 3
    for kept in ("scan", "remat2", "cond", "while"):
        assert kept in names
    np.testing.assert_allclose(module.with_jaxpr(new)(x, w), program(jnp.cos)(x, w),
                               rtol=1e-6)


def test_replacement_removes_dead_producers():
    f = lambda x, y: jnp.tanh(jnp.sin(x) * 3.0) + y  # noqa: E731
    x, y = rand((8,)), rand((8,), seed=1)
    module = trace(f, x, y)

    def plan(jaxpr):
        graph = Graph(jaxpr)
        root = next(e for e in graph.eqns if e.primitive.name == "tanh")
        start = graph.ancestors(root)[0]  # the sin equation
        assert start.primitive.name == "sin"
        return [Replacement(root=root, inputs=(start.invars[0],),
                            build=lambda a: [jnp.cos(a)])]

    new = Rewriter(plan=plan).run(module.jaxpr)
    assert prims(new) == ["cos", "add"]
    np.testing.assert_allclose(module.with_jaxpr(new)(x, y), jnp.cos(x) + y, rtol=1e-6)


def test_replacement_inside_scan_body():
    def f(x, w):
        return lax.scan(lambda h, wi: (jnp.exp(h) @ wi, None), x, w)[0]

    x, w = rand((2, 4)), rand((3, 4, 4), seed=1) * 0.3
    module = trace(f, x, w)

    def plan(jaxpr):
        return [Replacement(root=e, inputs=tuple(e.invars), build=lambda a: [jnp.sin(a)])
                for e in jaxpr.eqns if e.primitive.name == "exp"]

    new = Rewriter(plan=plan).run(module.jaxpr)
    assert "exp" not in prims(new) and "sin" in prims(new)
    want = lax.scan(lambda h, wi: (jnp.sin(h) @ wi, None), x, w)[0]
    np.testing.assert_allclose(module.with_jaxpr(new)(x, w), want, rtol=1e-6)


def test_untouched_program_keeps_shape_and_values():
    f = lambda x: lax.scan(lambda c, _: (c * 2.0, None), x, None, length=3)[0]  # noqa: E731
    x = rand((4,))
    module = trace(f, x)
    new = Rewriter(rules={"sin": sin_to_cos}).run(module.jaxpr)
    assert prims(new) == prims(module.jaxpr)
    np.testing.assert_array_equal(module.with_jaxpr(new)(x), f(x))
