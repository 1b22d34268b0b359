"""Halo schedule: outputs and gradients against the unsharded reference (windows of every
shape, segments, dense masks, bias, GQA, contiguous and zigzag, the three ``empty_rows``
modes, NaN), the refusals, and that only halo-sized arrays move."""
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh, needs_halo
from schedule_cases import Case, check_schedule, make_case
from test_nan_inf import assert_same

from cptransform import context_parallel
from cptransform.analysis.attention_shape import AttentionShape
from cptransform.ir.errors import ContextParallelError, PlanError
from cptransform.lowering.collectives import lower_and_count
from cptransform.lowering.context_parallel_attention import context_parallel_attention
from cptransform.lowering.schedule import schedules
from cptransform.op.attention_reference import attention_reference

SEQ = 32


def halo(cp, layout):
    """Keyword arguments of context_parallel_attention for halo on a ``cp`` mesh."""
    return dict(mesh=make_mesh((cp,), ("cp",)), axes="cp", schedule="halo", layout=layout)


def windowed(case: Case, window, *, causal=False, offset=0, empty_rows="zero") -> Case:
    """``case`` with its mask's window (and causal flag) replaced."""
    mask = case.spec.mask.replace(window=window, causal=causal, causal_offset=offset,
                                  empty_rows=empty_rows)
    return Case(case.operands, case.spec.replace(mask=mask))


# (cp, layout, base mask kind, heads, window, causal): local length 8 (contiguous cp=4,
# zigzag cp=2: two chunks of 8) or 4 (zigzag cp=4, contiguous cp=8).
CASES = {
    "causal-left<local": (4, "contiguous", "none", "mha", (3, None), True),
    "causal-left==local": (4, "contiguous", "none", "gqa", (8, None), True),
    # left = 0 with a causal mask leaves one key per row (dq exactly 0): look right instead.
    "left=0": (4, "contiguous", "none", "mha", (0, 2), False),
    "two-sided": (4, "contiguous", "none", "gqa", (5, 2), False),
    "two-sided==local": (8, "contiguous", "none", "mqa", (4, 4), False),
    "segments": (4, "contiguous", "segments", "gqa", (6, None), True),
    "dense": (4, "contiguous", "dense", "mha", (3, 3), False),
    "bias": (4, "contiguous", "bias", "gqa", (4, 1), False),
    "zigzag-causal": (2, "zigzag", "none", "gqa", (5, None), True),
    "zigzag-left==chunk": (4, "zigzag", "none", "mha", (4, None), True),
    "zigzag-left=0": (4, "zigzag", "none", "mha", (0, 3), False),
    "zigzag-two-sided": (2, "zigzag", "none", "mqa", (8, 8), False),
    "zigzag-segments": (4, "zigzag", "segments", "gqa", (3, 2), False),
    "zigzag-dense-causal": (2, "zigzag", "dense_causal", "gqa", (6, None), True),
    "zigzag-bias": (4, "zigzag", "bias", "mha", (2, 3), False),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_matches_reference(rng, name):
    """Output and dq, dk, dv (dbias) of halo against the unsharded reference, fp32."""
    cp, layout, kind, heads, window, causal = CASES[name]
    case = windowed(make_case(rng, kind, heads, seq=SEQ, dv=12), window, causal=causal)
    check_schedule(case, **halo(cp, layout))


def test_causal_offset_reaches_the_right_neighbour(rng):
    """``causal_offset=2``: each query sees two keys ahead, so a right halo of 2 travels."""
    case = windowed(make_case(rng, "none", "gqa", seq=SEQ), (3, None), causal=True, offset=2)
    check_schedule(case, **halo(4, "zigzag"))


def _compare_with_nan(case: Case, kw):
    """Output and gradients of ``sum(sin(o))``, NaN patterns included, against the
    reference (the conventions of test_nan_inf)."""
    diff = case.differentiable

    def both(fn):
        def run(*xs):
            def loss(*ds):
                full = list(xs)
                for i, x in zip(diff, ds):
                    full[i] = x
                return jnp.sum(jnp.sin(fn(*full))), fn(*full)
            return jax.grad(loss, argnums=tuple(range(len(diff))), has_aux=True)(
                *(xs[i] for i in diff))
        return jax.jit(run)

    got = both(lambda *xs: context_parallel_attention(*xs, spec=case.spec, **kw))(
        *case.operands)
    want = both(lambda *xs: attention_reference(*xs, spec=case.spec))(*case.operands)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert_same(g, w)
    return want


@pytest.mark.slow
@pytest.mark.parametrize("empty_rows", ["zero", "uniform", "nan"])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_empty_rows(rng, empty_rows, layout):
    """``causal_offset=-1``: the first query of the sequence (on rank 0, whose left halo has
    no sender) sees no key; zero, the mean of V over the whole sequence, or NaN (with NaN
    gradients for every V), as on one device."""
    case = windowed(make_case(rng, "none", "gqa", seq=SEQ), (3, None), causal=True,
                    offset=-1, empty_rows=empty_rows)
    (dq, dk, dv), out = _compare_with_nan(case, halo(4, layout))
    assert np.isnan(out[:, 0]).all() == (empty_rows == "nan")
    assert np.isnan(dv).all() == (empty_rows == "nan")
    if empty_rows == "uniform":
        v = np.asarray(case.operands[2], np.float64)
        np.testing.assert_allclose(out[:, 0, 0], v.mean(axis=1)[:, 0], rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_nan_in_one_value(rng, layout):
    """A NaN in the value of token 29 (rank 3): on one device every row of its head is NaN,
    also rows far outside the window, and so are the gradients it reaches."""
    case = windowed(make_case(rng, "none", "gqa", seq=SEQ), (3, None), causal=True)
    q, k, v = case.operands
    case = Case((q, k, v.at[1, 29, 0, 2].set(jnp.nan)), case.spec)
    _, out = _compare_with_nan(case, halo(4, layout))
    assert np.isnan(out[1, :, :4, 2]).all() and not np.isnan(out[0]).any()


@pytest.mark.slow
@pytest.mark.parametrize("operand", [0, 1], ids=["q", "k"])
def test_nan_in_one_query_or_key(rng, operand):
    """A NaN in token 29's query (key): on one device ``dk += Σ 0·Q`` (``dq += Σ 0·K``)
    makes the gradient of every key (query) of its head NaN, beyond the window."""
    case = windowed(make_case(rng, "none", "gqa", seq=SEQ), (3, 1), causal=False)
    operands = list(case.operands)
    operands[operand] = operands[operand].at[1, 29, 0, 2].set(jnp.nan)
    (dq, dk, _), _ = _compare_with_nan(Case(tuple(operands), case.spec), halo(4, "zigzag"))
    assert np.isnan((dk if operand == 0 else dq)[1, 0]).any()


def _loss_model(window):
    def f(q, k, v):
        o = jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=window)
        return jnp.sum(jnp.sin(o))
    return f


@pytest.mark.slow
@pytest.mark.parametrize("load_balance", ["none", "zigzag"])
def test_context_parallel_end_to_end(rng, load_balance):
    """``context_parallel(schedule="halo")`` on a jax.nn sliding-window attention: value and
    gradients, with the plan's layout reaching feasibility and the schedule."""
    needs_halo()
    normal = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)  # noqa: E731
    q, k, v = normal(2, SEQ, 4, 8), normal(2, SEQ, 2, 8), normal(2, SEQ, 2, 8)
    f = _loss_model((3, 0))
    want_l, want_g = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))(q, k, v)
    cp = context_parallel(f, cp=4, schedule="halo", load_balance=load_balance)
    got_l, got_g = jax.value_and_grad(cp, argnums=(0, 1, 2))(q, k, v)
    assert_same(got_l, want_l)
    for g, w in zip(got_g, want_g):
        assert_same(g, w)
    assert "halo" in cp.explain(q, k, v)


@pytest.mark.slow
@pytest.mark.parametrize("hardware", ["h100", "cpu-sim"])
def test_auto_chooses_halo_for_a_narrow_window(rng, hardware):
    """Under ``auto`` a window of 3 over 8-token shards goes to halo (its bytes are the
    window's, its compute the band's), and the program still matches one device."""
    needs_halo()
    normal = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)  # noqa: E731
    q, k, v = normal(1, SEQ, 4, 8), normal(1, SEQ, 4, 8), normal(1, SEQ, 4, 8)
    f = _loss_model((3, 0))
    cp = context_parallel(f, cp=4, load_balance="none", hardware=hardware)
    assert "schedule: halo" in cp.explain(q, k, v)
    assert_same(cp(q, k, v), f(q, k, v))


@pytest.mark.parametrize("window,causal,layout,cp,words", [
    ((9, None), True, "contiguous", 4, "reaches past the neighbouring chunk of 8"),
    ((5, None), True, "zigzag", 4, "reaches past the neighbouring chunk of 4"),
    ((2, 9), False, "contiguous", 4, "reaches past"),
    (None, True, "contiguous", 4, "bounded on both sides"),
    ((3, None), False, "contiguous", 4, "bounded on both sides"),
    ((3, None), True, "striped", 4, "striped layout"),
])
def test_refusals(rng, window, causal, layout, cp, words):
    """A window wider than a chunk, no (two-sided) window, striped: one clear error."""
    case = windowed(make_case(rng, "none", "mha", seq=SEQ), window, causal=causal)
    with pytest.raises(ContextParallelError, match=words):
        context_parallel_attention(*case.operands, spec=case.spec, **halo(cp, layout))


def test_explicit_positions_refused(rng):
    """Positions from the caller may put a key of the window on any rank."""
    case = windowed(make_case(rng, "none", "mha", seq=SEQ), (3, None), causal=True)
    q, k, v = case.operands
    pos = jnp.arange(SEQ, dtype=jnp.int32)[None]
    with pytest.raises(ContextParallelError, match="explicit positions"):
        context_parallel_attention(q, k, v, pos, pos, spec=case.spec.replace(positions=True),
                                   **halo(4, "contiguous"))


def test_planner_refuses_wide_window(rng):
    """Through ``context_parallel``: the plan names the attention and the fix."""
    normal = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)  # noqa: E731
    q = normal(1, SEQ, 4, 8)
    with pytest.raises(PlanError, match="reaches past the neighbouring chunk of 4"):
        context_parallel(_loss_model((6, 0)), cp=4, schedule="halo",
                         load_balance="zigzag")(q, q, q)


def _shape(window, seq=4096, layout="contiguous", cp=8):
    return AttentionShape(seq_len=seq, heads=8, kv_heads=2, head_dim=64, cp=cp, batch=2,
                          layout=layout, band=(-window, 0))


def test_volume_proportional_to_window():
    """Permuted bytes are ``window·bytes per key`` (twice under zigzag), whatever the
    sequence length; the ring's grow with it."""
    volume = schedules()["halo"].volume
    per_key = volume(_shape(1)).forward["collective_permute"]
    assert per_key == 2 * 2 * 64 * 2 * 2 + 4  # B·Hkv·(D + Dv)·bf16 + one int32 position
    for window in (1, 16, 64, 256):
        for seq in (4096, 65536):
            v = volume(_shape(window, seq))
            assert v.forward["collective_permute"] == window * per_key
            assert v.backward["collective_permute"] == window * 2 * 2 * 128 * 4
            assert volume(_shape(window, seq, "zigzag")).forward["collective_permute"] == \
                2 * window * per_key
    ring = schedules()["ring"].volume(_shape(64))
    assert volume(_shape(64)).forward_total * 50 < ring.forward_total


@pytest.mark.slow
@pytest.mark.parametrize("layout,window", [("contiguous", (3, 2)), ("zigzag", (3, 0))])
def test_permutes_move_only_halos(layout, window):
    """The lowered program's collective-permutes carry ``[B, halo, Hkv, D + Dv]`` K/V and
    ``[1, halo]`` positions, nothing sequence-sized; bytes match :func:`halo_statement`."""
    cp, batch, d, dv = 4, 2, 8, 12
    left, right = window
    case = windowed(make_case(np.random.default_rng(0), "none", "gqa", seq=64, d=d, dv=dv,
                              batch=batch, dtype=jnp.bfloat16), window, causal=right == 0)
    abstract = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in case.operands]

    def forward(*xs):
        return context_parallel_attention(*xs, spec=case.spec, **halo(cp, layout),
                                          in_layout_order=True)

    def grad(*xs):
        return jax.grad(lambda q, k, v: jnp.sum(forward(q, k, v).astype(jnp.float32)),
                        argnums=(0, 1, 2))(*xs)

    hkv = 2
    # Contiguous: the left halo goes up, the right one down; zigzag: both edges each way.
    widths = [left, right] if layout == "contiguous" else [left + right] * 2
    widths = [w for w in widths if w]
    want = Counter()
    for w in widths:
        want[f"{batch}x{w}x{hkv}x{d + dv}xbf16"] += 1
        want[f"1x{w}xi32"] += 1
    fwd = lower_and_count(forward, *abstract)
    permuted = Counter(str(c.operands[0]) for c in fwd.collectives
                       if c.kind == "collective_permute")
    assert permuted == want
    shape = AttentionShape(seq_len=64, heads=8, kv_heads=hkv, head_dim=d, v_head_dim=dv,
                           cp=cp, batch=batch, layout=layout, band=case.spec.mask.band())
    volume = schedules()["halo"].volume(shape)
    assert fwd.bytes_by_kind() == volume.forward
    bwd = lower_and_count(grad, *abstract)
    back = Counter(str(c.operands[0]) for c in bwd.collectives
                   if c.kind == "collective_permute") - want
    assert back == Counter(f"{batch}x{w}x{hkv}x{d + dv}xf32" for w in widths)
    assert bwd.per_device_bytes == volume.forward_total + volume.backward_total


@pytest.mark.parametrize("version, crashes", [("0.11.2", True), ("0.10.2", False),
                                              ("0.12.0.1", False)])
def test_halo_refused_where_xla_crashes(rng, monkeypatch, version, crashes):
    """On JAX 0.11.x, whose XLA segfaults compiling the halo schedule's K/V gradient, auto
    leaves halo out (saying why) and ``schedule="halo"`` is one error naming the cause and
    the fix; other versions plan halo as usual."""
    from cptransform.ir import compat
    from cptransform.ir.errors import PlanError

    monkeypatch.setattr(compat.versions, "_jax_version", lambda: version)
    normal = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)  # noqa: E731
    q, k, v = normal(1, SEQ, 4, 8), normal(1, SEQ, 4, 8), normal(1, SEQ, 4, 8)
    f = _loss_model((3, 0))
    text = context_parallel(f, cp=4, load_balance="none", hardware="h100").explain(
        q, k, v, verbose=True)
    assert ("schedule: halo" in text) != crashes
    assert ("crashes" in text) == crashes
    explicit = context_parallel(f, cp=4, schedule="halo", load_balance="none")
    if not crashes:
        assert "schedule: halo" in explicit.explain(q, k, v)
        return
    with pytest.raises(PlanError, match=rf"JAX {version}.*segfault.*schedule='ring'"):
        explicit.explain(q, k, v)
