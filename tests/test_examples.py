"""The examples' own checks at their smallest sizes: the transformed model against the
single-device one (loss and every gradient, float32 rel 1e-5), as each script runs it."""
import sys
from pathlib import Path

import jax
import pytest

from cptransform.ir.errors import ContextParallelError

# The examples import their neighbours (``_check``, ``llama``) as a script does.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import _check  # noqa: E402
import gemma  # noqa: E402
import hybrid_recurrent  # noqa: E402
import llama  # noqa: E402
import nnx_optax  # noqa: E402
import packed_documents  # noqa: E402

from cptransform import context_parallel  # noqa: E402


@pytest.mark.slow
def test_llama():
    assert llama.demo(seq=32)


@pytest.mark.slow
def test_gemma_local_and_global_layers():
    assert gemma.check(seq=32, cfg=gemma.Config(layers=2, window=4))


@pytest.mark.slow
def test_hybrid_recurrent_layers_pass_state():
    assert hybrid_recurrent.check(seq=64)


@pytest.mark.slow
def test_packed_documents_zigzag():
    assert packed_documents.check(seq=32)


@pytest.mark.slow
@pytest.mark.slow
def test_maxtext_style_training():
    """A MaxText-style linen model (logical axes, deferred normalisation) trained on a
    (data, fsdp, tensor, cp) mesh against one device."""
    import maxtext_style
    assert maxtext_style.check(seq=32, steps=2, layers=1, verbose=False)


def test_nnx_optax_training():
    assert nnx_optax.check(seq=16, steps=2, layers=1)


@pytest.mark.slow
def test_nnx_split_merge_pure_loss():
    """The ``nnx.split`` spelling: a pure loss of the state under ``jax.value_and_grad``."""
    from flax import nnx

    graphdef, state = nnx.split(nnx_optax.Decoder(layers=1))
    (tokens,) = nnx_optax.batches(1, vocab=128, batch=2, seq=16)
    loss = nnx_optax.pure_loss(graphdef)
    result = _check.compare_gradients(loss, context_parallel(loss, cp=8), state, tokens)
    assert result.ok, str(result)


@pytest.mark.slow
def test_nnx_train_step_under_the_decorator_is_refused():
    """A train step differentiates: the decorator belongs on its loss (the error says so)."""
    from flax import nnx
    import optax

    model = nnx_optax.Decoder(layers=1)
    optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    (tokens,) = nnx_optax.batches(1, vocab=128, batch=2, seq=16)
    step = context_parallel(nnx_optax.make_train_step(nnx_optax.loss), cp=8)
    with pytest.raises(ContextParallelError, match="put @context_parallel on the loss"):
        step(model, optimizer, tokens)
    assert jax.tree_util.tree_leaves(nnx.state(model, nnx.Param))  # still usable


SCRIPTS = ("llama", "gemma", "packed_documents", "nnx_optax", "gpt_oss", "encoder_decoder",
           "deepseek_sparse", "maxtext_style")


@pytest.mark.parametrize("script", SCRIPTS)
def test_an_example_that_shards_nothing_exits_non_zero(script, monkeypatch, capsys):
    """Run as a script with a matcher that finds nothing, each example prints the
    transform's refusal and ``NOT SHARDED`` and exits 1 (never ``MATCH``: the numbers of
    an unsharded program prove nothing)."""
    import runpy

    from cptransform.ir.pipeline import PassResult
    from cptransform.passes.match_attention import MatchAttention

    monkeypatch.setattr(MatchAttention, "run",
                        lambda self, module: PassResult(module.with_facts(matches=()), False))
    path = Path(__file__).resolve().parents[1] / "examples" / f"{script}.py"
    monkeypatch.setattr(sys, "argv", [str(path)])
    with pytest.raises(SystemExit) as exited:
        runpy.run_path(str(path), run_name="__main__")
    out = capsys.readouterr().out
    assert exited.value.code == 1
    assert out.rstrip().endswith("NOT SHARDED") and "MATCH" not in out, out[-2000:]
    assert "no attention found" in out


def test_equal_numbers_without_every_attention_sharded_are_not_a_match():
    """The verdict an example prints: MATCH needs every attention sharded and equal
    numbers; one attention of two left whole, or none sharded, is NOT SHARDED."""
    equal = dict(loss=1.0, cp_loss=1.0, grads=_check.TreeError(3, 0.0, "-"),
                 temp_bytes=(1, 1))
    assert _check.Comparison(sharding=_check.Sharding(2, 2), **equal).ok
    for rewritten, attentions in ((1, 2), (0, 2), (0, 0)):
        result = _check.Comparison(sharding=_check.Sharding(rewritten, attentions), **equal)
        assert not result.ok and str(result).endswith(
            f"NOT SHARDED ({rewritten} of {attentions} attentions sharded)")
    unequal = dict(equal, cp_loss=1.1)
    assert str(_check.Comparison(sharding=_check.Sharding(2, 2), **unequal)).endswith(
        "MISMATCH (rtol 1e-05)")
