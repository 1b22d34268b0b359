"""Public model packages as they are (`.ci/install-models`): tiny configs, random weights,
loss and every gradient under ``context_parallel(cp=4)`` against one device, per schedule;
every mask analytic (no dense ``S×S`` operand) and no all-gather of the whole sequence
outside attention in the compiled program.

Each case compiles a whole model twice (one device, transformed) on 8 simulated devices:
tens of seconds on shared cores. CI runs one schedule per family (:data:`CI_SAMPLE`,
``-m "integration and not slow"``); the other schedules are ``slow`` as well and run with
``-m integration``. A package that is not installed skips its cases.
"""
import contextlib
import sys
from pathlib import Path

import jax
import pytest

from conftest import RTOL, assert_tree_close
from cptransform import PartlyShardedWarning, context_parallel
from cptransform.lowering.sharding_leaks import sequence_all_gathers
from model_families import CP, FAMILIES, SCHEDULES, SEQ

pytestmark = pytest.mark.integration

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

#: Gradients at rounding-noise level on one device pass within this absolute error: a key
#: projection's bias is cancelled exactly by the softmax, so its gradient is ~1e-13 (BART)
#: in both runs and a relative comparison of two noises means nothing.
NOISE = 1e-8

#: The schedule each family runs under in CI (every schedule at least once over the
#: families; ring + zigzag where the program is reordered, encoder-decoder included).
CI_SAMPLE = {"llama": "ring_zigzag", "mistral": "auto", "gpt_neo": "allgather",
             "bart": "ring_zigzag", "t5": "ring_zigzag", "t5_decoder_inputs": "auto",
             "penzai": "ulysses", "penzai_stack": "auto", "gemma": "ring_zigzag",
             "keras_llama": "ulysses",
             "keras_gemma": "auto", "llama_padded": "ring_zigzag", "gpt2_padded": "allgather",
             "mistral_window_padded": "auto", "gemma_padded": "ring_zigzag",
             "keras_llama_padded": "ring_zigzag", "keras_gemma_padded": "ring_zigzag",
             "keras_gpt2_padded": "ulysses", "keras_mistral_padded": "auto",
             "gemma_padded_int": "ring_zigzag", "keras_llama_padded_int": "auto",
             "keras_gemma_padded_int": "ring_zigzag", "keras_gpt2_padded_int": "ring_zigzag",
             "keras_mistral_padded_int": "ulysses"}

#: What a family does not reach yet, asserted exactly as it stands (a fix fails the test
#: until its entry goes). Attentions whose mask keeps a dense part: none (DeepMind gemma's
#: window over ``cumsum(input_mask) - 1`` is a coordinate band; its int padding mask
#: multiplied into the causal one is the key padding term). keras-hub given an int
#: ``padding_mask`` merges it by ``minimum`` and some layers then test ``!= 0``: the region
#: padding term (``docs/contract.md``; ``tests/test_padding_masks.py`` holds the rule,
#: ``bench/padding_memory.py`` measures the family).
DENSE_MASKS: dict[str, int] = {}
#: Full-sequence all-gathers outside attention, per family. keras-hub's Gemma zeroes the
#: output rows that see no key with ``all(mask == 0, axis=-1)`` on the ``S×S`` mask after
#: the attention: with a boolean mask the matcher folds that row test into the attention's
#: ``empty_rows="zero"`` (``passes/match_attention/row_test.py``); with an int
#: ``padding_mask`` (whose negative entries make ``== 0`` no complement of the attention's
#: ``> 0``) it becomes counts along the keys (``row_scan.py``), sharded as recurrences.
#: T5 given padding masks: its two self-attentions left whole (:data:`LEFT_WHOLE`) run on
#: the whole sequence, for which their keys and values (four gathers) and the encoder's
#: ``[B, S]`` padding fill are gathered.
SEQUENCE_GATHERS: dict = {"t5_decoder_inputs": 5}
#: Attentions left whole (exact, unsharded, warned), per family. transformers' Flax T5 given
#: a padding mask sums its fill (``finfo.min``) into the relative-position bias: a row may
#: see no key, whose gradient to the bias the schedules do not give, so its two
#: self-attentions are refused (``docs/contract.md``); the cross-attention is sharded.
LEFT_WHOLE: dict[str, int] = {"t5_decoder_inputs": 2}


def _case(family: str, schedule: str):
    marks = [] if CI_SAMPLE.get(family) == schedule else [pytest.mark.slow]
    return pytest.param(family, schedule, marks=marks, id=f"{family}-{schedule}")


@pytest.mark.parametrize("family,schedule", [_case(f, s) for f in FAMILIES for s in SCHEDULES])
def test_model_is_exact_analytic_and_gathers_nothing(family, schedule):
    """Loss and every gradient as on one device; every attention matched and scheduled
    with an analytic mask; the compiled loss-and-gradient program (compiled once, for
    both checks) holds no all-gather of the whole sequence outside the schedules (but for
    the gaps :data:`DENSE_MASKS`, :data:`SEQUENCE_GATHERS` and :data:`LEFT_WHOLE` name)."""
    loss, args = FAMILIES[family]()
    name, load_balance = SCHEDULES[schedule]
    f = context_parallel(loss, cp=CP, schedule=name, load_balance=load_balance)
    left_whole = LEFT_WHOLE.get(family, 0)
    with pytest.warns(PartlyShardedWarning, match=rf"{left_whole} attention\(s\) run unsharded") \
            if left_whole else contextlib.nullcontext():
        compiled = jax.jit(jax.value_and_grad(f)).lower(*args).compile()
    got_loss, got_grads = compiled(*args)
    want_loss, want_grads = jax.jit(jax.value_and_grad(loss))(*args)
    assert_tree_close(got_loss, want_loss)
    for path, got, want in zip(jax.tree_util.tree_flatten_with_path(want_grads)[0],
                               jax.tree_util.tree_leaves(got_grads),
                               jax.tree_util.tree_leaves(want_grads)):
        err, scale = float(abs(got - want).max()), float(abs(want).max())
        assert err <= RTOL * scale + NOISE, f"{jax.tree_util.keystr(path[0])}: {err} vs {scale}"
    plans = f.module(*args).facts.plan
    assert plans, "no attention matched: the model ran unsharded"
    assert len([p for p in plans if p.mask.dense]) == DENSE_MASKS.get(family, 0), \
        "dense mask operands"
    assert len(sequence_all_gathers(compiled.as_text(), SEQ)) == SEQUENCE_GATHERS.get(family, 0)


def test_transformers_flax_training_example():
    pytest.importorskip("transformers")
    sys.path.insert(0, str(EXAMPLES))
    import transformers_flax
    assert transformers_flax.check(seq=32, steps=2, cp=4, layers=1, verbose=False)
