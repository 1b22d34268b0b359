"""Scatters and dynamic-update-slices along the sequence.

``canonicalize`` writes the static-index ones (decoder-input shifts, a start token at
position 0, a window set at constant starts) as pad + select; the transformed model then
matches the single-device one under every layout. XLA's SPMD partitioner partitions the
chained scatters themselves wrongly when their result is sequence-sharded: the plain-JAX
reproducer of docs/spmd_partitioner_bugs.md is the last test here.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from conftest import assert_tree_close, make_mesh
from cptransform import context_parallel, trace
from cptransform.ir import compat
from cptransform.ir.module import iter_eqns
from cptransform.ir.pipeline import Pipeline
from cptransform.passes import get_all_passes

B, S, D, VOCAB = 2, 32, 16, 64


def shift_right(ids, start=2):
    """transformers' Flax ``shift_tokens_right``: two scatters along the sequence."""
    shifted = jnp.zeros_like(ids).at[:, 1:].set(ids[:, :-1])
    return shifted.at[:, 0].set(start)


#: Static-index writes along dim 1 of a ``[B, S]`` (or ``[B, S, D]``) value.
STATIC_WRITES = {
    "shift_right": shift_right,
    "start_token": lambda x: x.at[:, 0].set(7),
    "last_token": lambda x: x.at[:, -1].set(x[:, 0]),
    "window": lambda x: x.at[:, 3:9].set(x[:, 10:16] * 2),
    "features_of_one_token": lambda x: x[..., None].at[:, 5, 0].set(1)[..., 0],
    "dynamic_update_slice": lambda x: lax.dynamic_update_slice(x, x[:, :4] + 1, (0, 6)),
    "dynamic_update_slice_clamped": lambda x: lax.dynamic_update_slice(x, x[:, :4], (0, 40)),
}


def canonicalized(fn, *args):
    module = trace(fn, *args)
    return Pipeline.parse("canonicalize", available=get_all_passes()).run(module).module


def ids(seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(3, VOCAB, (B, S)), jnp.int32)


@pytest.mark.parametrize("name", STATIC_WRITES)
def test_static_writes_become_pad_and_select(name):
    fn = STATIC_WRITES[name]
    x = ids(1)
    module = canonicalized(fn, x)
    prims = {e.primitive.name for e in iter_eqns(module.jaxpr)}
    assert not prims & {"scatter", "dynamic_update_slice"}, prims
    np.testing.assert_array_equal(compat.eval_jaxpr(module.jaxpr, x)[0], fn(x))


@pytest.mark.parametrize("write", [
    lambda x, i: x.at[:, i].set(0),                         # data-dependent index
    lambda x, i: x.at[:, 40].set(0, mode="drop"),           # index past the end: dropped
    lambda x, i: x.at[:, 1:].add(x[:, :-1]),                # scatter-add
], ids=["dynamic_index", "out_of_bounds", "scatter_add"])
def test_other_scatters_are_left_alone(write):
    x = ids(2)
    module = canonicalized(write, x, jnp.int32(4))
    assert {e.primitive.name for e in iter_eqns(module.jaxpr)} & {"scatter", "scatter-add"}
    np.testing.assert_array_equal(compat.eval_jaxpr(module.jaxpr, x, jnp.int32(4))[0],
                                  write(x, jnp.int32(4)))


def decoder_loss(params, labels):
    """A causal decoder whose inputs are its labels shifted right (encoder-decoder style)."""
    x = params["embed"][shift_right(labels)]
    q, k, v = (x @ params[w] for w in ("wq", "wk", "wv"))
    logits = jnp.einsum("bqd,bkd->bqk", q, k) / np.sqrt(D)
    logits = jnp.where(jnp.tril(jnp.ones((S, S), bool)), logits, -1e9)
    out = jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(logits, axis=-1), v) @ params["unembed"]
    logp = jax.nn.log_softmax(out, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))


@pytest.mark.parametrize("schedule,load_balance", [
    ("ring", "zigzag"),
    pytest.param("allgather", "none", marks=pytest.mark.slow),
    pytest.param("ring", "striped", marks=pytest.mark.slow)])
@pytest.mark.slow
def test_decoder_on_shifted_labels_matches_one_device(schedule, load_balance):
    keys = jax.random.split(jax.random.key(3), 5)
    params = {"embed": jax.random.normal(keys[0], (VOCAB, D)),
              **{w: jax.random.normal(k, (D, D)) / 4 for w, k in zip(("wq", "wk", "wv"), keys[1:])},
              "unembed": jax.random.normal(keys[4], (D, VOCAB)) / 4}
    labels = ids(4)
    f = context_parallel(decoder_loss, cp=4, schedule=schedule, load_balance=load_balance)
    loss, grads = jax.value_and_grad(f)(params, labels)
    want_loss, want_grads = jax.value_and_grad(decoder_loss)(params, labels)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    assert_tree_close(grads, want_grads)


def _constrained(fn, mesh):
    seq = NamedSharding(mesh, P(None, "cp"))
    return jax.jit(lambda x: lax.with_sharding_constraint(fn(x), seq))


def test_pad_and_select_form_partitions_as_on_one_device():
    mesh = make_mesh((8,), ("cp",))
    x = jnp.arange(B * S, dtype=jnp.int32).reshape(B, S) + 100
    module = canonicalized(shift_right, x)
    rewritten = _constrained(lambda y: compat.eval_jaxpr(module.jaxpr, y)[0], mesh)
    np.testing.assert_array_equal(rewritten(x), shift_right(x))


@pytest.mark.xfail(compat.jax_release() < (0, 12), strict=True, reason=(
    "XLA SPMD partitioner before JAX 0.12: two chained scatters along a sequence-sharded dim "
    "(zeros.at[:, 1:].set(x[:, :-1]).at[:, 0].set(c)) with a sharding constraint on the "
    "result lose the element each shard should receive from its left neighbour; see "
    "docs/spmd_partitioner_bugs.md. When this passes, XLA is fixed."))
def test_chained_scatters_partition_as_on_one_device():
    mesh = make_mesh((8,), ("cp",))
    x = jnp.arange(B * S, dtype=jnp.int32).reshape(B, S) + 100
    np.testing.assert_array_equal(_constrained(shift_right, mesh)(x), shift_right(x))
