"""Row tests after an attention (``passes/match_attention/row_test.py``): keras-hub Gemma's
``where(all(mask == 0, axis=-1), 0, attention)`` on the ``[B, T, S]`` int mask becomes the
attention's ``empty_rows="zero"`` where the row test's mask is proven to be the attention's
own (or implied by it, for an attention already zeroing its empty rows), and the row test
and its ``S×S`` mask disappear: no all-gather of the sequence is left. A row test that
cannot be folded (over another mask; after a ``-inf`` fill; on int data with negative
entries, where ``== 0`` and ``> .5`` are no complements) but reads as key tests split at
the causal diagonal becomes counts along the keys (``passes/match_attention/row_scan.py``):
two ``cumsum``s, sharded as recurrences, and still nothing gathers the sequence. One along
the query axis, or on a float mask of data values, stays as it is, exact.

Left padding makes the first query rows of each sequence see no key under the causal mask.
A negative case that would change the numbers if it were folded is checked to be exact.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cptransform import context_parallel
from cptransform.ir import compat
from cptransform.lowering.sharding_leaks import sequence_all_gathers
from test_match_support import primitives, randn, rewrite, specs
from test_nan_inf import assert_same

B, T, H, D = 2, 32, 4, 8
WINDOW = 5
#: Left padding per sequence: rows ``q < PADS[b]`` see no key under the causal mask.
PADS = (5, 11)
#: A padded key inside sequence 0: no query sees it, yet its row sees earlier keys (a row
#: test along the query axis zeroes that row).
HOLE = 20


def int_masks(valid):
    """keras-hub's ``[B, T, S]`` int mask (padding and float-position causal merged with
    ``minimum``) and the strictly causal one (row ``PADS[b]`` empty as well)."""
    pos = jnp.arange(T, dtype="float32")
    padding = valid[:, None, :].astype("int32")
    causal = (pos[:, None] >= pos[None, :])[None].astype("int32")
    strict = (pos[:, None] > pos[None, :])[None].astype("int32")
    return jnp.minimum(padding, causal), jnp.minimum(padding, strict)


def attention(q, k, v, visible, *, fill=-1e9, zeroing=False):
    """Keras' ``Softmax(mask=...)`` attention: fill, softmax, and (``zeroing``) zero what
    the mask hides after it."""
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * D ** -0.5
    p = jax.nn.softmax(jnp.where(visible, s, fill), axis=-1)
    if zeroing:
        p = jnp.where(visible, p, 0.0)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)


def keras_gemma(q, k, v, valid, row_test="all_eq", *, fill=-1e9, scale_mask=1):
    """The attention under the int mask read ``mask > .5``, then the output rows the row
    test finds without a visible key zeroed (``jnp.where(empty, zeros_like(o), o)``)."""
    mask, strict = int_masks(valid)
    mask = mask * scale_mask
    o = attention(q, k, v, mask[:, None] > 0.5, fill=fill)
    empty = {"all_eq": lambda: jnp.all(mask == 0, axis=-1, keepdims=True)[..., None],
             "not_any": lambda: ~jnp.any(mask != 0, axis=-1, keepdims=True)[..., None],
             "all_not_bool": lambda: jnp.all(~(mask > 0.5), axis=-1)[:, :, None, None],
             "different": lambda: jnp.all(strict == 0, axis=-1)[:, :, None, None],
             "other_axis": lambda: jnp.all(mask == 0, axis=1)[:, :, None, None]}[row_test]()
    return jnp.where(empty, jnp.zeros_like(o), o)


def keras_gemma_nonempty(q, k, v, valid):
    """The row test spelled the other way round: keep the rows that see a key."""
    mask, _ = int_masks(valid)
    o = attention(q, k, v, mask[:, None] > 0.5)
    return jnp.where(jnp.any(mask > 0.5, axis=-1)[:, :, None, None], o, 0.0)


def keras_gemma_local(q, k, v, valid):
    """Gemma's sliding-window layer: the attention's mask is the int mask and a window
    (``triu · tril`` of ones), zeroed after the softmax; the row test reads the int mask
    alone, which the attention's implies."""
    mask, _ = int_masks(valid)
    ones = jnp.ones((T, T), bool)
    sliding = jnp.triu(ones, 1 - WINDOW) * jnp.tril(ones, WINDOW - 1)
    o = attention(q, k, v, jnp.logical_and(mask, sliding[None])[:, None], zeroing=True)
    empty = jnp.all(mask == 0, axis=-1, keepdims=True)[..., None]
    return jnp.where(empty, jnp.zeros_like(o), o)


def keras_gemma_int(q, k, v, data, row_test="all_eq", *, fill=-1e9, strict=False):
    """keras-hub Gemma given an int ``padding_mask`` holding any integers: ``minimum(mask,
    causal)`` is ``mask != 0`` on the band and ``mask < 0`` off it for the row test,
    ``mask > 0`` on the band for the attention, so the two differ where an entry is
    negative (``strict``: the row test and the attention both strictly causal)."""
    pos = jnp.arange(T, dtype="float32")
    band = (pos[:, None] > pos[None, :]) if strict else (pos[:, None] >= pos[None, :])
    mask = jnp.minimum(data[:, None, :], band[None].astype("int32"))
    o = attention(q, k, v, mask[:, None] > 0.5, fill=fill)
    empty = {"all_eq": lambda: jnp.all(mask == 0, axis=-1, keepdims=True)[..., None],
             "not_any": lambda: ~jnp.any(mask != 0, axis=-1)[:, :, None, None]}[row_test]()
    return jnp.where(empty, jnp.zeros_like(o), o)


def weighted_by_later_keys(q, k, v, data):
    """No row test: the output weighted by whether any key at or after the query holds a
    nonzero entry of the int data (a reduction of ``minimum(data, j >= i)`` along the keys,
    wherever it is read)."""
    pos = jnp.arange(T)
    later = jnp.minimum(data[:, None, :], (pos[None, :] >= pos[:, None])[None].astype("int32"))
    o = attention(q, k, v, (data[:, None, :] > 0)[:, None] & (pos[None, :] <= pos[:, None]))
    return o * jnp.any(later != 0, axis=-1)[:, :, None, None].astype(o.dtype)


def keras_gemma_fractional(q, k, v, valid, weights):
    """A float mask with values between 0 and 1 (``minimum`` of the causal mask and data):
    ``mask == 0`` is not the complement of ``mask > .5``."""
    mask, _ = int_masks(valid)
    mask = jnp.minimum(mask.astype("float32"), weights)
    o = attention(q, k, v, mask[:, None] > 0.5)
    return jnp.where(jnp.all(mask == 0, axis=-1)[:, :, None, None], jnp.zeros_like(o), o)


#: What becomes of a row test: folded into the attention, rewritten into counts along the
#: keys, or left as it is.
FOLDED, SCANNED, LEFT = "folded", "scanned", "left"
#: name -> (function, its row test's outcome, whether its mask is int data with negative
#: entries rather than the boolean padding)
PROGRAMS = {
    "all_eq": (keras_gemma, FOLDED, False),
    "not_any": (lambda q, k, v, m: keras_gemma(q, k, v, m, "not_any"), FOLDED, False),
    "all_not_bool": (lambda q, k, v, m: keras_gemma(q, k, v, m, "all_not_bool"), FOLDED,
                     False),
    "nonempty": (keras_gemma_nonempty, FOLDED, False),
    "local_zeroed": (keras_gemma_local, FOLDED, False),
    "different": (lambda q, k, v, m: keras_gemma(q, k, v, m, "different"), SCANNED, False),
    "other_axis": (lambda q, k, v, m: keras_gemma(q, k, v, m, "other_axis"), LEFT, False),
    "neg_inf_fill": (lambda q, k, v, m: keras_gemma(q, k, v, m, fill=-jnp.inf), SCANNED,
                     False),
    "two_valued": (lambda q, k, v, m: keras_gemma(q, k, v, m, scale_mask=3), FOLDED, False),
    "int_all_eq": (keras_gemma_int, SCANNED, True),
    "int_not_any": (lambda q, k, v, d: keras_gemma_int(q, k, v, d, "not_any"), SCANNED, True),
    "int_strict": (lambda q, k, v, d: keras_gemma_int(q, k, v, d, strict=True), SCANNED,
                   True),
    "int_neg_inf_fill": (lambda q, k, v, d: keras_gemma_int(q, k, v, d, fill=-jnp.inf),
                         SCANNED, True),
    "later_keys_weight": (weighted_by_later_keys, SCANNED, True),
}

SCHEDULES = {"ring_zigzag": dict(schedule="ring", load_balance="zigzag"),
             "ulysses": dict(schedule="ulysses", load_balance="none"),
             "allgather": dict(schedule="allgather", load_balance="none"),
             "auto": dict(schedule="auto", load_balance="auto")}


def inputs(rng, *extra_shapes, int_data=False):
    """q, k, v, the left-padded ``valid`` mask (``int_data``: int32 data, 0 where padded,
    1 to 3 elsewhere and -1 at random places), then random float masks of
    ``extra_shapes``."""
    q, k, v = (randn(rng, B, T, H, D) for _ in range(3))
    valid = np.arange(T)[None, :] >= np.asarray(PADS)[:, None]
    valid[0, HOLE] = False
    if int_data:
        valid = valid * rng.integers(1, 4, (B, T))
        valid = np.where(rng.random((B, T)) < 0.15, -1, valid).astype(np.int32)
    return (q, k, v, jnp.asarray(valid)) + tuple(
        jnp.asarray(rng.choice([0.0, 0.3, 1.0], shape), jnp.float32) for shape in extra_shapes)


def check_schedule(fn, args, schedule):
    """Loss and every float gradient under ``schedule`` as on one device (NaN included);
    returns the sequence all-gathers left in the compiled program."""
    floats = tuple(i for i, a in enumerate(args) if a.dtype == jnp.float32)
    loss = lambda *a: jnp.sum(jnp.sin(fn(*a)) * jnp.cos(a[0]))  # noqa: E731
    cp = context_parallel(loss, cp=4, **SCHEDULES[schedule])
    compiled = jax.jit(jax.value_and_grad(cp, floats)).lower(*args).compile()
    got = compiled(*args)
    want = jax.jit(jax.value_and_grad(loss, floats))(*args)
    jax.tree.map(lambda g, w: assert_same(g, w, 1e-5), got, want)
    return sequence_all_gathers(compiled.as_text(), T)


def assert_outcome(fn, args, outcome: str):
    """The matched attention's ``empty_rows``, and whether the row reduction is left, gone
    (folded) or counts along the keys (scanned)."""
    module = rewrite(fn, *args)
    (spec,) = specs(module)
    ops = primitives(module)
    reductions = ops & {"reduce_and", "reduce_or"}
    folded = any("row-test" in r.mask_kind for r in module.facts.matches)
    assert folded == (outcome == FOLDED), module.facts.matches
    assert (spec.mask.empty_rows == "zero") == folded, spec.mask
    assert bool(reductions) == (outcome == LEFT), module
    assert ("cumsum" in ops) == (outcome == SCANNED), module
    return spec


def test_keras_row_test_becomes_zero_rows(rng):
    """The keras-hub spelling under ring + zigzag: the row test is the attention's
    ``empty_rows="zero"``, exact, and nothing gathers the sequence."""
    args = inputs(rng)
    spec = assert_outcome(keras_gemma, args, FOLDED)
    assert spec.mask.kv_padding and spec.mask.causal and not spec.mask.dense
    assert check_schedule(keras_gemma, args, "ring_zigzag") == []


def test_keras_int_mask_row_test_becomes_counts(rng):
    """keras-hub Gemma given an int ``padding_mask`` with negative entries: the row test is
    no zero-rows attention (a key whose entry is negative is visible to it and hidden from
    the attention), so it becomes counts along the keys, exact under ring + zigzag with
    nothing gathered; the attention's own ``> .5`` is causal and key padding."""
    args = inputs(rng, int_data=True)
    assert (np.asarray(args[3]) < 0).any()
    spec = assert_outcome(keras_gemma_int, args, SCANNED)
    assert spec.mask.causal and spec.mask.kv_padding and not spec.mask.dense
    assert check_schedule(keras_gemma_int, args, "ring_zigzag") == []


@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("name", [n for n, (_, out, _) in PROGRAMS.items() if out != LEFT])
def test_folded_and_scanned_row_tests_are_exact_and_gather_nothing(rng, name, schedule):
    """Folded into the attention, or counts along the keys (a row test over another mask:
    one more empty row; after a ``-inf`` fill: NaN rows whose gradient reaches every V; on
    int data with negative entries): exact, and nothing gathers the sequence."""
    fn, outcome, int_data = PROGRAMS[name]
    args = inputs(rng, int_data=int_data)
    assert_outcome(fn, args, outcome)
    assert check_schedule(fn, args, schedule) == []


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n, (_, out, _) in PROGRAMS.items() if out == LEFT])
def test_other_row_tests_are_left_and_exact(rng, name):
    """A row test along the query axis: its key tests vary with its rows."""
    fn, _, int_data = PROGRAMS[name]
    args = inputs(rng, int_data=int_data)
    assert_outcome(fn, args, LEFT)
    check_schedule(fn, args, "ring_zigzag")


@pytest.mark.slow
def test_fractional_mask_row_test_is_left_and_exact(rng):
    args = inputs(rng, (B, 1, T))
    assert_outcome(keras_gemma_fractional, args, LEFT)
    check_schedule(keras_gemma_fractional, args, "allgather")


#: Query and key positions of a ``[T, T]`` pair grid.
I, J = np.arange(T)[:, None], np.arange(T)[None, :]
#: Reductions of a mask along its keys on their own (no attention), each with whether it
#: becomes counts: key tests split at one causal diagonal, the keys on either axis, do; a
#: window (two-sided) or a test of data indexed by the row does not.
STANDALONE = {
    "prefix_any": (lambda d: jnp.any((J <= I) & (d[:, None, :] != 0), axis=-1), True),
    "strict_all_not": (lambda d: jnp.all(~((J < I) & (d[:, None, :] > 1)), axis=2), True),
    "keys_first_after": (lambda d: jnp.any((I >= J) & (d[:, :, None] < 0), axis=1), True),
    "region_max": (lambda d: jnp.any(jnp.maximum(d[:, None, :], (J <= I).astype("int32")) > 0,
                                     axis=-1), True),
    "window": (lambda d: jnp.any((I - J < 3) & (J <= I) & (d[:, None, :] != 0), axis=-1),
               False),
    "row_data": (lambda d: jnp.any((J <= I) & (d[:, :, None] > 0), axis=-1), False),
}


@pytest.mark.parametrize("name", STANDALONE)
def test_a_reduction_of_a_mask_along_its_keys_becomes_counts(rng, name):
    """A reduction of a mask along its keys anywhere in the program (here beside a causal
    attention, not after it) is the same booleans as counts along the keys, or left
    whole."""
    reduce, scanned = STANDALONE[name]

    def fn(q, k, v, data):
        return attention(q, k, v, (J <= I)[None, None]), reduce(data)

    args = inputs(rng)[:3] + (jnp.asarray(rng.integers(-1, 3, (B, T)), jnp.int32),)
    module = rewrite(fn, *args)
    ops = primitives(module)
    assert len(specs(module)) == 1
    assert ("cumsum" in ops) == scanned and bool(ops & {"reduce_or", "reduce_and"}) != scanned
    got, want = compat.eval_jaxpr(module.jaxpr, *args), fn(*args)
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-6)
