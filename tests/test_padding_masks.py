"""Padding masks read from data and merged with the analytic masks by the libraries' own
arithmetic stay per-token operands (``[B, S]``, the key and query padding terms' own),
never ``S×S``.

- every spelling of the fuzzer's ``mask_padding_merge`` class
  (``fuzz_programs.PADDING_MERGES``: gemma's product, keras-hub's ``minimum``, ``where``,
  ``logical_and``, query side and both sides, a float product through ``[B, 1, S, S]``,
  additive biases), with a causal mask or a window: no dense part, and exact under a ring
  with zigzag;
- an int mask whose entries are not 0/1 (a tokenizer's mask is, but nothing proves it):
  the per-token test replays the program's own arithmetic, so the numbers stay exact;
- ``minimum(mask, causal) != 0`` of an int mask is a region padding term (``x != 0`` on the
  causal band, ``x < 0`` above it: a negative entry makes its key visible past the causal
  mask), two ``[B, S]`` operands and no ``[S/cp, S]`` array per device; so is every
  spelling of the fuzzer's ``mask_region_padding`` class;
- the packages' own mask builders (DeepMind gemma's ``make_causal_attn_mask`` and sliding
  mask, keras-hub's ``compute_causal_mask`` / ``merge_padding_and_attention_mask`` with
  Keras' ``Softmax``) on padded batches whose mask is an int or boolean input (integration).
"""
import dataclasses
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fuzz_programs as fp
from conftest import assert_rewritten, assert_tree_close, fast_every
from cptransform import context_parallel
from test_match_support import check, randn, specs

B, T, H, D = 2, 32, 4, 8
VARIANTS = [f"{merge}_{band}" for merge in fp.PADDING_MERGES for band in ("causal", "window")]


def _case(variant: str, schedule: str = "ring", load_balance: str = "zigzag") -> fp.FuzzCase:
    return fp.FuzzCase(
        cls="mask_padding_merge", seed=3, cp=4, schedule=schedule, load_balance=load_balance,
        batch=B, seq=T, heads=2, kv_heads=2, head_dim=D, v_head_dim=D, model_dim=16,
        mask="padding_merge", causal=True, window=5, spelling="einsum", gqa_style="repeat",
        fill="neg_big", variant=variant, norm=False, rope=False, residual=False, bf16=False)


@pytest.mark.parametrize("variant", fast_every(VARIANTS, 4))
def test_every_merge_spelling_is_matched_without_a_dense_part(variant):
    loss, params, inputs = fp.build(_case(variant))
    f = context_parallel(loss, cp=4, schedule="ring", load_balance="zigzag")
    plans = f.module(params, inputs).facts.plan
    assert len(plans) == 1 and not plans[0].mask.dense, plans
    assert plans[0].mask.kv_padding or plans[0].mask.q_padding, plans[0].mask
    assert plans[0].mask.causal


@pytest.mark.parametrize("variant", fast_every(VARIANTS, 7))
def test_every_merge_spelling_is_exact_under_a_ring(variant):
    case = _case(variant)
    loss, params, inputs = fp.build(case)
    assert_rewritten(context_parallel(loss, cp=4, schedule="ring", load_balance="zigzag"),
                     params, inputs, count=1)
    outcome = fp.run_case(case)
    assert outcome.status == "passed", outcome


def _attention(q, k, v, mask):
    """``where(mask, s, -1e9)`` attention, ``mask`` broadcast to ``[B, 1, T, T]``."""
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D)
    s = jnp.where(mask, s, -1e9)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def _causal():
    return jnp.tril(jnp.ones((T, T), bool))


def _int_mask(rng):
    """An int ``[B, T]`` mask with entries beyond 0/1 (negative ones too) and a padded
    stretch."""
    x = rng.integers(-2, 4, (B, T)).astype(np.int32)
    x[0, :5] = 0
    return jnp.asarray(x)


def _qkv(rng):
    return randn(rng, B, T, H, D), randn(rng, B, T, H, D), randn(rng, B, T, H, D)


@pytest.mark.parametrize("spelling", ["product", "minimum_positive", "where"])
def test_int_data_beyond_zero_and_one_replays_the_programs_arithmetic(rng, spelling):
    merged = {
        "product": lambda x: (x[:, None, :] * _causal()[None]) != 0,
        "minimum_positive": lambda x: jnp.minimum(x[:, None, :], _causal()[None]
                                                  .astype(jnp.int32)) > 0,
        "where": lambda x: jnp.where(_causal()[None], x[:, None, :], 0) != 0,
    }[spelling]

    def fn(q, k, v, x):
        return _attention(q, k, v, merged(x)[:, None])

    module = check(fn, *_qkv(rng), _int_mask(rng))
    (spec,) = specs(module)
    assert spec.mask.causal and spec.mask.kv_padding and not spec.mask.dense


def _int_minimum(q, k, v, x):
    """keras-hub's merge of an int padding mask, tested ``!= 0``."""
    merged = jnp.minimum(x[:, None, :], _causal()[None].astype(jnp.int32))
    return _attention(q, k, v, merged[:, None].astype(bool))


def test_int_minimum_tested_nonzero_is_a_region_padding_term(rng):
    """``minimum(x, causal) != 0`` is ``x != 0`` on the causal band and ``x < 0`` above
    it: a region padding term (two ``[B, S]`` operands), no dense part, exact; the negative
    entries do make keys visible past the diagonal (the one-device result differs from
    ``causal & (x != 0)``)."""
    x = _int_mask(rng)
    assert bool(jnp.any(x < 0))
    qkv = _qkv(rng)
    (spec,) = specs(check(_int_minimum, *qkv, x))
    assert spec.mask.region_padding == (None, 0), spec.mask
    assert not (spec.mask.dense or spec.mask.causal or spec.mask.kv_padding), spec.mask
    conjunction = _attention(*qkv, (_causal()[None] & (x != 0)[:, None, :])[:, None])
    assert not np.allclose(_int_minimum(*qkv, x), conjunction, atol=1e-3)


@pytest.mark.parametrize("schedule,load_balance", [
    ("ring", "zigzag"), pytest.param("auto", "auto", marks=pytest.mark.slow),
    pytest.param("ulysses", "none", marks=pytest.mark.slow),
    pytest.param("allgather", "striped", marks=pytest.mark.slow)])
def test_int_minimum_loss_and_grads_match_one_device(rng, schedule, load_balance):
    """Values and gradients under ring/zigzag (and the other schedules), with negative
    entries, as one device computes them; the plan holds no dense term."""
    args = (*_qkv(rng), _int_mask(rng))
    loss = lambda q, k, v, x: jnp.sum(jnp.sin(_int_minimum(q, k, v, x)))  # noqa: E731
    f = context_parallel(loss, cp=4, schedule=schedule, load_balance=load_balance)
    assert_rewritten(f, *args, count=1)
    (plan,) = f.module(*args).facts.plan
    assert plan.mask.region_padding == (None, 0) and not plan.mask.dense, plan.mask
    got = jax.value_and_grad(f, (0, 1, 2))(*args)
    want = jax.value_and_grad(loss, (0, 1, 2))(*args)
    assert_tree_close(got, want, 1e-5)


def test_int_minimum_with_uneven_length_pads_queries_at_a_key_they_see(rng):
    """A length the layout pads (30 tokens over cp=4 zigzag): pad queries are aimed at a
    key whose inside test holds, so no pad row is empty and the numbers stay exact."""
    n = 30
    q, k, v = (randn(rng, B, n, H, D) for _ in range(3))
    x = rng.integers(-2, 4, (B, n)).astype(np.int32)
    x[0, :5] = 0

    def loss(q, k, v, x):
        causal = jnp.tril(jnp.ones((n, n), jnp.int32))
        merged = jnp.minimum(x[:, None, :], causal[None])
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D)
        s = jnp.where(merged[:, None] != 0, s, -jnp.inf)
        o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)
        return jnp.sum(jnp.where(jnp.isnan(o), 0.0, jnp.sin(o)))

    args = (q, k, v, jnp.asarray(x))
    f = context_parallel(loss, cp=4, schedule="ring", load_balance="zigzag")
    assert_rewritten(f, *args, count=1)
    got = jax.value_and_grad(f, (0, 1, 2))(*args)
    want = jax.value_and_grad(loss, (0, 1, 2))(*args)
    assert_tree_close(got, want, 1e-5)


@pytest.mark.parametrize("schedule,load_balance", [
    ("ring", "zigzag"), pytest.param("halo", "none", marks=pytest.mark.slow)])
def test_keras_gemma_sliding_layer_with_an_int_mask(rng, schedule, load_balance):
    """keras-hub Gemma's sliding layer: ``logical_and(minimum(mask, causal), sliding)`` of
    an int padding mask: the two-sided sliding window is a band term beside the region
    padding, which says causal (so halo takes it), exact in values and gradients."""
    w = 6

    def loss(q, k, v, x):
        merged = jnp.minimum(x[:, None, :], _causal()[None].astype(jnp.int32))
        ones = jnp.ones((T, T), bool)
        sliding = jnp.triu(ones, 1 - w) * jnp.tril(ones, w - 1)
        return jnp.sum(jnp.sin(_attention(q, k, v, jnp.logical_and(merged, sliding[None])
                                          [:, None])))

    args = (*_qkv(rng), _int_mask(rng))
    f = context_parallel(loss, cp=4, schedule=schedule, load_balance=load_balance)
    assert_rewritten(f, *args, count=1)
    (plan,) = f.module(*args).facts.plan
    assert plan.mask.band() == (-(w - 1), w - 1) and plan.mask.region_padding == (None, 0)
    assert not plan.mask.dense, plan.mask
    assert_tree_close(jax.value_and_grad(f, (0, 1, 2))(*args),
                      jax.value_and_grad(loss, (0, 1, 2))(*args), 1e-5)


REGION_VARIANTS = [f"{merge}_{band}" for merge in fp.REGION_PADDINGS
                   for band in ("causal", "window")]


def _region_case(variant: str) -> fp.FuzzCase:
    return dataclasses.replace(_case(variant), cls="mask_region_padding",
                               mask="region_padding")


@pytest.mark.parametrize("variant", fast_every(REGION_VARIANTS, 4))
def test_every_region_merge_is_a_region_padding_term_and_exact(variant):
    """Each spelling of the fuzzer's ``mask_region_padding`` class (``minimum``/``maximum``
    of int data, of a boolean mask, ``where`` of two data vectors; causal or a window): a
    region padding term, no dense part, exact under a ring with zigzag."""
    case = _region_case(variant)
    loss, params, inputs = fp.build(case)
    f = context_parallel(loss, cp=4, schedule="ring", load_balance="zigzag")
    assert_rewritten(f, params, inputs, count=1)
    (plan,) = f.module(params, inputs).facts.plan
    assert plan.mask.region_padding is not None and not plan.mask.dense, plan.mask
    outcome = fp.run_case(case)
    assert outcome.status == "passed", outcome


def _pair_arrays(hlo: str, rows: int, cols: int) -> list[str]:
    """Array types of ``hlo`` holding a ``rows × cols`` block of (query, key) pairs."""
    found = []
    for dims in re.findall(r"\b(?:pred|[su]\d+|bf16|f\d+)\[([0-9,]+)\]", hlo):
        shape = [int(n) for n in dims.split(",")]
        if any(a >= rows and b >= cols for a, b in zip(shape, shape[1:])):
            found.append(dims)
    return found


@pytest.mark.slow
def test_region_padding_holds_no_pair_array_per_device(rng):
    """At S=2048 over cp=8 the compiled loss-and-gradient program of keras-hub's int merge
    holds no ``[S/cp, S]`` array per device; the same mask given as data (the merged
    ``S×S`` int mask an input) does."""
    n, cp = 2048, 8
    q, k, v = (randn(rng, 1, n, 1, D) for _ in range(3))
    x = jnp.asarray(rng.integers(-1, 3, (1, n)), jnp.int32)
    causal = jnp.tril(jnp.ones((n, n), jnp.int32))

    def attend(q, k, v, merged):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D)
        s = jnp.where(merged[:, None] != 0, s, -1e9)
        return jnp.sum(jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v) ** 2)

    def region(q, k, v, x):
        # the causal mask built inside, as keras-hub's ``compute_causal_mask`` does
        return attend(q, k, v, jnp.minimum(x[:, None, :],
                                           jnp.tril(jnp.ones((n, n), jnp.int32))[None]))

    def dense(q, k, v, merged):
        return attend(q, k, v, merged)

    arrays = {}
    for name, fn, data in (("region", region, x),
                           ("dense", dense, jnp.minimum(x[:, None, :], causal[None]))):
        f = context_parallel(fn, cp=cp, schedule="ring", load_balance="zigzag")
        hlo = jax.jit(jax.grad(f, (0, 1, 2))).lower(q, k, v, data).compile().as_text()
        arrays[name] = _pair_arrays(hlo, n // cp, n)
    assert not arrays["region"], arrays["region"][:3]
    assert arrays["dense"]


# -- the packages' own mask builders (integration) -----------------------------------------

def _padded(dtype):
    mask = np.ones((B, T), np.int32)
    mask[1, :6] = 0      # left padding: the first rows see no key under causal
    return jnp.asarray(mask).astype(dtype)


@pytest.mark.integration
@pytest.mark.parametrize("dtype", [jnp.int32, jnp.bool_])
def test_deepmind_gemma_mask_builders_on_a_padded_batch(rng, dtype):
    """``make_causal_attn_mask`` (``input_mask[..., None, :] * causal``) and the local
    layer's sliding mask around ``build_positions_from_mask``'s positions, as
    ``gemma.modules.Attention`` applies them (``where(mask, logits, K_MASK)``)."""
    from model_families import _deepmind_gemma
    transformer, modules = _deepmind_gemma()

    def fn(q, k, v, input_mask):
        mask = transformer.make_causal_attn_mask(input_mask)
        positions = transformer.build_positions_from_mask(input_mask)
        local = mask * modules._create_sliding_mask(positions, 0, T, 8)
        out = []
        for m in (mask, local):
            s = jnp.einsum("bqhd,bkhd->bhqk", q, k)
            s = jnp.where(jnp.expand_dims(m, -3), s, modules.K_MASK)
            out.append(jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v))
        return sum(jnp.sum(o ** 2) for o in out)

    args = (*_qkv(rng), _padded(dtype))
    f = context_parallel(fn, cp=4, schedule="ring", load_balance="zigzag")
    assert_rewritten(f, *args, count=2)
    plans = f.module(*args).facts.plan
    assert not any(p.mask.dense for p in plans)
    assert [p.mask.coordinate_band is not None for p in plans] == [False, True]
    assert_tree_close(jax.grad(f, argnums=(0, 1, 2))(*args),
                      jax.grad(fn, argnums=(0, 1, 2))(*args))


@pytest.mark.integration
@pytest.mark.parametrize("dtype", [jnp.int32, jnp.bool_])
def test_keras_hub_mask_builders_on_a_padded_batch(rng, dtype):
    """keras-hub's decoder mask (``compute_causal_mask``, ``merge_padding_and_attention_mask``:
    ``minimum`` of int masks) through Keras' ``Softmax(mask=...)`` (``mask > 0.5`` in the
    mask's int dtype, post-softmax zeroing)."""
    os.environ.setdefault("KERAS_BACKEND", "jax")
    pytest.importorskip("keras_hub")
    import keras
    if keras.backend.backend() != "jax":
        pytest.skip(f"Keras runs on {keras.backend.backend()}: set KERAS_BACKEND=jax")
    from keras_hub.src.layers.modeling.transformer_layer_utils import (
        compute_causal_mask, merge_padding_and_attention_mask)
    softmax = keras.layers.Softmax(axis=-1)

    def fn(q, k, v, padding_mask):
        x = jnp.zeros((B, T, 1))
        mask = merge_padding_and_attention_mask(x, padding_mask, compute_causal_mask(B, T, T))
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k)
        p = softmax(s, mask=mask[:, None])
        return jnp.sum(jnp.einsum("bhqk,bkhd->bqhd", p, v) ** 2)

    args = (*_qkv(rng), _padded(dtype))
    f = context_parallel(fn, cp=4, schedule="ring", load_balance="zigzag")
    assert_rewritten(f, *args, count=1)
    (plan,) = f.module(*args).facts.plan
    assert plan.mask.causal and not plan.mask.dense
    assert_tree_close(jax.grad(f, argnums=(0, 1, 2))(*args),
                      jax.grad(fn, argnums=(0, 1, 2))(*args))
