"""Bad options of ``context_parallel``: one ``CPTransformError`` with a suggestion, ``seq_axes``
as a pytree prefix of the arguments (as ``jax.vmap``'s ``in_axes``), and the warning when
``cp`` leaves visible devices idle."""
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cptransform import attention, context_parallel
from cptransform.api.context_parallel import IdleDevicesWarning, _seq_axis_overrides
from cptransform.ir.errors import ContextParallelOptionError, PipelineError
from cptransform.ir.pipeline import Pipeline
from cptransform.passes import get_all_passes


@pytest.mark.parametrize("options, message", [
    (dict(schedule="rign"), r"unknown schedule='rign' \(did you mean 'ring'\?\); use one of"),
    (dict(load_balance="zigzig"), r"unknown load_balance='zigzig' \(did you mean 'zigzag'\?\)"),
    (dict(kernel="palas"), r"unknown kernel='palas' \(did you mean 'pallas'\?\)"),
    (dict(sheduel="ring"), r"unknown option\(s\) sheduel \(did you mean 'schedule'\?\)"),
    (dict(schedule="spiral"), r"unknown schedule='spiral'; use one of"),
])
def test_bad_options_suggest_the_closest_name(options, message):
    with pytest.raises(ContextParallelOptionError, match=message):
        context_parallel(lambda x: x, cp=2, **options)


def test_unknown_pass_in_a_pipeline_suggests_the_closest():
    with pytest.raises(PipelineError, match=r"unknown pass 'match-atention' \(did you mean "
                                            r"'match-attention'\?\)"):
        Pipeline.parse("canonicalize,match-atention", available=get_all_passes())


def attend(params, batch):
    """Attention over ``batch["x"]`` (``[B, S, H, D]``) whose keys are scaled by the
    parameters; ``batch["mask"]`` (``[B, S]``) weighs the output per token."""
    x = batch["x"]
    out = attention(x, x * params["scale"], x, causal=True)
    return jnp.sum(out * batch["mask"][:, :, None, None])


def _args(rng):
    params = {"scale": jnp.asarray(rng.normal(size=(16,)), jnp.float32)}
    batch = {"x": jnp.asarray(rng.normal(size=(1, 16, 2, 16)), jnp.float32),
             "mask": jnp.asarray(rng.normal(size=(1, 16)), jnp.float32)}
    return params, batch


@pytest.mark.parametrize("seq_axes", [(None, 1), (None, {"x": 1, "mask": 1}),
                                      ({"scale": None}, 1), (None, {"x": (1,), "mask": 1})])
def test_seq_axes_as_a_pytree_prefix(seq_axes):
    """Flat inputs: params' scale (0), then batch's mask (1) and x (2), in pytree order."""
    args = _args(np.random.default_rng(0))
    assert _seq_axis_overrides(seq_axes, args, [0, 1]) == {0: (), 1: (1,), 2: (1,)}


@pytest.mark.slow
def test_seq_axes_prefix_runs_as_on_one_device():
    params, batch = _args(np.random.default_rng(0))
    fn = context_parallel(attend, cp=2, schedule="ring", load_balance="none",
                          seq_axes=(None, {"x": 1, "mask": 1}))
    assert fn.module(params, batch).facts.seq_axes.lengths == (16,)
    np.testing.assert_allclose(fn(params, batch), attend(params, batch), rtol=1e-5)


@pytest.mark.parametrize("seq_axes, message", [
    ((None, {"x": 1}), r"seq_axes entry \{'x': 1\} of argument 1 is not a pytree prefix"),
    ((None, {"x": "seq", "mask": 1}), r"holds 'seq', which is not a dim"),
    ((None, {"x": 4, "mask": 1}), r"seq_axes entry 4 of argument 1 does not fit an array of "
                                  r"shape \(1, 16, 2, 16\)"),
    ((1,), r"seq_axes must have one entry per positional argument \(2 here\)"),
])
def test_bad_seq_axes_are_one_clear_error(seq_axes, message):
    params, batch = _args(np.random.default_rng(1))
    fn = context_parallel(attend, cp=2, seq_axes=seq_axes)
    with pytest.raises(ContextParallelOptionError, match=message):
        fn.module(params, batch)


def test_cp_leaving_devices_idle_warns_with_the_mesh_fix():
    assert len(jax.devices()) == 8
    x = jnp.asarray(np.random.default_rng(2).normal(size=(1, 12, 2, 8)), jnp.float32)
    with pytest.warns(IdleDevicesWarning, match=r"cp=3 uses 3 of the 8 visible devices; 5 "
                      r"stay idle\. .*mesh=jax\.make_mesh\(\(2, 3\), \('data', 'cp'\)\)"):
        context_parallel(lambda q: jnp.sum(attention(q, q, q)), cp=3).module(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error", IdleDevicesWarning)
        context_parallel(lambda q: jnp.sum(attention(q, q, q)), cp=8).module(
            jnp.concatenate([x, x[:, :4]], axis=1))


def test_enum_options_take_their_members_strings():
    from cptransform.op.attention_spec import EmptyRows, MaskSpec
    from cptransform.op.layouts import LayoutName
    # Members are their strings: options accept either, and messages print the string.
    assert LayoutName.ZIGZAG == "zigzag" and f"{LayoutName.STRIPED}" == "striped"
    assert MaskSpec(empty_rows=EmptyRows.NAN) == MaskSpec(empty_rows="nan")
    with pytest.raises(ValueError, match="one of zero, uniform, nan"):
        MaskSpec(empty_rows="mean")
