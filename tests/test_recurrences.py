"""Recurrences over the tokens are sharded by passing state, not by gathering the sequence:
each layer of ``examples/recurrent_layers.py`` in a hybrid block with a causal attention
gives one device's loss and gradients, with each recurrence run by the method its kind
allows (``prefix of totals`` for cumulative ops and associative scans, ``state passing``
for a scan whose carry is affine, a ``pipeline`` or ``gather`` for any other carry), in
every layout. A program with recurrences and no attention is sharded along them. The
fuzzer's ``recurrence``, ``affine_scan``, ``chunked_scan`` and ``prefix_scan`` classes draw
more spellings and placements."""
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from conftest import assert_rewritten, assert_tree_close
from cptransform import PartlyShardedWarning, UnshardedError, context_parallel
from cptransform.ir import compat
from cptransform.ir.errors import PlanError, ReorderError
from cptransform.op.recurrence import Method

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import recurrent_layers as R  # noqa: E402

B, S, D = 2, 32, 16
PASSED = {"mamba": Method.STATE_PASSING, "linear_attention": Method.PREFIX_OF_TOTALS,
          "gla": Method.STATE_PASSING, "rg_lru": Method.PREFIX_OF_TOTALS,
          "deltanet": Method.STATE_PASSING, "ema": Method.PREFIX_OF_TOTALS,
          "gru": Method.GATHER}


def data(name: str, seed: int = 0):
    params = R.block_params(name, jax.random.key(seed), D)
    return params, jax.random.normal(jax.random.key(seed + 1), (B, S, D))


def check(loss, args, methods, attentions: int = 1, cp: int = 4, **options):
    """``loss`` under ``context_parallel`` against one device (loss and gradients of every
    argument), its attentions all rewritten and its recurrences run by ``methods``;
    returns the transformed module."""
    f = context_parallel(loss, cp=cp, **options)
    argnums = tuple(range(len(args)))
    got = jax.jit(jax.value_and_grad(f, argnums))(*args)
    assert_tree_close(got, jax.jit(jax.value_and_grad(loss, argnums))(*args))
    if attentions:
        assert_rewritten(f, *args, count=attentions)
    module = f.module(*args)
    assert [r.method for r in module.facts.recurrences] == list(methods), \
        [r.describe() for r in module.facts.recurrences]
    return module


@pytest.mark.parametrize("name,load_balance,cp", [
    ("linear_attention", "zigzag", 4),   # prefix of totals: two cumsums
    ("deltanet", "zigzag", 4),           # state passing, a matrix state [B, H, d, d]
    ("rg_lru", "none", 4),               # lax.associative_scan, proved from its traced form
    ("gla", "zigzag", 2),                # a scan across 4 chunks of 8, zigzag over 2 ranks
])
def test_layer_in_a_hybrid_block(name, load_balance, cp):
    params, x = data(name)
    loss = R.hybrid_block(R.LAYERS[name])
    count = 2 if name in ("linear_attention", "ema") else 1
    if name == "rg_lru" and compat.scan_compiler_crash(2):
        # JAX 0.11.x: gathered with a warning rather than a segfault.
        with pytest.warns(PartlyShardedWarning, match="crashes"):
            check(loss, (params, x), [Method.GATHER], load_balance=load_balance, cp=cp)
        return
    module = check(loss, (params, x), [PASSED[name]] * count, load_balance=load_balance,
                   cp=cp)
    assert not module.facts.reorder_log, module.facts.reorder_log


def test_a_pair_scan_this_jax_cannot_compile_is_gathered_with_a_warning(monkeypatch):
    """``compat.scan_compiler_crash`` (JAX 0.11.x, simulated here on any JAX): an
    associative scan over a pair is gathered, warned of, and exact; ``recurrences='pass'``
    is refused with the crash named; a one-array scan still passes its totals."""
    from cptransform.ir.compat import versions

    monkeypatch.setattr(versions, "jax_release", lambda: (0, 11, 2))
    params, x = data("rg_lru")
    loss = R.hybrid_block(R.LAYERS["rg_lru"])
    with pytest.warns(PartlyShardedWarning, match="segfault.*associative_scan over 2 arrays"):
        module = check(loss, (params, x), [Method.GATHER], cp=4)
    assert "0.10.2 or 0.12" in module.facts.recurrences[0].reason
    with pytest.raises(PlanError, match="associative_scan over 2 arrays"):
        context_parallel(loss, cp=4, recurrences="pass")(params, x)

    def summed(p, x):
        return jnp.mean(jnp.tanh(lax.associative_scan(jnp.add, x @ p, axis=1)) ** 2)

    w = jax.random.normal(jax.random.key(5), (D, D))
    check(summed, (w, x), [Method.PREFIX_OF_TOTALS], attentions=0, cp=4)


LAYOUTS = ("none", "zigzag", "striped", "auto")
#: Each layer in two layouts, rotated so that every layout holds three or four layers: the
#: whole product took the slow tier twice as long for layouts the fuzzer draws anyway.
LAYER_LAYOUTS = [(name, LAYOUTS[(i + shift) % 4])
                 for i, name in enumerate(sorted(R.LAYERS)) for shift in (0, 1)]


@pytest.mark.slow
@pytest.mark.parametrize("name,load_balance", LAYER_LAYOUTS)
def test_every_layer_in_two_layouts(name, load_balance):
    if name == "rg_lru" and compat.scan_compiler_crash(2):
        pytest.skip("gathered on this JAX: test_layer_in_a_hybrid_block checks it")
    params = R.block_params(name, jax.random.key(3), D)
    x = jax.random.normal(jax.random.key(4), (B, 128, D))
    count = 2 if name in ("linear_attention", "ema") else 1
    check(R.hybrid_block(R.LAYERS[name]), (params, x), [PASSED[name]] * count,
          load_balance=load_balance, cp=8)


def test_carried_scan_pipelines_when_gathering_does_not_fit():
    """A GRU's carry is not affine: exact either way; the planner prices a pipeline
    (memory ∝ S/cp) against gathering, and a memory limit the gathered scan exceeds leaves
    the pipeline."""
    params, x = data("gru")

    def loss(p, x):
        return jnp.mean(jnp.tanh(x + R.gru(p["mix"], x)) ** 2)

    module = check(loss, (params, x), [Method.PIPELINE], attentions=0, memory_limit=10_000)
    (plan,) = module.facts.recurrences
    assert "not affine" in plan.reason and "over the memory limit" in plan.reason, plan.reason
    assert {c.method for c in plan.costs} == {Method.PIPELINE, Method.GATHER}


@pytest.mark.slow
@pytest.mark.parametrize("load_balance", ["none", "zigzag"])
def test_pipeline_in_a_hybrid_block(load_balance, monkeypatch):
    """The pipeline in each layout, beside an attention (forced: gathering is cheaper at
    this size)."""
    from cptransform.analysis import recurrence_cost
    from cptransform.op.recurrence import Kind

    monkeypatch.setitem(recurrence_cost.METHODS, Kind.CARRIED, (Method.PIPELINE,))
    params, x = data("gru")
    check(R.hybrid_block(R.gru), (params, x), [Method.PIPELINE], load_balance=load_balance)


def test_recurrent_only_model_is_sharded():
    """No attention: the sequence is the recurrences' axis, and they pass state."""
    params = {"a": R.init("mamba", jax.random.key(0), D),
              "b": R.init("linear_attention", jax.random.key(1), D)}
    x = jax.random.normal(jax.random.key(2), (B, S, D))

    def loss(p, x):
        h = x + R.mamba(p["a"], R.rms(x))
        h = h + R.linear_attention(p["b"], R.rms(h))
        return jnp.mean(jnp.tanh(h) ** 2)

    module = check(loss, (params, x), [Method.STATE_PASSING] + [Method.PREFIX_OF_TOTALS] * 2,
                   attentions=0, cp=8)
    assert module.facts.seq_axes.inputs[-1] == (1,)


def test_no_attention_and_no_recurrence_sharded_raises():
    """A recurrence whose steps do not split over the devices is gathered: with no
    attention, nothing is sharded, which is an error naming it."""
    x = jax.random.normal(jax.random.key(0), (B, 30, D))

    def loss(x):
        return jnp.sum(jnp.cumsum(x, axis=1) ** 2)

    with pytest.raises(UnshardedError, match=r"(?s)no attention found and no recurrence "
                       r"sharded.*cumsum prefix.*steps do not split into 4 chunks"):
        context_parallel(loss, cp=4)(x)


def test_nan_and_inf_propagate_as_on_one_device():
    """A NaN in one token and an infinite one elsewhere: every output and gradient has one
    device's NaN pattern (the later tokens of a forward recurrence, the earlier of a
    reverse one)."""
    x = np.array(jax.random.normal(jax.random.key(0), (B, S, D)))
    x[0, 11, 3] = np.nan
    x[1, 20, 5] = np.inf

    def loss(x):
        gate = jax.nn.sigmoid(x[..., :1])

        def step(h, xt):
            h = 0.9 * h + xt
            return h, h
        _, ys = lax.scan(step, jnp.zeros_like(x[:, 0]), x.swapaxes(0, 1), reverse=True)
        y = jnp.cumsum(x * gate, axis=1) + ys.swapaxes(0, 1)
        return jnp.sum(jnp.where(jnp.isfinite(y), y, 0.0) ** 2), y

    f = context_parallel(loss, cp=4, allow_unsharded=False)
    got = jax.jit(jax.value_and_grad(f, has_aux=True))(x)
    want = jax.jit(jax.value_and_grad(loss, has_aux=True))(x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.isnan(a), np.isnan(b))
        np.testing.assert_allclose(np.nan_to_num(a), np.nan_to_num(b), rtol=1e-5, atol=1e-4)
    assert [r.method for r in f.module(x).facts.recurrences] == \
        [Method.STATE_PASSING, Method.PREFIX_OF_TOTALS]


@jax.custom_vjp
def _clipped(x):
    return x


_clipped.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -0.01, 0.01),))


@pytest.mark.slow
def test_custom_vjp_in_the_step_is_kept():
    """A custom gradient rule on the step's input stays the user's rule: the gradients are
    the clipped ones, as on one device."""
    params, x = data("deltanet")

    def layer(p, x, cut=False):
        return R.deltanet(p, _clipped(x))

    check(R.hybrid_block(layer), (params, x), [Method.STATE_PASSING], load_balance="none")


def test_explain_names_each_recurrence_its_method_and_bytes():
    params, x = data("mamba")
    f = context_parallel(R.hybrid_block(R.mamba), cp=4, load_balance="none")
    text = f.explain(params, x, verbose=True)
    assert "recurrence #0 at" in text and "scan affine" in text and "carry diagonal" in text
    assert "method: state passing — least predicted time" in text, text
    assert "forward communication per device: state passing" in text and "gather" in text


@pytest.mark.slow
def test_gather_on_request_and_strict_refuses_its_round_trip():
    """``recurrences="gather"`` runs each recurrence on the whole sequence (exact, as XLA
    partitions it); in a load-balanced layout that is a round trip through natural order,
    which ``strict=True`` refuses with the cause and the fix."""
    params, x = data("mamba")
    loss = R.hybrid_block(R.mamba)
    check(loss, (params, x), [Method.GATHER], load_balance="none", recurrences="gather")
    f = context_parallel(loss, cp=4, load_balance="zigzag", recurrences="gather",
                         strict=True)
    with pytest.raises(ReorderError, match="recurrence at .*strict=True.*load_balance='none'"):
        f(params, x)


@pytest.mark.slow
@pytest.mark.parametrize("load_balance", ["none", "zigzag"])
def test_reverse_recurrences(load_balance):
    """Reverse scans, cumulative ops and associative scans take their state from the
    chunks after them."""
    params, x = data("rg_lru")

    def layer(p, x, cut=False):
        a = jax.nn.sigmoid(x @ p["a"])

        def combine(left, right):
            return left[0] * right[0], right[0] * left[1] + right[1]

        def step(h, xt):
            h = 0.8 * h + xt
            return h, jnp.tanh(h)

        _, ys = lax.scan(step, jnp.zeros_like(x[:, 0]), x.swapaxes(0, 1), reverse=True)
        return (lax.associative_scan(combine, (a, x), axis=1, reverse=True)[1]
                + lax.cumsum(x, axis=1, reverse=True) / S + ys.swapaxes(0, 1))

    check(R.hybrid_block(layer), (params, x),
          [Method.STATE_PASSING, Method.PREFIX_OF_TOTALS, Method.PREFIX_OF_TOTALS],
          load_balance=load_balance)


@pytest.mark.slow
def test_map_over_tokens_and_scan_over_layers_are_no_recurrences():
    """No carry (``lax.map`` over tokens) or iterations that are layers, not tokens: the
    loop is no recurrence and runs in layout order, nothing is converted."""
    H = 2

    def model(p):
        x = p["x"] + lax.map(lambda t: jnp.tanh(t * p["a"]),
                             p["x"].swapaxes(0, 1)).swapaxes(0, 1)

        def layer(x, w):
            q, k, v = ((x @ w[i]).reshape(B, S, H, D // H) for i in range(3))
            o = jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(B, S, D)
            return x + o, None
        y, _ = lax.scan(layer, x, p["w"])
        return jnp.mean(y ** 2)

    key = jax.random.key(3)
    p = {"x": jax.random.normal(key, (B, S, D)), "a": jax.random.normal(key, (D,)),
         "w": jax.random.normal(jax.random.fold_in(key, 1), (2, 3, D, D)) / np.sqrt(D)}
    module = check(model, (p,), [], load_balance="zigzag")
    assert not [m for m in module.facts.reorder_log if "un-permute" in m]


@pytest.mark.slow
def test_recurrence_inside_a_scan_over_layers():
    """Layers stacked by ``lax.scan`` (its body holds an attention: no recurrence itself):
    each layer's selective scan passes state, in layout order inside the loop body."""
    keys = jax.random.split(jax.random.key(5), 3)

    def stacked(name):
        return jax.tree.map(lambda *xs: jnp.stack(xs),
                            *[R.init(name, k, D) for k in jax.random.split(keys[0], 2)])

    params = {"mix": stacked("mamba"), "attn": stacked("linear_attention")}
    x = jax.random.normal(keys[1], (B, S, D))

    def loss(p, x):
        def layer(h, lp):
            h = h + R.mamba(lp["mix"], R.rms(h))
            return h + R.attention(lp["attn"], R.rms(h)), None
        h, _ = lax.scan(layer, x, p)
        return jnp.mean(jnp.tanh(h) ** 2)

    module = check(loss, (params, x), [Method.STATE_PASSING], load_balance="zigzag")
    assert not module.facts.reorder_log, module.facts.reorder_log
