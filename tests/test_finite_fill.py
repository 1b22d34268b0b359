"""A finite fill too large to hide its keys (``where(mask, s, -8)``, then a ``tanh``
soft-cap or none): each masked key keeps the logit ``cap(fill)``, a share of its row's
probability (``MaskSpec.fill``). The attention runs sharded with the single-device values
and gradients: no chunk pair and no ring step is skipped, and the kernels that cannot give
masked pairs a finite logit are refused by name."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_rewritten, assert_tree_close
from test_match_support import randn

from cptransform import context_parallel
from cptransform.ir.errors import KernelError, PlanError
from cptransform.lowering.kernels import kernels
from cptransform.lowering.kernels.capabilities import choose_kernel
from cptransform.op.attention_spec import AttentionSpec, Layout, MaskSpec

B, T, H, D = 2, 64, 8, 8
CAP = 5.0


def filled_attention(q, k, v, *, fill=-8.0, cap=True, window=None):
    """Causal (or a window of ``window`` keys back) logits with the masked ones set to
    ``fill``, then ``CAP · tanh(x / CAP)`` when ``cap``."""
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D)
    i, j = jnp.arange(q.shape[1])[:, None], jnp.arange(k.shape[1])[None, :]
    keep = j <= i if window is None else (j <= i) & (j > i - window)
    s = jnp.where(keep, s, fill)
    if cap:
        s = CAP * jnp.tanh(s / CAP)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def data(seed: int, t: int = T):
    rng = np.random.default_rng(seed)
    return tuple(randn(rng, B, t, H, D) for _ in range(3))


def loss_of(**kwargs):
    return lambda q, k, v: jnp.sum(jnp.tanh(filled_attention(q, k, v, **kwargs)) ** 2)


def check_sharded(loss, args, **options):
    f = context_parallel(loss, cp=8, **options)
    assert_rewritten(f, *args, count=1)
    grad = lambda g: jax.value_and_grad(g, argnums=(0, 1, 2))  # noqa: E731
    assert_tree_close(grad(f)(*args), grad(loss)(*args))
    return f


@pytest.mark.parametrize("options", [
    dict(schedule="auto"),
    dict(schedule="ring", load_balance="zigzag"),
    # Contiguous shards: under a causal -inf mask whole ring steps would be skipped.
    pytest.param(dict(schedule="ring", load_balance="none"), marks=pytest.mark.slow),
    pytest.param(dict(schedule="allgather"), marks=pytest.mark.slow),
    pytest.param(dict(schedule="ulysses"), marks=pytest.mark.slow),
    pytest.param(dict(schedule="hybrid", load_balance="zigzag"), marks=pytest.mark.slow),
    pytest.param(dict(schedule="double_ring", load_balance="none"), marks=pytest.mark.slow),
])
def test_a_fill_then_a_soft_cap_runs_sharded(options):
    f = check_sharded(loss_of(), data(0), **options)
    assert "fill=-4.608" in f.explain(*data(0))


@pytest.mark.parametrize("fill,cap", [(-8.0, False),
                                      pytest.param(0.0, True, marks=pytest.mark.slow)])
def test_a_finite_fill_without_or_with_a_soft_cap(fill, cap):
    check_sharded(loss_of(fill=fill, cap=cap), data(1), schedule="ring", load_balance="none")


def test_a_window_with_a_fill_is_not_a_halo():
    """A window hides nothing under a fill: every key is read, so no halo is planned."""
    f = check_sharded(loss_of(window=8), data(2), schedule="auto")
    assert "halo" not in f.explain(*data(2)).lower()
    with pytest.raises(PlanError, match="halo needs a sliding window"):
        context_parallel(loss_of(window=8), cp=8, schedule="halo")(*data(2))


def test_hiding_fills_stay_masks():
    """A fill at or below the limit still hides its keys (skipped blocks, a band)."""
    assert MaskSpec(causal=True, fill=-8.0).band() == (None, None)
    assert MaskSpec(causal=True, empty_rows="uniform").band() == (None, 0)
    with pytest.raises(ValueError, match="finite float"):
        MaskSpec(causal=True, fill=float("-inf"))


def test_kernels_without_a_fill_are_refused_by_name():
    f = context_parallel(loss_of(), cp=8, schedule="ring", kernel="pallas")
    with pytest.raises(KernelError, match="finite logit -4.608"):
        f(*data(3))


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_auto_passes_over_the_kernels_without_a_fill(backend):
    """On a GPU or TPU ``auto`` takes the chunked XLA kernel, saying why not the faster
    ones (their refusal comes before any on-device self-check)."""
    bthd = Layout.parse("BTHD")
    spec = AttentionSpec(q=bthd, k=bthd, v=bthd, scale=0.125,
                         mask=MaskSpec(causal=True, fill=-4.5))
    kernel, why = choose_kernel("auto", spec, jnp.bfloat16, (64, 64), kernels(),
                                backend=backend)
    assert kernel.name == "xla" and "not pallas: it does not give masked pairs" in why


def test_a_length_the_layout_does_not_divide_is_refused():
    f = context_parallel(loss_of(), cp=8, schedule="ring", load_balance="zigzag")
    with pytest.raises(NotImplementedError, match="pad key would take that share"):
        f(*data(4, t=40))


def test_a_nan_key_reaches_only_the_rows_that_see_it():
    """A NaN in one key's K makes NaN the rows that see it (its logit is theirs) and not
    the rows that mask it (they take the fill), as on one device."""
    q, k, v = data(5)
    k = k.at[:, 40].set(jnp.nan)
    f = context_parallel(filled_attention, cp=8, schedule="ring", load_balance="zigzag")
    assert_rewritten(f, q, k, v, count=1)
    got, want = np.asarray(f(q, k, v)), np.asarray(filled_attention(q, k, v))
    assert np.isnan(want[:, 40:]).all() and not np.isnan(want[:, :40]).any()
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(np.nan_to_num(got), np.nan_to_num(want), rtol=2e-5, atol=2e-5)


@pytest.mark.slow
def test_a_fill_of_data_masks():
    """Segments and a dense mask from the data, filled with -3 then soft-capped."""
    rng = np.random.default_rng(6)
    q, k, v = data(6)
    keep = jnp.asarray(rng.uniform(size=(B, 1, T, T)) > 0.5)
    seg = jnp.asarray(np.sort(rng.integers(0, 3, (B, T)), axis=1))

    def loss(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D)
        s = jnp.where(keep & (seg[:, None, :, None] == seg[:, None, None, :]), s, -3.0)
        s = CAP * jnp.tanh(s / CAP)
        return jnp.sum(jnp.tanh(jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v)) ** 2)

    check_sharded(loss, (q, k, v), schedule="ring", load_balance="zigzag")


@pytest.mark.slow
def test_a_fill_beside_sinks():
    """A sink column beside filled logits: the sink joins rows that are never empty."""
    q, k, v = data(8)
    sinks = jnp.asarray(np.random.default_rng(8).standard_normal(H), jnp.float32)

    def loss(q, k, v, sinks):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D)
        i, j = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
        s = CAP * jnp.tanh(jnp.where(j <= i, s, -8.0) / CAP)
        column = jnp.broadcast_to(sinks[None, :, None, None], s.shape[:-1] + (1,))
        w = jax.nn.softmax(jnp.concatenate([s, column], -1), -1)[..., :-1]
        return jnp.sum(jnp.tanh(jnp.einsum("bhqk,bkhd->bqhd", w, v)) ** 2)

    f = context_parallel(loss, cp=8, schedule="ring", load_balance="zigzag")
    assert_rewritten(f, q, k, v, sinks, count=1)
    grad = lambda g: jax.value_and_grad(g, argnums=(0, 1, 2, 3))  # noqa: E731
    assert_tree_close(grad(f)(q, k, v, sinks), grad(loss)(q, k, v, sinks))
