"""Contractions over the sequence axis under zigzag/striped: a weight contracted with the
sequence (``[S]`` pooling, ``[S, S]`` token mixing) is held in the same token order as the
activations, so loss and every gradient equal the single-device run."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cptransform import context_parallel
from test_transform import assert_tree_close

B, S, H, D = 2, 32, 2, 8
KEYS = jax.random.split(jax.random.key(21), 6)
X = jax.random.normal(KEYS[0], (B, S, H, D))
W_POOL = jax.random.normal(KEYS[1], (S,))
W_MIX = jax.random.normal(KEYS[2], (S, S)) / 4
W_MIX_NP = np.asarray(jax.random.normal(KEYS[3], (S, S)) / 4)


def attend(x):
    return jax.nn.dot_product_attention(x, x, x, is_causal=True)


def learned_pooling(x, w):
    """``einsum('bshd,s->bhd')``: a length-S weight pools the attention output."""
    return jnp.sum(jnp.einsum("bshd,s->bhd", attend(x), w) ** 2)


def weighted_token_loss(x, w):
    """``per_token_loss @ w`` over the sequence."""
    per_token = jnp.mean(attend(x) ** 2, axis=(2, 3))
    return jnp.mean(per_token @ w)


def shifted_pooling(x, w):
    """A contraction of sequence slices (``o[:, 1:]`` with ``w[1:]``): not full length."""
    return jnp.sum(jnp.einsum("bshd,s->bhd", attend(x)[:, 1:], w[1:]) ** 2)


def token_mixer(x, params):
    """MLP-Mixer style ``einsum('bsd,st->btd')``, W a parameter; the mixed tokens go back
    into the residual stream and through a second attention, so both dims of W carry the
    sequence."""
    h = attend(x).reshape(B, S, H * D)
    h = h + jnp.tanh(jnp.einsum("bsd,st->btd", h, params["mix"]))
    return jnp.mean(attend(h.reshape(B, S, H, D)) ** 2)


def mixer_output(x, w):
    """A mix whose output dim stays natural (only W's contracted dim carries the sequence)."""
    h = attend(x).reshape(B, S, H * D)
    return jnp.sum(jnp.einsum("bsd,st->btd", h, w) ** 2)


def mixer_numpy_constant(x):
    """The mixing matrix is a NumPy array captured at trace time (a jaxpr constant)."""
    h = attend(x).reshape(B, S, H * D)
    h = h + jnp.einsum("bsd,st->btd", h, W_MIX_NP)
    return jnp.mean(attend(h.reshape(B, S, H, D)) ** 2)


def scanned_mixer(x, ws):
    """Token mixing inside ``lax.scan`` over stacked ``[L, S, S]`` weights."""
    def layer(h, w):
        h = h + jnp.tanh(jnp.einsum("bshd,st->bthd", attend(h), w))
        return h, None
    return jnp.mean(jax.lax.scan(layer, x, ws)[0] ** 2)


CASES = {
    "pooling": (learned_pooling, (X, W_POOL)),
    "token_loss": (weighted_token_loss, (X, W_POOL)),
    "shifted_pooling": (shifted_pooling, (X, W_POOL)),
    "mixer_param": (token_mixer, (X, {"mix": W_MIX})),
    "mixer_output": (mixer_output, (X, W_MIX)),
    "mixer_numpy": (mixer_numpy_constant, (X,)),
    "scanned_mixer": (scanned_mixer, (X, jnp.stack([W_MIX, W_MIX_NP]))),
}


@pytest.mark.slow
@pytest.mark.parametrize("load_balance", ["zigzag", "striped"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_contraction_over_sequence_matches(case, load_balance):
    fn, args = CASES[case]
    argnums = tuple(range(len(args)))
    ref_v, ref_g = jax.value_and_grad(fn, argnums=argnums)(*args)
    f = context_parallel(fn, cp=4, load_balance=load_balance)
    value, grads = jax.value_and_grad(f, argnums=argnums)(*args)
    np.testing.assert_allclose(value, ref_v, rtol=1e-5)
    assert_tree_close(grads, ref_g)


def test_weights_carry_the_sequence_only_along_linked_dims():
    """The pooling weight's one dim and both dims of a residual mixer carry the sequence; a
    mixer whose output stays out of the sequence links only its contracted dim."""
    seq = lambda fn, *args: context_parallel(fn, cp=4).module(*args).facts.seq_axes.inputs  # noqa: E731
    assert seq(learned_pooling, X, W_POOL) == ((1,), (0,))
    assert seq(token_mixer, X, {"mix": W_MIX}) == ((1,), (0, 1))
    assert seq(mixer_output, X, W_MIX) == ((1,), (0,))


def channel_attention(x, w):
    """Softmax over features (``[B, D, D]`` scores, D == S by coincidence) around a causal
    attention, and a ``[D, D]`` weight: neither may become sequence-carrying."""
    a = jax.nn.softmax(jnp.swapaxes(x, 1, 2) @ x / 8, axis=-1)
    h = (x @ a) @ w
    q = h.reshape(B, S, H, S // H)
    return jnp.mean(attend(q) ** 2)


@pytest.mark.slow
def test_channel_attention_with_model_width_equal_to_sequence():
    x = jax.random.normal(KEYS[4], (B, S, S))
    w = jax.random.normal(KEYS[5], (S, S)) / 4
    ref_v, ref_g = jax.value_and_grad(channel_attention, argnums=(0, 1))(x, w)
    f = context_parallel(channel_attention, cp=4, load_balance="zigzag")
    value, grads = jax.value_and_grad(f, argnums=(0, 1))(x, w)
    np.testing.assert_allclose(value, ref_v, rtol=1e-5)
    assert_tree_close(grads, ref_g)
    assert f.module(x, w).facts.seq_axes.inputs == ((1,), ())
