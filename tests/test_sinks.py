"""Attention sinks (gpt-oss): the reference, every schedule, the matcher and the transform.

A sink is one extra logit per query head in each row's softmax whose value is 0; gpt-oss
spells it ``softmax(concat([logits, sink column]))[..., :-1]``. Everything is compared with
that spelling (or the reference) on one device, forward and gradients (sinks included).
"""
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh
from schedule_cases import check_schedule, make_case, relative_error
from test_match_support import assert_close, check, check_refused, randn, rewrite, specs

from cptransform import attention, context_parallel
from cptransform.analysis.seq_axes import infer_seq_axes
from cptransform.api.context_parallel import UnshardedWarning
from cptransform.ir import compat
from cptransform.ir.module import iter_eqns
from cptransform.lowering.collectives import lower_and_count
from cptransform.lowering.context_parallel_attention import context_parallel_attention
from cptransform.op.attention import attention_p
from cptransform.op.attention_reference import attention_reference

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from examples import gpt_oss  # noqa: E402

F32_MIN = float(jnp.finfo(jnp.float32).min)


def visible(t, causal=True, window=None):
    """Boolean ``[T, T]``: key ``j`` visible from query ``i``."""
    i, j = np.arange(t)[:, None], np.arange(t)[None]
    ok = np.ones((t, t), bool)
    if causal:
        ok &= j <= i
    if window is not None:
        ok &= j >= i - window
    return jnp.asarray(ok)


def sink_softmax_attention(q, k, v, sinks, ok, fill=-jnp.inf):
    """By hand: ``q, k, v [B, T, H, D]``, ``sinks [H]``, ``ok [T, T]`` (or ``[B, H, T, T]``);
    the sink is a last logit column, its probability dropped after the softmax."""
    b, t, h, d = q.shape
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d)
    logits = jnp.where(ok, logits, fill)
    column = jnp.broadcast_to(sinks.reshape(1, h, 1, 1), (b, h, t, 1))
    w = jax.nn.softmax(jnp.concatenate([logits, column], -1), -1)[..., :-1]
    return jnp.einsum("bhqk,bkhd->bqhd", w, v)


def grads(fn, args, seed=3):
    """Gradients of ``sum(fn(*args) * w)`` for a random ``w``, w.r.t. every argument."""
    w = jnp.asarray(np.random.default_rng(seed).normal(size=jax.eval_shape(fn, *args).shape),
                    jnp.float32)
    return jax.grad(lambda *a: jnp.sum(fn(*a) * w), tuple(range(len(args))))(*args)


def qkvs(rng, b=2, t=16, h=4, d=8):
    return (randn(rng, b, t, h, d), randn(rng, b, t, h, d), randn(rng, b, t, h, d),
            randn(rng, h))


# -- the reference -----------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("window,fill,empty_rows", [
    (None, -jnp.inf, "nan"), (3, -jnp.inf, "nan"), (3, F32_MIN, "uniform")])
def test_reference_is_the_sink_softmax(rng, window, fill, empty_rows):
    args = qkvs(rng)
    ok = visible(16, window=window)

    def ours(q, k, v, s):
        return attention(q, k, v, causal=True, window=None if window is None else (window, 0),
                         sinks=s, empty_rows=empty_rows)

    def by_hand(q, k, v, s):
        return sink_softmax_attention(q, k, v, s, ok, fill)

    assert_close(ours(*args), by_hand(*args), 1e-6)
    assert relative_error(ours(*args), attention(*args[:3], causal=True)) > 1e-2
    for g, w in zip(grads(ours, args), grads(by_hand, args)):
        assert_close(g, w, 1e-5)


@pytest.mark.slow
def test_sink_gradient_formula(rng):
    """``d sink_h = -Σ_rows exp(sink_h - lse) · rowsum(dO ∘ O)`` (lse including the sink)."""
    q, k, v, s = qkvs(rng)
    do = randn(rng, *q.shape)
    fn = lambda s: attention(q, k, v, causal=True, sinks=s)  # noqa: E731
    o, vjp = jax.vjp(fn, s)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    logits = jnp.where(visible(16), logits, -jnp.inf)
    lse = jnp.logaddexp(jax.nn.logsumexp(logits, -1), s[None, :, None])
    delta = jnp.einsum("bqhd,bqhd->bhq", do, o)
    want = -jnp.sum(jnp.exp(s[None, :, None] - lse) * delta, axis=(0, 2))
    assert_close(vjp(do)[0], want, 1e-5)


@pytest.mark.slow
def test_minus_inf_sink_is_no_sink(rng):
    q, k, v, _ = qkvs(rng)
    s = jnp.full((4,), -jnp.inf)
    ok = visible(16, window=2) & ~jnp.eye(16, dtype=bool)   # query 0 sees no key: NaN
    ours = lambda q, k, v: attention(q, k, v, mask=ok, sinks=s, empty_rows="nan")  # noqa: E731
    plain = lambda q, k, v: attention(q, k, v, mask=ok, empty_rows="nan")  # noqa: E731
    by_hand = lambda q, k, v: sink_softmax_attention(q, k, v, s, ok)  # noqa: E731
    out = ours(q, k, v)
    assert bool(jnp.all(jnp.isnan(out[:, 0]))) and not bool(jnp.any(jnp.isnan(out[:, 1:])))
    assert_close(out, plain(q, k, v), 0)
    assert_close(out, by_hand(q, k, v), 1e-6)
    ds = jax.grad(lambda s: jnp.sum(attention(q, k, v, causal=True, sinks=s)))(s)
    np.testing.assert_array_equal(np.asarray(ds), 0.0)


@pytest.mark.slow
@pytest.mark.parametrize("fill,empty_rows", [(-jnp.inf, "nan"), (F32_MIN, "uniform")])
def test_fully_masked_row_with_a_finite_sink_is_zero(rng, fill, empty_rows):
    args = qkvs(rng)
    ok = visible(16, window=2) & ~jnp.eye(16, dtype=bool)
    ours = lambda q, k, v, s: attention(q, k, v, mask=ok, sinks=s,  # noqa: E731
                                        empty_rows=empty_rows)
    by_hand = lambda q, k, v, s: sink_softmax_attention(q, k, v, s, ok, fill)  # noqa: E731
    out = ours(*args)
    np.testing.assert_array_equal(np.asarray(out[:, 0]), 0.0)
    assert_close(out, by_hand(*args), 1e-6)
    for g, w in zip(grads(ours, args), grads(by_hand, args)):
        assert_close(g, w, 1e-5)


@pytest.mark.slow
def test_minus_inf_sink_on_an_empty_row(rng):
    """Finite-minimum fill: the ``-inf`` sink's head averages V on the empty row, the other
    heads give 0; gradients (the ``-inf`` sink's is 0, not NaN) as on one device."""
    q, k, v, s = qkvs(rng)
    s = s.at[2].set(-jnp.inf)
    ok = visible(16, window=2) & ~jnp.eye(16, dtype=bool)
    ours = lambda q, k, v, s: attention(q, k, v, mask=ok, sinks=s,  # noqa: E731
                                        empty_rows="uniform")
    by_hand = lambda q, k, v, s: sink_softmax_attention(q, k, v, s, ok, F32_MIN)  # noqa: E731
    out = ours(q, k, v, s)
    assert_close(out[:, 0, 2], jnp.mean(v[:, :, 2], axis=1), 1e-6)
    assert_close(out, by_hand(q, k, v, s), 1e-6)
    got, want = grads(ours, (q, k, v, s)), grads(by_hand, (q, k, v, s))
    assert float(got[3][2]) == 0.0
    for g, w in zip(got, want):
        assert_close(g, w, 1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("bad", [jnp.inf, jnp.nan])
def test_inf_or_nan_sink_makes_its_rows_nan(rng, bad):
    q, k, v, s = qkvs(rng)
    s = s.at[1].set(bad)
    ok = visible(16)
    out = attention(q, k, v, causal=True, sinks=s)
    want = sink_softmax_attention(q, k, v, s, ok)
    assert bool(jnp.all(jnp.isnan(out[:, :, 1]))) and not bool(jnp.any(jnp.isnan(out[:, :, 0])))
    assert_close(out, want, 1e-6)


def test_sinks_shape_is_checked(rng):
    q, k, v, s = qkvs(rng)
    with pytest.raises(Exception, match="sinks has shape"):
        attention(q, k, v, sinks=s[:3])


@pytest.mark.slow
def test_vmap_of_sinks(rng):
    q, k, v, s = qkvs(rng)
    per_batch = jnp.stack([s, s[::-1]])
    got = jax.vmap(lambda q, k, v, s: attention(q, k, v, causal=True, sinks=s, layout="THD"))(
        q, k, v, per_batch)
    want = jnp.stack([attention(q[i:i + 1], k[i:i + 1], v[i:i + 1], causal=True,
                                sinks=per_batch[i])[0] for i in range(2)])
    assert_close(got, want, 1e-6)


# -- every schedule ------------------------------------------------------------------------------

SCHEDULES = {"ring": (4,), "ulysses": (4,), "allgather": (4,), "hybrid": (2, 2),
             "halo": (4,), "double_ring": (2, 2)}


def test_every_schedule_is_tested_with_sinks():
    from cptransform.lowering.schedule import schedules
    assert set(SCHEDULES) == set(schedules())


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["causal", "window"])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_schedule_matches_one_device(rng, schedule, layout, kind):
    shape = SCHEDULES[schedule]
    axes = ("cp",) if len(shape) == 1 else ("uly", "ring")
    if schedule == "halo":  # windows only, each side within a zigzag chunk of 6 tokens
        kind = {"causal": "causal_window"}.get(kind, kind)
    case = make_case(rng, kind, "gqa", batch=1, seq=48 if schedule == "halo" else 16,
                     sinks=True)
    check_schedule(case, mesh=make_mesh(shape, axes), axes=axes, schedule=schedule,
                   layout=layout)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["ring", "ulysses"])
def test_sinks_cost_one_small_all_reduce(rng, schedule):
    """Beside the schedule's own collectives, the backward adds one all-reduce of the
    ``[1, H]`` sink gradients (not of a per-row array)."""
    mesh = make_mesh((4,), ("cp",))

    def collectives(sinks):
        case = make_case(np.random.default_rng(0), "causal", "gqa", batch=2, seq=32,
                         sinks=sinks)
        loss = lambda *xs: jnp.sum(context_parallel_attention(  # noqa: E731
            *xs, spec=case.spec, mesh=mesh, axes=("cp",), schedule=schedule,
            layout="zigzag"))
        diff = tuple(case.differentiable)
        report = lower_and_count(jax.grad(loss, diff), *case.operands)
        return sorted((c.kind, tuple(t.shape for t in c.operands), c.count)
                      for c in report.collectives)

    plain, with_sinks = collectives(False), collectives(True)
    extra = list(with_sinks)
    for c in plain:
        extra.remove(c)
    assert extra == [("all_reduce", ((1, 8),), 1)]


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["ring", "ulysses"])
def test_empty_rows_with_sinks_across_devices(rng, schedule):
    """A query that sees no key: 0 with a finite sink, the mean of V with a ``-inf`` one."""
    case = make_case(rng, "dense", "mha", batch=1, seq=16, sinks=True, empty_rows="uniform")
    sinks = case.operands[-1].at[0, 3].set(-jnp.inf)
    case = type(case)(case.operands[:-1] + (sinks,), case.spec)
    out = attention_reference(*case.operands, spec=case.spec)
    assert float(jnp.max(jnp.abs(out[0, 1, :3]))) == 0.0
    assert float(jnp.max(jnp.abs(out[0, 1, 3]))) > 0.0
    check_schedule(case, mesh=make_mesh((4,), ("cp",)), axes=("cp",), schedule=schedule,
                   layout="contiguous")


@pytest.mark.slow
@pytest.mark.parametrize("schedule,variant", [("ring", "tpu"), ("ulysses", "gpu")])
def test_pallas_kernels_under_the_schedules(rng, schedule, variant, monkeypatch):
    """The Pallas kernels (interpret mode) never see the sinks: the schedule merges them."""
    monkeypatch.setenv("CPTRANSFORM_PALLAS_VARIANT", variant)
    case = make_case(rng, "causal", "gqa", batch=1, seq=16, d=8, sinks=True)
    check_schedule(case, mesh=make_mesh((2,), ("cp",)), axes=("cp",), schedule=schedule,
                   layout="zigzag", kernel="pallas")


# -- the matcher ---------------------------------------------------------------------------------

def gpt_oss_sdpa(q, k, v, s, sliding_window=0):
    """gpt-oss ``sdpa`` (``gpt_oss/torch/model.py``) in JAX: ``q [T, Hkv, G, D]``,
    ``k, v [T, Hkv, D]``, ``s [Hkv·G]``; additive ``-inf`` causal mask, sink column."""
    t, hkv, g, d = q.shape
    k = jnp.broadcast_to(k[:, :, None, :], (t, hkv, g, d))
    v = jnp.broadcast_to(v[:, :, None, :], (t, hkv, g, d))
    s = jnp.broadcast_to(s.reshape(hkv, g, 1, 1), (hkv, g, t, 1))
    mask = jnp.triu(jnp.full((t, t), -jnp.inf), k=1)
    if sliding_window:
        mask += jnp.tril(jnp.full((t, t), -jnp.inf), k=-sliding_window)
    qk = jnp.einsum("qhmd,khmd->hmqk", q, k) * d ** -0.5
    qk += mask[None, None]
    qk = jnp.concatenate([qk, s], axis=-1)
    w = jax.nn.softmax(qk, axis=-1)[..., :-1]
    return jnp.einsum("hmqk,khmd->qhmd", w, v).reshape(t, -1)


def gpt_oss_args(rng, t=16, hkv=2, g=2, d=8):
    return (randn(rng, t, hkv, g, d), randn(rng, t, hkv, d), randn(rng, t, hkv, d),
            randn(rng, hkv * g))


def bthd_sinks(q, k, v, s, form="softmax", fill=-jnp.inf, window=None):
    """``[B, T, H, D]`` GQA attention with a where-mask, a sink column and the softmax
    spelled as ``jax.nn.softmax``, ``exp(x - logsumexp(x))``, by hand
    (``exp(x - max) / sum``), or deferred (``(e[..., :-1] @ v) / sum``)."""
    b, t, h, d = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, t, hkv, h // hkv, d)
    logits = jnp.einsum("btkgd,bskd->bkgts", qg, k) * d ** -0.5
    logits = jnp.where(visible(t, window=window), logits, fill)
    column = jnp.broadcast_to(s.reshape(1, hkv, h // hkv, 1, 1), logits.shape[:-1] + (1,))
    x = jnp.concatenate([logits, column], axis=-1)
    if form == "softmax":
        out = jnp.einsum("bkgts,bskd->btkgd", jax.nn.softmax(x, -1)[..., :-1], v)
    elif form == "log":
        p = jnp.exp(x - jax.nn.logsumexp(x, -1, keepdims=True))
        out = jnp.einsum("bkgts,bskd->btkgd", p[..., :-1], v)
    else:
        e = jnp.exp(x - jax.lax.stop_gradient(jnp.max(x, -1, keepdims=True)))
        total = jnp.sum(e, -1, keepdims=True)
        if form == "manual":
            out = jnp.einsum("bkgts,bskd->btkgd", (e / total)[..., :-1], v)
        else:
            out = jnp.einsum("bkgts,bskd->bkgtd", e[..., :-1], v) / total
            out = jnp.moveaxis(out, 3, 1)
    return out.reshape(b, t, h, -1)


def bthd_args(rng, b=2, t=16, h=4, hkv=2, d=8):
    return randn(rng, b, t, h, d), randn(rng, b, t, hkv, d), randn(rng, b, t, hkv, d), \
        randn(rng, h)


def assert_grads_close(fn, module, args):
    for g, w in zip(grads(module.as_function(), args), grads(fn, args)):
        assert_close(g, w, 1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("window", [0, 4])
def test_match_gpt_oss_spelling(rng, window):
    fn = lambda *a: gpt_oss_sdpa(*a, sliding_window=window)  # noqa: E731
    args = gpt_oss_args(rng)
    module = check(fn, *args)
    assert [s.sinks for s in specs(module)] == [True]
    assert_grads_close(fn, module, args)


@pytest.mark.slow
@pytest.mark.parametrize("form", ["softmax", "log", "manual", "deferred"])
def test_match_softmax_forms(rng, form):
    fn = lambda *a: bthd_sinks(*a, form=form, window=3)  # noqa: E731
    args = bthd_args(rng)
    module = check(fn, *args, analytic=True)
    (spec,) = specs(module)
    assert spec.sinks and spec.groups == 2 and spec.mask.window == (3, None)
    assert_grads_close(fn, module, args)


def test_match_finite_fill(rng):
    fn = lambda *a: bthd_sinks(*a, fill=F32_MIN, window=3)  # noqa: E731
    args = bthd_args(rng)
    (spec,) = specs(check(fn, *args, analytic=True))
    assert spec.sinks and spec.mask.empty_rows == "uniform"


def test_refuse_sink_before_the_keys(rng):
    def fn(q, k, v, s):
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k)
        column = jnp.broadcast_to(s.reshape(1, -1, 1, 1), logits.shape[:-1] + (1,))
        w = jax.nn.softmax(jnp.concatenate([column, logits], -1), -1)[..., 1:]
        return jnp.einsum("bhqk,bkhd->bqhd", w, v)
    check_refused(fn, *qkvs(rng), reason="sink column comes before")


def test_refuse_sink_varying_over_queries(rng):
    def fn(q, k, v, s):
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k)
        column = jnp.broadcast_to(s.T[None, :, :, None], logits.shape[:-1] + (1,))
        w = jax.nn.softmax(jnp.concatenate([logits, column], -1), -1)[..., :-1]
        return jnp.einsum("bhqk,bkhd->bqhd", w, v)
    q, k, v, _ = qkvs(rng)
    check_refused(fn, q, k, v, randn(rng, 16, 4), reason="varies over query positions")


def test_refuse_other_slices_of_the_probabilities(rng):
    def fn(q, k, v, s):
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k)
        column = jnp.broadcast_to(s.reshape(1, -1, 1, 1), logits.shape[:-1] + (1,))
        w = jax.nn.softmax(jnp.concatenate([logits, column], -1), -1)[..., 1:]
        return jnp.einsum("bhqk,bkhd->bqhd", w, v)
    check_refused(fn, *qkvs(rng), reason="dropping the last (sink) column")


def test_refuse_a_sink_probability_kept_for_the_value_product(rng):
    """``p @ concat([v, 0])`` is a sink too, but the matcher reads only the sliced form."""
    def fn(q, k, v, s):
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k)
        column = jnp.broadcast_to(s.reshape(1, -1, 1, 1), logits.shape[:-1] + (1,))
        w = jax.nn.softmax(jnp.concatenate([logits, column], -1), -1)
        return jnp.einsum("bhqk,bkhd->bqhd", w, jnp.pad(v, ((0, 0), (0, 1), (0, 0), (0, 0))))
    check_refused(fn, *qkvs(rng), reason="not sliced away")


def test_sinks_carry_no_sequence_axis(rng):
    """Eight heads, eight tokens: the sinks have the sequence's size, but no dataflow links
    them to it."""
    args = bthd_args(rng, b=1, t=8, h=8, hkv=8)
    module = rewrite(lambda *a: bthd_sinks(*a), *args)
    axes = infer_seq_axes(module.jaxpr)
    ins = compat.open_jaxpr(module.jaxpr).invars
    assert [axes.dims(x) for x in ins] == [(1,), (1,), (1,), ()]


def ejkernel_sinks(q, k, v, sinks):
    """ejkernel's XLA path (EasyDeL's gpt-oss): logits concatenated with the sink column,
    shifted by their row maximum (no stop_gradient), then ``jax.nn.softmax`` and the
    sink's probability sliced away."""
    b, t, h, d = q.shape
    aw = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d)
    aw = jnp.where(visible(t), aw, jnp.finfo(aw.dtype).min)
    column = jnp.broadcast_to(sinks.reshape(1, h, 1, 1), (b, h, t, 1))
    combined = jnp.concatenate([aw, column], -1)
    combined = combined - jnp.max(combined, axis=-1, keepdims=True)
    w = jax.nn.softmax(combined, axis=-1)[..., :t]
    return jnp.einsum("bhqk,bkhd->bqhd", w, v)


def test_match_ejkernel_shifted_logits(rng):
    """Logits shifted by their row maximum before ``jax.nn.softmax`` (a row constant: the
    softmax of the unshifted logits; unmatched without it): matched with sinks, sharded
    (ring/zigzag), the same numbers and gradients as one device."""
    args = bthd_args(rng, hkv=4)
    f = context_parallel(ejkernel_sinks, cp=8, schedule="ring", load_balance="zigzag")
    assert [r.spec.sinks for r in f.module(*args).facts.matches if r.rewritten] == [True]
    assert_close(jax.jit(f)(*args), ejkernel_sinks(*args), 1e-5)
    for g, w in zip(grads(f, args), grads(ejkernel_sinks, args)):
        assert_close(g, w, 1e-5)


# -- the transform -------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("schedule,load_balance", [("ring", "zigzag"), ("allgather", "none")])
def test_context_parallel_gpt_oss(rng, schedule, load_balance):
    fn = lambda *a: gpt_oss_sdpa(*a, sliding_window=4)  # noqa: E731
    args = gpt_oss_args(rng, t=32)
    f = context_parallel(fn, cp=8, schedule=schedule, load_balance=load_balance)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnshardedWarning)
        module = f.module(*args)
    assert [r.spec.sinks for r in module.facts.matches if r.rewritten] == [True]
    names = {e.primitive.name for e in iter_eqns(module.jaxpr)}
    assert "shard_map" in names and attention_p.name not in names
    assert_close(jax.jit(f)(*args), fn(*args), 1e-5)
    for g, w in zip(grads(f, args), grads(fn, args)):
        assert_close(g, w, 1e-5)


@pytest.mark.slow
def test_gpt_oss_example_at_its_smallest(capsys):
    """``examples/gpt_oss.py``'s check on a tiny model: both layer kinds are matched with
    sinks, sharded over 8 devices, and the loss and every gradient match one device."""
    cfg = gpt_oss.Config(vocab=32, dim=32, layers=2, heads=4, kv_heads=2, mlp_dim=32,
                         window=4)
    assert gpt_oss.demo(seq=32, cp=8, cfg=cfg, batch=1)
    out = capsys.readouterr().out
    assert "rewritten [causal window(4) sinks]" in out and "rewritten [causal sinks]" in out
    assert "MATCH" in out
