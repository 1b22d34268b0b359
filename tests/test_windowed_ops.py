"""Ops that read their neighbours along the sequence (pooling windows, a depthwise causal
conv, token shifts, rolls), before and after attention, give the single-device loss and
gradients under every layout, cp 2/4/8: the windows run with a halo exchange, never through
XLA's SPMD partitioning of ``select_and_scatter`` on a sharded window dim (wrong: see
docs/spmd_partitioner_bugs.md); windows the halo cannot compute exactly are refused."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from conftest import assert_tree_close, make_mesh
from cptransform import context_parallel
from cptransform.ir import compat
from cptransform.ir.errors import ContextParallelError, CPTransformError

B, S, H, HD = 2, 32, 2, 4
F = H * HD


def pool(init, fn, width, left):
    def op(h, _):
        return lax.reduce_window(h, init, fn, (1, width, 1), (1, 1, 1),
                                 ((0, 0), (left, width - 1 - left), (0, 0)))
    return op


def short_conv(h, w4):
    """Mamba's short conv: depthwise, causal, width 4."""
    return lax.conv_general_dilated(h, w4, (1,), ((3, 0),), dimension_numbers=("NWC", "WIO", "NWC"),
                                    feature_group_count=F)


OPS = {
    "maxpool3": pool(-jnp.inf, lax.max, 3, 1),
    "avgpool3": lambda h, w4: pool(0.0, lax.add, 3, 1)(h, w4) / 3,
    "conv4": short_conv,
    "shift": lambda h, _: jnp.pad(h, ((0, 0), (1, 0), (0, 0)))[:, :-1],
    "roll": lambda h, _: jnp.roll(h, 1, axis=1),
}

#: Tokens each op reads beyond its own on one side (the halo it needs).
REACH = {"maxpool3": 1, "avgpool3": 1, "conv4": 3, "shift": 1, "roll": 0}


def model(op):
    def loss(x, w, w4):
        h = x + op(x @ w, w4)
        q, k, v = (h.reshape(B, S, H, HD) for _ in range(3))
        o = jax.nn.dot_product_attention(q * 0.5, k, v, is_causal=True).reshape(B, S, F)
        return jnp.mean(jnp.tanh(op(o, w4) + x) ** 2)
    return loss


def data(seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(keys[0], (B, S, F)), jax.random.normal(keys[1], (F, F)) / 3,
            jax.random.normal(keys[2], (4, 1, F)))


def check(name, load_balance, cp, *args):
    fn = model(OPS[name])
    args = args or data()
    ref = jax.value_and_grad(fn, argnums=(0, 1, 2))(*args)
    mesh = make_mesh((cp,), ("cp",))
    got = jax.value_and_grad(context_parallel(fn, mesh=mesh, load_balance=load_balance),
                             argnums=(0, 1, 2))(*args)
    assert_tree_close(got, ref)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["conv4", "maxpool3", "shift"])
def test_window_op_zigzag_cp4(name):
    check(name, "zigzag", 4)


def test_maxpool_contiguous_cp4():
    check("maxpool3", "none", 4)


@pytest.mark.slow
@pytest.mark.parametrize("cp", [2, 4, 8])
@pytest.mark.parametrize("load_balance", ["none", "zigzag", "striped"])
@pytest.mark.parametrize("name", sorted(OPS))
def test_window_op_matrix(name, load_balance, cp):
    """Exact, or refused by name where the window reaches past the chunk a rank holds."""
    chunk = S // (2 * cp) if load_balance == "zigzag" else S // cp
    if REACH[name] > chunk:
        with pytest.raises(ContextParallelError, match="more than a zigzag chunk"):
            check(name, load_balance, cp)
    else:
        check(name, load_balance, cp)


@pytest.mark.parametrize("name", ["conv4", "maxpool3", "shift"])
def test_zigzag_keeps_the_window_in_layout_order(name):
    """Under zigzag the window exchanges each chunk's own neighbours: nothing is un-permuted."""
    fn = context_parallel(model(OPS[name]), cp=4, load_balance="zigzag")
    report = fn.explain(*data())
    assert "un-permute" not in str(report)


@pytest.mark.slow
def test_left_shift_by_slice_then_pad():
    def shift_left(h, _):
        return jnp.pad(h[:, 2:], ((0, 0), (0, 2), (0, 0)), constant_values=0.5)
    fn = model(shift_left)
    args = data(2)
    ref = jax.value_and_grad(fn, argnums=(0, 1))(*args)
    got = jax.value_and_grad(context_parallel(fn, cp=4, load_balance="zigzag"),
                             argnums=(0, 1))(*args)
    assert_tree_close(got, ref)


def test_striped_window_gathers_and_says_so():
    fn = context_parallel(model(OPS["maxpool3"]), cp=4, load_balance="striped", strict=True)
    with pytest.raises(CPTransformError, match="seq_window"):
        fn(*data())


@pytest.mark.slow
def test_maxpool_gradient_keeps_inf_pattern():
    x, w, w4 = data(1)
    x = x.at[0, 9, 3].set(jnp.inf).at[1, 16, 0].set(-jnp.inf)
    fn = model(OPS["maxpool3"])
    ref = jax.grad(fn, argnums=(0, 1))(x, w, w4)
    got = jax.grad(context_parallel(fn, cp=4, load_balance="zigzag"), argnums=(0, 1))(x, w, w4)
    for a, e in zip(got, ref):
        np.testing.assert_array_equal(np.isnan(a), np.isnan(e))
        np.testing.assert_allclose(np.nan_to_num(a), np.nan_to_num(e), rtol=1e-5, atol=1e-6)


def test_strided_pool_on_the_sequence_is_refused():
    def loss(x, w, w4):
        q, k, v = (x.reshape(B, S, H, HD) for _ in range(3))
        o = jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(B, S, F)
        pooled = lax.reduce_window(o, -jnp.inf, lax.max, (1, 2, 1), (1, 2, 1), "VALID")
        return jnp.mean(pooled ** 2)
    with pytest.raises(ContextParallelError, match="stride 1"):
        context_parallel(loss, cp=4, load_balance="none")(*data())


def test_window_wider_than_a_chunk_is_refused():
    fn = model(pool(-jnp.inf, lax.max, 11, 5))
    with pytest.raises(ContextParallelError, match="more than a zigzag chunk of 4 tokens"):
        context_parallel(fn, cp=4, load_balance="zigzag")(*data())


def _names(jaxpr, in_shard_map=False):
    """``(primitive name, inside a shard_map)`` of every equation, bodies included."""
    for e in jaxpr.eqns:
        yield e.primitive.name, in_shard_map
        for _, sub in compat.eqn_subjaxprs(e):
            yield from _names(compat.open_jaxpr(sub), in_shard_map or e.primitive.name == "shard_map")


def test_pool_gradient_runs_only_inside_the_halo_shard_map():
    """The pool's gradient (select_and_scatter_add) is never left to the SPMD partitioner."""
    fn = context_parallel(model(OPS["maxpool3"]), cp=4, load_balance="none")
    found = [inside for name, inside in _names(jax.make_jaxpr(jax.grad(fn))(*data()).jaxpr)
             if name.startswith(("select_and", "reduce_window"))]
    assert found and all(found)


@pytest.mark.slow
def test_partitioner_bug_reproducer():
    """docs/spmd_partitioner_bugs.md: jit with the window dim sharded over 8 devices gets the
    max-pool gradient wrong; the transform (its halo) gets it right at cp=8."""
    mesh = make_mesh((8,), ("cp",))

    def f(x):
        y = lax.reduce_window(x, -jnp.inf, lax.max, (1, 3, 1), (1, 1, 1),
                              ((0, 0), (1, 1), (0, 0)))
        return jnp.sum(jnp.sin(y))

    x = jax.random.normal(jax.random.key(0), (2, 64, 4))
    ref = jax.jit(jax.grad(f))(x)
    sh = NamedSharding(mesh, P(None, "cp"))
    partitioned = jax.jit(jax.grad(f), in_shardings=sh, out_shardings=sh)(jax.device_put(x, sh))
    if np.allclose(partitioned, ref, atol=1e-5):
        pytest.skip("this JAX/XLA partitions select_and_scatter correctly")
    check("maxpool3", "none", 8)
