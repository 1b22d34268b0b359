"""Tiny configurations of public model families, random weights, one loss each.

Each builder returns ``(loss, args)``: ``loss(params, *batch)`` is the ordinary
single-device training loss of the package's own model code (next-token cross-entropy for
causal LMs; labels in, decoder inputs built by the model's own ``shift_tokens_right`` for
encoder-decoders), ``args`` its random arguments. Nothing is downloaded: every model is
built from a config with random weights. A builder skips its test when its package is
missing (``pytest.importorskip``).
"""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

#: Tokens per sequence and sequences per batch: a multiple of 2·cp for cp ≤ 8.
SEQ, BATCH, VOCAB = 32, 2, 64
#: Heads (query and key/value) divisible by cp = 4, so Ulysses applies.
HEADS, DIM = 4, 32
CP = 4


def tokens(seed: int, shape=None) -> jax.Array:
    """Random token ids in ``[1, VOCAB)`` (0 is kept for padding), ``[BATCH, SEQ]`` by
    default (read when called: ``bench/padding_memory.py`` sets a longer ``SEQ``)."""
    shape = (BATCH, SEQ) if shape is None else shape
    return jnp.asarray(np.random.default_rng(seed).integers(1, VOCAB, shape), jnp.int32)


def padding(side: str, pad: int = 6) -> jax.Array:
    """An int ``[B, S]`` attention mask as tokenizers give it (1 = token, 0 = padding): the
    first row unpadded, the second padded by ``pad`` tokens on ``side`` (``"left"``, as for
    generation, puts query rows under causal masking that see no key)."""
    mask = np.ones((BATCH, SEQ), np.int32)
    if side == "left":
        mask[1, :pad] = 0
    else:
        mask[1, SEQ - pad:] = 0
    return jnp.asarray(mask)


def next_token_loss(logits: jax.Array, ids: jax.Array) -> jax.Array:
    """Mean cross-entropy of ``logits[:, t]`` predicting ``ids[:, t + 1]``."""
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1))


def label_loss(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean cross-entropy of ``logits[:, t]`` predicting ``labels[:, t]``."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))


# -- transformers (Flax) ---------------------------------------------------------------------

def _transformers():
    return pytest.importorskip("transformers")


def _causal_lm(model_cls, config):
    model = model_cls(config, seed=0)

    def loss(params, ids):
        return next_token_loss(model(ids, params=params).logits, ids)

    return loss, (model.params, tokens(1))


def _padded_causal_lm(model_cls, config, side: str):
    """A transformers causal LM called with an int ``attention_mask`` input (what its
    tokenizer returns for a padded batch); padded positions hold token 0."""
    model = model_cls(config, seed=0)
    mask = padding(side)

    def loss(params, ids, attention_mask):
        logits = model(ids, attention_mask=attention_mask, params=params).logits
        return next_token_loss(logits, ids)

    return loss, (model.params, tokens(1) * mask, mask)


def llama():
    """transformers' ``FlaxLlamaForCausalLM`` (RoPE, GQA, RMSNorm, SwiGLU)."""
    t = _transformers()
    return _causal_lm(t.FlaxLlamaForCausalLM, t.LlamaConfig(
        vocab_size=VOCAB, hidden_size=DIM, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=HEADS, num_key_value_heads=HEADS, max_position_embeddings=SEQ))


def mistral():
    """transformers' ``FlaxMistralForCausalLM`` without a sliding window (full causal)."""
    t = _transformers()
    return _causal_lm(t.FlaxMistralForCausalLM, t.MistralConfig(
        vocab_size=VOCAB, hidden_size=DIM, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=HEADS, num_key_value_heads=HEADS, max_position_embeddings=SEQ,
        sliding_window=None))


def llama_padded():
    """transformers' Llama on a left-padded batch: the key-padding mask is data
    (``attention_mask != 0`` broadcast against the causal mask, added as a bias)."""
    t = _transformers()
    return _padded_causal_lm(t.FlaxLlamaForCausalLM, t.LlamaConfig(
        vocab_size=VOCAB, hidden_size=DIM, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=HEADS, num_key_value_heads=2, max_position_embeddings=SEQ), "left")


def gpt2_padded():
    """transformers' GPT-2 on a right-padded batch."""
    t = _transformers()
    return _padded_causal_lm(t.FlaxGPT2LMHeadModel, t.GPT2Config(
        vocab_size=VOCAB, n_embd=DIM, n_layer=2, n_head=HEADS, n_positions=SEQ,
        embd_pdrop=0.0, attn_pdrop=0.0, resid_pdrop=0.0), "right")


def mistral_window_padded():
    """transformers' Mistral with a sliding window on a right-padded batch."""
    t = _transformers()
    return _padded_causal_lm(t.FlaxMistralForCausalLM, t.MistralConfig(
        vocab_size=VOCAB, hidden_size=DIM, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=HEADS, num_key_value_heads=2, max_position_embeddings=SEQ,
        sliding_window=8), "right")


def gpt_neo():
    """transformers' ``FlaxGPTNeoForCausalLM``: a global and a local (windowed) layer."""
    t = _transformers()
    return _causal_lm(t.FlaxGPTNeoForCausalLM, t.GPTNeoConfig(
        vocab_size=VOCAB, hidden_size=DIM, num_layers=2, num_heads=HEADS,
        attention_types=[[["global", "local"], 1]], window_size=8,
        max_position_embeddings=SEQ, embed_dropout=0.0, attention_dropout=0.0,
        resid_dropout=0.0))


def _seq2seq(model_cls, config, shift):
    model = model_cls(config, seed=0)

    def loss(params, input_ids, labels):
        decoder_input_ids = shift(labels, config.pad_token_id, config.decoder_start_token_id)
        logits = model(input_ids, decoder_input_ids=decoder_input_ids, params=params).logits
        return label_loss(logits, labels)

    return loss, (model.params, tokens(2), tokens(3))


def bart():
    """transformers' ``FlaxBartForConditionalGeneration`` trained from labels (its own
    ``shift_tokens_right`` builds the decoder inputs)."""
    t = _transformers()
    from transformers.models.bart.modeling_flax_bart import shift_tokens_right
    return _seq2seq(t.FlaxBartForConditionalGeneration, t.BartConfig(
        vocab_size=VOCAB, d_model=DIM, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=HEADS, decoder_attention_heads=HEADS,
        encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=SEQ,
        dropout=0.0, attention_dropout=0.0), shift_tokens_right)


class _NumpyClipKeywords:
    """``jax.numpy`` whose ``clip`` also takes numpy's keyword names ``a_min``/``a_max``,
    which JAX no longer accepts (transformers 4.x's Flax T5 computes its relative-position
    buckets with ``jnp.clip(x, a_max=...)``): the same ``clip``, under the old names."""

    def __getattr__(self, name):
        return getattr(jnp, name)

    @staticmethod
    def clip(x, a_min=None, a_max=None, **bounds):
        return jnp.clip(x, min=bounds.get("min", a_min), max=bounds.get("max", a_max))


def _flax_t5():
    """transformers' Flax T5 module, its ``jnp`` given :class:`_NumpyClipKeywords` where this
    JAX refuses ``clip(a_max=...)`` (the model's code runs unchanged, every version)."""
    _transformers()
    from transformers.models.t5 import modeling_flax_t5
    try:
        jnp.clip(jnp.zeros(1), a_max=1)
    except TypeError:
        modeling_flax_t5.jnp = _NumpyClipKeywords()
    return modeling_flax_t5


def _t5_config():
    t = _transformers()
    return t.T5Config(
        vocab_size=VOCAB, d_model=DIM, d_kv=DIM // HEADS, d_ff=64, num_layers=1,
        num_decoder_layers=1, num_heads=HEADS, relative_attention_num_buckets=8,
        dropout_rate=0.0, decoder_start_token_id=0)


def t5():
    """transformers' ``FlaxT5ForConditionalGeneration`` (relative position bias) trained
    from labels (its own ``shift_tokens_right`` builds the decoder inputs)."""
    t5_module = _flax_t5()
    return _seq2seq(t5_module.FlaxT5ForConditionalGeneration, _t5_config(),
                    t5_module.shift_tokens_right)


def t5_decoder_inputs():
    """transformers' Flax T5 called with ``decoder_input_ids`` given (teacher forcing from a
    data pipeline) and padded batches: int ``attention_mask`` (encoder, right-padded) and
    ``decoder_attention_mask`` (left-padded) inputs, as a tokenizer returns them. The model
    adds each mask into its relative-position bias as ``where(mask > 0, 0, finfo.min)``."""
    model = _flax_t5().FlaxT5ForConditionalGeneration(_t5_config(), seed=0)

    def loss(params, input_ids, attention_mask, decoder_input_ids, decoder_attention_mask,
             labels):
        logits = model(input_ids, attention_mask=attention_mask,
                       decoder_input_ids=decoder_input_ids,
                       decoder_attention_mask=decoder_attention_mask, params=params).logits
        return label_loss(logits, labels)

    encoder_mask, decoder_mask = padding("right"), padding("left")
    return loss, (model.params, tokens(2) * encoder_mask, encoder_mask,
                  tokens(8) * decoder_mask, decoder_mask, tokens(3))


# -- penzai ----------------------------------------------------------------------------------

def penzai_llama(use_layer_stack: bool):
    """penzai's Llama-style transformer (``llamalike_common``), with or without
    ``use_layer_stack`` (layers as one scanned stack)."""
    pytest.importorskip("penzai")
    from penzai import pz
    from penzai.models.transformer.variants import llamalike_common

    config = llamalike_common.LlamalikeTransformerConfig(
        num_kv_heads=HEADS, query_head_multiplier=1, embedding_dim=DIM, projection_dim=8,
        mlp_hidden_dim=64, num_decoder_blocks=2, vocab_size=VOCAB, mlp_variant="swiglu",
        tie_embedder_and_logits=False, rope_wavelength=10_000, rms_norm_eps=1e-6,
        use_layer_stack=use_layer_stack, parameter_dtype=jnp.float32,
        activation_dtype=jnp.float32)
    model = llamalike_common.build_llamalike_transformer(config, init_base_rng=jax.random.key(0))
    graphdef, params = pz.unbind_params(model, freeze=True)
    params = {p.label: p.value for p in params}

    def loss(params, ids):
        bound = pz.bind_variables(graphdef, [pz.Parameter(value=v, label=k)
                                             for k, v in params.items()])
        named = pz.nx.wrap(ids).tag("batch", "seq")
        logits = bound(named, token_positions=pz.nx.arange("seq", ids.shape[1]))
        return next_token_loss(logits.untag("batch", "seq", "vocabulary").unwrap(), ids)

    return loss, (params, tokens(4))


# -- DeepMind gemma -------------------------------------------------------------------------

def _deepmind_gemma():
    """``(gemma.transformer, gemma.modules)`` of DeepMind's package, skipping when it is not
    installed. ``examples/gemma.py`` shares the name: once a test module has put
    ``examples/`` on ``sys.path`` and imported it, ``import gemma`` finds the script, so the
    package is imported with that folder out of the way."""
    import importlib
    import sys

    script = sys.modules.get("gemma")
    if script is not None and not hasattr(script, "__path__"):
        folder = os.path.dirname(os.path.abspath(script.__file__))
        saved_path = sys.path[:]
        sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != folder]
        del sys.modules["gemma"]
        try:
            return _deepmind_gemma()
        finally:
            sys.path[:] = saved_path
    transformer = pytest.importorskip("gemma.transformer")
    return transformer, importlib.import_module("gemma.modules")


def gemma():
    """DeepMind's ``gemma`` 2.x Flax transformer (``gemma.transformer``, Gemma 2 style):
    alternating local sliding-window and global layers, GQA, attention and final logit
    soft-caps, post-norms; positions and masks from a padding mask the library's way
    (``build_positions_from_mask``: ``cumsum(input_mask)``, ``make_causal_attn_mask``)."""
    transformer, modules = _deepmind_gemma()

    config = transformer.TransformerConfig(
        num_layers=2, num_embed=VOCAB, embed_dim=DIM, hidden_dim=64, num_heads=HEADS,
        head_dim=8, num_kv_heads=2, final_logit_softcap=30.0, use_post_attn_norm=True,
        use_post_ffw_norm=True, max_cache_length=None, attn_logits_soft_cap=50.0,
        attention_types=(modules.AttentionType.LOCAL_SLIDING, modules.AttentionType.GLOBAL),
        sliding_window_size=8)
    model = transformer.Transformer(config)
    ids = tokens(5)

    def loss(params, ids):
        input_mask = ids != 0
        positions = transformer.build_positions_from_mask(input_mask)
        mask = transformer.make_causal_attn_mask(input_mask)
        logits, _ = model.apply({"params": params}, ids, positions, None, mask)
        return next_token_loss(logits, ids)

    params = model.init(jax.random.key(0), ids, jnp.zeros_like(ids), None,
                        jnp.ones((BATCH, SEQ, SEQ), bool))["params"]
    return loss, (params, ids)


def gemma_padded(mask_dtype=bool):
    """DeepMind's gemma with the padding mask an input (left padding): positions from its
    ``cumsum``, the mask from ``make_causal_attn_mask`` (``mask_dtype``: ``int32`` as a
    tokenizer's ``attention_mask``, which the library multiplies into the causal mask)."""
    transformer, modules = _deepmind_gemma()
    config = transformer.TransformerConfig(
        num_layers=2, num_embed=VOCAB, embed_dim=DIM, hidden_dim=64, num_heads=HEADS,
        head_dim=8, num_kv_heads=2, final_logit_softcap=30.0, use_post_attn_norm=True,
        use_post_ffw_norm=True, max_cache_length=None, use_qk_norm=True,
        attention_types=(modules.AttentionType.LOCAL_SLIDING, modules.AttentionType.GLOBAL),
        sliding_window_size=8)
    model = transformer.Transformer(config)
    mask = (padding("left") != 0).astype(mask_dtype)

    def loss(params, ids, input_mask):
        positions = transformer.build_positions_from_mask(input_mask)
        attn_mask = transformer.make_causal_attn_mask(input_mask)
        logits, _ = model.apply({"params": params}, ids, positions, None, attn_mask)
        return next_token_loss(logits, ids)

    ids = tokens(7) * mask
    params = model.init(jax.random.key(0), ids, jnp.zeros_like(ids), None,
                        jnp.ones((BATCH, SEQ, SEQ), bool))["params"]
    return loss, (params, ids, mask)


# -- keras-hub (Keras 3 on JAX) --------------------------------------------------------------

def _keras_causal_lm(name: str, padded: bool = False, mask_dtype=bool, heads=None, **config):
    """keras-hub's ``<name>CausalLM`` on a tiny ``<name>Backbone``; the loss calls the model
    statelessly (``stateless_call``) on the trainable variables, with the padding mask the
    library's preprocessors give (``token_ids != 0``; ``padded``: a right-padded batch whose
    mask is an input, boolean as a dataset of preprocessed batches hands it over, or of
    ``mask_dtype``). ``heads``: the backbone's head arguments (GQA by default)."""
    os.environ.setdefault("KERAS_BACKEND", "jax")  # read when Keras is first imported
    keras_hub = pytest.importorskip("keras_hub")
    import keras
    if keras.backend.backend() != "jax":
        pytest.skip(f"Keras runs on {keras.backend.backend()}: set KERAS_BACKEND=jax")
    keras.utils.set_random_seed(0)
    heads = dict(num_query_heads=HEADS, num_key_value_heads=2) if heads is None else heads
    backbone = getattr(keras_hub.models, f"{name}Backbone")(
        vocabulary_size=VOCAB, num_layers=2, hidden_dim=DIM, intermediate_dim=64,
        **heads, **config)
    model = getattr(keras_hub.models, f"{name}CausalLM")(backbone=backbone, preprocessor=None)
    frozen = [v.value for v in model.non_trainable_variables]

    weights = [v.value for v in model.trainable_variables]
    if padded:
        mask = (padding("right") != 0).astype(mask_dtype)

        def padded_loss(params, ids, padding_mask):
            logits, _ = model.stateless_call(params, frozen,
                                             {"token_ids": ids, "padding_mask": padding_mask})
            return next_token_loss(logits, ids)

        return padded_loss, (weights, tokens(6) * (mask != 0), mask)

    def loss(params, ids):
        logits, _ = model.stateless_call(params, frozen,
                                         {"token_ids": ids, "padding_mask": ids != 0})
        return next_token_loss(logits, ids)

    return loss, (weights, tokens(6))


def keras_llama():
    """keras-hub's Llama (``LlamaCausalLM``: RoPE, GQA, SwiGLU; Keras' own
    ``dot_product_attention``)."""
    return _keras_causal_lm("Llama")


def keras_gemma(**padded):
    """keras-hub's Gemma 2 (``GemmaCausalLM``): a sliding-window layer (``triu · tril`` of
    ones) and a global one, int masks merged by ``minimum``, ``Softmax(mask=...)``, soft-caps,
    and rows with no visible key zeroed after the attention."""
    return _keras_causal_lm(
        "Gemma", head_dim=8, query_head_dim_normalize=True, use_post_ffw_norm=True,
        use_post_attention_norm=True, final_logit_soft_cap=30.0, attention_logit_soft_cap=50.0,
        use_sliding_window_attention=True, sliding_window_size=8, **padded)


def keras_gpt2(**padded):
    """keras-hub's GPT-2 (``GPT2CausalLM``: ``TransformerDecoder`` layers, Keras'
    ``MultiHeadAttention``), dropout off."""
    return _keras_causal_lm("GPT2", heads=dict(num_heads=HEADS), dropout=0.0,
                            max_sequence_length=SEQ, **padded)


def keras_mistral(**padded):
    """keras-hub's Mistral (``MistralCausalLM``) with a sliding window of 8."""
    return _keras_causal_lm("Mistral", sliding_window=8, **padded)


FAMILIES = {
    "llama": llama, "mistral": mistral, "gpt_neo": gpt_neo, "bart": bart, "t5": t5,
    "t5_decoder_inputs": t5_decoder_inputs,
    "penzai": lambda: penzai_llama(False), "penzai_stack": lambda: penzai_llama(True),
    "gemma": gemma, "keras_llama": keras_llama, "keras_gemma": keras_gemma,
    # padded batches, the padding mask an input as tokenizers and datasets give it
    "llama_padded": llama_padded, "gpt2_padded": gpt2_padded,
    "mistral_window_padded": mistral_window_padded, "gemma_padded": gemma_padded,
    "keras_llama_padded": lambda: _keras_causal_lm("Llama", padded=True),
    "keras_gemma_padded": lambda: keras_gemma(padded=True),
    "keras_gpt2_padded": lambda: keras_gpt2(padded=True),
    "keras_mistral_padded": lambda: keras_mistral(padded=True),
    # the padding mask an int input, as a tokenizer's attention_mask
    "gemma_padded_int": lambda: gemma_padded(np.int32),
    "keras_llama_padded_int": lambda: _keras_causal_lm("Llama", padded=True,
                                                       mask_dtype=np.int32),
    "keras_gemma_padded_int": lambda: keras_gemma(padded=True, mask_dtype=np.int32),
    "keras_gpt2_padded_int": lambda: keras_gpt2(padded=True, mask_dtype=np.int32),
    "keras_mistral_padded_int": lambda: keras_mistral(padded=True, mask_dtype=np.int32),
}

#: The schedules each family is checked under: (schedule, load_balance).
SCHEDULES = {"ring_zigzag": ("ring", "zigzag"), "ulysses": ("ulysses", "none"),
             "allgather": ("allgather", "none"), "auto": ("auto", "auto")}
