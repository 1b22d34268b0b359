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


@pytest.mark.slow
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


@pytest.mark.slow
def test_static_argnames_under_an_outer_jit(data):
    x, w = data

    def fn(x, w, *, causal):
        return jnp.sum(attend(x, w, causal=causal) ** 2)

    f = jax.jit(context_parallel(fn, cp=4, static_argnames="causal"),
                static_argnames="causal")
    np.testing.assert_allclose(f(x, w, causal=False), fn(x, w, causal=False), rtol=RTOL)
    np.testing.assert_allclose(f(x, w, causal=True), fn(x, w, causal=True), rtol=RTOL)


@pytest.mark.slow
def test_an_unhashable_static_value_is_refused_by_name(data):
    x, w = data
    f = context_parallel(lambda x, w, sizes: jnp.sum(attend(x, w)) * len(sizes), cp=4)
    with pytest.raises(ValueError, match="argument 2 .list. holds no array.*hashable"):
        f(x, w, [1, 2])


@pytest.mark.slow
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


def test_no_attention_raises_naming_the_refused_softmax(data):
    """Nothing to shard is an error naming each softmax and why it was left, and the
    opt-out; with ``allow_unsharded=True`` the function runs unchanged with a warning;
    ``strict=True`` refuses even then."""
    x, _ = data

    def gate(x):
        return jnp.sum(jax.nn.softmax(x, axis=-1) * x)

    with pytest.raises(ContextParallelError, match=r"(?s)no attention found and no "
                       r"recurrence sharded, so nothing is sharded.*"
                       r"test_arguments_and_meshes.py.*refused: softmax input "
                       r"does not come from a q·k product.*allow_unsharded=True"):
        context_parallel(gate, cp=4)(x)
    f = context_parallel(gate, cp=4, allow_unsharded=True)
    with pytest.warns(UnshardedWarning, match="no attention found.*nothing is sharded"):
        np.testing.assert_allclose(f(x), gate(x), rtol=RTOL)
    with pytest.raises(ContextParallelError, match="no attention found"):
        context_parallel(gate, cp=4, strict=True, allow_unsharded=True)(x)


@pytest.mark.slow
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


@pytest.mark.slow
def test_state_written_into_an_argument_is_written_back(data):
    """A function that assigns into its arguments (a step counter in a dict): the caller's
    dict sees the write after the call, as with the undecorated function."""
    x, w = data

    def fn(state, x):
        state["step"] = state["step"] + 1
        return jnp.sum(attend(x, state["w"]) ** 2)

    want_state, got_state = ({"step": jnp.zeros((), jnp.int32), "w": w} for _ in range(2))
    want = fn(want_state, x)
    got = context_parallel(fn, cp=4)(got_state, x)
    np.testing.assert_allclose(got, want, rtol=RTOL)
    assert int(got_state["step"]) == int(want_state["step"]) == 1


def test_an_argument_gaining_an_array_is_refused(data):
    """A new dict entry cannot be written back by position: one clear error."""
    x, w = data

    def fn(state, x):
        state["seen"] = x
        return jnp.sum(attend(x, state["w"]) ** 2)

    with pytest.raises(ContextParallelError, match="fn changes the structure of its arguments"):
        context_parallel(fn, cp=4)({"w": w}, x)


def dropout_attention():
    """An NNX module whose call advances its ``Rngs`` (``nnx.Dropout``), and its loss."""
    from flax import nnx

    class Model(nnx.Module):
        def __init__(self):
            rngs = nnx.Rngs(0, dropout=1)
            # No key bias: the softmax cancels it, its gradient is rounding noise.
            self.attn = nnx.MultiHeadAttention(num_heads=2, in_features=8, qkv_features=8,
                                               use_bias=False, decode=False, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)

    def loss(model, x):
        return jnp.sum(model.drop(model.attn(x, mask=nnx.make_causal_mask(x[..., 0]))) ** 2)

    return Model(), loss


@pytest.mark.slow
def test_nnx_dropout_advances_its_rngs_under_the_decorator(data):
    """``nnx.Dropout`` advances its ``Rngs`` counter on every call: under the decorator too,
    so each step draws a new mask, the same as on one device (a lost write would repeat the
    first mask every step)."""
    from flax import nnx

    runs = []
    for wrap in (lambda f: f, lambda f: context_parallel(f, cp=4)):
        model, loss = dropout_attention()
        step = nnx.value_and_grad(wrap(loss))
        runs.append([step(model, data[0]) for _ in range(2)])
    assert not np.isclose(runs[0][0][0], runs[0][1][0])  # the masks did change
    for (want, want_g), (got, got_g) in zip(*runs):
        np.testing.assert_allclose(got, want, rtol=RTOL)
        for g, w in zip(jax.tree_util.tree_leaves(got_g), jax.tree_util.tree_leaves(want_g)):
            np.testing.assert_allclose(g, w, rtol=RTOL, atol=RTOL * np.abs(w).max())


@pytest.mark.slow
def test_nnx_scan_over_layers_writes_its_state_back(data):
    """``nnx.scan`` assigns every layer's state back to the module (new arrays, same
    values): written back, not mistaken for a change of the model."""
    from flax import nnx

    @nnx.split_rngs(splits=2)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
        return nnx.MultiHeadAttention(num_heads=2, in_features=8, qkv_features=8,
                                      use_bias=False, decode=False, rngs=rngs)

    def loss(layers, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def step(h, layer):
            return h + layer(h, mask=nnx.make_causal_mask(h[..., 0]))
        return jnp.sum(step(x, layers) ** 2)

    layers = make(nnx.Rngs(0))
    want, want_g = nnx.value_and_grad(loss)(layers, data[0])
    got, got_g = nnx.value_and_grad(context_parallel(loss, cp=4))(layers, data[0])
    np.testing.assert_allclose(got, want, rtol=RTOL)
    for g, w in zip(jax.tree_util.tree_leaves(got_g), jax.tree_util.tree_leaves(want_g)):
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=RTOL * np.abs(w).max())


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_inputs_sharded_over_a_data_axis_of_an_explicit_mesh(data, jit):
    """What the idle-devices warning suggests: ``jax.make_mesh((2, 4), ('data', 'cp'))``
    (Explicit axes by default) and the batch placed over ``'data'``. The gradient, eager
    or under ``jit``, is one device's and keeps the input's sharded type (it once ended in
    JAX's "Expected cotangent type float32[2@data,...]")."""
    from jax.sharding import NamedSharding, PartitionSpec
    x, w = data
    mesh = jax.make_mesh((2, 4), ("data", "cp"))
    xs = jax.device_put(x, NamedSharding(mesh, PartitionSpec("data")))

    def loss(x, w):
        return jnp.mean(attend(x, w) ** 2)

    grad = jax.value_and_grad(context_parallel(loss, mesh=mesh, axis="cp"), argnums=(0, 1))
    got = (jax.jit(grad) if jit else grad)(xs, w)
    want = jax.value_and_grad(loss, argnums=(0, 1))(x, w)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=RTOL, atol=1e-7), got,
                 want)
    assert jax.typeof(got[1][0]).sharding.spec == jax.typeof(xs).sharding.spec
