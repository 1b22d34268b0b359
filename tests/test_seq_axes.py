"""infer-seq-axes: sequence dims follow dataflow from attention, never sizes."""
import jax
import jax.numpy as jnp
import pytest

from cptransform import trace
from cptransform.ir import compat
from cptransform.ir.pipeline import Pipeline
from cptransform.analysis.dim_rules import reshape_dim_map
from cptransform.analysis.seq_axes import infer_seq_axes
from cptransform.passes import get_all_passes

PASSES = get_all_passes()


@pytest.mark.parametrize("src,dst,expected", [
    ((2, 16, 32), (2, 16, 4, 8), {0: 0, 1: 1}),
    ((2, 16, 4, 8), (32, 4, 8), {2: 1, 3: 2}),
    ((1, 16, 8), (16, 8), {1: 0, 2: 1}),
    ((2, 16, 8), (2, 1, 16, 8), {0: 0, 1: 2, 2: 3}),
    ((6, 4), (4, 6), {}),
])
def test_reshape_dim_map(src, dst, expected):
    assert reshape_dim_map(src, dst) == expected


def matched(fn, *args):
    module = trace(fn, *args)
    return Pipeline.parse("canonicalize,match-attention", available=PASSES).run(module).module


def model(embed, tokens, mask, table):
    """Tokens [B,S] -> embeddings; a dense [B,S,S] mask input; a [S,S] table not reaching
    attention (same sizes as the sequence, on purpose)."""
    x = embed[tokens].reshape(tokens.shape + (2, 4))
    out = jax.nn.dot_product_attention(x, x, x, mask=mask[:, None])
    return out.sum() + table.sum()


def test_inputs_found_by_dataflow_not_by_size():
    args = (jnp.ones((16, 8)), jnp.ones((2, 16), jnp.int32), jnp.ones((2, 16, 16), bool),
            jnp.ones((16, 16)))
    module = matched(model, *args)
    axes = infer_seq_axes(module.jaxpr)
    ins = compat.open_jaxpr(module.jaxpr).invars
    assert axes.seq_len == 16
    assert [axes.dims(v) for v in ins] == [(), (1,), (1, 2), ()]


def test_override_seeds_and_cuts():
    args = (jnp.ones((16, 8)), jnp.ones((2, 16), jnp.int32), jnp.ones((2, 16, 16), bool),
            jnp.ones((16, 16)))
    module = matched(model, *args)
    axes = infer_seq_axes(module.jaxpr, {3: (0,)})
    table = compat.open_jaxpr(module.jaxpr).invars[3]
    assert axes.dims(table) == (0,)


def test_unconnected_attentions_are_two_sequences():
    """Two attentions that dataflow does not connect are two sequences, even of one
    length: sizes are never evidence."""
    def two(a, b):
        return (jax.nn.dot_product_attention(a, a, a).sum()
                + jax.nn.dot_product_attention(b, b, b).sum())

    for shapes, lengths in ((((1, 8, 2, 4), (1, 16, 2, 4)), (8, 16)),
                            (((1, 8, 2, 4), (1, 8, 2, 4)), (8, 8))):
        module = matched(two, *(jnp.ones(s) for s in shapes))
        axes = infer_seq_axes(module.jaxpr)
        a, b = compat.open_jaxpr(module.jaxpr).invars
        assert axes.lengths == lengths and axes.seq_len is None
        assert axes.sequence[(a, 1)] != axes.sequence[(b, 1)]


def test_cross_attention_has_a_query_and_a_key_sequence():
    def cross(q, kv):
        return jax.nn.dot_product_attention(q, kv, kv).sum()

    module = matched(cross, jnp.ones((1, 8, 2, 4)), jnp.ones((1, 16, 2, 4)))
    axes = infer_seq_axes(module.jaxpr)
    q, kv = compat.open_jaxpr(module.jaxpr).invars
    assert axes.lengths == (8, 16)
    assert axes.full_dims(q) == (1,) and axes.full_dims(kv) == (1,)


def test_keys_of_a_kv_cache_are_a_sequence_of_their_own_length():
    """A KV cache concatenated to the new keys: the keys (12) are a sequence of their own,
    derived from the queries' (8) by the concatenation, as a cross-attention's memory."""
    def cached(x, cache):
        k = jnp.concatenate([cache, x], axis=1)
        return jax.nn.dot_product_attention(x, k, k).sum()

    module = matched(cached, jnp.ones((1, 8, 2, 4)), jnp.ones((1, 4, 2, 4)))
    axes = infer_seq_axes(module.jaxpr)
    x, cache = compat.open_jaxpr(module.jaxpr).invars
    assert axes.lengths == (8, 12)
    assert axes.full_dims(x) == (1,) and axes.dims(cache) == (1,)
    assert axes.sequence[(x, 1)] != axes.sequence[(cache, 1)]


def test_batch_dims_are_one_axis_across_q_k_and_v():
    """Frames are batch dims of a spatial attention over ``[B, T, P, H, D]`` and the
    sequence of a temporal one. k's frames, merged with the batch by a reshape and split
    back, still reach the frames through the spatial attention: their order must agree
    with q's (a dim the analysis lost was once left in natural order beside q's
    permuted one, a silent wrong answer under zigzag)."""
    def space_time(x, y):
        b, t, p, h, d = y.shape
        k = (y.reshape(b * t, p, h, d) * 2.0).reshape(b, t, p, h, d)
        s = jnp.einsum("btqhd,btkhd->bthqk", x, k)
        o = jnp.einsum("bthqk,btkhd->btqhd", jax.nn.softmax(s, -1), k)
        s = jnp.einsum("bqphd,bkphd->bphqk", o, x)
        return jnp.einsum("bphqk,bkphd->bqphd", jax.nn.softmax(s, -1), x).sum()

    shape = (2, 4, 8, 1, 4)
    module = matched(space_time, jnp.ones(shape), jnp.ones(shape))
    axes = infer_seq_axes(module.jaxpr)
    spatial = next(e for e in axes.attentions if e.invars[0].aval.shape[2] == 8
                   and e.params["spec"].q.seq == 2)
    q, k, v = spatial.invars[:3]
    spec = spatial.params["spec"]
    frames = axes.sequence.get((q, spec.q.batch[1]))
    assert frames is not None and axes.lengths[frames] == 4
    assert axes.sequence.get((k, spec.k.batch[1])) == frames
    assert axes.sequence.get((v, spec.v.batch[1])) == frames
