"""Custom derivative rules are part of the program: under zigzag/striped they run as
written (in natural order; in layout order when the function and its rule are both
elementwise, as a straight-through rounding's are), never replaced by autodiff. Loss and
every gradient equal the undecorated function."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cptransform import context_parallel
from cptransform.ir.errors import ReorderError

RTOL = 1e-5


@jax.custom_vjp
def clip_gradient(x):
    return x


clip_gradient.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -1e-3, 1e-3),))


@jax.custom_jvp
def straight_through_round(x):
    return jnp.round(x * 4) / 4


straight_through_round.defjvp(lambda primals, tangents: (straight_through_round(primals[0]),
                                                          tangents[0]))


@jax.custom_vjp
def order_weighted(x):
    """Identity forward; the backward weighs each token's cotangent by a running sum over the
    sequence (dim 1), so it depends on the token order."""
    return x


order_weighted.defvjp(lambda x: (x, None), lambda _, g: (jnp.cumsum(g, axis=1),))


def model(wrap, w, x):
    q, k, v = (jnp.einsum("bsd,dhe->bshe", x, w[i]) for i in range(3))
    o = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    o = wrap(o)
    return jnp.sum(jnp.sin(o) * o)


@pytest.mark.slow
@pytest.mark.parametrize("wrap", [clip_gradient, straight_through_round, order_weighted],
                         ids=["clip", "straight-through", "order-dependent"])
@pytest.mark.parametrize("load_balance", ["zigzag", "striped"])
def test_custom_rule_kept(wrap, load_balance):
    kx, kw = jax.random.split(jax.random.PRNGKey(11))
    x = jax.random.normal(kx, (2, 32, 8))
    w = jax.random.normal(kw, (3, 8, 2, 4)) / 2
    fn = functools.partial(model, wrap)
    f = context_parallel(fn, cp=4, load_balance=load_balance)
    value, grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(w, x)
    ref_value, ref_grads = jax.jit(jax.value_and_grad(fn, argnums=(0, 1)))(w, x)
    np.testing.assert_allclose(value, ref_value, rtol=RTOL)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(g, r, rtol=RTOL, atol=RTOL * float(jnp.max(jnp.abs(r))))
    converted = "custom derivative rule" in f.explain(w, x)
    assert converted == (wrap is not straight_through_round)


def test_strict_refuses_the_natural_order_round_trip():
    x = jax.random.normal(jax.random.PRNGKey(1), (1, 32, 8))
    w = jax.random.normal(jax.random.PRNGKey(2), (3, 8, 2, 4))
    f = context_parallel(functools.partial(model, clip_gradient), cp=4,
                         load_balance="zigzag", strict=True)
    with pytest.raises(ReorderError, match="custom derivative rule.*strict=True"):
        f(w, x)
