"""Random small programs around attention, for the differential fuzzer.

A :class:`FuzzCase` is a printable record (class, seed, sizes, mask, spelling, options).
:func:`draw_case` fills one in from any ``choose(name, options)`` function: hypothesis'
``data.draw`` in ``tests/test_fuzz.py``, a NumPy generator in ``bench/fuzz.py``.
:func:`build` turns a case into ``(loss_fn, params, inputs)``: ``params`` holds every float
operand (each gets a gradient), ``inputs`` the integer / boolean ones. :func:`run_case`
runs ``jax.value_and_grad`` of the undecorated and the ``@context_parallel`` function
(both jitted) and classifies the result:

- ``passed``: loss and every gradient equal (fp32: ``rtol=1e-5`` plus ``atol=1e-5 * max|ref|``;
  bf16 attention: ``2e-2``), NaN where the reference is NaN;
- ``unmatched``: the numbers are equal, but only because no attention was found and the
  function ran unsharded (run with ``allow_unsharded=True``, it warned
  ``UnshardedWarning``), or some attention was left whole (``PartlyShardedWarning``): a
  spelling the matcher misses;
- ``refused``: a ``CPTransformError`` or ``NotImplementedError`` with a message;
- ``wrong``: different numbers (a silent wrong answer);
- ``crashed``: any other exception (an unclear crash).

Reproduce a case with ``python -m bench.fuzz --repro "FuzzCase(...)"`` or
``run_case(FuzzCase(...))``.

Only the public API is used: ``context_parallel`` (and its ``UnshardedWarning``) and
``cptransform.ir.errors``.
"""
from __future__ import annotations

import dataclasses
import math
import traceback
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name

import fuzz_equal_dims
from cptransform import context_parallel
from cptransform.api.context_parallel import UnshardedWarning
from cptransform.ir.errors import CPTransformError
from cptransform.ir.module import iter_eqns, trace
from cptransform.ir.pipeline import Pipeline
from cptransform.passes import get_all_passes
from cptransform.op.recurrence import Method

# ----------------------------------------------------------------------------------------
# Case classes
# ----------------------------------------------------------------------------------------

#: One attention with a drawn mask, around projections (norm / RoPE / residual drawn).
MASK_CLASSES = ("mask_none", "mask_causal", "mask_window", "mask_two_sided", "mask_segments",
                "mask_key_padding", "mask_dense", "mask_bias", "mask_builders", "mask_chunked",
                "mask_data_window")
#: The surrounding-program classes (mask drawn from the simple ones unless stated).
PROGRAM_CLASSES = (
    "llama_block",      # RMSNorm, RoPE (positions from jnp.arange), GQA, SwiGLU, residuals
    "bf16",             # attention in bfloat16 (f32 softmax), everything else f32
    "seq_contract",     # einsum('bshd,s->bhd', o, w) with a learned length-S weight
    "token_mix",        # einsum('bsd,st->btd', x, W), W an S x S argument
    "fused_qkv",        # qkv = x @ Wqkv; jnp.split(qkv, 3, axis=-1)
    "concat_nonseq",    # concatenation / slicing on the feature and head dims
    "cumsum_seq",       # jnp.cumsum along the sequence
    "shift_loss",       # embeddings, logits[:, :-1] vs tokens[:, 1:] cross-entropy
    "seq_scatter",      # sequence scatters: decoder inputs = tokens shifted by .at[].set
    "custom_vjp_clip",  # custom_vjp gradient clipping (global norm over the sequence) on o
    "straight_through",  # custom_vjp straight-through rounding of the normed activations
    "scan_layers",      # lax.scan over stacked layers
    "checkpoint",       # jax.checkpoint around the block; the block's input labelled by
                        # checkpoint_name (saved by name) or placed by device_put on a
                        # 1-device mesh, as MaxText and EasyDeL do (CHECKPOINT_LABELS)
    "vmap_batch",       # a per-example block under jax.vmap over the batch
    "nan_weight",       # a NaN in the output projection: the loss must be NaN too
    "masked_rows",      # fully masked query rows (left padding + causal), -inf or added fill
    "row_test",         # keras-hub Gemma: output rows zeroed by a row test on the int mask
    "windows",          # a windowed op along the tokens before and after the block
    "gathered_keys",    # DeepSeek-V3.2-style keys gathered per query (k[idx]: [B, Q, k, ..])
                        # beside the attention: take_along_axis or indexing, causal picks
    "recurrence",       # a recurrence over the tokens before or after the block (RECURRENCES)
    "derived_sequence",  # a second block over a slice of the first's output: MTP's
                         # h[:, :-1] + x[:, 1:], or a dropped prefix h[:, c:]
    "combined_maps",    # attention maps combined linearly before one value product
                        # (differential attention, COMBINATIONS), instead of the attention
    "dropout_probs",    # dropout drawn with jax.random on the probabilities (DROPOUTS),
                        # instead of the attention
    "deferred_norm",    # the division by the row sum after the value product, through
                        # moves of either side (DEFERRED: MaxText's), instead of the attention
    "kv_cache",         # K/V written into a longer cache (a prefill) or a cache prefix
                        # concatenated to them (KV_CACHES), the cache in the loss too
    "logit_chain",      # a data factor on the logits (a learned temperature...) or a
                        # finite fill then a soft-cap (LOGIT_CHAINS)
)
#: The calls around the transform: state across steps, static arguments, dtypes.
CALL_CLASSES = (
    "rng_steps",          # dropout from a PRNG key in a state dict, split and written back,
                          # three steps against the undecorated function's own key stream
    "static_equal_hash",  # a static argument 1 / True / 1.0 (equal hash) that picks the program
    "dtype_f64",          # the whole program in float64 (x64 on): float64 accuracy (1e-10)
    "dtype_fp16",         # attention in float16 (float32 softmax), everything else float32
)
#: Classes of the layout analysis (a merged, chunked, pooled, routed or shifted sequence).
LAYOUT_CLASSES = (
    "merge_tokens",     # tokens flattened with batch / heads: [B*S, E] rows, [B*S*2, E/2]
    "chunk_tokens",     # [B, S, E] -> [B, S/c, c, E].mean(2), c in 2, 4, 8
    "dense_head",       # h.reshape(B, S*E) @ W: a head over all tokens
    "pooling",          # first / last / indexed token, mean, segment_sum by segment ids
    "routing",          # top-2 one-hot dispatch, top-1 with cumsum capacity, sort dispatch
    "shift_extreme",    # logsumexp(t[:, :-1]) with a huge last token, sqrt(r[:, 1:]), r[:, 0]=0
)
PROGRAM_CLASSES += LAYOUT_CLASSES
#: A validity vector merged with the causal mask the libraries' ways (PADDING_MERGES); last
#: in ALL_CLASSES, so that every other class keeps its index (the seed of its draws).
PADDING_MERGE_CLASSES = ("mask_padding_merge",)
#: Recurrences along the tokens, which must pass state between devices (a gathered one is
#: a failure); after the others for the same reason.
RECURRENCE_CLASSES = (
    "affine_scan",      # a lax.scan over the tokens whose carry is affine, a random body
                        # (AFFINE_BODIES), forward or reversed, before or after the block
    "chunked_scan",     # gated linear attention across chunks of a random size (CHUNKS)
    "prefix_scan",      # cumulative ops and associative scans over the tokens (PREFIXES)
)
#: Two or three sequence-like dims of one length (frames x patches x rows), attended one at
#: a time or merged (tests/fuzz_equal_dims.py); after the others for the same reason.
EQUAL_DIMS_CLASSES = ("equal_dims",)
#: An int padding mask (negative entries included) merged with the causal mask (or a
#: window) by arithmetic whose test differs on the band and off it (REGION_PADDINGS);
#: last for the same reason.
REGION_PADDING_CLASSES = ("mask_region_padding",)
#: Reductions of a mask along its keys that cannot be folded into an attention: int
#: padding data (negative entries included) merged with a causal band, reduced per row by
#: the drawn spelling (ROW_REDUCTIONS); last for the same reason.
ROW_REDUCTION_CLASSES = ("row_reduction",)
#: A bias with an additive mask summed into it before the logits take it (BIAS_SUMMED,
#: transformers' T5); last for the same reason.
BIAS_SUMMED_CLASSES = ("mask_bias_summed",)
ALL_CLASSES = (MASK_CLASSES + PROGRAM_CLASSES + CALL_CLASSES + PADDING_MERGE_CLASSES
               + RECURRENCE_CLASSES + EQUAL_DIMS_CLASSES + REGION_PADDING_CLASSES
               + ROW_REDUCTION_CLASSES + BIAS_SUMMED_CLASSES)

#: Classes that currently find bugs (wrong numbers or unclear crashes), with the reason.
#: ``tests/test_fuzz.py`` skips them; ``bench/fuzz.py`` runs them. Fix the bug, delete the
#: entry, and the CI fuzzer covers the class.
KNOWN_BROKEN: dict[str, str] = {}

#: ``windows`` variants, ``kind_width``: max/min/avg pooling of a (centered or causal) window,
#: a depthwise causal conv (Mamba's short conv), a token shift by pad+slice, a roll.
WINDOW_KINDS = ("maxpool", "minpool", "avgpool", "causalmax", "conv", "shift", "roll")
WINDOW_VARIANTS = tuple(f"{kind}_{width}" for kind in WINDOW_KINDS for width in (1, 2, 3, 4, 5))
#: How public libraries build masks (the ``mask_builders`` class draws one): transformers'
#: precomputed causal mask cut to the sequence (static or dynamic slice), GPT-Neo's and
#: Mistral's local windows, a difference of ``tril`` masks, keras-hub's ``minimum`` of int
#: masks (with Keras' post-softmax zeroing), a padding mask spelled ``data > 0``.
MASK_BUILDERS = ("hf_slice", "hf_dynamic_slice", "neo_xor", "mistral_triu",
                 "tril_difference", "keras_minimum", "keras_softmax_zero", "data_padding")
#: How libraries merge a validity vector (``valid = tokens != pad``, or the int mask a
#: tokenizer gives) with the causal mask into an ``S×S`` one (the ``mask_padding_merge``
#: class draws one, a window sometimes and-ed in): DeepMind gemma's ``mask[..., None, :] *
#: causal`` (int or bool data) tested by ``where``; keras-hub's ``minimum`` of int masks,
#: tested ``> 0`` (Keras' ``Softmax``) or cast to bool from a boolean padding mask; a
#: ``where`` selecting the int data; ``jnp.logical_and`` of the int data; the query-side
#: form and both sides (``valid[:, :, None] & valid[:, None, :]``); a float product
#: through ``[B, 1, S, S]`` tested ``> 0.5``; a large negative additive bias
#: (``(1 - valid) * -1e9``) or a ``where(.., 0, finfo.min)`` bias instead of a boolean.
PADDING_MERGES = ("gemma_mul_int", "gemma_mul_bool", "keras_min_gt_int", "keras_min_bool",
                  "where_int", "logical_and_int", "query_side", "both_sides", "b1ss_float",
                  "bias_additive", "bias_where")
#: How libraries merge int padding data with the causal mask so that the key test on the
#: band differs from the one off it (the ``mask_region_padding`` class draws one, with the
#: causal mask or a window; the data has negative entries): keras-hub's
#: ``minimum(mask, causal)`` tested ``!= 0`` (as int or after a cast to float; ``> 0.5``
#: is a conjunction, ``mask_padding_merge``'s), ``maximum(mask, causal) > 0`` of int data or of a boolean padding mask,
#: ``where(causal, a, b) != 0`` of two int data vectors and ``where(causal, a != 0, b < 0)``
#: of two boolean tests.
REGION_PADDINGS = ("keras_min_ne", "keras_min_float", "max_int", "max_bool", "where_two_int",
                   "where_two_bool")
#: ``mask_bias_summed``'s variants, ``<bias>_<mask>``: a learned bias (``param``) or ALiBi's
#: (from iotas) with the mask's fill summed into it, ``s + (bias + where(visible, 0,
#: fill))`` (transformers' Flax T5 adds its mask into its relative-position bias so):
#: causal (every row sees a key), left key padding (data: a row may see no key) or both.
BIAS_SUMMED = tuple(f"{bias}_{mask}" for bias in ("param", "alibi")
                    for mask in ("causal", "padding", "causal+padding"))
#: The ``row_test`` class's row tests (keras-hub Gemma zeroes the attention's output rows
#: that see no key): over the attention's own int mask, spelled ``all(mask == 0)``,
#: ``~any(mask != 0)`` or ``all(~(mask > .5))``; over it while the attention also applies a
#: sliding window and Keras' post-softmax zeroing (``window_zeroed``, Gemma's local layer);
#: over a different mask (strictly causal: one more empty row) or along the query axis.
ROW_TESTS = ("same_all_eq", "same_not_any", "same_all_not", "window_zeroed", "different",
             "other_axis")
#: The ``row_reduction`` class's reductions along the keys of an int mask built from
#: padding data with negative entries (keras-hub's ``minimum(data, band)``), none of which
#: an attention's empty rows say: keras-hub Gemma's ``all(mask == 0)`` zeroing the output
#: after the attention (``keras_all_eq``), ``~any(mask != 0)`` (``keras_not_any``), the row
#: test over the strictly causal mask (``strict``), ``any`` over the keys at or after the
#: query (``after``) weighting the output, ``any`` of the data's boolean test on the band
#: counted per row (``count_weight``), and over a window (``window``: two-sided, left as
#: it is).
ROW_REDUCTIONS = ("keras_all_eq", "keras_not_any", "strict", "after", "count_weight",
                  "window")
#: Llama-4 chunked attention's public spellings (the ``mask_chunked`` class draws one; the
#: chunk is ``FuzzCase.window``): ``(qi // C == ki // C) & (ki <= qi)``; transformers' Llama-4
#: ``_create_chunked_attention_mask`` (``|ki // C - qi // C| == 0`` and ``ki - qi <= 0``);
#: transformers' ``masking_utils`` (``and_masks(causal_mask_function,
#: chunked_overlay(C))``: per-index functions vmapped over query and key indices).
CHUNKED_SPELLINGS = ("floordiv", "llama4_abs", "hf_overlay")
#: Windows over data positions (the ``mask_data_window`` class draws one; the window is
#: ``FuzzCase.window``): keys ``kv`` around the query's position among the kept tokens,
#: ``pos = cumsum(key_valid) - (cumsum >= 1)`` as gemma's ``build_positions_from_mask``
#: computes it, with left padding or a padded stretch in the middle: gemma's
#: ``(kv > pos - W) * (kv < pos + W)``, or the keys behind it, ``pos - W < kv <= pos``.
DATA_WINDOWS = tuple(f"{spelling}_{padding}" for spelling in ("gemma", "behind")
                     for padding in ("left", "middle"))

#: The ``recurrence`` class's recurrences over time, ``kind@place`` (place: on the block's
#: input or output): a gated linear ``lax.scan`` over ``swapaxes``'d tokens (forward or
#: reversed), a tanh RNN, a Mamba-style matrix state ``[B, H, d, d]`` over ``moveaxis``'d
#: heads, a ``fori_loop`` / ``while_loop`` (on a value with its gradient stopped) indexing
#: the tokens by their counter, the same
#: linear recurrence by ``lax.associative_scan``, and ``lax.map`` over tokens (no carry).
RECURRENCE_KINDS = ("scan_linear", "scan_reverse", "scan_rnn", "scan_state", "fori_index",
                    "while_index", "associative", "map_tokens")
RECURRENCES = tuple(f"{kind}@{place}" for kind in RECURRENCE_KINDS
                    for place in ("input", "output"))

#: The ``affine_scan`` class's bodies, ``structure@place/direction``: a diagonal carry with
#: a per-token coefficient, one broadcast along the batch (a free dim), a matrix state
#: decayed by the delta rule (DeltaNet: mixed key dim, free value dim), an outer-product
#: state decayed per key dim (GLA/Mamba-2 per token), two independent carry leaves, and a
#: carry mixed by a per-token matrix ``h @ A(x_t)``; the per-step outputs are nonlinear.
AFFINE_STRUCTURES = ("diagonal", "broadcast", "delta", "outer", "two_leaves", "mixing")
AFFINE_BODIES = tuple(f"{structure}@{place}/{direction}" for structure in AFFINE_STRUCTURES
                      for place in ("input", "output") for direction in ("forward", "reverse"))
#: The ``chunked_scan`` class's chunk lengths (those whose chunks split over the devices).
CHUNKS = (2, 4, 8)
#: The ``prefix_scan`` class's recurrences, ``kind/direction``.
PREFIX_KINDS = ("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp", "linear_pair",
                "max_plus")
PREFIXES = tuple(f"{kind}/{direction}" for kind in PREFIX_KINDS
                 for direction in ("forward", "reverse"))

#: How ``combined_maps`` combines attention maps: two softmaxes and a scalar λ, one softmax
#: over twice the heads viewed ``[B, H, 2, Q, K]`` (the Diff Transformer's reference code),
#: a per-head λ, three maps, maps added, and a product of two maps (no linear combination:
#: left whole, exact).
COMBINATIONS = ("two", "viewed", "per_head", "three", "added", "product")
#: How ``dropout_probs`` drops probabilities: ``where(keep, p / keep, 0)``, ``p * keep /
#: keep`` (a bool cast by the product), flax's multiplier broadcast over batch and heads
#: (bits ``[1, 1, Q, K]``), probabilities transposed to ``[B, Q, H, K]`` before the bits are
#: drawn in that order, ``uniform(key) < keep`` written out, a key folded from the given one,
#: and a legacy raw ``uint32[2]`` key.
DROPOUTS = ("select", "multiply", "broadcast", "heads_after", "uniform", "folded", "raw_key")
#: Where ``deferred_norm`` divides by the row sum after the value product ``e @ v``: the sum
#: transposed to the output's ``[B, Q, H, 1]`` order; MaxText's (grouped heads ``[B, K, G,
#: Q, S]``, the sum moved to ``[B, Q, K, G, 1]`` and reshaped to ``[B, Q, K·G, 1]``, the
#: output reshaped to ``[B, Q, H, Dv]`` before the division); the heads merged with the
#: features (``[B, Q, H·Dv]``, the sum broadcast along Dv and merged the same way); the sum
#: in float32 divided into a float32 cast of the output; MaxText's own (the softmax over
#: the merged heads ``[B, K·G, Q, S]``, its exponentials viewed as ``[B, K, G, Q, S]`` for
#: the product, the sum transposed to ``[B, Q, K·G, 1]``).
DEFERRED = ("transposed", "maxtext", "merged_features", "cast", "maxtext_merged_heads")
#: What ``checkpoint`` puts on the block's (normed) input inside the remat block: nothing,
#: ``checkpoint_name`` under a ``save_only_these_names`` policy (MaxText's remat), a
#: ``device_put`` onto a ``NamedSharding`` of a 1-device mesh (EasyDeL places its RoPE
#: tables so).
CHECKPOINT_LABELS = ("", "named", "placed")
#: How ``kv_cache`` attends over a cache: the prompt's K/V written at position 0 of a cache
#: twice as long by ``dynamic_update_slice`` (a cache of zeros made inside, or one passed
#: in) or by ``.at[:, :S].set``, the queries over the whole cache (``key < S`` and the drawn
#: mask); or a cache of ``S/2`` earlier tokens concatenated before the prompt's keys.
KV_CACHES = ("write_created", "write_input", "at_set", "concat")
#: What ``logit_chain`` puts on the logits before the drawn mask: a learned temperature per
#: head, a scalar one, a scale per query computed from the queries, a divisor per head
#: (all folded into q); a temperature applied after the mask (refused: on one device its
#: gradient is NaN under a -inf fill); a finite fill of -8 then a soft-cap, or a finite fill
#: of -2 alone (too large to hide: the masked keys keep a share of the probability,
#: ``MaskSpec.fill``).
LOGIT_CHAINS = ("temperature_head", "temperature_scalar", "scale_query", "divisor",
                "after_mask", "softcap_fill", "finite_fill")
SPELLINGS = ("jnn", "einsum", "matmul")
SCHEDULES = ("ring", "ulysses", "allgather", "auto")
LOAD_BALANCES = ("none", "zigzag", "striped", "auto")


@dataclass(frozen=True)
class FuzzCase:
    """One generated program; ``repr`` is the reproduction."""

    cls: str
    seed: int
    cp: int
    schedule: str
    load_balance: str
    batch: int
    seq: int
    heads: int
    kv_heads: int
    head_dim: int
    v_head_dim: int
    model_dim: int
    mask: str            # none causal window two_sided segments key_padding dense bias chunked
                         # builder row_test data_window
    causal: bool         # combined with segments / key_padding / dense / bias
    window: int          # for window / two_sided / data_window; the chunk C for chunked
    spelling: str        # jnn einsum matmul
    gqa_style: str       # repeat reshape (hand-written spellings)
    fill: str            # where-mask fill: neg_big (-1e9), finfo_min, neg_inf
    variant: str         # per-class / per-mask sub-choice
    norm: bool
    rope: bool
    residual: bool
    bf16: bool

    def repro(self) -> str:
        return f"python -m bench.fuzz --repro \"{self!r}\""


def _heads(choose, cp: int, force_mha: bool = False, need_ulysses: bool = False):
    heads = choose("heads", (1, 2, 4, 8))
    if force_mha:
        return heads, heads
    kind = choose("head_sharing", ("mha", "gqa", "mqa"))
    if kind == "mha" or heads == 1:
        return heads, heads
    if kind == "mqa":
        return heads, 1
    return heads, choose("kv_heads", tuple(k for k in (2, 4) if k < heads and heads % k == 0)
                         or (1,))


def draw_case(choose: Callable[[str, tuple], Any], cls: str, seed: int) -> FuzzCase:
    """A case of class ``cls``; ``choose(name, options)`` returns one of ``options``."""
    assert cls in ALL_CLASSES, cls
    cp = choose("cp", (2, 4, 8))
    seq = choose("seq", tuple(s for s in range(16, 65, 2 * cp)))
    batch = choose("batch", (1, 2))
    force_mha = cls in ("fused_qkv", "equal_dims")
    heads, kv_heads = _heads(choose, cp, force_mha)
    head_dim = choose("head_dim", (4, 8, 16))
    mask = {"mask_none": "none", "mask_causal": "causal", "mask_window": "window",
            "mask_two_sided": "two_sided", "mask_segments": "segments",
            "mask_key_padding": "key_padding", "mask_dense": "dense",
            "mask_bias": "bias", "mask_builders": "builder", "mask_chunked": "chunked",
            "mask_data_window": "data_window",
            "mask_padding_merge": "padding_merge",
            "mask_region_padding": "region_padding",
            "row_reduction": "row_reduction",
            "mask_bias_summed": "bias_summed"}.get(cls)
    if cls == "masked_rows":
        mask = "key_padding"
    elif cls == "row_test":
        mask = "row_test"
    elif cls == "equal_dims":
        mask = choose("mask", ("none", "causal"))
    elif mask is None:
        mask = choose("mask", ("none", "causal", "causal", "window"))
    spelling = choose("spelling", SPELLINGS)
    if cls in ("masked_rows", "mask_builders", "row_test", "mask_data_window",
               "mask_padding_merge", "mask_region_padding", "kv_cache", "logit_chain",
               "row_reduction") \
            and spelling == "jnn":
        spelling = "einsum"   # the -inf fill is a hand-written where-mask
    if cls in ("dtype_f64", "dtype_fp16") and spelling == "jnn":
        # jax.nn.dot_product_attention's softmax is float32 even for f64, and its float16
        # products ask for a float32 result, which XLA's CPU dot does not support
        spelling = "einsum"
    same_v = spelling == "jnn" or cls == "fused_qkv"
    v_head_dim = head_dim if same_v else choose("v_head_dim", (head_dim, 4, 8))
    schedules = tuple(s for s in SCHEDULES if s != "ulysses" or heads % cp == 0)
    schedule = choose("schedule", schedules)
    load_balance = choose("load_balance", LOAD_BALANCES[1:] if cls == "recurrence"
                          else LOAD_BALANCES)
    causal = mask in ("causal", "window", "chunked") or (
        mask in ("segments", "key_padding", "dense", "bias", "data_window")
        and choose("causal", (False, True)))
    if cls in ("masked_rows", "row_test"):
        causal = True
    if mask in ("padding_merge", "region_padding", "row_reduction"):
        causal = True
    window = choose("window", (1, 3, 5, 8, 17)) \
        if mask in ("window", "two_sided", "builder", "row_test", "data_window",
                    "padding_merge", "region_padding", "row_reduction") \
        else choose("chunk", (3, 4, 8, 16)) if mask == "chunked" else 0
    fill = choose("fill", ("neg_inf", "finfo_min_added") if cls == "masked_rows"
                  else ("neg_big_added", "finfo_min_added") if cls == "mask_bias_summed"
                  else FILLS)
    variants = {
        "mask_key_padding": KEY_PADDINGS,
        "mask_bias": ("param", "alibi"),
        "mask_bias_summed": BIAS_SUMMED,
        "mask_dense": ("batch", "shared"),
        "concat_nonseq": ("concat_features", "slice_heads"),
        "custom_vjp_clip": ("global_norm", "elementwise"),
        "shift_loss": ("mean", "sum"),
        "seq_scatter": tuple(SEQUENCE_SCATTERS),
        "scan_layers": ("plain", "remat"),
        "nan_weight": ("wo", "wq"),
        "masked_rows": ("where_out", "plain"),
        "row_test": ROW_TESTS,
        "windows": WINDOW_VARIANTS,
        "static_equal_hash": ((1, True, 1.0, 1), (True, 1, 1.0), (1.0, True, 1)),
        "mask_builders": MASK_BUILDERS,
        "mask_padding_merge": tuple(f"{merge}_{window}" for merge in PADDING_MERGES
                                    for window in ("causal", "window")),
        "mask_region_padding": tuple(f"{merge}_{window}" for merge in REGION_PADDINGS
                                     for window in ("causal", "window")),
        "mask_chunked": CHUNKED_SPELLINGS,
        "row_reduction": ROW_REDUCTIONS,
        "mask_data_window": DATA_WINDOWS,
        "merge_tokens": ("rows", "rows_heads", "rows_bf16"),
        "chunk_tokens": ("2", "4", "8"),
        "dense_head": ("",),
        "pooling": ("first", "last", "indexed", "mean", "segment_sum"),
        "routing": ("top2", "top1_capacity", "sort"),
        "shift_extreme": ("logsumexp_huge", "sqrt_zero"),
        "gathered_keys": ("take_along_axis", "indexing"),
        "recurrence": RECURRENCES,
        "affine_scan": AFFINE_BODIES,
        "chunked_scan": tuple(str(c) for c in CHUNKS if seq % (c * cp) == 0),
        "prefix_scan": PREFIXES,
        "derived_sequence": ("mtp", "prefix_1", "prefix_3"),
        "combined_maps": COMBINATIONS,
        "dropout_probs": DROPOUTS,
        "deferred_norm": DEFERRED,
        "kv_cache": KV_CACHES,
        "logit_chain": LOGIT_CHAINS,
        "llama_block": POSITION_DTYPES,
        "checkpoint": CHECKPOINT_LABELS,
    }.get(cls, ("",))
    variant = choose("variant", variants)
    if cls == "equal_dims":
        variant = fuzz_equal_dims.draw_variant(choose)
        # lengths the layouts divide (the program then runs in layout order), n³ small
        seq = choose("dim_length", tuple(n for n in (4, 8, 16) if n % (2 * cp) == 0
                                         and (variant.startswith("2") or n <= 8)) or (8,))
        batch = 2   # a batch of one would make every merge with it a no-op
    llama = cls == "llama_block"
    return FuzzCase(
        cls=cls, seed=seed, cp=cp, schedule=schedule, load_balance=load_balance,
        batch=batch, seq=seq, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
        v_head_dim=v_head_dim, model_dim=choose("model_dim", (16, 32)), mask=mask,
        causal=causal, window=window, spelling=spelling,
        gqa_style=choose("gqa_style", ("repeat", "reshape")), fill=fill, variant=variant,
        norm=True if llama else choose("norm", (False, True)),
        rope=True if llama else choose("rope", (False, True)),
        residual=True if llama else choose("residual", (False, True)),
        bf16=cls == "bf16")


def numpy_chooser(rng: np.random.Generator):
    def choose(name, options):
        return options[int(rng.integers(len(options)))]
    return choose


# ----------------------------------------------------------------------------------------
# Building the program
# ----------------------------------------------------------------------------------------

#: How masked logits are filled: selected (``where(mask, s, fill)``) with -1e9, the dtype's
#: minimum or -inf, or (``_added``) added as a bias, ``s + where(mask, 0, fill)``, as
#: transformers' attention bias does: a fully masked row's scores then keep their gradient.
FILLS = ("neg_big", "finfo_min", "neg_inf", "neg_big_added", "finfo_min_added")


def _fill_value(fill: str, dtype):
    fill = fill.removesuffix("_added")
    if fill == "neg_inf":
        return -jnp.inf
    if fill == "finfo_min":
        return jnp.finfo(dtype).min
    return -1e9


def _masked(case: FuzzCase, s, allowed, fill):
    """The logits ``s`` with the entries ``allowed`` hides filled as ``case.fill`` says."""
    if case.fill.endswith("_added"):
        return s + jnp.where(allowed, 0.0, fill).astype(s.dtype)
    return jnp.where(allowed, s, fill)


def softmax_dtype(dtype):
    """The dtype the programs compute softmaxes (and RoPE angles) in: float32 for bf16 and
    float16 activations, float64 for float64 ones (``dtype_f64`` is float64 throughout)."""
    return jnp.promote_types(dtype, jnp.float32)


def rmsnorm(x, g, eps=1e-5):
    return x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * g


#: ``llama_block``'s variants: the dtype of RoPE's ``jnp.arange`` positions. Every iota
#: along the sequence goes through the layout's position map; a float iota holds whole
#: numbers, and unsigned and narrow integers must divide there as they do on one device.
POSITION_DTYPES = ("float32", "int32", "uint32", "int16")


def rope(x, base=10000.0, positions=None):
    """x: [B, S, H, D] (D even); positions from ``jnp.arange`` (in ``positions``' dtype,
    default the angles')."""
    s, d = x.shape[1], x.shape[-1]
    angles = softmax_dtype(x.dtype)
    pos = jnp.arange(s, dtype=positions or angles).astype(angles)
    inv = 1.0 / (base ** (jnp.arange(0, d, 2, dtype=angles) / d))
    ang = pos[:, None] * inv[None, :]
    cos, sin = jnp.cos(ang)[None, :, None, :], jnp.sin(ang)[None, :, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).astype(x.dtype)


def _allowed(case: FuzzCase, inputs: dict, batched: bool = True):
    """The boolean mask [B|1, 1, S, S] (or None) for hand-written spellings."""
    s = case.seq
    i = jnp.arange(s)[:, None]
    j = jnp.arange(s)[None, :]
    m = None

    def conj(a, b):
        return b if a is None else a & b

    if case.causal:
        m = conj(m, i >= j)
    if case.mask == "window":
        m = conj(m, i - j < case.window)
    if case.mask == "two_sided":
        m = conj(m, jnp.abs(i - j) <= case.window)
    if case.mask == "chunked":  # the spelling writes its causal part itself
        m = _chunked(case)
    if m is not None:
        m = m[None, None]
    if case.mask == "segments":
        seg = inputs["segment_ids"]
        m = conj(m, (seg[:, :, None] == seg[:, None, :])[:, None])
    if case.mask == "key_padding":
        valid = _key_valid(case, inputs)
        m = conj(m, valid[:, None, None, :])
    if case.mask == "dense":
        m = conj(m, inputs["dense_mask"])
    if case.mask == "data_window":
        m = conj(m, _data_window(case, inputs["key_valid"])[:, None])
    return m


def _data_window(case: FuzzCase, valid):
    """``[B, S, S]``: kept keys in the drawn window around the queries' data positions."""
    pos = jnp.cumsum(valid, axis=-1)
    at = (pos - (pos >= 1))[:, :, None]
    kv, w = jnp.arange(case.seq)[None, None, :], case.window
    if case.variant.startswith("behind"):
        near = (kv <= at) & (kv > at - w)
    else:
        near = (kv > at - w) * (kv < at + w)
    return near & valid[:, None, :]


def _chunked(case: FuzzCase):
    """The causal chunked visibility ``[S, S]`` in the drawn spelling (its causal part
    included: each spelling writes the two together)."""
    c, ar = case.window, jnp.arange(case.seq)
    if case.variant == "llama4_abs":
        block_pos = jnp.abs(ar[None, :] // c - ar[:, None] // c)
        token_pos = ar[None, :] - ar[:, None]
        return (block_pos == 0) & (token_pos <= 0)
    if case.variant == "hf_overlay":
        def both(q_idx, kv_idx):
            return (kv_idx <= q_idx) & (kv_idx // c == q_idx // c)
        return jax.vmap(jax.vmap(both, in_axes=(None, 0)), in_axes=(0, None))(ar, ar)
    return (ar[:, None] // c == ar[None, :] // c) & (ar[None, :] <= ar[:, None])


#: ``mask_key_padding``'s spellings of the key-padding mask read from data: lengths against
#: an iota, a boolean input, and a test of an input against a constant (an int 0/1
#: attention mask ``!= 0``, a float one ``> 0.5``, token ids ``!= pad_id`` with pad id 0 or
#: 3), as tokenizers and datasets hand them over.
KEY_PADDINGS = ("lengths", "valid", "int_ne", "float_gt", "ids_ne_0", "ids_ne_3")


def _key_valid(case, inputs):
    if case.variant == "lengths":
        return jnp.arange(case.seq)[None, :] < inputs["lengths"][:, None]
    data = inputs["key_valid"]
    if case.variant == "float_gt":
        return data > 0.5
    if case.variant.startswith("ids_ne_"):
        return data != int(case.variant.rsplit("_", 1)[1])
    if case.variant == "int_ne":
        return data != 0
    return data


def _key_valid_data(case: FuzzCase, valid: np.ndarray, rng) -> np.ndarray:
    """``valid`` (boolean ``[B, S]``) as the data the drawn spelling tests."""
    if case.variant == "int_ne":
        return valid.astype(np.int32)
    if case.variant == "float_gt":
        return valid.astype(np.float32)
    if case.variant.startswith("ids_ne_"):
        pad = int(case.variant.rsplit("_", 1)[1])
        ids = rng.integers(4, 20, valid.shape).astype(np.int32)
        return np.where(valid, ids, pad).astype(np.int32)
    return valid


def _bias(case, params):
    if case.mask not in ("bias", "bias_summed"):
        return None
    if case.variant.startswith("alibi"):
        i = jnp.arange(case.seq)[:, None]
        j = jnp.arange(case.seq)[None, :]
        slopes = params["alibi_slopes"]   # [H]
        return (slopes[:, None, None] * (j - i).astype(jnp.float32)[None])[None]
    return params["bias"]


def _precomputed_causal(n: int):
    """flax's ``make_causal_mask(ones((1, n)))`` as transformers precomputes it: [1,1,n,n]."""
    idx = jnp.broadcast_to(jnp.arange(n), (1, n))
    return jnp.greater_equal(idx[:, None, :, None], idx[:, None, None, :])


def _built_mask(case: FuzzCase, inputs: dict):
    """The visibility [B|1, 1, S, S] (boolean or 0/1 int) the drawn library builder makes."""
    s, w = case.seq, case.window
    valid = inputs["key_valid"]
    full = _precomputed_causal(2 * s)
    kind = case.variant
    if kind in ("keras_minimum", "keras_softmax_zero"):
        i = jnp.arange(s, dtype="float32")[:, None]
        causal = (i >= jnp.arange(s, dtype="float32"))[None].astype("int32")
        return jnp.minimum(valid[:, None, :].astype("int32"), causal)[:, None]
    if kind == "data_padding":
        tokens = valid.astype(jnp.int32) * 7
        return (tokens > 0)[:, None, None, :] & jnp.tril(jnp.ones((s, s), bool))
    local = {"hf_slice": lambda: full[:, :, :s, :s],
             "hf_dynamic_slice": lambda: lax.dynamic_slice(full, (0, 0, 0, 0), (1, 1, s, s)),
             "neo_xor": lambda: (full ^ jnp.tril(full, -w))[:, :, :s, :s],
             "mistral_triu": lambda: jnp.triu(full, -w)[:, :, :s, :s],
             "tril_difference": lambda: (jnp.tril(jnp.ones((s, s)))
                                         - jnp.tril(jnp.ones((s, s)), -w))[None, None]}[kind]()
    return jnp.logical_and(local > 0, valid[:, None, None, :])


def _attend_built(case: FuzzCase, q, k, v, inputs):
    """Attention under a library-built mask (``mask_builders``), einsum or matmul."""
    return _masked_attention(case, q, k, v, _built_mask(case, inputs) > 0,
                             case.variant == "keras_softmax_zero")


def _masked_attention(case: FuzzCase, q, k, v, visible, zero_hidden: bool):
    """Attention (einsum or matmul, KV heads repeated) whose logits are filled where
    ``visible`` is False, and (``zero_hidden``, Keras' ``Softmax(mask=...)``) whose
    probabilities are zeroed there after the softmax."""
    h, kh = q.shape[2], k.shape[2]
    if kh != h:
        k, v = jnp.repeat(k, h // kh, axis=2), jnp.repeat(v, h // kh, axis=2)
    if case.spelling == "einsum":
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k)
    else:
        s = q.transpose(0, 2, 1, 3) @ k.transpose(0, 2, 3, 1)
    s = _masked(case, s.astype(softmax_dtype(s.dtype)) / math.sqrt(q.shape[-1]), visible,
                _fill_value(case.fill, softmax_dtype(s.dtype)))
    p = jax.nn.softmax(s, axis=-1)
    if zero_hidden:
        p = jnp.where(visible, p, 0.0)
    p = p.astype(v.dtype)
    if case.spelling == "einsum":
        return jnp.einsum("bhqk,bkhd->bqhd", p, v)
    return (p @ v.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)


def _padding_merged(case: FuzzCase, q, k, v, inputs):
    """Attention under a validity vector merged with the causal mask (and a window) the
    drawn library's way (:data:`PADDING_MERGES`), a boolean, an int tested by ``where``,
    or an additive bias."""
    n = case.seq
    merge, band = case.variant.rsplit("_", 1)
    valid = inputs["key_valid"]
    data = valid.astype(jnp.int32)
    i, j = jnp.arange(n)[:, None], jnp.arange(n)[None, :]
    causal = (j <= i) & ((i - j < case.window) if band == "window" else True)
    built = {
        "gemma_mul_int": lambda: data[:, None, :] * causal[None],
        "gemma_mul_bool": lambda: valid[:, None, :] * causal[None],
        "keras_min_gt_int": lambda: jnp.minimum(data[:, None, :], causal[None].astype("int32"))
        > jnp.asarray(0.5).astype("int32"),
        "keras_min_bool": lambda: jnp.minimum(valid[:, None, :].astype("int32"),
                                              causal[None].astype("int32")).astype(bool),
        "where_int": lambda: jnp.where(causal[None], data[:, None, :], 0),
        "logical_and_int": lambda: jnp.logical_and(data[:, None, :], causal[None]),
        "query_side": lambda: valid[:, :, None] & causal[None],
        "both_sides": lambda: valid[:, :, None] & valid[:, None, :] & causal[None],
        "b1ss_float": lambda: (valid.astype(jnp.float32)[:, None, None, :]
                               * causal.astype(jnp.float32)[None, None]) > 0.5,
    }
    if merge in built:
        mask = built[merge]()
        mask = mask if mask.ndim == 4 else mask[:, None]
        return _masked_attention(case, q, k, v, mask, False)
    h, kh = q.shape[2], k.shape[2]
    if kh != h:
        k, v = jnp.repeat(k, h // kh, axis=2), jnp.repeat(v, h // kh, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(softmax_dtype(q.dtype)) \
        / math.sqrt(q.shape[-1])
    if merge == "bias_additive":
        # BERT's "extended attention mask": (1 - mask) * -1e9 added to the scores
        both = valid[:, None, None, :].astype(s.dtype) * causal.astype(s.dtype)
        s = s + (1.0 - both) * -1e9
    else:
        s = s + jnp.where(valid[:, None, None, :] & causal, 0.0, jnp.finfo(s.dtype).min)
    p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)


def _region_padded(case: FuzzCase, q, k, v, inputs):
    """Attention under int padding data merged with the causal mask (and a window) the
    drawn way (:data:`REGION_PADDINGS`): the key test on the band differs from the one off
    it, and a negative entry makes its key visible past the band."""
    n = case.seq
    merge, band = case.variant.rsplit("_", 1)
    a, b = inputs["key_data"], inputs["key_other"]
    i, j = jnp.arange(n)[:, None], jnp.arange(n)[None, :]
    causal = ((j <= i) & ((i - j < case.window) if band == "window" else True))[None]
    ints = causal.astype("int32")
    built = {
        "keras_min_ne": lambda: jnp.minimum(a[:, None, :], ints) != 0,
        "keras_min_float": lambda: jnp.minimum(a[:, None, :], ints).astype("float32") != 0.0,
        "max_int": lambda: jnp.maximum(a[:, None, :], ints) > 0,
        "max_bool": lambda: jnp.maximum((a > 0)[:, None, :].astype("int32"), ints) > 0.5,
        "where_two_int": lambda: jnp.where(causal, a[:, None, :], b[:, None, :]) != 0,
        "where_two_bool": lambda: jnp.where(causal, (a != 0)[:, None, :], (b < 0)[:, None, :]),
    }
    return _masked_attention(case, q, k, v, built[merge]()[:, None], False)


def _row_tested(case: FuzzCase, q, k, v, inputs):
    """keras-hub Gemma's attention (``row_test``): causal and left padding merged into an int
    mask by ``minimum``, ``where(mask > .5, s, fill)``, then the output rows the drawn row
    test (:data:`ROW_TESTS`) finds without a visible key set to zero."""
    n = case.seq
    pos = jnp.arange(n, dtype="float32")
    padding = inputs["key_valid"][:, None, :].astype("int32")
    mask = jnp.minimum(padding, (pos[:, None] >= pos[None, :])[None].astype("int32"))
    visible = mask[:, None] > 0.5
    if case.variant == "window_zeroed":
        ones = jnp.ones((n, n), bool)
        sliding = jnp.triu(ones, 1 - case.window) * jnp.tril(ones, case.window - 1)
        visible = jnp.logical_and(mask, sliding[None])[:, None]
    o = _masked_attention(case, q, k, v, visible, case.variant == "window_zeroed")
    strict = jnp.minimum(padding, (pos[:, None] > pos[None, :])[None].astype("int32"))
    empty = {"same_all_eq": lambda: jnp.all(mask == 0, axis=-1),
             "same_not_any": lambda: ~jnp.any(mask != 0, axis=-1),
             "same_all_not": lambda: jnp.all(~(mask > 0.5), axis=-1),
             "window_zeroed": lambda: jnp.all(mask == 0, axis=-1),
             "different": lambda: jnp.all(strict == 0, axis=-1),
             "other_axis": lambda: jnp.all(mask == 0, axis=1)}[case.variant]()
    return jnp.where(empty[:, :, None, None], jnp.zeros_like(o), o)


def _row_reduced(case: FuzzCase, q, k, v, inputs):
    """Attention under int padding data merged with the causal mask by ``minimum`` and
    tested ``> .5``, then its output rows zeroed or weighted by the drawn reduction of that
    int mask along the keys (:data:`ROW_REDUCTIONS`)."""
    n, data = case.seq, inputs["key_data"][:, None, :]
    i, j = jnp.arange(n)[:, None], jnp.arange(n)[None, :]
    mask = jnp.minimum(data, (j <= i)[None].astype("int32"))
    o = _masked_attention(case, q, k, v, (mask > 0.5)[:, None], False)
    zero = jnp.zeros_like(o)
    if case.variant == "keras_all_eq":
        return jnp.where(jnp.all(mask == 0, axis=-1)[:, :, None, None], zero, o)
    if case.variant == "keras_not_any":
        return jnp.where(~jnp.any(mask != 0, axis=-1, keepdims=True)[..., None], zero, o)
    if case.variant == "strict":
        strict = jnp.minimum(data, (j < i)[None].astype("int32"))
        return jnp.where(jnp.all(strict == 0, axis=-1)[:, :, None, None], zero, o)
    if case.variant == "after":
        after = jnp.minimum(data, (j >= i)[None].astype("int32"))
        return o * jnp.any(after != 0, axis=-1)[:, :, None, None].astype(o.dtype)
    if case.variant == "count_weight":
        seen = jnp.any(jnp.logical_and(data > 1, j <= i), axis=2)
        return o * (1.0 + seen.astype(o.dtype))[:, :, None, None]
    window = (i - j < case.window) & (j <= i)
    near = jnp.minimum(data, window[None].astype("int32"))
    return jnp.where(jnp.all(near == 0, axis=-1)[:, :, None, None], zero, o)


def _bias_summed(case: FuzzCase, q, k, v, params, inputs):
    """The drawn mask's fill summed into the bias, the sum added to the logits once
    (:data:`BIAS_SUMMED`)."""
    n = case.seq
    mask = case.variant.split("_", 1)[1].split("+")
    i, j = jnp.arange(n)[:, None], jnp.arange(n)[None, :]
    visible = (j <= i)[None, None] if "causal" in mask else jnp.ones((1, 1, n, n), bool)
    if "padding" in mask:
        visible = visible & inputs["key_valid"][:, None, None, :]
    fill = _fill_value(case.fill, softmax_dtype(q.dtype))
    bias = _bias(case, params) + jnp.where(visible, 0.0, fill)
    if case.spelling == "jnn":
        return jax.nn.dot_product_attention(q, k, v, bias=bias.astype(q.dtype))
    groups = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(softmax_dtype(q.dtype)) \
        / math.sqrt(q.shape[-1])
    p = jax.nn.softmax(s + bias, axis=-1).astype(v.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)


def attend(case: FuzzCase, q, k, v, params, inputs):
    """q [B,S,H,D], k [B,S,K,D], v [B,S,K,Dv] -> [B,S,H,Dv] in the drawn spelling."""
    if case.mask == "builder":
        return _attend_built(case, q, k, v, inputs)
    if case.mask == "row_test":
        return _row_tested(case, q, k, v, inputs)
    if case.mask == "padding_merge":
        return _padding_merged(case, q, k, v, inputs)
    if case.mask == "region_padding":
        return _region_padded(case, q, k, v, inputs)
    if case.mask == "row_reduction":
        return _row_reduced(case, q, k, v, inputs)
    if case.mask == "bias_summed":
        return _bias_summed(case, q, k, v, params, inputs)
    h, kh = q.shape[2], k.shape[2]
    bias = _bias(case, params)
    scale = 1.0 / math.sqrt(q.shape[-1])
    if case.spelling == "jnn":
        kw: dict[str, Any] = {}
        mask = None
        if case.mask in ("window", "two_sided"):
            kw["local_window_size"] = ((case.window - 1, 0) if case.mask == "window"
                                       else (case.window, case.window))
        if case.causal:
            kw["is_causal"] = True
        if case.mask == "segments":
            seg = inputs["segment_ids"]
            mask = (seg[:, :, None] == seg[:, None, :])[:, None]
        if case.mask == "key_padding":
            if case.variant == "lengths":
                kw["key_value_seq_lengths"] = inputs["lengths"]
            else:
                mask = _key_valid(case, inputs)[:, None, None, :]
        if case.mask == "dense":
            mask = inputs["dense_mask"]
        if case.mask == "chunked":
            mask = _chunked(case)[None, None]
        if bias is not None:
            bias = bias.astype(q.dtype)
        return jax.nn.dot_product_attention(q, k, v, bias=bias, mask=mask, **kw)

    allowed = _allowed(case, inputs)
    fill = _fill_value(case.fill, softmax_dtype(q.dtype))
    if case.gqa_style == "reshape" and kh != h:
        g = h // kh
        qg = q.reshape(q.shape[0], q.shape[1], kh, g, q.shape[3])
        if case.spelling == "einsum":
            s = jnp.einsum("bqkgd,bskd->bkgqs", qg, k)
        else:
            s = qg.transpose(0, 2, 3, 1, 4) @ k.transpose(0, 2, 3, 1)[:, :, None]
        s = s.astype(softmax_dtype(s.dtype)) * scale
        s = s.reshape(s.shape[0], h, s.shape[3], s.shape[4])
        if bias is not None:
            s = s + bias
        if allowed is not None:
            s = _masked(case, s, allowed, fill)
        p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
        pg = p.reshape(p.shape[0], kh, g, p.shape[2], p.shape[3])
        if case.spelling == "einsum":
            o = jnp.einsum("bkgqs,bskd->bqkgd", pg, v)
        else:
            o = (pg @ v.transpose(0, 2, 1, 3)[:, :, None]).transpose(0, 3, 1, 2, 4)
        return o.reshape(o.shape[0], o.shape[1], h, v.shape[-1])
    if kh != h:
        k = jnp.repeat(k, h // kh, axis=2)
        v = jnp.repeat(v, h // kh, axis=2)
    if case.spelling == "einsum":
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k)
    else:
        s = q.transpose(0, 2, 1, 3) @ k.transpose(0, 2, 3, 1)
    s = s.astype(softmax_dtype(s.dtype)) * scale
    if bias is not None:
        s = s + bias
    if allowed is not None:
        s = _masked(case, s, allowed, fill)
    p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    if case.spelling == "einsum":
        return jnp.einsum("bhqk,bkhd->bqhd", p, v)
    return (p @ v.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)


def _normal(rng, shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def make_data(case: FuzzCase):
    """(params, inputs) for a case: random, never zeros, from the case's seed."""
    rng = np.random.default_rng(case.seed)
    if case.cls == "equal_dims":
        params, inputs = fuzz_equal_dims.params_and_inputs(case, rng)
        return jax.tree_util.tree_map(jnp.asarray, (params, inputs))
    b, s, h, kh, d, dv, e = (case.batch, case.seq, case.heads, case.kv_heads, case.head_dim,
                             case.v_head_dim, case.model_dim)
    p: dict[str, Any] = {}
    inp: dict[str, Any] = {}
    layers = 2 if case.cls == "scan_layers" else None

    def w(name, shape, fan_in):
        full = shape if layers is None else (layers,) + shape
        p[name] = _normal(rng, full, 1.0 / math.sqrt(fan_in))

    if case.cls == "fused_qkv":
        w("wqkv", (e, 3 * h * d), e)
    else:
        w("wq", (e, h * d), e)
        w("wk", (e, kh * d), e)
        w("wv", (e, kh * dv), e)
    w("wo", (h * dv, e), h * dv)
    if case.norm:
        p["g"] = (1.0 + 0.1 * rng.standard_normal((e,) if layers is None else (layers, e))
                  ).astype(np.float32)
    if case.cls == "llama_block":
        w("w1", (e, 2 * e), e)
        w("w3", (e, 2 * e), e)
        w("w2", (2 * e, e), 2 * e)
    if case.cls in ("shift_loss", "seq_scatter"):
        vocab = 11
        inp["tokens"] = rng.integers(0, vocab, (b, s)).astype(np.int32)
        p["emb"] = _normal(rng, (vocab, e))
        p["unemb"] = _normal(rng, (e, vocab), 1.0 / math.sqrt(e))
    else:
        p["x"] = _normal(rng, (b, s, e))
        p["target"] = _normal(rng, (b, s, e))
    if case.cls == "seq_contract":
        p["w_s"] = _normal(rng, (s,), 1.0 / math.sqrt(s))
    if case.cls == "token_mix":
        p["w_mix"] = _normal(rng, (s, s), 1.0 / math.sqrt(s))
    if case.cls == "concat_nonseq":
        hh = max(1, h // 2) if case.variant == "slice_heads" else h
        w("wo2", (hh * dv + e, e), hh * dv + e)
    if case.mask in ("bias", "bias_summed"):
        if case.variant.startswith("alibi"):
            p["alibi_slopes"] = (0.1 + rng.random(h)).astype(np.float32)
        else:
            shape = (1, h, s, s) if rng.random() < 0.5 else (b, 1, s, s)
            p["bias"] = _normal(rng, shape)
    if case.mask == "segments":
        seg = np.zeros((b, s), np.int32)
        for r in range(b):
            cuts = np.sort(rng.choice(np.arange(1, s), size=int(rng.integers(1, 4)),
                                      replace=False))
            for c in cuts:
                seg[r, c:] += 1
        inp["segment_ids"] = seg
    if case.mask == "key_padding":
        if case.cls == "masked_rows":
            # left padding: the first rows see only padded keys (fully masked under causal)
            pads = rng.integers(1, s // 2, (b,))
            inp["key_valid"] = np.arange(s)[None, :] >= pads[:, None]
        else:
            lengths = rng.integers(s // 2, s + 1, (b,)).astype(np.int32)
            if case.variant == "lengths":
                inp["lengths"] = lengths
            else:
                inp["key_valid"] = _key_valid_data(
                    case, np.arange(s)[None, :] < lengths[:, None], rng)
    if case.mask == "bias_summed" and "padding" in case.variant:
        # left padding: under causal, the first rows see no key
        pads = rng.integers(1, s // 2, (b,))
        inp["key_valid"] = np.arange(s)[None, :] >= pads[:, None]
    if case.mask == "row_test":
        # left padding: under causal, the first rows see no key
        pads = rng.integers(1, s // 2, (b,))
        inp["key_valid"] = np.arange(s)[None, :] >= pads[:, None]
    if case.mask == "builder":
        lengths = rng.integers(s // 2, s + 1, (b,))
        inp["key_valid"] = np.arange(s)[None, :] < lengths[:, None]
    if case.mask == "padding_merge":
        # left padding (the first rows see no key under causal) or right padding
        pads = rng.integers(1, s // 2, (b,))
        left = np.arange(s)[None, :] >= pads[:, None]
        inp["key_valid"] = left if rng.random() < 0.5 else left[:, ::-1].copy()
    if case.mask in ("region_padding", "row_reduction"):
        # int data: left padding (zeros), entries beyond 0/1 and a few negative ones (keys
        # visible past the band); a second vector for the where-merges
        pads = rng.integers(1, s // 2, (b,))
        data = rng.integers(1, 4, (b, s)) * (np.arange(s)[None, :] >= pads[:, None])
        inp["key_data"] = np.where(rng.random((b, s)) < 0.1, -1, data).astype(np.int32)
        inp["key_other"] = rng.integers(-1, 2, (b, s)).astype(np.int32)
    if case.mask == "data_window":
        valid = np.ones((b, s), bool)
        for r in range(b):
            start = 0 if case.variant.endswith("left") else int(rng.integers(1, s // 2))
            valid[r, start:start + int(rng.integers(1, s // 2))] = False
        inp["key_valid"] = valid
    if case.mask == "dense":
        mb = b if case.variant == "batch" else 1
        m = rng.random((mb, 1, s, s)) < 0.6
        m |= np.eye(s, dtype=bool)[None, None]
        inp["dense_mask"] = m
    if case.cls == "gathered_keys":
        # each query's picks among its causal keys (itself always among them)
        picks = (rng.random((b, s, 3)) * (np.arange(s)[None, :, None] + 1)).astype(np.int32)
        picks[..., 0] = np.arange(s)[None, :]
        inp["picks"] = picks
    if case.cls == "combined_maps":
        p["lam"] = _normal(rng, (h,))
    if case.cls == "kv_cache" and case.variant != "write_created":
        length = s // 2 if case.variant == "concat" else 2 * s
        p["cache_k"] = _normal(rng, (b, length, kh, d))
        p["cache_v"] = _normal(rng, (b, length, kh, dv))
    if case.cls == "logit_chain":
        p["temp"] = rng.uniform(0.5, 2.0, () if case.variant == "temperature_scalar"
                                else (h,)).astype(np.float32)
    if case.cls == "dropout_probs":
        inp["dropout_key"] = np.asarray(jax.random.key_data(jax.random.key(case.seed)))
    if case.cls in ("recurrence",) + RECURRENCE_CLASSES:
        p["w_rec"] = _normal(rng, (e, e), 0.5 / math.sqrt(e))
        p["a_rec"] = _normal(rng, (e,))
    if case.cls in RECURRENCE_CLASSES:
        p["w_gate"] = _normal(rng, (e, e), 1 / math.sqrt(e))
    if case.cls == "windows" and case.variant.startswith("conv"):
        p["w_conv"] = _normal(rng, (int(case.variant.rsplit("_", 1)[1]), 1, e), 0.5)
    if case.cls in LAYOUT_CLASSES:
        _layout_data(case, rng, p, inp)
    if case.cls == "nan_weight":
        key = "wo" if case.variant == "wo" else "wq"
        p[key] = p[key].copy()
        p[key].reshape(-1)[int(rng.integers(p[key].size))] = np.nan
    params = jax.tree_util.tree_map(jnp.asarray, p)
    inputs = jax.tree_util.tree_map(jnp.asarray, inp)
    return params, inputs


def _clip_fwd(x):
    return x, None


def _clip_bwd_global(_, g):
    n = jnp.sqrt(jnp.sum(g.astype(jnp.float32) ** 2))
    return ((g * jnp.minimum(1.0, 1e-3 / (n + 1e-12))).astype(g.dtype),)


def _clip_bwd_elem(_, g):
    return (jnp.clip(g, -1e-4, 1e-4),)


@jax.custom_vjp
def clip_global(x):
    return x


clip_global.defvjp(_clip_fwd, _clip_bwd_global)


@jax.custom_vjp
def clip_elem(x):
    return x


clip_elem.defvjp(_clip_fwd, _clip_bwd_elem)


@jax.custom_vjp
def ste_round(x):
    return jnp.round(x * 4.0) / 4.0


ste_round.defvjp(lambda x: (jnp.round(x * 4.0) / 4.0, None), lambda _, g: (g,))


#: Sequence scatters with static indices (``seq_scatter``): ``(emb, tokens) -> [B, S, E]``
#: embeddings of decoder inputs built the way encoder-decoders build them from labels.
SEQUENCE_SCATTERS = {
    # transformers' shift_tokens_right: two chained scatters along the sequence
    "shift_right": lambda emb, t: emb[jnp.zeros_like(t).at[:, 1:].set(t[:, :-1])
                                      .at[:, 0].set(3)],
    "start_token": lambda emb, t: emb[t.at[:, 0].set(1)],
    "update_slice": lambda emb, t: emb[lax.dynamic_update_slice(t, t[:, :-1], (0, 1))],
    "roll": lambda emb, t: emb[jnp.roll(t, 1, axis=1)],
    # a float scatter on the embeddings (gradients flow through the update and the operand)
    "embedding_window": lambda emb, t: emb[t].at[:, 2:5].set(emb[t][:, -3:] * 0.5),
}
def _layout_data(case: FuzzCase, rng, p: dict, inp: dict):
    """Weights and inputs of the layout classes."""
    b, s, e = case.batch, case.seq, case.model_dim
    if case.cls == "merge_tokens":
        half = e // 2 if case.variant == "rows_heads" else e
        p["w_tok"] = _normal(rng, (half, half), 1.0 / math.sqrt(half))
    if case.cls == "dense_head":
        p["w_head"] = _normal(rng, (s * e, 3), 1.0 / math.sqrt(s * e))
    if case.cls == "routing":
        p["router"] = _normal(rng, (e, 4), 1.0 / math.sqrt(e))
        p["experts"] = _normal(rng, (4, e, e), 1.0 / math.sqrt(e))
    if case.cls == "pooling":
        p["w_pool"] = _normal(rng, (e, 3), 1.0 / math.sqrt(e))
        inp["pool_segments"] = rng.integers(0, 4, (b, s)).astype(np.int32)
    if case.cls == "shift_extreme":
        bump = np.zeros((b, s), np.float32) if case.variant == "logsumexp_huge" else \
            np.ones((b, s), np.float32)
        bump[:, -1 if case.variant == "logsumexp_huge" else 0] = \
            1e30 if case.variant == "logsumexp_huge" else 0.0
        inp["bump"] = bump


def _route(case: FuzzCase, p: dict, t):
    """Mixture-of-experts routing over flattened tokens ``t [T, E]``."""
    probs = jax.nn.softmax(t @ p["router"], axis=-1)
    expert_out = jnp.tanh(jnp.einsum("td,xdf->txf", t, p["experts"]))   # [T, experts, E]
    if case.variant == "top2":
        top, idx = lax.top_k(probs, 2)
        gate = jnp.einsum("tk,tke->te", top, jax.nn.one_hot(idx, 4))
        return jnp.einsum("te,ted->td", gate, expert_out) + probs.mean(0).sum()
    if case.variant == "top1_capacity":
        onehot = jax.nn.one_hot(jnp.argmax(probs, -1), 4)
        kept = onehot * (jnp.cumsum(onehot, axis=0) <= t.shape[0] // 6)
        return jnp.einsum("te,ted->td", kept * probs, expert_out)
    expert = jnp.argmax(probs, -1)
    order = jnp.argsort(expert)
    ts = t[order] * (1.0 + expert[order][:, None])
    return jnp.zeros_like(ts).at[order].set(ts) * probs.max(-1, keepdims=True)


def layout_loss(case: FuzzCase, p: dict, y, inputs: dict):
    """The loss of a layout class on the attention block's output ``y [B, S, E]``."""
    b, s, e = y.shape
    if case.cls == "merge_tokens":
        if case.variant == "rows_heads":
            t = jnp.tanh(y.reshape(b * s * 2, e // 2) @ p["w_tok"])
        elif case.variant == "rows_bf16":
            t = (y.reshape(b * s, e).astype(jnp.bfloat16) @ p["w_tok"].astype(jnp.bfloat16))
            t = jnp.tanh(t.astype(jnp.float32))
        else:
            t = jnp.tanh(y.reshape(b * s, e) @ p["w_tok"])
        return jnp.mean((t.reshape(b, s, e) + y - p["target"]) ** 2)
    if case.cls == "chunk_tokens":
        c = int(case.variant)
        while s % c:
            c //= 2
        pooled = y.reshape(b, s // c, c, e).mean(2)
        return jnp.mean(jnp.tanh(pooled) * jnp.arange(s // c)[None, :, None])
    if case.cls == "dense_head":
        return jnp.mean(jnp.tanh(y.reshape(b, s * e) @ p["w_head"]))
    if case.cls == "routing":
        return jnp.mean(_route(case, p, y.reshape(b * s, e)) ** 2)
    if case.cls == "pooling":
        if case.variant == "segment_sum":
            pooled = jax.vmap(lambda yb, sb: jax.ops.segment_sum(yb, sb, num_segments=4))(
                y, inputs["pool_segments"]).sum(1)
        else:
            pooled = {"first": lambda: y[:, 0], "last": lambda: y[:, -1],
                      "indexed": lambda: y[:, 3] - y[:, s - 2],
                      "mean": lambda: y.mean(1)}[case.variant]()
        return jnp.mean(jnp.tanh(pooled @ p["w_pool"]))
    if case.variant == "logsumexp_huge":
        t = y.sum(-1) + inputs["bump"]
        return jnp.sum(jax.nn.logsumexp(t[:, :-1], axis=-1))
    r = (y ** 2).sum(-1) * inputs["bump"]
    return jnp.sum(jnp.sqrt(r[:, 1:]))


def block(case: FuzzCase, p: dict, x, inputs: dict):
    """One attention block on x [B, S, E] with layer weights ``p``; returns [B, S, E]."""
    b, s = x.shape[0], x.shape[1]
    h, kh, d, dv = case.heads, case.kv_heads, case.head_dim, case.v_head_dim
    hx = rmsnorm(x, p["g"]) if case.norm else x
    if case.cls == "straight_through":
        hx = ste_round(hx)
    if case.cls == "checkpoint" and case.variant == "named":
        hx = checkpoint_name(hx, "block_in")
    if case.cls == "checkpoint" and case.variant == "placed":
        one = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
        hx = jax.device_put(hx, jax.sharding.NamedSharding(one, jax.sharding.PartitionSpec()))
    if case.cls == "fused_qkv":
        qkv = hx @ p["wqkv"]
        q, k, v = jnp.split(qkv, 3, axis=-1)
    else:
        q, k, v = hx @ p["wq"], hx @ p["wk"], hx @ p["wv"]
    q = q.reshape(b, s, h, d)
    k = k.reshape(b, s, kh, d)
    v = v.reshape(b, s, kh, dv)
    if case.rope and d % 2 == 0:
        positions = case.variant if case.cls == "llama_block" else None
        q, k = rope(q, positions=positions), rope(k, positions=positions)
    if case.bf16:
        q, k, v = q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
    if case.cls == "dtype_fp16":
        q, k, v = q.astype(jnp.float16), k.astype(jnp.float16), v.astype(jnp.float16)
    if case.cls == "combined_maps":
        o = combined_maps(case, q, k, v, p, inputs).astype(x.dtype)
    elif case.cls == "dropout_probs":
        o = dropped_attention(case, q, k, v, inputs).astype(x.dtype)
    elif case.cls == "deferred_norm":
        o = deferred_attention(case, q, k, v, inputs).astype(x.dtype)
    elif case.cls == "kv_cache":
        o, cache = cached_attention(case, q, k, v, p)
        o = o.astype(x.dtype) + jnp.mean(jnp.tanh(cache)).astype(x.dtype)
    elif case.cls == "logit_chain":
        o = chained_attention(case, q, k, v, p, inputs).astype(x.dtype)
    else:
        o = attend(case, q, k, v, p, inputs).astype(x.dtype)
    if case.cls == "gathered_keys":
        o = o + gathered_attention(case, q, k, v, inputs["picks"]).astype(x.dtype)
    if case.cls == "seq_contract":
        # a learned length-S weight contracted with the attention output over the sequence
        pooled = jnp.einsum("bshd,s->bhd", o, p["w_s"])
        o = o + jnp.tanh(pooled)[:, None]
    if case.cls == "custom_vjp_clip":
        o = clip_global(o) if case.variant == "global_norm" else clip_elem(o)
    if case.cls == "masked_rows" and case.variant == "where_out":
        o = jnp.where(_key_valid(case, inputs)[:, :, None, None], o, 0.0)
    flat = o.reshape(b, s, h * dv)
    if case.cls == "concat_nonseq":
        if case.variant == "slice_heads":
            flat = o[:, :, : max(1, h // 2)].reshape(b, s, -1)
        y = jnp.concatenate([flat, hx], axis=-1) @ p["wo2"]
    else:
        y = flat @ p["wo"]
    if case.residual:
        y = x + y
    if case.cls == "llama_block":
        hy = rmsnorm(y, p["g"])
        y = y + (jax.nn.silu(hy @ p["w1"]) * (hy @ p["w3"])) @ p["w2"]
    return y


def combined_maps(case: FuzzCase, q, k, v, params, inputs):
    """Attention maps of the case's mask combined linearly (``case.variant`` in
    :data:`COMBINATIONS`) before one value product: q/k [B,S,H,D], v [B,S,K,Dv]."""
    h = q.shape[2]
    k, v = (jnp.repeat(x, h // x.shape[2], axis=2) for x in (k, v))
    allowed = _allowed(case, inputs)
    fill = _fill_value(case.fill, softmax_dtype(q.dtype))

    def maps(a, b):
        s = jnp.einsum("bqhd,bkhd->bhqk", a, b).astype(softmax_dtype(a.dtype))
        s = s / math.sqrt(a.shape[-1])
        return jax.nn.softmax(s if allowed is None else _masked(case, s, allowed, fill), -1)

    lam = jax.nn.sigmoid(params["lam"])
    q2, k2 = q[..., ::-1], jnp.tanh(k)
    if case.variant == "viewed":
        both = maps(jnp.concatenate([q, q2], 2), jnp.concatenate([k, k2], 2))
        both = both.reshape(both.shape[0], h, 2, *both.shape[2:])
        p = both[:, :, 0] - lam[0] * both[:, :, 1]
    elif case.variant == "per_head":
        p = maps(q, k) - lam[:, None, None] * maps(q2, k2)
    elif case.variant == "three":
        p = maps(q, k) - lam[0] * maps(q2, k2) + 0.25 * maps(q2, k)
    elif case.variant == "added":
        p = 0.5 * (maps(q, k) + maps(q2, k2))
    elif case.variant == "product":
        p = maps(q, k) - lam[0] * maps(q, k) * maps(q2, k2)
    else:
        p = maps(q, k) - lam[0] * maps(q2, k2)
    if case.spelling == "matmul":
        return (p.astype(v.dtype) @ v.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    return jnp.einsum("bhqk,bkhd->bqhd", p.astype(v.dtype), v)


def deferred_attention(case: FuzzCase, q, k, v, inputs):
    """The case's mask, softmax normalised after the value product (``case.variant`` in
    :data:`DEFERRED`): q [B,S,H,D], k [B,S,K,D], v [B,S,K,Dv] -> [B,S,H,Dv]."""
    b, sq, h, _ = q.shape
    kh, dv = k.shape[2], v.shape[-1]
    allowed = _allowed(case, inputs)
    fill = _fill_value(case.fill, softmax_dtype(q.dtype))
    qg = q.reshape(b, sq, kh, h // kh, q.shape[-1])
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k).astype(softmax_dtype(q.dtype))
    s = s / math.sqrt(q.shape[-1])
    if allowed is not None:
        s = _masked(case, s, allowed[:, :, None], fill)
    if case.variant == "maxtext_merged_heads":
        s = s.reshape(b, h, sq, s.shape[-1])
    e = jnp.exp(s - jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True)))
    total = jnp.sum(e, axis=-1, keepdims=True)                  # [B, K, G, Q, 1]
    if case.variant == "maxtext_merged_heads":
        e = e.reshape(b, kh, h // kh, sq, e.shape[-1])
        o = jnp.einsum("bkgts,bskd->btkgd", e.astype(v.dtype), v).reshape(b, sq, h, dv)
        return o / jnp.transpose(total, (0, 2, 1, 3)).astype(o.dtype)
    o = jnp.einsum("bkgts,bskd->btkgd", e.astype(v.dtype), v)  # [B, Q, K, G, Dv]
    if case.variant == "maxtext":
        total = jnp.moveaxis(total, -2, 1).reshape(b, sq, h, 1)
        return o.reshape(b, sq, h, dv) / total.astype(o.dtype)
    if case.variant == "merged_features":
        total = jnp.broadcast_to(jnp.moveaxis(total, -2, 1), (b, sq, kh, h // kh, dv))
        return (o.reshape(b, sq, h * dv) / total.reshape(b, sq, h * dv).astype(o.dtype)
                ).reshape(b, sq, h, dv)
    total = total.transpose(0, 3, 1, 2, 4)                      # [B, Q, K, G, 1]
    if case.variant == "cast":
        return (o.astype(jnp.float32) / total).reshape(b, sq, h, dv)
    return (o / total.astype(o.dtype)).reshape(b, sq, h, dv)


def cached_attention(case: FuzzCase, q, k, v, params):
    """The queries over a KV cache (``case.variant`` in :data:`KV_CACHES`) under the drawn
    mask, its positions offset by the cache's earlier tokens; returns the output and the
    written key cache. q/k [B,S,H,D], v [B,S,K,Dv]."""
    s, h = q.shape[1], q.shape[2]
    if case.variant == "concat":
        keys = jnp.concatenate([params["cache_k"].astype(k.dtype), k], axis=1)
        values = jnp.concatenate([params["cache_v"].astype(v.dtype), v], axis=1)
    else:
        def write(cache, new):
            if case.variant == "at_set":
                return cache.at[:, :s].set(new)
            return lax.dynamic_update_slice(cache, new, (0, 0, 0, 0))
        if case.variant == "write_created":
            shape = lambda x: (x.shape[0], 2 * s) + x.shape[2:]  # noqa: E731
            keys, values = write(jnp.zeros(shape(k), k.dtype), k), \
                write(jnp.zeros(shape(v), v.dtype), v)
        else:
            keys = write(params["cache_k"].astype(k.dtype), k)
            values = write(params["cache_v"].astype(v.dtype), v)
    offset = keys.shape[1] - s if case.variant == "concat" else 0
    query = jnp.arange(s)[:, None] + offset
    key = jnp.arange(keys.shape[1])[None, :]
    visible = key < s + offset
    if case.causal:
        visible = visible & (key <= query)
    if case.mask == "window":
        visible = visible & (query - key < case.window)
    kk, vv = (jnp.repeat(x, h // x.shape[2], axis=2) for x in (keys, values))
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, kk).astype(softmax_dtype(q.dtype))
    logits = _masked(case, logits / math.sqrt(q.shape[-1]), visible,
                     _fill_value(case.fill, softmax_dtype(q.dtype)))
    p = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", p, vv), keys


def chained_attention(case: FuzzCase, q, k, v, params, inputs):
    """Attention whose logits carry ``case.variant`` of :data:`LOGIT_CHAINS` around the
    drawn mask. q/k [B,S,H,D], v [B,S,K,Dv]."""
    h = q.shape[2]
    k, v = (jnp.repeat(x, h // x.shape[2], axis=2) for x in (k, v))
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(softmax_dtype(q.dtype))
    s = s / math.sqrt(q.shape[-1])
    t = params["temp"]
    per_head = t[None, :, None, None] if t.ndim else t
    if case.variant in ("temperature_head", "temperature_scalar"):
        s = s * per_head
    elif case.variant == "scale_query":
        norms = jnp.linalg.norm(q.astype(s.dtype), axis=-1)
        s = s * jnp.log1p(norms).transpose(0, 2, 1)[..., None]
    elif case.variant == "divisor":
        s = s / per_head
    allowed = _allowed(case, inputs)
    if allowed is not None and case.variant in ("softcap_fill", "finite_fill"):
        fill = -8.0 if case.variant == "softcap_fill" else -2.0
        # The fill spelled as the drawn fill is: selected, or selected from the negation.
        s = jnp.where(~allowed, fill, s) if case.fill == "neg_inf" else jnp.where(allowed, s, fill)
    elif allowed is not None:
        s = _masked(case, s, allowed, _fill_value(case.fill, s.dtype))
    if case.variant == "after_mask":
        s = s * per_head
    if case.variant == "softcap_fill":
        s = 5.0 * jnp.tanh(s / 5.0)
    p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    if case.spelling == "matmul":
        return (p @ v.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)


def dropped_attention(case: FuzzCase, q, k, v, inputs):
    """Attention of the case's mask whose probabilities go through dropout drawn with
    ``jax.random`` (``case.variant`` in :data:`DROPOUTS`): q/k [B,S,H,D], v [B,S,K,Dv]."""
    h, keep = q.shape[2], 0.75
    k, v = (jnp.repeat(x, h // x.shape[2], axis=2) for x in (k, v))
    allowed = _allowed(case, inputs)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(softmax_dtype(q.dtype)) / math.sqrt(
        q.shape[-1])
    if allowed is not None:
        s = _masked(case, s, allowed, _fill_value(case.fill, s.dtype))
    p = jax.nn.softmax(s, axis=-1)
    raw = inputs["dropout_key"]
    key = raw if case.variant == "raw_key" else jax.random.wrap_key_data(raw)
    if case.variant == "folded":
        key = jax.random.fold_in(key, 7)
    if case.variant == "heads_after":
        p = p.transpose(0, 2, 1, 3)
    shape = (1, 1, *p.shape[2:]) if case.variant == "broadcast" else p.shape
    if case.variant == "uniform":
        kept = jax.random.uniform(key, shape) < keep
    else:
        kept = jax.random.bernoulli(key, keep, shape)
    if case.variant in ("select", "folded", "raw_key"):
        p = jnp.where(kept, p / keep, 0.0)
    elif case.variant == "broadcast":
        p = p * (kept.astype(p.dtype) / jnp.asarray(keep, p.dtype))
    else:
        p = p * kept / keep
    if case.variant == "heads_after":
        return jnp.einsum("bqhk,bkhd->bqhd", p.astype(v.dtype), v)
    if case.spelling == "matmul":
        return (p.astype(v.dtype) @ v.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    return jnp.einsum("bhqk,bkhd->bqhd", p.astype(v.dtype), v)


def gathered_attention(case: FuzzCase, q, k, v, picks):
    """Sparse attention over keys gathered per query (``picks [B, S, n]``): the gathered
    K/V carry the query dim, ``[B, S, n, H, D]`` (``case.variant`` spells the gather)."""
    h = q.shape[2]
    k, v = (jnp.repeat(x, h // x.shape[2], axis=2) for x in (k, v))
    if case.variant == "take_along_axis":
        k_sel, v_sel = (jnp.take_along_axis(x[:, None], picks[..., None, None], axis=2)
                        for x in (k, v))
    else:
        rows = jnp.arange(q.shape[0])[:, None, None]
        k_sel, v_sel = k[rows, picks], v[rows, picks]
    s = jnp.einsum("bqhd,bqnhd->bhqn", q, k_sel).astype(softmax_dtype(q.dtype))
    p = jax.nn.softmax(s / math.sqrt(q.shape[-1]), axis=-1).astype(v.dtype)
    return jnp.einsum("bhqn,bqnhd->bqhd", p, v_sel)


def recurrence(case: FuzzCase, x, p: dict):
    """The ``recurrence`` class's recurrence over the tokens of x [B, S, E] (``case.variant``),
    added to ``x``."""
    kind = case.variant.split("@")[0]
    gate = jax.nn.sigmoid(p["a_rec"])
    u = x @ p["w_rec"]
    b, s, e = x.shape

    def linear(h, ut):
        h = gate * h + ut
        return h, h

    if kind in ("scan_linear", "scan_reverse"):
        _, ys = lax.scan(linear, jnp.zeros((b, e), x.dtype), u.swapaxes(0, 1),
                         reverse=kind == "scan_reverse")
        return x + ys.swapaxes(0, 1)
    if kind == "scan_rnn":
        def rnn(h, ut):
            h = jnp.tanh(h @ p["w_rec"] + ut)
            return h, h * 0.5
        _, ys = lax.scan(rnn, jnp.zeros((b, e), x.dtype), jnp.moveaxis(x, 1, 0))
        return x + jnp.moveaxis(ys, 0, 1)
    if kind == "scan_state":
        heads = 2
        k, v = (jnp.moveaxis(t.reshape(b, s, heads, e // heads), 1, 0) for t in (x, u))

        def state(c, kv):
            kt, vt = kv
            c = 0.9 * c + jnp.einsum("bhd,bhf->bhdf", kt, vt)
            return c, jnp.einsum("bhd,bhdf->bhf", kt, c)
        _, ys = lax.scan(state, jnp.zeros((b, heads, e // heads, e // heads), x.dtype), (k, v))
        return x + jnp.moveaxis(ys, 0, 1).reshape(b, s, e) / s
    if kind in ("fori_index", "while_index"):
        def step(i, carry):
            h, out = carry
            h = jnp.tanh(gate * h + lax.dynamic_index_in_dim(u, i, 1, keepdims=False))
            return h, lax.dynamic_update_index_in_dim(out, h, i, 1)
        init = (jnp.zeros((b, e), x.dtype), jnp.zeros_like(x))
        if kind == "fori_index":
            return x + lax.fori_loop(0, s, step, init)[1]
        # reverse mode does not go through while_loop: its operands carry no gradient
        u, gate = lax.stop_gradient(u), lax.stop_gradient(gate)
        _, _, out = lax.while_loop(lambda c: c[0] < s,
                                   lambda c: (c[0] + 1,) + step(c[0], c[1:]), (0,) + init)
        return x + out
    if kind == "associative":
        def combine(left, right):
            return left[0] * right[0], right[0] * left[1] + right[1]
        return x + lax.associative_scan(combine, (jnp.broadcast_to(gate, u.shape), u),
                                        axis=1)[1]
    return x + lax.map(lambda t: jnp.tanh(t @ p["w_rec"]), x.swapaxes(0, 1)).swapaxes(0, 1)


def affine_scan(case: FuzzCase, x, p: dict):
    """The ``affine_scan`` class's scan (``case.variant``) over the tokens of x [B, S, E],
    added to ``x``: a carry affine in itself, outputs any function of it."""
    structure, rest = case.variant.split("@")
    reverse = rest.endswith("reverse")
    b, s, e = x.shape
    heads, d = 2, e // 2
    u = x @ p["w_rec"]
    gate = jax.nn.sigmoid(x @ p["w_gate"])
    if structure in ("diagonal", "broadcast"):
        coefficient = gate if structure == "diagonal" else \
            jnp.broadcast_to(jax.nn.sigmoid(p["a_rec"]), x.shape)
        init, xs = jnp.zeros((b, e)), (coefficient, u)

        def step(h, t):
            a_t, u_t = t
            h = a_t * h + u_t
            return h, jnp.tanh(h) * u_t
    elif structure in ("delta", "outer"):
        k = (u / (1 + jnp.linalg.norm(u, axis=-1, keepdims=True))).reshape(b, s, heads, d)
        v, g = x.reshape(b, s, heads, d), gate.reshape(b, s, heads, d)
        init, xs = jnp.zeros((b, heads, d, d)), (k, v, g)

        def step(h, t):
            k_t, v_t, g_t = t
            if structure == "delta":
                beta = g_t[..., :1]
                h = h - jnp.einsum("bhk,bhv->bhkv", beta * k_t,
                                   jnp.einsum("bhk,bhkv->bhv", k_t, h) - v_t)
            else:
                h = g_t[..., None] * h + jnp.einsum("bhk,bhv->bhkv", k_t, v_t)
            return h, jnp.einsum("bhk,bhkv->bhv", k_t, jnp.sin(h)).reshape(b, e)
    elif structure == "two_leaves":
        init, xs = (jnp.zeros((b, e)), jnp.zeros((b,))), (gate, u)

        def step(h, t):
            a_t, u_t = t
            h1, h2 = h
            h1, h2 = a_t * h1 + u_t, 0.5 * h2 + u_t[:, 0]
            return (h1, h2), h1 * jnp.cos(h2)[:, None]
    else:
        mix = jnp.einsum("bsi,ij->bsij", gate, p["w_rec"]) / e

        def step(h, t):
            m_t, u_t = t
            h = jnp.einsum("bi,bij->bj", h, m_t) + u_t
            return h, jax.nn.gelu(h)
        init, xs = jnp.zeros((b, e)), (mix, u)
    _, ys = lax.scan(step, init, tuple(jnp.moveaxis(t, 1, 0) for t in xs), reverse=reverse)
    return x + jnp.moveaxis(ys, 0, 1)


def chunked_scan(case: FuzzCase, x, p: dict):
    """The ``chunked_scan`` class's gated linear attention in chunk form over x [B, S, E]
    (``case.variant``: the chunk length), added to ``x``."""
    b, s, e = x.shape
    c = int(case.variant)
    n, heads, d = s // c, 2, e // 2
    q, k = (t.reshape(b, n, c, heads, d) for t in (x @ p["w_rec"], x @ p["w_gate"]))
    v = x.reshape(b, n, c, heads, d)
    g = jax.nn.log_sigmoid((x * p["a_rec"]).reshape(b, n, c, heads, d)) / 8
    causal = jnp.tril(jnp.ones((c, c), bool))

    def step(state, t):
        q_c, k_c, v_c, g_c = t
        decay = jnp.cumsum(g_c, axis=1)
        qd, kd = q_c * jnp.exp(decay), k_c * jnp.exp(-decay)
        out = jnp.einsum("bqhk,bhkv->bqhv", qd, state) + jnp.einsum(
            "bhqt,bthv->bqhv", jnp.einsum("bqhk,bthk->bhqt", qd, kd) * causal, v_c)
        last = decay[:, -1]
        state = jnp.exp(last)[..., None] * state + jnp.einsum(
            "bthk,bthv->bhkv", k_c * jnp.exp(last[:, None] - decay), v_c)
        return state, out

    _, out = lax.scan(step, jnp.zeros((b, heads, d, d)),
                      tuple(jnp.moveaxis(t, 1, 0) for t in (q, k, v, g)))
    return x + jnp.moveaxis(out, 0, 1).reshape(b, s, e) / c


def prefix_scan(case: FuzzCase, x, p: dict):
    """The ``prefix_scan`` class's recurrence (``case.variant``) over the tokens of
    x [B, S, E], added to ``x``."""
    kind, direction = case.variant.split("/")
    reverse = direction == "reverse"
    u = x @ p["w_rec"]
    if kind in ("cumsum", "cummax", "cummin", "cumlogsumexp"):
        return x + getattr(lax, kind)(u, axis=1, reverse=reverse) / u.shape[1]
    if kind == "cumprod":
        return x + lax.cumprod(1 + 0.05 * jnp.tanh(u), axis=1, reverse=reverse)
    a = jax.nn.sigmoid(x @ p["w_gate"])
    if kind == "linear_pair":
        def combine(left, right):
            return left[0] * right[0], right[0] * left[1] + right[1]
    else:
        def combine(left, right):
            return (jnp.maximum(left[0] + right[1], right[0]),
                    left[1] + right[1])
    return x + lax.associative_scan(combine, (a, u), axis=1, reverse=reverse)[0] / 4


#: Each recurrence-passing class's op over the tokens of x [B, S, E].
PASSING_OPS = {"affine_scan": affine_scan, "chunked_scan": chunked_scan,
               "prefix_scan": prefix_scan}


def window_op(case: FuzzCase, x, p: dict):
    """The ``windows`` class's op (``case.variant``) along the tokens of x [B, S, E]."""
    kind, width = case.variant.rsplit("_", 1)
    width = int(width)
    if kind == "conv":
        return lax.conv_general_dilated(x, p["w_conv"], (1,), ((width - 1, 0),),
                                        dimension_numbers=("NWC", "WIO", "NWC"),
                                        feature_group_count=x.shape[-1])
    if kind == "shift":
        return jnp.pad(x, ((0, 0), (width, 0), (0, 0)))[:, :-width]
    if kind == "roll":
        return jnp.roll(x, width, axis=1)
    init, fn = {"maxpool": (-jnp.inf, lax.max), "causalmax": (-jnp.inf, lax.max),
                "minpool": (jnp.inf, lax.min), "avgpool": (0.0, lax.add)}[kind]
    left = width - 1 if kind == "causalmax" else width // 2
    y = lax.reduce_window(x, init, fn, (1, width, 1), (1, 1, 1),
                          ((0, 0), (left, width - 1 - left), (0, 0)))
    return y / width if kind == "avgpool" else y


def build(case: FuzzCase):
    """(loss_fn(params, inputs), params, inputs)."""
    params, inputs = make_data(case)
    layer_keys = tuple(k for k in ("wq", "wk", "wv", "wqkv", "wo", "g") if k in params)

    def loss(p, inp):
        if case.cls == "equal_dims":
            return fuzz_equal_dims.loss(
                case, lambda c, q, k, v: attend(c, q, k, v, p, inp), p, inp)
        if case.cls == "shift_loss":
            x = p["emb"][inp["tokens"]]
        elif case.cls == "seq_scatter":
            x = SEQUENCE_SCATTERS[case.variant](p["emb"], inp["tokens"])
        else:
            x = p["x"]
        if case.cls == "token_mix":
            x = x + jnp.einsum("bsd,st->btd", x, p["w_mix"])
        if case.cls == "windows":
            x = x + window_op(case, x, p)
        recurrent = case.cls == "recurrence"
        if recurrent and case.variant.endswith("@input"):
            x = recurrence(case, x, p)
        passing = PASSING_OPS.get(case.cls)
        at_input = passing is not None and "@output" not in case.variant
        if at_input:
            x = passing(case, x, p)
        if case.cls == "scan_layers":
            stacked = {k: p[k] for k in layer_keys}
            rest = {k: v for k, v in p.items() if k not in layer_keys}

            def body(carry, lp):
                return block(case, {**rest, **lp}, carry, inp), None

            if case.variant == "remat":
                body = jax.checkpoint(body)
            y, _ = lax.scan(body, x, stacked)
        elif case.cls == "checkpoint":
            policy = jax.checkpoint_policies.save_only_these_names("block_in") \
                if case.variant == "named" else None
            y = jax.checkpoint(lambda pp, xx: block(case, pp, xx, inp), policy=policy)(p, x)
        elif case.cls == "vmap_batch":
            def one(xx, ii):
                yy = block(dataclasses.replace(case, batch=1), p, xx[None],
                           jax.tree_util.tree_map(lambda a: a[None], ii))
                return yy[0]
            per_example = {k: v for k, v in inp.items() if k not in ("dense_mask",)}
            if "dense_mask" in inp:
                raise AssertionError("vmap_batch draws no dense mask")
            y = jax.vmap(one)(x, per_example)
        else:
            y = block(case, p, x, inp)
        if recurrent and case.variant.endswith("@output"):
            y = recurrence(case, y, p)
        if passing is not None and not at_input:
            y = passing(case, y, p)
        if case.cls == "derived_sequence":
            cut = 1 if case.variant == "mtp" else int(case.variant.rsplit("_", 1)[1])
            z = y[:, :-1] + 0.5 * x[:, 1:] if case.variant == "mtp" else y[:, cut:]
            z = block(dataclasses.replace(case, seq=case.seq - cut), p, z, inp)
            return jnp.mean((y - p["target"]) ** 2) + jnp.mean(jnp.tanh(z) ** 2)
        if case.cls in LAYOUT_CLASSES:
            return layout_loss(case, p, y, inp)
        if case.cls == "cumsum_seq":
            y = jnp.cumsum(y, axis=1) / y.shape[1]
        if case.cls == "windows":
            y = window_op(case, y, p)
        if case.cls in ("shift_loss", "seq_scatter"):
            logits = y @ p["unemb"]
            logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
            nll = -jnp.take_along_axis(logp, inp["tokens"][:, 1:, None], axis=-1)[..., 0]
            return jnp.mean(nll) if case.variant == "mean" else jnp.sum(nll) / 100.0
        return jnp.mean((y - p["target"]) ** 2)

    return loss, params, inputs


# ----------------------------------------------------------------------------------------
# Running and classifying
# ----------------------------------------------------------------------------------------

@dataclass
class Outcome:
    status: str          # passed unmatched refused wrong crashed
    detail: str = ""

    def __str__(self):
        return f"{self.status}: {self.detail}" if self.detail else self.status


def _tol(case: FuzzCase) -> float:
    if case.cls == "dtype_f64":
        return 1e-10
    bf16_variant = isinstance(case.variant, str) and case.variant.endswith("bf16")
    return 2e-2 if case.bf16 or case.cls == "dtype_fp16" or bf16_variant else F32_RTOL


#: Relative tolerance of a float32 program against its undecorated run.
F32_RTOL = 1e-5
#: How much more float32 rounding error than the undecorated run's own the transformed run
#: may show, both measured against a float64 run of the same program. A schedule sums in
#: another order (blockwise online softmax, partial sums per device), so on an ill-
#: conditioned program (the undecorated float32 run already 3e-5 off float64) the two float32
#: runs differ by more than ``F32_RTOL`` while both are rounding noise; a real error is
#: orders of magnitude above the noise.
F32_NOISE_FACTOR = 8.0


def beyond_float32_noise(case: FuzzCase, got, ref, diff: str) -> str | None:
    """``diff`` unless every leaf of ``got`` is within :data:`F32_NOISE_FACTOR` times the
    float32 reference's own error, both against a float64 run of the program (None then)."""
    def in_float64(run_case):
        loss, params, inputs = build(run_case)
        wide = lambda a: jnp.asarray(a, jnp.float64) if jnp.issubdtype(  # noqa: E731
            jnp.asarray(a).dtype, jnp.floating) else a
        return jax.jit(jax.value_and_grad(loss))(jax.tree_util.tree_map(wide, params),
                                                 jax.tree_util.tree_map(wide, inputs))

    truth = jax.block_until_ready(_with_x64(in_float64, case))
    for g, r, t in zip(*(jax.tree_util.tree_leaves(x) for x in (got, ref, truth))):
        g, r, t = (np.asarray(x, np.float64) for x in (g, r, t))
        finite = np.isfinite(t)
        if not np.array_equal(np.isfinite(g), finite):
            return diff
        scale = float(np.abs(t[finite]).max()) if finite.any() else 0.0
        scale = scale or 1.0
        own = float(np.abs(r - t)[finite].max(initial=0.0)) / scale
        ours = float(np.abs(g - t)[finite].max(initial=0.0)) / scale
        if ours > max(F32_RTOL, F32_NOISE_FACTOR * own):
            return f"{diff}; against float64: {ours:.3g} relative, one device's own {own:.3g}"
    return None


def compare(case: FuzzCase, got, ref) -> str | None:
    """None when equal, else what differs."""
    rtol = _tol(case)
    (gl, gg), (rl, rg) = got, ref
    items = [("loss", gl, rl)] + [
        (jax.tree_util.keystr(path), g, r)
        for (path, r), g in zip(jax.tree_util.tree_flatten_with_path(rg)[0],
                                jax.tree_util.tree_leaves(gg))]
    for name, g, r in items:
        g, r = np.asarray(g, np.float64), np.asarray(r, np.float64)
        if g.shape != r.shape:
            return f"{name}: shape {g.shape} vs reference {r.shape}"
        finite = np.abs(r[np.isfinite(r)])
        # like tests/test_transform.assert_tree_close: an all-zero reference leaf has scale 1
        scale = (float(finite.max()) if finite.size else 0.0) or 1.0
        try:
            np.testing.assert_allclose(g, r, rtol=rtol, atol=rtol * scale, equal_nan=True)
        except AssertionError as err:
            gn, rn = int(np.isnan(g).sum()), int(np.isnan(r).sum())
            bad = np.abs(g - r)
            ok = np.isfinite(bad)
            worst = float(bad[ok].max()) if ok.any() else float("nan")
            msg = " ".join(str(err).split())[:200]
            return (f"{name}: max|diff|={worst:.3g} vs max|ref|={scale:.3g}; NaNs {gn} vs "
                    f"reference {rn}; {msg}")
    return None


def _last_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    text = " ".join(text.split())
    return text[:300]


def run_case(case: FuzzCase) -> Outcome:
    """Run one case; the reference must work (else the generator is wrong: raises)."""
    if case.cls == "dtype_f64":
        return _with_x64(_run_program, case)
    if case.cls in CALL_RUNNERS:
        return _classified(CALL_RUNNERS[case.cls], case)
    return _run_program(case)


def _run_program(case: FuzzCase) -> Outcome:
    loss, params, inputs = build(case)
    if case.cls == "dtype_f64":
        params = jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float64), params)
    ref = jax.jit(jax.value_and_grad(loss))(params, inputs)
    ref = jax.block_until_ready(ref)
    if case.cls == "nan_weight":
        assert np.isnan(float(ref[0])), "the NaN weight should make the reference loss NaN"
    try:
        # The recurrence classes pass state whatever it costs: the planner prices passing
        # against gathering, and these short sequences would often gather.
        passing = {"recurrences": "pass"} \
            if case.cls in RECURRENCE_CLASSES + ROW_REDUCTION_CLASSES else {}
        f = context_parallel(loss, cp=case.cp, schedule=case.schedule,
                             load_balance=case.load_balance, allow_unsharded=True, **passing)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", UnshardedWarning)
            got = jax.block_until_ready(jax.jit(jax.value_and_grad(f))(params, inputs))
    except Exception as exc:  # noqa: BLE001 - classified: a refusal or an unclear crash
        return _exception_outcome(exc)
    diff = compare(case, got, ref)
    if diff is not None and _tol(case) == F32_RTOL:
        diff = beyond_float32_noise(case, got, ref, diff)
    if diff is not None:
        return Outcome("wrong", diff)
    unsharded = [w for w in caught if issubclass(w.category, UnshardedWarning)]
    if unsharded:
        return Outcome("unmatched", _refusals(str(unsharded[0].message)))
    if case.cls in RECURRENCE_CLASSES + ROW_REDUCTION_CLASSES:
        module = f.module(params, inputs)
        gathered = [r.describe() for r in module.facts.recurrences
                    if r.method in (None, Method.GATHER)]
        if gathered:
            return Outcome("unmatched", "a recurrence not passing state: "
                           + "; ".join(gathered))
        left = _row_reductions_left(case, loss, params, inputs)
        if left:
            return Outcome("unmatched", "a row reduction of the mask left whole: " + left)
    return Outcome("passed")


def _row_reductions_left(case: FuzzCase, loss, params, inputs) -> str:
    """For a ``row_reduction`` case whose reduction can be counts (every variant but the
    two-sided ``window``), the reductions of a ``[.., S, S]`` mask match-attention left."""
    if case.cls not in ROW_REDUCTION_CLASSES or case.variant == "window":
        return ""
    module = Pipeline.parse("canonicalize,match-attention", available=get_all_passes()) \
        .run(trace(loss, params, inputs)).module
    return ", ".join(str(e) for e in iter_eqns(module.jaxpr)
                     if e.primitive.name in ("reduce_and", "reduce_or")
                     and list(e.invars[0].aval.shape).count(case.seq) >= 2)


def _exception_outcome(exc: Exception) -> Outcome:
    """A refusal (a ``CPTransformError`` or ``NotImplementedError`` with a message), or a
    crash: a refusal without a message, or any other exception, with where it was raised."""
    if isinstance(exc, (CPTransformError, NotImplementedError)):
        if str(exc).strip():
            return Outcome("refused", _last_line(exc))
        return Outcome("crashed", "refusal without a message: " + _last_line(exc))
    tb = traceback.extract_tb(exc.__traceback__)
    where = f" (at {tb[-1].filename}:{tb[-1].lineno})" if tb else ""
    return Outcome("crashed", _last_line(exc) + where)


def _refusals(message: str) -> str:
    """The refused softmaxes of an ``UnshardedWarning`` (its indented lines), on one line."""
    lines = [line.strip() for line in message.splitlines() if line.startswith("  ")]
    return "; ".join(lines) or " ".join(message.split())[:300]


# ----------------------------------------------------------------------------------------
# The calls around the transform
# ----------------------------------------------------------------------------------------

def _with_x64(run: Callable[[FuzzCase], Any], case: FuzzCase) -> Any:
    """``run(case)`` with 64-bit types enabled (restored afterwards)."""
    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        return run(case)
    finally:
        jax.config.update("jax_enable_x64", previous)


def _classified(run: Callable[[FuzzCase], str | None], case: FuzzCase) -> Outcome:
    """``run`` returns what differs (or None); its exceptions are classified as in
    :func:`run_case`."""
    try:
        diff = run(case)
    except Exception as exc:  # noqa: BLE001 - classified: a refusal or an unclear crash
        return _exception_outcome(exc)
    return Outcome("wrong", diff) if diff is not None else Outcome("passed")


def _options(case: FuzzCase) -> dict:
    return dict(cp=case.cp, schedule=case.schedule, load_balance=case.load_balance)


def _run_rng_steps(case: FuzzCase) -> str | None:
    """Three steps of a loss that splits the PRNG key it finds in ``state`` (and writes the
    new key back) to draw a dropout mask on its input: each step's loss and gradients, and
    the final key, equal the undecorated function's."""
    loss, params, inputs = build(case)

    def stepped(p, inp, state):
        state["key"], sub = jax.random.split(state["key"])
        keep = jax.random.bernoulli(sub, 0.75, p["x"].shape)
        return loss({**p, "x": jnp.where(keep, p["x"] / 0.75, 0.0)}, inp)

    f = context_parallel(stepped, **_options(case))
    states = [{"key": jax.random.PRNGKey(case.seed)} for _ in range(2)]
    for step in range(3):
        ref = jax.value_and_grad(stepped)(params, inputs, dict(states[0]))
        got = jax.value_and_grad(f)(params, inputs, dict(states[1]))
        stepped(params, inputs, states[0])
        f(params, inputs, states[1])
        diff = compare(case, got, ref)
        if diff is not None:
            return f"step {step}: {diff}"
    if not np.array_equal(states[0]["key"], states[1]["key"]):
        return "the key written back differs from the undecorated function's"
    return None


def _run_static_equal_hash(case: FuzzCase) -> str | None:
    """A static argument drawn from ``1``, ``True`` and ``1.0`` in turn (equal, same hash):
    each call runs the program its own value and type trace."""
    loss, params, inputs = build(case)

    def picked(p, inp, n):
        return loss(p, inp) * {int: 2.0, bool: 3.0, float: 5.0}[type(n)]

    f = context_parallel(picked, **_options(case))
    for n in case.variant:
        diff = compare(case, jax.value_and_grad(f)(params, inputs, n),
                       jax.value_and_grad(picked)(params, inputs, n))
        if diff is not None:
            return f"static {n!r}: {diff}"
    return None


#: Runners of the call classes that are not one ``value_and_grad`` of a drawn program.
CALL_RUNNERS: dict[str, Callable[[FuzzCase], str | None]] = {
    "rng_steps": _run_rng_steps,
    "static_equal_hash": _run_static_equal_hash,
}
