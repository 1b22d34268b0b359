"""Dropout on the attention probabilities is sharded with the bits one device draws.

The kernels draw each tile's bits from the key and the pairs' global positions
(:mod:`cptransform.op.dropout`), so the loss and every gradient equal the undecorated
program's under every schedule and layout. Spellings: ``where(keep, p / keep, 0)``
(``nn.Dropout``), ``p * keep / keep_prob`` broadcast over batch and heads (flax's
``dot_product_attention_weights``), bits drawn with the heads after the queries, grouped
query heads, flax's stock functions and modules. What cannot be one device's bits (another
key implementation, an empty row's uniform fill under data masks) is left whole and logged.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import assert_tree_close, sharded_only
from cptransform import PartlyShardedWarning, context_parallel
from cptransform.ir.errors import KernelError
from cptransform.op import dropout

B, S, H, D = 2, 32, 4, 8
CAUSAL = jnp.tril(jnp.ones((S, S), bool))
KEEP = 0.8


def _probs(q, k, axis_order="bhqk"):
    s = jnp.einsum(f"bqhd,bkhd->{axis_order}", q, k) / np.sqrt(D)
    mask = CAUSAL if axis_order == "bhqk" else CAUSAL[:, None, :]
    return jax.nn.softmax(jnp.where(mask, s, -jnp.inf), axis=-1)


def selected(q, k, v, key):
    """``nn.Dropout``: ``where(keep, p / keep_prob, 0)``."""
    p = _probs(q, k)
    keep = jax.random.bernoulli(key, KEEP, p.shape)
    return jnp.einsum("bhqk,bkhd->bqhd", jnp.where(keep, p / KEEP, 0.0), v)


def broadcast_multiplier(q, k, v, key):
    """flax's ``dot_product_attention_weights`` with ``broadcast_dropout=True``: one mask
    for every batch entry and head, as a multiplier."""
    p = _probs(q, k)
    keep = jax.random.bernoulli(key, KEEP, (1, 1, S, S))
    multiplier = keep.astype(p.dtype) / jnp.asarray(KEEP, p.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", p * multiplier, v)


def heads_after_queries(q, k, v, key):
    """Probabilities ``[B, Q, H, K]``, bits drawn in that order."""
    p = _probs(q, k, "bqhk")
    p = p * jax.random.bernoulli(key, KEEP, p.shape) / KEEP
    return jnp.einsum("bqhk,bkhd->bqhd", p, v)


def grouped(q, k, v, key):
    """Grouped-query attention viewed ``[B, Hkv, G, Q, K]``: two query heads per KV head."""
    qg = jnp.concatenate([q, q[..., ::-1]], axis=2).reshape(B, S, H, 2, D)
    s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k) / np.sqrt(D)
    p = jax.nn.softmax(jnp.where(CAUSAL, s, -jnp.inf), axis=-1)
    keep = jax.random.bernoulli(key, KEEP, p.shape)
    o = jnp.einsum("bhgqk,bkhd->bqhgd", jnp.where(keep, p / KEEP, 0.0), v)
    return o.reshape(B, S, 2 * H, D)[:, :, ::2]


def flax_function(q, k, v, key):
    """flax.linen's stock ``dot_product_attention`` (finite mask fill, dropout per batch
    entry and head)."""
    from flax import linen
    return linen.dot_product_attention(q, k, v, mask=CAUSAL[None, None], dropout_rng=key,
                                       dropout_rate=1 - KEEP, broadcast_dropout=False,
                                       deterministic=False)


def flax_module(q, k, v, key):
    """flax.linen's ``Dropout`` module on the probabilities (its key derived by the
    module)."""
    from flax import linen
    p = linen.Dropout(1 - KEEP, deterministic=False).apply({}, _probs(q, k),
                                                         rngs={"dropout": key})
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)


SPELLINGS = {"selected": selected, "broadcast_multiplier": broadcast_multiplier,
             "heads_after_queries": heads_after_queries, "grouped": grouped,
             "flax_function": flax_function, "flax_module": flax_module}


def _loss(layer):
    def loss(q, k, v, key):
        return jnp.mean(jnp.tanh(layer(q, k, v, key)) ** 2)
    return loss


def _args(seed=0, length=S):
    ks = jax.random.split(jax.random.key(seed), 4)
    return (*(jax.random.normal(kk, (B, length, H, D)) for kk in ks[:3]), ks[3])


def _check(loss, args, **options):
    f = context_parallel(loss, cp=4, **options)
    with sharded_only():
        got = jax.value_and_grad(f, argnums=(0, 1, 2))(*args)
    matches = f.module(*args).facts.matches
    assert matches and all(m.rewritten and m.spec.dropout is not None for m in matches), \
        matches
    want = jax.value_and_grad(loss, argnums=(0, 1, 2))(*args)
    assert_tree_close(got, want, rtol=2e-5)
    return f


@pytest.mark.parametrize("spelling", [
    "selected", "broadcast_multiplier",
    *(pytest.param(s, marks=pytest.mark.slow)
      for s in ("heads_after_queries", "grouped", "flax_function", "flax_module"))])
def test_dropout_is_sharded_with_one_devices_bits(spelling):
    if spelling.startswith("flax"):
        pytest.importorskip("flax")
    _check(_loss(SPELLINGS[spelling]), _args())


def _schedules(*pairs):
    """Options ``schedule``/``load_balance`` per pair: the first in the fast tier, the
    others slow."""
    options = [dict(schedule=s, load_balance=lb) for s, lb in pairs]
    return pytest.mark.parametrize(
        "options", options[:1] + [pytest.param(o, marks=pytest.mark.slow) for o in options[1:]],
        ids=lambda o: f"{o['schedule']}-{o['load_balance']}")


@_schedules(("ring", "zigzag"), ("ring", "striped"), ("ulysses", "none"),
            ("allgather", "none"), ("hybrid", "zigzag"), ("double_ring", "none"))
def test_every_schedule_draws_the_same_bits(options):
    f = _check(_loss(selected), _args(1), **options)
    (plan,) = f.module(*_args(1)).facts.plan
    assert plan.schedule == options["schedule"], plan.schedule


@_schedules(("ring", "zigzag"), ("ring", "striped"), ("allgather", "zigzag"),
            ("hybrid", "zigzag"))
def test_without_a_mask_the_keys_positions_still_travel(options):
    """No mask term reads the keys' positions, dropout does: under a permuted layout the
    ring must send them with the keys (the bits of a pair follow its key's position)."""
    def layer(q, k, v, key):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D)
        p = jax.nn.softmax(s, axis=-1)
        keep = jax.random.bernoulli(key, KEEP, p.shape)
        return jnp.einsum("bhqk,bkhd->bqhd", jnp.where(keep, p / KEEP, 0.0), v)

    def loss(q, k, v, key):
        # A causal attention beside it makes the permuted layout worth taking.
        return jnp.mean(jnp.tanh(layer(q, k, v, key)) ** 2) + jnp.mean(
            jax.nn.dot_product_attention(q, k, v, is_causal=True) ** 2)

    f = context_parallel(loss, cp=4, **options)
    with sharded_only():
        got = jax.value_and_grad(f, argnums=(0, 1, 2))(*_args(8))
    assert_tree_close(got, jax.value_and_grad(loss, argnums=(0, 1, 2))(*_args(8)), rtol=2e-5)


@pytest.mark.slow
def test_a_length_the_layout_does_not_divide():
    """Padded queries and keys draw bits past the sequence; they are masked."""
    _check(_loss(broadcast_multiplier_of(S - 3)), _args(2, S - 3),
           load_balance="zigzag")


def broadcast_multiplier_of(length):
    def layer(q, k, v, key):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D)
        causal = jnp.tril(jnp.ones((length, length), bool))
        p = jax.nn.softmax(jnp.where(causal, s, -jnp.inf), axis=-1)
        keep = jax.random.bernoulli(key, KEEP, p.shape)
        return jnp.einsum("bhqk,bkhd->bqhd", jnp.where(keep, p / KEEP, 0.0), v)
    return layer


def test_layers_in_a_scan_with_a_key_each():
    """Two dropout layers under ``lax.scan``, each with its own key split from one."""
    def loss(q, k, v, key):
        def layer(h, kl):
            return h + selected(h, k, v, kl), None
        return jnp.mean(jax.lax.scan(layer, q, jax.random.split(key, 2))[0] ** 2)

    _check(loss, _args(3))


def test_nan_in_v_reaches_the_rows_as_on_one_device():
    """A NaN in V reaches every row through ``p·M·NaN`` whether the pair is dropped or
    not (``0·NaN``), as the dense product does."""
    q, k, v, key = _args(4)
    v = v.at[0, 5, 1, 3].set(jnp.nan)
    got = context_parallel(selected, cp=4)(q, k, v, key)
    want = selected(q, k, v, key)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    ok = ~np.isnan(want)
    np.testing.assert_allclose(np.asarray(got)[ok], np.asarray(want)[ok], rtol=2e-5,
                               atol=1e-6)


def test_pallas_refuses_and_auto_takes_the_xla_kernel():
    args = _args(5)
    with pytest.raises(KernelError, match="does not draw dropout bits"):
        context_parallel(selected, cp=4, kernel="pallas")(*args)
    f = context_parallel(selected, cp=4, kernel="auto")
    text = f.explain(*args)
    assert "kernel: xla" in text
    assert "mask: causal empty=nan dropout;" in text, text


@pytest.mark.parametrize("case", ["uniform_with_padding", "rbg_key", "given_mask"])
def test_what_cannot_be_one_devices_bits_is_left_whole(case):
    """Left whole, logged, exact: an empty row's uniform fill under a data mask (its
    output would be the dropped mean of V), a key whose bits depend on the whole shape
    (``rbg``), and a keep-mask passed in as data (no bits to draw)."""
    q, k, v, key = _args(6)
    pad = jnp.arange(S)[None, :] >= jnp.array([[0], [5]])

    def loss(q, k, v, key, pad):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D)
        if case == "uniform_with_padding":
            mask = CAUSAL & pad[:, None, None, :]
            p = jax.nn.softmax(jnp.where(mask, s, jnp.finfo(s.dtype).min), axis=-1)
        else:
            p = jax.nn.softmax(jnp.where(CAUSAL, s, -jnp.inf), axis=-1)
        if case == "given_mask":
            keep = pad[:, None, :, None]
        elif case == "rbg_key":
            keep = jax.random.bernoulli(jax.random.key(3, impl="rbg"), KEEP, p.shape)
        else:
            keep = jax.random.bernoulli(key, KEEP, p.shape)
        o = jnp.einsum("bhqk,bkhd->bqhd", jnp.where(keep, p / KEEP, 0.0), v)
        return jnp.mean(o ** 2) + jnp.mean(jax.nn.dot_product_attention(q, k, v,
                                                                         is_causal=True))

    f = context_parallel(loss, cp=4)
    with pytest.warns(PartlyShardedWarning, match=r"1 attention\(s\) run unsharded") as caught:
        got = jax.value_and_grad(f, argnums=(0, 1, 2))(q, k, v, key, pad)
    assert len([w for w in caught if w.category is PartlyShardedWarning]) == 1
    assert sum(m.rewritten for m in f.module(q, k, v, key, pad).facts.matches) == 1
    want = jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v, key, pad)
    assert_tree_close(got, want, rtol=2e-5)


def test_a_blocks_bits_are_the_bits_one_device_draws():
    """:func:`dropout.multiplier` of scattered positions and (batch, head) offsets equals
    the bits ``jax.random`` draws over the whole shape, at a flat index past 2**32."""
    rng = np.random.default_rng(0)
    shape = (3, 5, 70000, 70000)              # 7.4e10 elements: the index needs 64 bits
    key = jax.random.key(11)
    spec = dropout.DropoutSpec(shape[3], 1, dropout.MultiplierMap((), ("bits",)))
    strides = {"b": shape[1] * shape[2] * shape[3], "h": shape[2] * shape[3]}
    where = dropout.offsets(strides, {"b": 3, "h": 5}, ["b"], ("h",))
    seed = jnp.concatenate([jnp.broadcast_to(jax.random.key_data(key), (3, 5, 2)),
                            jnp.asarray(where)], axis=-1)
    q_pos = jnp.asarray(rng.integers(0, shape[2], (1, 6)), jnp.int32)
    kv_pos = jnp.asarray(rng.integers(0, shape[3], (1, 7)), jnp.int32)
    got = np.asarray(dropout.multiplier(spec, seed, q_pos, kv_pos)).astype(np.uint64)
    # One device's bits at those flat indices: threefry of the index's two words.
    flat = (np.arange(3)[:, None, None, None] * strides["b"]
            + np.arange(5)[None, :, None, None] * strides["h"]
            + np.asarray(q_pos)[0][None, None, :, None].astype(np.int64) * shape[3]
            + np.asarray(kv_pos)[0][None, None, None, :]).astype(np.uint64)
    words = [jnp.asarray((flat >> np.uint64(32)).astype(np.uint32)),
             jnp.asarray((flat & np.uint64(0xFFFFFFFF)).astype(np.uint32))]
    kd = jax.random.key_data(key)
    x, y = jax.extend.random.threefry2x32_p.bind(
        *(jnp.broadcast_to(w, flat.shape) for w in (kd[0], kd[1], *words)))
    np.testing.assert_array_equal(got, np.asarray(x ^ y).astype(np.float32).astype(np.uint64))
    small = (2, 3, 9, 11)
    bits = np.asarray(jax.random.bits(key, small))
    where = dropout.offsets({"b": 3 * 99, "h": 99}, {"b": 2, "h": 3}, ["b"], ("h",))
    seed = jnp.concatenate([jnp.broadcast_to(jax.random.key_data(key), (2, 3, 2)),
                            jnp.asarray(where)], axis=-1)
    spec = dropout.DropoutSpec(11, 1, dropout.MultiplierMap((), ("bits",)))
    got = dropout.multiplier(spec, seed, jnp.arange(9)[None], jnp.arange(11)[None])
    np.testing.assert_array_equal(np.asarray(got), bits.astype(np.float32))
