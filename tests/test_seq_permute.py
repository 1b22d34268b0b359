"""Layout conversions of a sequence-sharded dim move tokens by collectives, exactly.

``seq_permute_p`` (natural ↔ zigzag / striped order) lowered under ``shard_map``
(``lowering/seq_permute.py``) must equal the one-device gather for every layout, rank
count, dim and mesh, with the inverse conversion as its transpose; and an attention whose
operands arrive in natural order must reach its layout without an all-gather of the whole
sequence (XLA's partitioning of the gather), in the forward and the backward.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from conftest import assert_tree_close, fast_every, make_mesh
from cptransform import context_parallel
from cptransform.lowering.seq_permute import collective_permutable, permuted_sequence
from cptransform.lowering.sharding_leaks import sequence_all_gathers
from cptransform.op.layouts import SequenceLayout

MESHES = {  # name: (mesh shape, axis names, the sequence's mesh axes, major first)
    "cp2": ((2,), ("cp",), ("cp",)),
    "cp8": ((8,), ("cp",), ("cp",)),
    "data2-cp4": ((2, 4), ("data", "cp"), ("cp",)),
    "two-axes": ((2, 4), ("u", "r"), ("u", "r")),
    # ppermute numbers a tuple of axes in mesh order, the sharding in the tuple's.
    "two-axes-reversed": ((2, 4), ("u", "r"), ("r", "u")),
}


# Striped over two sequence axes is left to the gather (no all-to-all over several).
CASES = [(layout, mesh, dim) for layout in ("zigzag", "striped") for mesh in MESHES
         for dim in (1, 2) if layout == "zigzag" or len(MESHES[mesh][2]) == 1]


@pytest.mark.parametrize("layout,mesh_name,dim", fast_every(CASES, 3))
def test_collectives_equal_the_gather_and_transpose_to_the_inverse(layout, mesh_name, dim,
                                                                     rng):
    shape, names, seq = MESHES[mesh_name]
    mesh = make_mesh(shape, names)
    cp = int(np.prod([mesh.shape[a] for a in seq]))
    length = 8 * cp
    lay = SequenceLayout(layout, length, cp)
    dims = [2, 3, 5]
    dims.insert(dim, length)
    x = jnp.asarray(rng.standard_normal(dims[:3]), jnp.float32)
    assert collective_permutable(lay, x.shape, dim, 1, mesh, seq)
    spec = [None] * 3
    spec[dim] = seq if len(seq) > 1 else seq[0]
    if "data" in names:
        spec[0 if dim != 0 else 1] = "data"
    x = jax.device_put(x, NamedSharding(mesh, P(*spec)))
    for inverse in (False, True):
        want = lay.unpermute(x, dim) if inverse else lay.permute(x, dim)
        moved = jax.jit(lambda v: permuted_sequence(v, layout=lay, dim=dim, inverse=inverse,
                                                    mesh=mesh, seq=seq))
        np.testing.assert_array_equal(moved(x), want)
        w = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)
        grad = jax.jit(jax.grad(lambda v: (moved(v) * w).sum()))(x)
        np.testing.assert_array_equal(grad, lay.permute(w, dim) if inverse
                                      else lay.unpermute(w, dim))


S, B, H, D = 64, 2, 4, 16


def causal_attention(q, k, v):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D)
    s = jnp.where(jnp.tril(jnp.ones((S, S), bool)), s, -1e30)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v)


def per_token(q, k, v, w):
    """Per-token outputs: the program stays in natural order and the attention converts
    its operands to its layout and its result back."""
    return causal_attention(q, k, v) * w


def order_free_loss(q, k, v, w):
    """A loss that does not depend on the token order: reorder-sequence permutes the
    program's inputs once."""
    return (jnp.tanh(causal_attention(q, k, v)) * w.sum(1, keepdims=True)).sum()


@pytest.mark.parametrize("layout", ["zigzag", "striped"])
@pytest.mark.parametrize("fn", [per_token, order_free_loss], ids=lambda f: f.__name__)
def test_layout_conversions_gather_no_sequence(fn, layout, rng):
    args = tuple(jnp.asarray(rng.standard_normal((B, S, H, D)), jnp.float32)
                 for _ in range(4))
    f = context_parallel(fn, cp=8, schedule="ring", load_balance=layout)

    def loss(g):
        return lambda *a: jnp.sum(g(*a) ** 2)
    grad = jax.value_and_grad(loss(f), argnums=(0, 1, 2, 3))
    assert sequence_all_gathers(jax.jit(grad).lower(*args).compile().as_text(), S) == []
    assert_tree_close(jax.jit(grad)(*args),
                      jax.value_and_grad(loss(fn), argnums=(0, 1, 2, 3))(*args), rtol=2e-4)
