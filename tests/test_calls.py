"""The calls around the transform (issue 16): nested decorated functions, forward-mode
derivatives, static arguments keyed by value and type, flags that flip, NNX state across
steps, ``jax.set_mesh`` contexts, inputs committed to one device, and float64 end to end.
Each compares with the undecorated function or expects one clear error."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from conftest import assert_rewritten, assert_tree_close, needs_halo
from test_arguments_and_meshes import dropout_attention
from cptransform import context_parallel
from cptransform.ir.errors import ContextParallelError
from cptransform.op.accumulation import accumulator_dtype

RTOL = 1e-5


def attend(x, w, *, causal=True):
    """Hand-written causal attention (``jax.nn.dot_product_attention`` computes its own
    softmax in float32, so it cannot be a float64 reference)."""
    q, k, v = (jnp.einsum("bsd,dhe->bshe", x, w[i]) for i in range(3))
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    if causal:
        t = jnp.arange(x.shape[1])
        s = jnp.where(t[None, :] <= t[:, None], s, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def loss(x, w):
    return jnp.sum(attend(x, w) ** 2)


@pytest.fixture(scope="module")
def data():
    kx, kw = jax.random.split(jax.random.PRNGKey(3))
    return jax.random.normal(kx, (2, 32, 8)), jax.random.normal(kw, (3, 8, 4, 4)) / 3


@pytest.mark.slow
def test_a_decorated_function_called_inside_another_runs_inline(data):
    inner = context_parallel(lambda x, w: attend(x, w), cp=4, schedule="allgather")
    outer = context_parallel(lambda x, w: jnp.sum(inner(x, w) ** 2), cp=4, schedule="ring")
    assert_tree_close(jax.value_and_grad(outer, argnums=(0, 1))(*data),
                      jax.value_and_grad(loss, argnums=(0, 1))(*data))
    assert "ring" in outer.explain(*data)


@pytest.mark.slow
def test_forward_mode_matches_one_device(data):
    x, w = data
    tangents = jax.random.normal(jax.random.PRNGKey(4), x.shape), w[::-1]
    f = context_parallel(loss, cp=4)
    assert_tree_close(jax.jvp(f, data, tangents), jax.jvp(loss, data, tangents))
    # Only x perturbed: w's tangent is a symbolic zero (and grad of x alone still works).
    assert_tree_close(jax.jvp(lambda x: f(x, w), (x,), (tangents[0],)),
                      jax.jvp(lambda x: loss(x, w), (x,), (tangents[0],)))
    assert_tree_close(jax.grad(f)(x, w), jax.grad(loss)(x, w))


def test_forward_over_reverse_is_refused_with_reverse_over_reverse_as_the_fix(data):
    """``jax.jvp`` of ``jax.grad`` (and ``jax.hessian``, forward over reverse) would
    differentiate the transposed VJP forward again: one clear error that names the
    reverse-over-reverse spellings (which the next test checks against one device)."""
    x, w = data
    f = context_parallel(loss, cp=4)
    v = jax.random.normal(jax.random.PRNGKey(5), w.shape)
    with pytest.raises(ContextParallelError, match="reverse mode twice"):
        jax.jvp(lambda w: jax.grad(f, argnums=1)(x, w), (w,), (v,))
    with pytest.raises(ContextParallelError, match=r"jax\.jacrev\(jax\.jacrev\(f\)\)"):
        jax.hessian(f, argnums=1)(x, w)


@pytest.mark.slow
def test_reverse_over_reverse_matches_one_device(data):
    """The fixes the forward-over-reverse refusal names: a Hessian-vector product by
    ``grad`` of ``vdot(grad, v)`` and a Hessian by ``jacrev(jacrev)``."""
    x, w = data
    v = jax.random.normal(jax.random.PRNGKey(5), w.shape)
    f = context_parallel(loss, cp=4)

    def hvp(fn):
        return jax.grad(lambda w: jnp.vdot(jax.grad(fn, argnums=1)(x, w), v))(w)

    assert_tree_close(hvp(f), hvp(loss))
    w1 = w[:, :2, :1]     # a Hessian small enough to compute: 3·2·1·4 weights

    def small(fn):
        return lambda w1: fn(x, w.at[:, :2, :1].set(w1))

    assert_tree_close(jax.jacrev(jax.jacrev(small(f)))(w1),
                      jax.jacrev(jax.jacrev(small(loss)))(w1))


@pytest.mark.slow
def test_linearize_stops_at_the_schedules_custom_vjp(data):
    """Reverse mode and jax.linearize trace alike (LinearizeTracers), so the program runs
    its schedules' custom_vjps there, and applying a linearized function forward is
    JAX's refusal (docs/contract.md: use jax.jvp)."""
    _, lin = jax.linearize(context_parallel(loss, cp=4), *data)
    with pytest.raises(TypeError, match="custom_vjp"):
        lin(*data)


@pytest.mark.slow
def test_static_arguments_of_equal_hash_are_separate_programs(data):
    """``1 == True == 1.0`` and they hash alike; ``jax.jit`` keys static arguments by type
    too, and so must the transform's cache."""
    def fn(x, w, n):
        return loss(x, w) * {int: 2.0, bool: 3.0, float: 5.0}[type(n)]

    f = context_parallel(fn, cp=4)
    for n in (1, True, 1.0, 1):
        np.testing.assert_allclose(f(*data, n), fn(*data, n), rtol=RTOL)


@pytest.mark.slow
def test_a_bool_flag_that_flips_between_calls(data):
    def fn(x, w, causal):
        return jnp.sum(attend(x, w, causal=causal) ** 2)

    f = context_parallel(fn, cp=4)
    for causal in (True, False, True):
        assert_tree_close(jax.value_and_grad(f, argnums=(0, 1))(*data, causal),
                          jax.value_and_grad(fn, argnums=(0, 1))(*data, causal))


@pytest.mark.slow
def test_nnx_dropout_state_across_steps_of_a_jitted_train_step():
    """Dropout after attention advances the ``Rngs`` every step; three AdamW steps in
    ``nnx.jit`` draw the same masks and reach the same parameters as one device."""
    nnx = pytest.importorskip("flax.nnx")
    optax = pytest.importorskip("optax")
    _, fn = dropout_attention()

    x = jax.random.normal(jax.random.PRNGKey(5), (2, 32, 8))
    runs = []
    for loss_fn in (fn, context_parallel(fn, cp=4)):
        model, _ = dropout_attention()
        optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)

        @nnx.jit
        def step(model, optimizer, x, loss_fn=loss_fn):
            value, grads = nnx.value_and_grad(loss_fn)(model, x)
            optimizer.update(model, grads)
            return value

        runs.append(([step(model, optimizer, x) for _ in range(3)],
                     nnx.state(model, nnx.Param)))
    (want, want_params), (got, got_params) = runs
    assert len(set(np.asarray(want).round(3).tolist())) == 3   # each step's mask differs
    np.testing.assert_allclose(got, want, rtol=RTOL)
    assert_tree_close(got_params, want_params, rtol=1e-4)


def test_explicit_set_mesh_with_batch_sharded_inputs_matches_one_device(data):
    """``jax.set_mesh`` of a ``jax.make_mesh`` mesh (Explicit axes, ``data=2, cp=4``), the
    batch sharded ``P('data')`` as that mesh's users shard it: the call, its gradient and
    both under ``jit`` inside the block give one device's numbers, and its outputs the
    types the undecorated function's have there (the program runs under
    ``jax.sharding.auto_axes``)."""
    mesh = jax.make_mesh((2, 4), ("data", "cp"), axis_types=(AxisType.Explicit,) * 2,
                         devices=jax.devices()[:8])
    f = context_parallel(loss, mesh=mesh, axis="cp", schedule="ring", load_balance="zigzag")
    value_and_grad = lambda g: jax.value_and_grad(g, argnums=(0, 1))  # noqa: E731
    want = value_and_grad(loss)(*data)
    with jax.set_mesh(mesh):
        args = (jax.device_put(data[0], P("data")), data[1])
        assert_rewritten(f, *args, count=1)
        for run in (value_and_grad(f), jax.jit(value_and_grad(f))):
            got = run(*args)
            assert_tree_close(got, want)
        types = [jax.typeof(x) for x in jax.tree_util.tree_leaves(got)]
        assert types == [jax.typeof(x) for x in jax.tree_util.tree_leaves(
            value_and_grad(loss)(*args))]


@pytest.mark.slow
@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_under_jax_set_mesh_the_call_and_its_gradient_match(data, axis_type):
    """Under ``jax.set_mesh`` of the transform's mesh (one axis) the call and its gradient
    match one device, jitted or not, on Auto and Explicit axes alike; under another
    Explicit mesh the gradient is refused, with the two ways out (the context's mesh, or
    ``grad`` outside the block)."""
    mesh = jax.make_mesh((4,), ("cp",), devices=jax.devices()[:4],
                         axis_types=(getattr(AxisType, axis_type),))
    f = context_parallel(loss, mesh=mesh)
    with jax.set_mesh(mesh):
        np.testing.assert_allclose(f(*data), loss(*data), rtol=RTOL)
        np.testing.assert_allclose(jax.jit(f)(*data), loss(*data), rtol=RTOL)
        assert_tree_close(jax.grad(f)(*data), jax.grad(loss)(*data))
        assert_tree_close(jax.jit(jax.grad(f))(*data), jax.grad(loss)(*data))
    other = jax.make_mesh((2,), ("x",), devices=jax.devices()[4:6],
                          axis_types=(AxisType.Explicit,))
    with jax.set_mesh(other):
        np.testing.assert_allclose(f(*data), loss(*data), rtol=RTOL)
        with pytest.raises(ContextParallelError, match="mesh=mesh.*outside the `with"):
            jax.grad(f)(*data)
    assert_tree_close(jax.grad(f)(*data), jax.grad(loss)(*data))


def test_inputs_committed_to_one_device_run_sharded_and_come_back_there(data):
    """Arguments committed to one device (``jax.device_put(x, jax.devices()[3])``): moved
    onto the mesh for the sharded program; the outputs and the committed arguments'
    gradients come back on that device, as the undecorated function's do, so they mix
    with the caller's arrays there. (An uncommitted argument's gradient stays on the mesh.)"""
    x, w = data
    f = context_parallel(loss, cp=8, schedule="ring", load_balance="zigzag")
    device = jax.devices()[3]
    args = (jax.device_put(x, device), jax.device_put(w, device))
    assert_rewritten(f, *args, count=1)
    got = jax.value_and_grad(f, argnums=(0, 1))(*args)
    want = jax.value_and_grad(loss, argnums=(0, 1))(*args)
    assert_tree_close(got, want)
    assert all(leaf.sharding.device_set == {device} for leaf in jax.tree_util.tree_leaves(got))
    value, grad_x = jax.value_and_grad(f)(args[0], w)
    assert value.sharding.device_set == grad_x.sharding.device_set == {device}
    np.testing.assert_allclose(value, want[0], rtol=RTOL)


@pytest.mark.slow
def test_committed_inputs_under_an_outer_jit_meet_jax_own_rule(data):
    """Under an outer ``jax.jit`` the arguments are tracers: JAX pins that jit to the
    committed argument's device and refuses the mesh inside it (its own error). The fix
    the docs give works: leave the argument uncommitted (or put it on the mesh)."""
    x, w = data
    f = context_parallel(loss, cp=4)
    committed = jax.device_put(x, jax.devices()[6])
    with pytest.raises(ValueError, match="incompatible devices"):
        jax.jit(f)(committed, w)
    np.testing.assert_allclose(jax.jit(f)(np.asarray(committed), w), loss(x, w), rtol=RTOL)


@pytest.fixture
def x64():
    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", previous)


@pytest.mark.parametrize("schedule, load_balance", [
    pytest.param("ring", "zigzag", marks=pytest.mark.slow),
    pytest.param("ulysses", "none", marks=pytest.mark.slow),
    pytest.param("allgather", "striped", marks=pytest.mark.slow),
    pytest.param("hybrid", "zigzag", marks=pytest.mark.slow),
    pytest.param("halo", "none", marks=pytest.mark.slow),
])
def test_float64_end_to_end_at_float64_accuracy(x64, data, schedule, load_balance):
    if schedule == "halo":
        needs_halo()
    x, w = (a.astype(jnp.float64) for a in data)

    def fn(x, w):
        if schedule == "halo":   # a sliding window of 4 keys
            q, k, v = (jnp.einsum("bsd,dhe->bshe", x, w[i]) for i in range(3))
            t = jnp.arange(x.shape[1])
            near = (t[None, :] <= t[:, None]) & (t[None, :] >= t[:, None] - 4)
            s = jnp.where(near, jnp.einsum("bqhd,bkhd->bhqk", q, k), -jnp.inf)
            return jnp.sum(jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v) ** 2)
        return loss(x, w)

    f = context_parallel(fn, cp=4, schedule=schedule, load_balance=load_balance)
    got = jax.value_and_grad(f, argnums=(0, 1))(x, w)
    want = jax.value_and_grad(fn, argnums=(0, 1))(x, w)
    assert all(leaf.dtype == jnp.float64 for leaf in jax.tree_util.tree_leaves(got))
    assert_tree_close(got, want, rtol=1e-12)


@pytest.mark.parametrize("dtype, accum", [(jnp.bfloat16, jnp.float32),
                                          (jnp.float16, jnp.float32),
                                          (jnp.float32, jnp.float32)])
def test_low_precision_still_accumulates_in_float32(dtype, accum):
    assert accumulator_dtype(dtype) == accum


@pytest.mark.slow
def test_bfloat16_runs_at_bfloat16_accuracy(data):
    x, w = (a.astype(jnp.bfloat16) for a in data)
    f = context_parallel(loss, cp=4)
    got = jax.value_and_grad(lambda x, w: f(x, w).astype(jnp.float32))(x, w)
    want = jax.value_and_grad(lambda x, w: loss(x, w).astype(jnp.float32))(x, w)
    assert got[1].dtype == jnp.bfloat16
    assert_tree_close(got, want, rtol=2e-2)
