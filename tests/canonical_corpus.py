"""The corpus of programs whose canonical form must agree across JAX releases.

Each entry is a name and a thunk giving ``(fn, args)``: the attention spellings of the match
tests, each example's loss, one drawn program per fuzzer class (pinned as ``FuzzCase``
records, so the corpus does not move with NumPy's random streams), and Flax / NNX / optax
idioms. ``tests/test_canonical_form.py`` traces each, runs ``canonicalize`` (the boundary
after which every analysis reads one program whatever JAX traced it) and compares its
:func:`~cptransform.ir.canonical_text.canonical_lines` with the file in
``tests/canonical_forms/``. ``python tests/canonical_corpus.py`` writes those files anew.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLES = os.path.join(os.path.dirname(HERE), "examples")
#: Where the canonical text of each program is kept, one ``<name>.txt`` each.
FORMS = os.path.join(HERE, "canonical_forms")

#: One drawn program per fuzzer class (``draw_case`` with ``numpy_chooser(default_rng(i))``
#: for the class's index ``i``, written out once), as ``FuzzCase`` reprs.
FUZZ_SEEDS = (
    "FuzzCase(cls='mask_none', seed=0, cp=8, schedule='ring', load_balance='none', batch=2, seq=48, heads=2, kv_heads=2, head_dim=4, v_head_dim=4, model_dim=32, mask='none', causal=False, window=0, spelling='jnn', gqa_style='reshape', fill='finfo_min_added', variant='', norm=True, rope=True, residual=True, bf16=False)",
    "FuzzCase(cls='mask_causal', seed=1, cp=4, schedule='ring', load_balance='zigzag', batch=2, seq=40, heads=8, kv_heads=8, head_dim=4, v_head_dim=8, model_dim=16, mask='causal', causal=True, window=0, spelling='matmul', gqa_style='repeat', fill='finfo_min_added', variant='', norm=True, rope=False, residual=False, bf16=False)",
    "FuzzCase(cls='mask_window', seed=2, cp=8, schedule='allgather', load_balance='striped', batch=1, seq=32, heads=2, kv_heads=1, head_dim=16, v_head_dim=16, model_dim=32, mask='window', causal=True, window=17, spelling='einsum', gqa_style='repeat', fill='neg_big_added', variant='', norm=True, rope=False, residual=True, bf16=False)",
    "FuzzCase(cls='mask_two_sided', seed=3, cp=8, schedule='ring', load_balance='none', batch=1, seq=16, heads=1, kv_heads=1, head_dim=16, v_head_dim=4, model_dim=32, mask='two_sided', causal=False, window=3, spelling='matmul', gqa_style='repeat', fill='neg_inf', variant='', norm=False, rope=False, residual=True, bf16=False)",
    "FuzzCase(cls='mask_segments', seed=4, cp=8, schedule='allgather', load_balance='striped', batch=2, seq=64, heads=4, kv_heads=1, head_dim=16, v_head_dim=16, model_dim=32, mask='segments', causal=False, window=0, spelling='matmul', gqa_style='reshape', fill='finfo_min', variant='', norm=True, rope=False, residual=True, bf16=False)",
    "FuzzCase(cls='mask_key_padding', seed=5, cp=8, schedule='auto', load_balance='none', batch=1, seq=64, heads=8, kv_heads=4, head_dim=8, v_head_dim=8, model_dim=16, mask='key_padding', causal=False, window=0, spelling='jnn', gqa_style='repeat', fill='finfo_min', variant='float_gt', norm=False, rope=False, residual=False, bf16=False)",
    "FuzzCase(cls='mask_dense', seed=6, cp=4, schedule='allgather', load_balance='auto', batch=2, seq=40, heads=2, kv_heads=1, head_dim=8, v_head_dim=4, model_dim=32, mask='dense', causal=False, window=0, spelling='einsum', gqa_style='reshape', fill='neg_big_added', variant='batch', norm=False, rope=True, residual=True, bf16=False)",
    "FuzzCase(cls='mask_bias', seed=7, cp=8, schedule='ring', load_balance='zigzag', batch=2, seq=48, heads=8, kv_heads=4, head_dim=16, v_head_dim=16, model_dim=16, mask='bias', causal=False, window=0, spelling='jnn', gqa_style='repeat', fill='finfo_min_added', variant='alibi', norm=True, rope=False, residual=True, bf16=False)",
    "FuzzCase(cls='mask_builders', seed=8, cp=8, schedule='allgather', load_balance='auto', batch=1, seq=32, heads=8, kv_heads=8, head_dim=4, v_head_dim=8, model_dim=16, mask='builder', causal=False, window=1, spelling='einsum', gqa_style='repeat', fill='finfo_min', variant='tril_difference', norm=False, rope=False, residual=False, bf16=False)",
    "FuzzCase(cls='mask_chunked', seed=9, cp=4, schedule='allgather', load_balance='striped', batch=2, seq=64, heads=2, kv_heads=2, head_dim=8, v_head_dim=8, model_dim=32, mask='chunked', causal=True, window=16, spelling='matmul', gqa_style='reshape', fill='finfo_min_added', variant='hf_overlay', norm=True, rope=False, residual=False, bf16=False)",
    "FuzzCase(cls='mask_data_window', seed=10, cp=8, schedule='auto', load_balance='striped', batch=1, seq=64, heads=1, kv_heads=1, head_dim=16, v_head_dim=16, model_dim=16, mask='data_window', causal=False, window=1, spelling='einsum', gqa_style='reshape', fill='neg_inf', variant='behind_left', norm=False, rope=False, residual=True, bf16=False)",
    "FuzzCase(cls='llama_block', seed=11, cp=2, schedule='ulysses', load_balance='none', batch=2, seq=20, heads=2, kv_heads=1, head_dim=8, v_head_dim=8, model_dim=32, mask='causal', causal=True, window=0, spelling='jnn', gqa_style='repeat', fill='neg_inf', variant='int16', norm=True, rope=True, residual=True, bf16=False)",
    "FuzzCase(cls='bf16', seed=12, cp=4, schedule='allgather', load_balance='zigzag', batch=2, seq=24, heads=8, kv_heads=8, head_dim=4, v_head_dim=4, model_dim=16, mask='none', causal=False, window=0, spelling='jnn', gqa_style='reshape', fill='neg_inf', variant='', norm=True, rope=True, residual=False, bf16=True)",
    "FuzzCase(cls='seq_contract', seed=13, cp=8, schedule='ring', load_balance='none', batch=2, seq=64, heads=8, kv_heads=8, head_dim=16, v_head_dim=16, model_dim=32, mask='window', causal=True, window=8, spelling='jnn', gqa_style='reshape', fill='finfo_min_added', variant='', norm=True, rope=False, residual=True, bf16=False)",
    "FuzzCase(cls='token_mix', seed=14, cp=2, schedule='allgather', load_balance='none', batch=2, seq=56, heads=2, kv_heads=2, head_dim=16, v_head_dim=4, model_dim=16, mask='causal', causal=True, window=0, spelling='matmul', gqa_style='reshape', fill='neg_inf', variant='', norm=False, rope=True, residual=True, bf16=False)",
    "FuzzCase(cls='fused_qkv', seed=15, cp=8, schedule='ring', load_balance='zigzag', batch=2, seq=48, heads=8, kv_heads=8, head_dim=4, v_head_dim=4, model_dim=32, mask='causal', causal=True, window=0, spelling='jnn', gqa_style='repeat', fill='neg_inf', variant='', norm=True, rope=True, residual=False, bf16=False)",
    "FuzzCase(cls='concat_nonseq', seed=16, cp=4, schedule='allgather', load_balance='zigzag', batch=2, seq=40, heads=2, kv_heads=1, head_dim=4, v_head_dim=4, model_dim=32, mask='causal', causal=True, window=0, spelling='einsum', gqa_style='repeat', fill='neg_big', variant='concat_features', norm=True, rope=True, residual=False, bf16=False)",
    "FuzzCase(cls='cumsum_seq', seed=17, cp=8, schedule='ring', load_balance='zigzag', batch=1, seq=64, heads=1, kv_heads=1, head_dim=8, v_head_dim=8, model_dim=16, mask='window', causal=True, window=3, spelling='einsum', gqa_style='reshape', fill='finfo_min_added', variant='', norm=True, rope=False, residual=True, bf16=False)",
    "FuzzCase(cls='shift_loss', seed=18, cp=8, schedule='auto', load_balance='auto', batch=1, seq=32, heads=4, kv_heads=1, head_dim=4, v_head_dim=4, model_dim=32, mask='causal', causal=True, window=0, spelling='jnn', gqa_style='reshape', fill='neg_big_added', variant='sum', norm=True, rope=True, residual=True, bf16=False)",
    "FuzzCase(cls='seq_scatter', seed=19, cp=4, schedule='ring', load_balance='striped', batch=1, seq=32, heads=8, kv_heads=2, head_dim=16, v_head_dim=16, model_dim=16, mask='none', causal=False, window=0, spelling='einsum', gqa_style='reshape', fill='finfo_min_added', variant='roll', norm=True, rope=False, residual=False, bf16=False)",
    "FuzzCase(cls='custom_vjp_clip', seed=20, cp=8, schedule='allgather', load_balance='zigzag', batch=1, seq=32, heads=2, kv_heads=1, head_dim=4, v_head_dim=4, model_dim=16, mask='none', causal=False, window=0, spelling='einsum', gqa_style='reshape', fill='neg_big', variant='global_norm', norm=True, rope=True, residual=True, bf16=False)",
    "FuzzCase(cls='straight_through', seed=21, cp=2, schedule='ulysses', load_balance='striped', batch=1, seq=56, heads=4, kv_heads=2, head_dim=16, v_head_dim=16, model_dim=32, mask='causal', causal=True, window=0, spelling='jnn', gqa_style='repeat', fill='neg_big_added', variant='', norm=False, rope=True, residual=False, bf16=False)",
    "FuzzCase(cls='scan_layers', seed=22, cp=8, schedule='allgather', load_balance='none', batch=2, seq=32, heads=1, kv_heads=1, head_dim=4, v_head_dim=4, model_dim=32, mask='causal', causal=True, window=0, spelling='einsum', gqa_style='repeat', fill='finfo_min_added', variant='plain', norm=True, rope=False, residual=False, bf16=False)",
    "FuzzCase(cls='checkpoint', seed=23, cp=2, schedule='ring', load_balance='striped', batch=1, seq=52, heads=4, kv_heads=4, head_dim=4, v_head_dim=4, model_dim=32, mask='causal', causal=True, window=0, spelling='jnn', gqa_style='repeat', fill='neg_big_added', variant='', norm=False, rope=False, residual=False, bf16=False)",
    "FuzzCase(cls='vmap_batch', seed=24, cp=4, schedule='allgather', load_balance='striped', batch=2, seq=32, heads=2, kv_heads=1, head_dim=8, v_head_dim=4, model_dim=32, mask='none', causal=False, window=0, spelling='einsum', gqa_style='reshape', fill='neg_inf', variant='', norm=False, rope=False, residual=True, bf16=False)",
    "FuzzCase(cls='nan_weight', seed=25, cp=4, schedule='ring', load_balance='striped', batch=2, seq=24, heads=1, kv_heads=1, head_dim=4, v_head_dim=4, model_dim=32, mask='causal', causal=True, window=0, spelling='einsum', gqa_style='reshape', fill='neg_big', variant='wo', norm=True, rope=True, residual=False, bf16=False)",
    "FuzzCase(cls='masked_rows', seed=26, cp=8, schedule='auto', load_balance='auto', batch=2, seq=32, heads=1, kv_heads=1, head_dim=4, v_head_dim=8, model_dim=32, mask='key_padding', causal=True, window=0, spelling='einsum', gqa_style='reshape', fill='finfo_min_added', variant='plain', norm=False, rope=True, residual=True, bf16=False)",
    "FuzzCase(cls='row_test', seed=27, cp=2, schedule='ulysses', load_balance='auto', batch=1, seq=52, heads=2, kv_heads=1, head_dim=4, v_head_dim=4, model_dim=16, mask='row_test', causal=True, window=1, spelling='einsum', gqa_style='reshape', fill='neg_big_added', variant='different', norm=False, rope=False, residual=False, bf16=False)",
    "FuzzCase(cls='windows', seed=28, cp=4, schedule='ring', load_balance='none', batch=1, seq=56, heads=8, kv_heads=1, head_dim=16, v_head_dim=16, model_dim=32, mask='window', causal=True, window=17, spelling='jnn', gqa_style='repeat', fill='finfo_min', variant='avgpool_3', norm=True, rope=False, residual=True, bf16=False)",
    "FuzzCase(cls='gathered_keys', seed=29, cp=8, schedule='allgather', load_balance='none', batch=2, seq=16, heads=4, kv_heads=4, head_dim=8, v_head_dim=8, model_dim=16, mask='causal', causal=True, window=0, spelling='jnn', gqa_style='repeat', fill='finfo_min_added', variant='take_along_axis', norm=False, rope=False, residual=True, bf16=False)",
    "FuzzCase(cls='recurrence', seed=30, cp=2, schedule='auto', load_balance='zigzag', batch=2, seq=28, heads=2, kv_heads=1, head_dim=4, v_head_dim=4, model_dim=16, mask='causal', causal=True, window=0, spelling='einsum', gqa_style='reshape', fill='finfo_min_added', variant='scan_linear@input', norm=False, rope=False, residual=False, bf16=False)",
    "FuzzCase(cls='derived_sequence', seed=31, cp=4, schedule='auto', load_balance='striped', batch=1, seq=64, heads=1, kv_heads=1, head_dim=16, v_head_dim=4, model_dim=16, mask='none', causal=False, window=0, spelling='einsum', gqa_style='reshape', fill='neg_big', variant='mtp', norm=False, rope=True, residual=True, bf16=False)",
    "FuzzCase(cls='combined_maps', seed=32, cp=8, schedule='allgather', load_balance='striped', batch=2, seq=16, heads=4, kv_heads=2, head_dim=8, v_head_dim=8, model_dim=32, mask='causal', causal=True, window=0, spelling='jnn', gqa_style='reshape', fill='finfo_min', variant='product', norm=True, rope=True, residual=True, bf16=False)",
    "FuzzCase(cls='dropout_probs', seed=33, cp=8, schedule='allgather', load_balance='striped', batch=1, seq=32, heads=4, kv_heads=1, head_dim=16, v_head_dim=16, model_dim=32, mask='causal', causal=True, window=0, spelling='jnn', gqa_style='reshape', fill='finfo_min', variant='broadcast', norm=True, rope=True, residual=False, bf16=False)",
    "FuzzCase(cls='kv_cache', seed=34, cp=2, schedule='ulysses', load_balance='zigzag', batch=1, seq=16, heads=8, kv_heads=8, head_dim=4, v_head_dim=4, model_dim=32, mask='none', causal=False, window=0, spelling='einsum', gqa_style='repeat', fill='neg_big_added', variant='write_created', norm=True, rope=False, residual=True, bf16=False)",
    "FuzzCase(cls='logit_chain', seed=35, cp=2, schedule='ring', load_balance='striped', batch=2, seq=32, heads=2, kv_heads=1, head_dim=16, v_head_dim=16, model_dim=16, mask='none', causal=False, window=0, spelling='matmul', gqa_style='repeat', fill='neg_big', variant='scale_query', norm=True, rope=False, residual=True, bf16=False)",
    "FuzzCase(cls='merge_tokens', seed=34, cp=2, schedule='ulysses', load_balance='zigzag', batch=1, seq=16, heads=8, kv_heads=8, head_dim=4, v_head_dim=4, model_dim=32, mask='none', causal=False, window=0, spelling='einsum', gqa_style='repeat', fill='neg_big_added', variant='rows', norm=True, rope=False, residual=True, bf16=False)",
    "FuzzCase(cls='chunk_tokens', seed=35, cp=2, schedule='ring', load_balance='striped', batch=2, seq=32, heads=2, kv_heads=1, head_dim=16, v_head_dim=16, model_dim=16, mask='none', causal=False, window=0, spelling='matmul', gqa_style='repeat', fill='neg_big', variant='4', norm=True, rope=False, residual=True, bf16=False)",
    "FuzzCase(cls='dense_head', seed=36, cp=4, schedule='auto', load_balance='zigzag', batch=1, seq=24, heads=2, kv_heads=1, head_dim=16, v_head_dim=8, model_dim=32, mask='window', causal=True, window=5, spelling='einsum', gqa_style='repeat', fill='finfo_min_added', variant='', norm=True, rope=False, residual=False, bf16=False)",
    "FuzzCase(cls='pooling', seed=37, cp=2, schedule='ulysses', load_balance='auto', batch=2, seq=52, heads=4, kv_heads=4, head_dim=4, v_head_dim=4, model_dim=16, mask='window', causal=True, window=5, spelling='matmul', gqa_style='repeat', fill='finfo_min_added', variant='segment_sum', norm=False, rope=False, residual=True, bf16=False)",
    "FuzzCase(cls='routing', seed=38, cp=2, schedule='auto', load_balance='none', batch=1, seq=40, heads=1, kv_heads=1, head_dim=16, v_head_dim=16, model_dim=32, mask='causal', causal=True, window=0, spelling='einsum', gqa_style='reshape', fill='neg_big', variant='top1_capacity', norm=False, rope=True, residual=False, bf16=False)",
    "FuzzCase(cls='shift_extreme', seed=39, cp=8, schedule='auto', load_balance='striped', batch=1, seq=48, heads=4, kv_heads=1, head_dim=4, v_head_dim=4, model_dim=32, mask='causal', causal=True, window=0, spelling='jnn', gqa_style='repeat', fill='finfo_min', variant='sqrt_zero', norm=True, rope=False, residual=True, bf16=False)",
    "FuzzCase(cls='rng_steps', seed=40, cp=4, schedule='ulysses', load_balance='striped', batch=1, seq=56, heads=4, kv_heads=2, head_dim=16, v_head_dim=16, model_dim=32, mask='none', causal=False, window=0, spelling='jnn', gqa_style='reshape', fill='neg_big', variant='', norm=False, rope=False, residual=False, bf16=False)",
    "FuzzCase(cls='static_equal_hash', seed=41, cp=4, schedule='auto', load_balance='none', batch=2, seq=64, heads=8, kv_heads=1, head_dim=4, v_head_dim=4, model_dim=32, mask='causal', causal=True, window=0, spelling='matmul', gqa_style='reshape', fill='finfo_min', variant=(1.0, True, 1), norm=True, rope=False, residual=False, bf16=False)",
    "FuzzCase(cls='dtype_f64', seed=42, cp=2, schedule='ring', load_balance='striped', batch=2, seq=56, heads=2, kv_heads=1, head_dim=16, v_head_dim=16, model_dim=32, mask='none', causal=False, window=0, spelling='matmul', gqa_style='reshape', fill='finfo_min_added', variant='', norm=True, rope=True, residual=True, bf16=False)",
    "FuzzCase(cls='dtype_fp16', seed=43, cp=4, schedule='allgather', load_balance='auto', batch=1, seq=48, heads=1, kv_heads=1, head_dim=4, v_head_dim=4, model_dim=32, mask='causal', causal=True, window=0, spelling='matmul', gqa_style='reshape', fill='finfo_min', variant='', norm=False, rope=False, residual=False, bf16=False)",
    "FuzzCase(cls='deferred_norm', seed=44, cp=8, schedule='ulysses', load_balance='zigzag', batch=1, seq=64, heads=8, kv_heads=4, head_dim=8, v_head_dim=8, model_dim=16, mask='causal', causal=True, window=0, spelling='matmul', gqa_style='repeat', fill='neg_inf', variant='maxtext', norm=False, rope=False, residual=False, bf16=False)",
    "FuzzCase(cls='mask_padding_merge', seed=45, cp=8, schedule='allgather', load_balance='striped', batch=2, seq=48, heads=4, kv_heads=2, head_dim=16, v_head_dim=8, model_dim=32, mask='padding_merge', causal=True, window=5, spelling='matmul', gqa_style='reshape', fill='neg_big_added', variant='query_side_causal', norm=True, rope=False, residual=False, bf16=False)",
    "FuzzCase(cls='affine_scan', seed=48, cp=2, schedule='allgather', load_balance='auto', batch=1, seq=36, heads=4, kv_heads=1, head_dim=8, v_head_dim=8, model_dim=32, mask='none', causal=False, window=0, spelling='matmul', gqa_style='repeat', fill='finfo_min_added', variant='outer@output/forward', norm=True, rope=True, residual=True, bf16=False)",
    "FuzzCase(cls='chunked_scan', seed=49, cp=2, schedule='allgather', load_balance='striped', batch=2, seq=32, heads=4, kv_heads=4, head_dim=8, v_head_dim=8, model_dim=32, mask='causal', causal=True, window=0, spelling='einsum', gqa_style='repeat', fill='neg_big', variant='4', norm=True, rope=False, residual=True, bf16=False)",
    "FuzzCase(cls='prefix_scan', seed=50, cp=8, schedule='ring', load_balance='zigzag', batch=2, seq=64, heads=8, kv_heads=1, head_dim=8, v_head_dim=8, model_dim=16, mask='none', causal=False, window=0, spelling='matmul', gqa_style='reshape', fill='neg_big_added', variant='cumlogsumexp/reverse', norm=True, rope=False, residual=False, bf16=False)",
    "FuzzCase(cls='equal_dims', seed=40, cp=4, schedule='ring', load_balance='zigzag', batch=2, seq=16, heads=4, kv_heads=4, head_dim=8, v_head_dim=8, model_dim=32, mask='causal', causal=True, window=0, spelling='jnn', gqa_style='reshape', fill='neg_big_added', variant='2|a1,a1,a0,a1|batched|around', norm=False, rope=True, residual=False, bf16=False)",
    "FuzzCase(cls='mask_region_padding', seed=52, cp=8, schedule='allgather', load_balance='striped', batch=1, seq=48, heads=4, kv_heads=2, head_dim=8, v_head_dim=8, model_dim=16, mask='region_padding', causal=True, window=3, spelling='matmul', gqa_style='repeat', fill='finfo_min_added', variant='where_two_bool_causal', norm=False, rope=False, residual=False, bf16=False)",
    "FuzzCase(cls='row_reduction', seed=53, cp=8, schedule='allgather', load_balance='none', batch=2, seq=16, heads=4, kv_heads=1, head_dim=4, v_head_dim=8, model_dim=32, mask='row_reduction', causal=True, window=1, spelling='einsum', gqa_style='repeat', fill='neg_big_added', variant='count_weight', norm=True, rope=True, residual=True, bf16=False)",
    "FuzzCase(cls='mask_bias_summed', seed=53, cp=8, schedule='allgather', load_balance='zigzag', batch=2, seq=64, heads=4, kv_heads=1, head_dim=8, v_head_dim=8, model_dim=16, mask='bias_summed', causal=False, window=0, spelling='jnn', gqa_style='reshape', fill='finfo_min_added', variant='param_causal+padding', norm=True, rope=True, residual=True, bf16=False)",
)


def _randn(*shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _qkv(*shape):
    return tuple(_randn(*shape, seed=i) for i in range(3))


def _example(name: str):
    """The example script ``examples/<name>.py`` as a module (its ``make()``)."""
    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)
    spec = importlib.util.spec_from_file_location(f"corpus_example_{name}",
                                                  os.path.join(EXAMPLES, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _spellings() -> dict[str, Callable[[], tuple]]:
    import test_differential_attention as differential
    import test_dropout_attention as dropout
    import test_mask_builders as builders
    import test_match_handwritten as handwritten
    import test_match_spellings as spellings
    import test_match_unit_dims as unit_dims

    out: dict[str, Callable[[], tuple]] = {}
    for fn in handwritten.SPELLINGS:
        out[f"handwritten_{fn.__name__}"] = (
            lambda fn=fn: (fn, _qkv(handwritten.B, handwritten.T, handwritten.H, handwritten.D)))
    for name, fn in unit_dims.SPELLINGS.items():
        out[f"unit_dims_{name}"] = lambda fn=fn: (fn, _qkv(1, unit_dims.T, 1, unit_dims.D))
    for fn in (spellings.gemma_global, spellings.gemma_local):
        out[f"spelling_{fn.__name__}"] = (
            lambda fn=fn: (fn, spellings.gqa_inputs(np.random.default_rng(0))))
    for name, lse in spellings.LSE.items():
        out[f"spelling_per_head_{name}"] = (
            lambda lse=lse: (spellings.per_head(lse), _qkv(spellings.B, spellings.T,
                                                           spellings.N, spellings.H)))
    for name, case in builders.CASES.items():
        out[f"mask_builder_{name}"] = (
            lambda name=name, fn=case[0]: (fn, builders.inputs(np.random.default_rng(0), name)))
    for name, fn in dropout.SPELLINGS.items():
        out[f"dropout_{name}"] = lambda fn=fn: (dropout._loss(fn), dropout._args())
    for name, fn in differential.SPELLINGS.items():
        out[f"differential_{name}"] = (
            lambda fn=fn: (differential._loss(fn), differential._args()))
    return out


def _examples() -> dict[str, Callable[[], tuple]]:
    names = ("llama", "gemma", "packed_documents", "nnx_optax", "gpt_oss", "encoder_decoder",
             "deepseek_sparse")
    def loss_and_args(name):
        module = _example(name)
        if hasattr(module, "make"):
            return module.make()
        return module.loss, module.example_args()
    return {f"example_{n}": (lambda n=n: loss_and_args(n)) for n in names}


def _fuzz() -> dict[str, Callable[[], tuple]]:
    from fuzz_programs import FuzzCase, build

    out = {}
    for text in FUZZ_SEEDS:
        case = eval(text, {"FuzzCase": FuzzCase})

        def thunk(case=case):
            loss, params, inputs = build(case)
            return loss, (params, inputs)
        out[f"fuzz_{case.cls}"] = thunk
    return out


def _flax_idioms() -> dict[str, Callable[[], tuple]]:
    import flax.linen as linen
    import optax
    from flax import nnx

    def linen_mha():
        module = linen.MultiHeadDotProductAttention(num_heads=2, qkv_features=16)
        x = _randn(2, 16, 16)
        variables = module.init(jax.random.key(0), x)
        mask = linen.make_causal_mask(jnp.ones((2, 16)))

        def loss(variables, x):
            return jnp.mean(module.apply(variables, x, mask=mask) ** 2)
        return loss, (variables, x)

    def nnx_mha():
        model = nnx.MultiHeadAttention(num_heads=2, in_features=16, qkv_features=16,
                                       decode=False, rngs=nnx.Rngs(0))
        graph, state = nnx.split(model)
        x = _randn(2, 16, 16)

        def loss(state, x):
            mask = nnx.make_causal_mask(jnp.ones((2, 16)))
            return jnp.mean(nnx.merge(graph, state)(x, mask=mask) ** 2)
        return loss, (state, x)

    def optax_cross_entropy():
        w = _randn(16, 32)

        def loss(w, x, labels):
            q = k = v = (x @ w).reshape(2, 16, 4, 8)
            o = jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(2, 16, 32)
            logits = o @ w.T
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        return loss, (w, _randn(2, 16, 16), jnp.arange(32, dtype=jnp.int32).reshape(2, 16) % 16)

    def linen_scan_layers():
        class Block(linen.Module):
            @linen.compact
            def __call__(self, x, _):
                h = linen.SelfAttention(num_heads=2, qkv_features=16)(
                    linen.RMSNorm()(x), mask=linen.make_causal_mask(jnp.ones(x.shape[:2])))
                return x + h, None

        model = linen.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                           length=2)()
        x = _randn(2, 16, 16)
        variables = model.init(jax.random.key(0), x, None)

        def loss(variables, x):
            return jnp.mean(model.apply(variables, x, None)[0] ** 2)
        return loss, (variables, x)

    return {"flax_linen_mha": linen_mha, "flax_nnx_mha": nnx_mha,
            "optax_cross_entropy": optax_cross_entropy, "flax_linen_scan": linen_scan_layers}


def corpus() -> dict[str, Callable[[], tuple]]:
    """Every program of the corpus: name -> thunk giving ``(fn, args)``."""
    return {**_spellings(), **_examples(), **_fuzz(), **_flax_idioms()}


@contextlib.contextmanager
def _x64(name: str):
    """64-bit types on for the float64 fuzzer class, as its runner has them."""
    wanted = name == "fuzz_dtype_f64"
    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", wanted or previous)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", previous)


def canonical_form(name: str, thunk: Callable[[], tuple]) -> list[str]:
    """The canonical text of one corpus program: traced, canonicalized, printed."""
    from cptransform.ir.canonical_text import canonical_lines
    from cptransform.ir.module import trace
    from cptransform.passes.canonicalize import Canonicalize

    with _x64(name):
        fn, args = thunk()
        module = Canonicalize().run(trace(fn, *args, name=name)).module
        return canonical_lines(module.jaxpr)


def form_path(name: str) -> str:
    return os.path.join(FORMS, f"{name}.txt")


def write_forms() -> None:
    """Write every program's canonical text (``python tests/canonical_corpus.py``)."""
    os.makedirs(FORMS, exist_ok=True)
    for name, thunk in corpus().items():
        with open(form_path(name), "w") as f:
            f.write("\n".join(canonical_form(name, thunk)) + "\n")
        print(name)


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    __import__("conftest")  # 8 simulated devices, as the tests have
    write_forms()
