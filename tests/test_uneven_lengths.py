"""Sequence lengths that the layout does not divide: padded inside the attention with
masked positions, exact against the single-device function (output and every gradient)."""
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_tree_close, make_mesh
from conformance_matrix import FEATURES
from schedule_cases import Case, check_schedule, make_case

from cptransform import context_parallel
from cptransform.ir.module import iter_eqns
from cptransform.op.attention_spec import ROLES
from cptransform.op.mask_terms import TERMS
from cptransform.op.operand_roles import Side
from cptransform.op.attention import attention_p
from cptransform.passes.reorder_sequence import ReorderError

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from examples import llama  # noqa: E402

RTOL = 1e-5
HEADS = 8


def assert_sharded(f, *args, schedule: str):
    """The transform lowered every attention to a ``shard_map`` schedule: no
    ``attention_p`` left, one ``shard_map`` per attention, and the plan names ``schedule``."""
    module = f.module(*args)
    names = [e.primitive.name for e in iter_eqns(module.jaxpr)]
    assert attention_p.name not in names and "shard_map" in names
    assert [p.schedule for p in module.facts.plan] == [schedule] * len(module.facts.plan)


# -- the entry point: every schedule, layout and mask kind at lengths cp does not divide --

@pytest.mark.slow
@pytest.mark.parametrize("schedule,layout,kind,empty_rows,seq", [
    ("ring", "zigzag", "causal", "nan", 19),           # 2·cp + 3
    ("ring", "none", "window", "uniform", 5),          # shorter than cp: ranks of padding only
    ("ring", "striped", "dense_causal", "zero", 19),
    ("allgather", "zigzag", "segments", "uniform", 19),
    ("allgather", "none", "dense", "uniform", 13),    # its dense mask has an empty row
    ("ulysses", "zigzag", "causal_window", "uniform", 5),
    ("ulysses", "none", "bias", "nan", 19),
])
def test_schedules_pad_uneven_lengths(rng, schedule, layout, kind, empty_rows, seq):
    case = make_case(rng, kind, "gqa", batch=1, seq=seq, empty_rows=empty_rows)
    check_schedule(case, mesh=make_mesh((8,), ("cp",)), axes="cp", schedule=schedule,
                   layout="contiguous" if layout == "none" else layout)


@pytest.mark.slow
def test_hybrid_pads_uneven_lengths(rng):
    case = make_case(rng, "causal", "mha", batch=1, seq=19, empty_rows="uniform")
    check_schedule(case, mesh=make_mesh((2, 4), ("uly", "ring")), axes=("uly", "ring"),
                   schedule="hybrid", layout="zigzag")


# -- the transform: the user's program needs no change --

def self_attention(params, x, segments, *, causal: bool, window: int | None):
    """One attention layer written by hand: segment, causal and window masks from iotas,
    filled with a finite minimum (so an empty row is the uniform mean of V)."""
    b, s, d = x.shape
    split = lambda w: (x @ w).reshape(b, s, HEADS, d // HEADS)  # noqa: E731
    q, k, v = split(params["wq"]), split(params["wk"]), split(params["wv"])
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d // HEADS)
    pos = jnp.arange(s)
    allowed = segments[:, None, :, None] == segments[:, None, None, :]
    if causal:
        allowed = allowed & (pos[:, None] >= pos[None, :])
    if window is not None:
        allowed = allowed & (pos[:, None] - pos[None, :] <= window)
    logits = jnp.where(allowed, logits, jnp.finfo(jnp.float32).min)
    o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), v).reshape(b, s, d)
    return jnp.mean(jnp.tanh(x + o @ params["wo"]) ** 2)


def layer_args(seq: int, seed: int = 0):
    keys = jax.random.split(jax.random.key(seed), 6)
    d = 16
    params = {n: jax.random.normal(k, (d, d)) / 4
              for n, k in zip(("wq", "wk", "wv", "wo"), keys)}
    x = jax.random.normal(keys[4], (2, seq, d))
    segments = jnp.cumsum(jax.random.bernoulli(keys[5], 0.2, (2, seq)), axis=1)
    return params, x, segments


@pytest.mark.slow
@pytest.mark.parametrize("schedule,load_balance,seq,causal,window", [
    ("ring", "zigzag", 19, True, None),
    ("allgather", "none", 5, False, 2),
    ("ulysses", "zigzag", 13, True, 4),
])
def test_transform_pads_uneven_lengths(schedule, load_balance, seq, causal, window):
    args = layer_args(seq)
    fn = lambda p, x, s: self_attention(p, x, s, causal=causal, window=window)  # noqa: E731
    want = jax.value_and_grad(fn, argnums=(0, 1))(*args)
    f = context_parallel(fn, cp=8, schedule=schedule, load_balance=load_balance)
    got = jax.value_and_grad(f, argnums=(0, 1))(*args)
    np.testing.assert_allclose(got[0], want[0], rtol=RTOL)
    assert_tree_close(got[1], want[1])
    assert_sharded(f, *args, schedule=schedule)


@pytest.mark.slow
def test_explain_reports_the_padding():
    args = layer_args(19)
    fn = lambda p, x, s: self_attention(p, x, s, causal=True, window=None)  # noqa: E731
    text = context_parallel(fn, cp=8, schedule="ring", load_balance="zigzag").explain(*args)
    # 19 tokens to a multiple of 2·cp = 16: 13 pad tokens of q, o (8 heads × 2 × 2 floats)
    # and k, v, for 2 sequences: 2·13·(16·2 + 16·2)·4 bytes.
    assert "padding: queries 19 -> 32 (+13), keys 19 -> 32 (+13) to a multiple of 16; " \
           f"+{2 * 13 * 64 * 4} bytes" in text
    assert "layout: zigzag inside the attentions, the program in natural order" in text


@pytest.mark.slow
def test_llama_with_an_uneven_length():
    """The Llama example at 27 tokens (26 predicted) over cp=8 with zigzag: RoPE from
    ``arange``, the next-token shift and the causal mask all see the real positions."""
    cfg = llama.Config(vocab=64, dim=32, layers=1, heads=4, kv_heads=2, mlp_dim=64)
    params, tokens = llama.example_args(cfg, batch=2, seq=27, seed=1)
    loss = lambda p, t: llama.loss(p, t, cfg)  # noqa: E731
    want = jax.value_and_grad(loss)(params, tokens)
    f = context_parallel(loss, cp=8, schedule="ring", load_balance="zigzag")
    got = jax.value_and_grad(f)(params, tokens)
    np.testing.assert_allclose(got[0], want[0], rtol=RTOL)
    assert_tree_close(got[1], want[1])
    assert_sharded(f, params, tokens, schedule="ring")


def test_keep_permuted_needs_a_reordered_program():
    """With an uneven length zigzag runs inside the attention and outputs come back in
    natural order: asking for them permuted is refused, not silently ignored."""
    def hidden(x):
        return jax.nn.dot_product_attention(x, x, x, is_causal=True)

    x = jax.random.normal(jax.random.key(7), (1, 19, 2, 4))
    with pytest.raises(ReorderError, match="keep_permuted=True .* natural order"):
        context_parallel(hidden, cp=8, load_balance="zigzag", keep_permuted=True)(x)


# -- attentions over a sequence derived from the model's by a slice (MTP, a prefix dropped) --

def _derived_sequence_loss(kind: str, b=2, s=32, e=16, vocab=11):
    """A causal LM whose second block attends over a sequence one slice shorter: DeepSeek-V3's
    multi-token prediction (``h[:, :-1]`` beside the embeddings of ``tokens[:, 1:]``), or
    the tokens after a dropped prefix (``h[:, 3:]``)."""
    def block(x, w):
        q, k, v = ((x @ w[i]).reshape(x.shape[0], x.shape[1], 2, e // 2) for i in range(3))
        o = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        return x + o.reshape(x.shape[0], x.shape[1], e)

    def nll(logits, targets):
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))

    def loss(p, tokens):
        h = block(p["emb"][tokens], p["w1"])
        main = nll(h[:, :-1] @ p["unemb"], tokens[:, 1:])
        if kind == "mtp":
            m = jnp.concatenate([h[:, :-1], p["emb"][tokens[:, 1:]]], axis=-1) @ p["proj"]
            m = block(m, p["w2"])
            return main + 0.3 * nll(m[:, :-1] @ p["unemb"], tokens[:, 2:])
        m = block(h[:, 3:], p["w2"])
        return main + 0.3 * nll(m @ p["unemb"], tokens[:, 3:])

    keys = jax.random.split(jax.random.key(11), 6)
    p = {"emb": jax.random.normal(keys[0], (vocab, e)),
         "w1": jax.random.normal(keys[1], (3, e, e)) / np.sqrt(e),
         "w2": jax.random.normal(keys[2], (3, e, e)) / np.sqrt(e),
         "proj": jax.random.normal(keys[3], (2 * e, e)) / np.sqrt(2 * e),
         "unemb": jax.random.normal(keys[4], (e, vocab)) / np.sqrt(e)}
    tokens = jax.random.randint(keys[5], (b, s), 0, vocab)
    return loss, (p, tokens)


@pytest.mark.parametrize("kind,load_balance", [
    ("mtp", "auto"),
    pytest.param("mtp", "none", marks=pytest.mark.slow),
    pytest.param("prefix", "auto", marks=pytest.mark.slow),
])
def test_attention_over_a_derived_shorter_sequence(kind, load_balance):
    """The shorter sequence is a second sequence (seeded over size-keeping links, reached
    by the slice only where no sequence holds a dim), padded inside its attention: both
    attentions sharded, loss and gradients as on one device."""
    loss, args = _derived_sequence_loss(kind)
    f = context_parallel(loss, cp=4, load_balance=load_balance)
    assert_tree_close(jax.jit(jax.value_and_grad(f))(*args),
                      jax.jit(jax.value_and_grad(loss))(*args))
    module = f.module(*args)
    assert sorted(module.facts.seq_axes.lengths) == sorted([32, 31 if kind == "mtp" else 29])
    assert len(module.facts.plan) == 2


# -- every mask term's operands at padded queries: the class of terms, not a list --

def _truncated(case, n: int):
    """``case`` (batch, sequence, heads, features; 32 tokens) cut to its first ``n`` tokens
    on both sides, every operand along the dims its role names (top-k picks past the cut
    point at the last key kept)."""
    by_operand = {role.operand: role for role in ROLES.values() if role.operand}
    ops = []
    for name, x in zip(case.spec.operand_names(), case.operands):
        role = by_operand.get(name)
        if role is None or role.heavy or name in ("q", "k", "v"):
            x = x[:, :n]
        elif role.per_token:
            x = x[..., :n]
        elif role.side is Side.ROWS:
            x = x[..., :n, :n] if role.columns else jnp.minimum(x[..., :n, :], n - 1)
        ops.append(x)
    return Case(tuple(ops), case.spec)


def _term_features():
    """One conformance feature per registered mask term (the first that brings it)."""
    chosen = {}
    for name, build in FEATURES.items():
        case = build(np.random.default_rng(0), "gqa", 8, jnp.float32)
        for term in case.spec.mask.terms():
            chosen.setdefault(type(term).__name__, name)
    assert set(chosen) == {t.__name__ for t in TERMS}
    return sorted(set(chosen.values()))


@pytest.mark.parametrize("feature", _term_features())
def test_every_mask_term_pads_exactly(rng, feature):
    """27 tokens over 8 devices under zigzag (padded to 32): each term's operands take its
    own values at the padded queries (``MaskTerm.padding``), so no padded row is empty —
    under ``empty_rows="nan"`` one would turn every gradient of its keys into NaN — and
    the result is the unpadded attention's, value and gradients."""
    case = _truncated(FEATURES[feature](rng, "gqa", 8, jnp.float32), 27)
    case = Case(case.operands, case.spec.replace(
        mask=case.spec.mask.replace(empty_rows="nan")))
    check_schedule(case, mesh=make_mesh((8,), ("cp",)), axes="cp", schedule="allgather",
                   layout="zigzag")
