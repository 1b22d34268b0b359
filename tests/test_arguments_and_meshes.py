"""What the transform accepts around the program: static arguments, Explicit meshes,
``seq_axes`` overrides, and functions with no attention (issue: never a silent wrong
answer). Each compares with the undecorated function or expects one clear error."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cptransform import UnshardedWarning, context_parallel
from cptransform.ir.errors import ContextParallelError, SeqAxisError

RTOL = 1e-5


def attend(x, w, *, causal=True, scale=1.0):
    q, k, v = (jnp.einsum("bsd,dhe->bshe", x, w[i]) for i in range(3))
    return scale * jax.nn.dot_product_attention(q, k, v, is_causal=causal)


@pytest.fixture(scope="module")
def data():
    kx, kw = jax.random.split(jax.random.PRNGKey(7))
    return jax.random.normal(kx, (2, 32, 8)), jax.random.normal(kw, (3, 8, 2, 4)) / 3


def test_python_scalars_and_strings_are_static(data):
    x, w = data

    def fn(x, w, causal, mode, scale):
        o = attend(x, w, causal=causal, scale=scale)
        return jnp.sum(o ** 2) if mode == "l2" else jnp.sum(jnp.abs(o))

    f = context_parallel(fn, cp=4)
    for causal, mode, scale in ((True, "l2", 0.5), (False, "l1", 2.0)):
        want = jax.value_and_grad(fn)(x, w, causal, mode, scale)
        got = jax.value_and_grad(f)(x, w, causal, mode, scale)
        np.testing.assert_allclose(got[0], want[0], rtol=RTOL)
        np.testing.assert_allclose(got[1], want[1], rtol=RTOL, atol=RTOL * np.abs(want[1]).max())


def test_static_argnames_under_an_outer_jit(data):
    x, w = data

    def fn(x, w, *, causal):
        return jnp.sum(attend(x, w, causal=causal) ** 2)

    f = jax.jit(context_parallel(fn, cp=4, static_argnames="causal"),
                static_argnames="causal")
    np.testing.assert_allclose(f(x, w, causal=False), fn(x, w, causal=False), rtol=RTOL)
    np.testing.assert_allclose(f(x, w, causal=True), fn(x, w, causal=True), rtol=RTOL)


def test_an_unhashable_static_value_is_refused_by_name(data):
    x, w = data
    f = context_parallel(lambda x, w, sizes: jnp.sum(attend(x, w)) * len(sizes), cp=4)
    with pytest.raises(ValueError, match="argument 2 .list. holds no array.*hashable"):
        f(x, w, [1, 2])


def test_explicit_mesh_from_jax_make_mesh(data):
    x, w = data
    mesh = jax.make_mesh((4,), ("cp",), devices=jax.devices()[:4])

    def fn(x, w):
        return jnp.sum(attend(x, w) ** 2)

    got = jax.value_and_grad(context_parallel(fn, mesh=mesh))(x, w)
    want = jax.value_and_grad(fn)(x, w)
    np.testing.assert_allclose(got[0], want[0], rtol=RTOL)
    np.testing.assert_allclose(got[1], want[1], rtol=RTOL, atol=RTOL * np.abs(want[1]).max())


def test_seq_axes_pointing_at_a_dim_of_another_size_is_refused(data):
    x, w = data
    f = context_parallel(lambda w, x: jnp.sum(attend(x, w)), cp=4, seq_axes=(None, 2))
    with pytest.raises(SeqAxisError, match="dim 2 of args\\[1\\].*sequence lengths are \\[32\\]"):
        f(w, x)


def test_seq_axes_contradicting_dataflow_is_refused(data):
    x, w = data
    padded = jnp.zeros((2, 32, 32)).at[:, :, :8].set(x)   # dim 2 has the sequence's size

    def fn(w, x):
        return jnp.sum(attend(x[:, :, :8], w))

    f = context_parallel(fn, cp=4, seq_axes=(None, 2))
    with pytest.raises(SeqAxisError, match="dataflow to the attention proves dims \\[1\\]"):
        f(w, padded)


def test_no_attention_warns_with_the_refused_softmax(data):
    x, _ = data

    def gate(x):
        return jnp.sum(jax.nn.softmax(x, axis=-1) * x)

    f = context_parallel(gate, cp=4)
    with pytest.warns(UnshardedWarning, match="no attention found.*nothing is sharded"):
        np.testing.assert_allclose(f(x), gate(x), rtol=RTOL)
    with pytest.raises(ContextParallelError, match="no attention found"):
        context_parallel(gate, cp=4, strict=True)(x)


def test_an_empty_pytree_argument_is_traced_not_static(data):
    x, w = data

    def fn(params, x, extra):
        return jnp.sum(attend(x, params["w"]) ** 2) + len(extra)

    f = context_parallel(fn, cp=4)
    got = jax.value_and_grad(f)({"w": w}, x, {})
    want = jax.value_and_grad(fn)({"w": w}, x, {})
    np.testing.assert_allclose(got[0], want[0], rtol=RTOL)
    np.testing.assert_allclose(got[1]["w"], want[1]["w"], rtol=RTOL,
                               atol=RTOL * np.abs(want[1]["w"]).max())
