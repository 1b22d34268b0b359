"""Masks built the way public model libraries build them stay analytic (no S×S operand):
transformers' precomputed ``make_causal_mask`` cut to the sequence, GPT-Neo / Mistral
local windows, keras-hub's int masks merged with ``minimum``, Keras' post-softmax zeroing
(``empty_rows="zero"``), padding spelled ``data > 0`` or tested after a broadcast
(transformers' int ``attention_mask``), and a scanned layer whose fill value
is closed over (penzai's layer stack). Small self-contained reproductions of each spelling;
matched masks checked, then loss and every gradient against one device per schedule."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import fast_every, needs_halo
from jax import lax

from cptransform import context_parallel
from test_match_support import check, check_refused, randn, specs
from test_nan_inf import assert_same

B, T, H, D = 2, 32, 4, 8
#: ``config.max_position_embeddings`` (longer than the sequence: the mask is cut to it).
MAX_POSITIONS = 48
WINDOW = 4
F32_MIN = float(jnp.finfo(jnp.float32).min)


def hf_full_causal():
    """transformers' ``self.causal_mask``: ``make_causal_mask(ones((1, max_positions)))``."""
    return nn.make_causal_mask(jnp.ones((1, MAX_POSITIONS), dtype="bool"), dtype="bool")


def hf_attention(q, k, v, causal_mask, attention_mask):
    """transformers Flax self-attention: cut, broadcast, combine with the padding mask,
    turned into a bias with ``lax.select`` (FlaxGPTNeo / FlaxMistral / FlaxLlama)."""
    causal_mask = jnp.broadcast_to(causal_mask, (q.shape[0],) + causal_mask.shape[1:])
    attention_mask = jnp.broadcast_to(jnp.expand_dims(attention_mask, axis=(-3, -2)),
                                      causal_mask.shape)
    mask = nn.combine_masks(attention_mask, causal_mask)
    bias = lax.select(mask > 0, jnp.full(mask.shape, 0.0), jnp.full(mask.shape, F32_MIN))
    return nn.dot_product_attention(q, k, v, bias=bias)


def hf_slice(q, k, v, valid):
    return hf_attention(q, k, v, hf_full_causal()[:, :, :T, :T], valid)


def hf_dynamic_slice(q, k, v, valid):
    cut = lax.dynamic_slice(hf_full_causal(), (0, 0, 0, 0), (1, 1, T, T))
    return hf_attention(q, k, v, cut, valid)


def gpt_neo_local(q, k, v, valid):
    full = hf_full_causal()
    local = full ^ jnp.tril(full, -WINDOW)
    return hf_attention(q, k, v, local[:, :, :T, :T], valid)


def mistral_sliding(q, k, v, valid):
    local = jnp.triu(hf_full_causal(), k=-WINDOW)
    return hf_attention(q, k, v, local[:, :, :T, :T], valid)


def tril_difference(q, k, v, valid):
    ones = jnp.ones((T, T))
    local = (jnp.tril(ones) - jnp.tril(ones, -WINDOW))[None, None]
    return hf_attention(q, k, v, local, valid)


def keras_causal(batch, length):
    """keras-hub's ``compute_causal_mask`` (float positions)."""
    out_pos = jnp.arange(length, dtype="float32") + jnp.asarray(0, "float32")
    in_pos = jnp.arange(length, dtype="float32")
    return jnp.broadcast_to((out_pos[:, None] >= in_pos)[None], (batch, length, length))


def keras_softmax(scores, mask):
    """``keras.layers.Softmax(mask=...)``: fill, softmax, then zero what the mask hides."""
    if mask.dtype != jnp.bool_:
        mask = mask > 0.5
    scores = jnp.where(mask, scores, -1e9)
    return jnp.where(mask, jax.nn.softmax(scores, axis=-1), 0.0)


def keras_attention(q, k, v, merge, valid):
    """keras-hub decoder attention: ``merge_padding_and_attention_mask``, then Keras MHA."""
    padding = jnp.expand_dims(valid, axis=1).astype("int32")
    mask = merge(padding, keras_causal(q.shape[0], T).astype("int32"))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * D ** -0.5
    probs = keras_softmax(scores, mask[:, None])
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v)


def keras_minimum(q, k, v, valid):
    return keras_attention(q, k, v, jnp.minimum, valid)


def keras_product(q, k, v, valid):
    return keras_attention(q, k, v, lambda a, b: a * b, valid)


def keras_bitwise_and(q, k, v, valid):
    return keras_attention(q, k, v, lambda a, b: a & b, valid)


def data_padding(q, k, v, tokens):
    """A key padding mask spelled ``tokens > 0`` (pad id 0), and a causal mask."""
    keep = (tokens > 0)[:, None, None, :] & jnp.tril(jnp.ones((T, T), bool))
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * D ** -0.5
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(jnp.where(keep, s, -jnp.inf)), v)


def pad_id_after_broadcast(q, k, v, tokens):
    """A key padding mask tested after it is broadcast to the logits' shape
    (``tokens[:, None, None, :] != PAD``): the test reads the ``[B, T]`` data, not an
    ``S×S`` value."""
    keep = (jnp.broadcast_to(tokens[:, None, None, :], (B, 1, T, T)) != PAD) \
        & jnp.tril(jnp.ones((T, T), bool))
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * D ** -0.5
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(jnp.where(keep, s, -1e9)), v)


def scanned_layers(q, k, v, valid):
    """Two layers under ``lax.scan`` whose fill value and mask are closed over (what a
    penzai layer stack traces to): they reach the body as scan constants."""
    fill = jnp.asarray(-1e9, jnp.float32) * jnp.ones(())
    causal = jnp.tril(jnp.ones((T, T), bool))

    def body(x, scale):
        s = jnp.einsum("bqhd,bkhd->bhqk", q * scale, x) * D ** -0.5
        s = jnp.where(causal & valid[:, None, None, :], s, fill)
        return x + jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v), None

    return lax.scan(body, k, jnp.asarray([1.0, 0.5]))[0]


#: name -> (function, band of the matched mask, segments expected, empty_rows, count)
CASES = {
    "hf_slice": (hf_slice, (None, 0), True, "uniform", 1),
    "hf_dynamic_slice": (hf_dynamic_slice, (None, 0), True, "uniform", 1),
    "gpt_neo_local": (gpt_neo_local, (-(WINDOW - 1), 0), True, "uniform", 1),
    "mistral_sliding": (mistral_sliding, (-WINDOW, 0), True, "uniform", 1),
    "tril_difference": (tril_difference, (-(WINDOW - 1), 0), True, "uniform", 1),
    "keras_minimum": (keras_minimum, (None, 0), True, "zero", 1),
    "keras_product": (keras_product, (None, 0), True, "zero", 1),
    "keras_bitwise_and": (keras_bitwise_and, (None, 0), True, "zero", 1),
    "data_padding": (data_padding, (None, 0), True, "nan", 1),
    "scanned_layers": (scanned_layers, (None, 0), True, "uniform", 1),
    # transformers' attention_mask as its tokenizer returns it (int), or as float data:
    # combine_masks tests it against 0 after broadcasting it to the logits' shape
    "hf_int_attention_mask": (hf_slice, (None, 0), True, "uniform", 1),
    "hf_float_attention_mask": (mistral_sliding, (-WINDOW, 0), True, "uniform", 1),
    "pad_id_after_broadcast": (pad_id_after_broadcast, (None, 0), True, "uniform", 1),
}

#: The token id ``pad_id_after_broadcast`` pads with.
PAD = 3


def inputs(rng, name):
    q, k, v = (randn(rng, B, T, H, D) for _ in range(3))
    valid = rng.random((B, T)) > 0.25
    # Key 0 padded: batch 0's first query sees no key, the row Keras' zeroing empties.
    # Elsewhere key 0 is kept (empty rows under finite and -inf fills: test_nan_inf).
    valid[0, 0] = not name.startswith("keras")
    if name == "data_padding":
        tokens = rng.integers(1, 50, (B, T)) * valid
        return q, k, v, jnp.asarray(tokens, jnp.int32)
    if name == "pad_id_after_broadcast":
        return q, k, v, jnp.asarray(np.where(valid, rng.integers(4, 50, (B, T)), PAD),
                                    jnp.int32)
    if name.startswith("hf_int"):
        return q, k, v, jnp.asarray(valid, jnp.int32)
    if name.startswith("hf_float"):
        return q, k, v, jnp.asarray(valid, jnp.float32)
    return q, k, v, jnp.asarray(valid)


@pytest.mark.parametrize("name", fast_every(list(CASES), 3))
def test_matched_mask_is_analytic(rng, name):
    fn, band, segments, rows, count = CASES[name]
    module = check(fn, *inputs(rng, name), count=count, rtol=1e-5)
    for spec in specs(module):
        assert not spec.mask.dense, spec.mask
        assert spec.mask.band() == band, spec.mask
        # ``segments``: the case's padding is read as a per-token (key padding) operand
        assert spec.mask.kv_padding == segments and spec.mask.empty_rows == rows, spec.mask


def test_maximum_of_masks_is_a_region_padding_term(rng):
    """``max(padding, causal)`` is the padding's test off the causal band and every key on
    it: a region padding term, exact, no dense part."""
    fn = lambda q, k, v, valid: keras_attention(q, k, v, jnp.maximum, valid)  # noqa: E731
    (spec,) = specs(check(fn, *inputs(rng, "keras_maximum"), rtol=1e-5))
    assert spec.mask.region_padding == (1, None) and not spec.mask.dense, spec.mask


def test_keras_minimum_of_an_int_padding_mask_is_a_region_padding_term(rng):
    """keras-hub's ``minimum`` given the int ``padding_mask`` a user passes (entries beyond
    0/1, negative ones included), then Keras' ``Softmax`` (``> 0.5``) and the
    ``dot_product_attention`` path's ``!= 0``: the first is a conjunction with causal (key
    padding), the second ``mask != 0`` on the causal band and ``mask < 0`` above it."""
    q, k, v, valid = inputs(rng, "keras_minimum")
    data = jnp.asarray(np.where(np.asarray(valid), rng.integers(-1, 3, valid.shape), 0),
                       jnp.int32)

    def tested_nonzero(q, k, v, data):
        mask = jnp.minimum(data[:, None, :], keras_causal(q.shape[0], T).astype("int32"))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * D ** -0.5
        scores = jnp.where(mask[:, None] != 0, scores, -1e9)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)

    (spec,) = specs(check(keras_minimum, q, k, v, data, rtol=1e-5))
    assert spec.mask.kv_padding and spec.mask.causal and not spec.mask.dense, spec.mask
    (spec,) = specs(check(tested_nonzero, q, k, v, data, rtol=1e-5))
    assert spec.mask.region_padding == (None, 0) and not spec.mask.dense, spec.mask


def test_zeroing_by_another_mask_is_refused(rng):
    """Zeroing the probabilities by a mask other than the logits' changes the attention."""
    def fn(q, k, v, valid):
        causal = jnp.tril(jnp.ones((T, T), bool))
        s = jnp.where(causal, jnp.einsum("bqhd,bkhd->bhqk", q, k), -1e9)
        p = jnp.where(causal & valid[:, None, None, :], jax.nn.softmax(s), 0.0)
        return jnp.einsum("bhqk,bkhd->bqhd", p, v)

    check_refused(fn, *inputs(rng, "hf_slice"), reason="zeroed after the softmax")


SCHEDULES = {"ring": dict(schedule="ring", load_balance="zigzag"),
             "ulysses": dict(schedule="ulysses", load_balance="none"),
             "allgather": dict(schedule="allgather", load_balance="none")}


@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("name", ["hf_slice", "gpt_neo_local", "mistral_sliding",
                                  "tril_difference", "keras_minimum", "data_padding",
                                  "scanned_layers", "hf_int_attention_mask",
                                  "pad_id_after_broadcast"])
def test_loss_and_grads_match_one_device(rng, name, schedule):
    fn = CASES[name][0]
    args = inputs(rng, name)
    loss = lambda q, k, v, m: jnp.sum(jnp.sin(fn(q, k, v, m)))  # noqa: E731
    cp = context_parallel(loss, cp=4, **SCHEDULES[schedule])
    got = jax.value_and_grad(cp, (0, 1, 2))(*args)
    want = jax.value_and_grad(loss, (0, 1, 2))(*args)
    jax.tree.map(lambda g, w: assert_same(g, w, 1e-5), got, want)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt_neo_local", "mistral_sliding", "tril_difference"])
def test_windows_run_under_halo(rng, name):
    """The local layers' windows are windows: the halo schedule takes them."""
    needs_halo()
    fn = CASES[name][0]
    args = inputs(rng, name)
    loss = lambda q, k, v, m: jnp.sum(jnp.sin(fn(q, k, v, m)))  # noqa: E731
    cp = context_parallel(loss, cp=4, schedule="halo", load_balance="none")
    assert "schedule: halo" in cp.explain(*args)
    got = jax.value_and_grad(cp, (0, 1, 2))(*args)
    want = jax.value_and_grad(loss, (0, 1, 2))(*args)
    jax.tree.map(lambda g, w: assert_same(g, w, 1e-5), got, want)
