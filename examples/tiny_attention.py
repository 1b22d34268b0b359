"""The smallest program the CLI can be pointed at: one causal self-attention over
``x [batch, seq, heads, head_dim]`` (queries, keys and values all ``x``).

    .venv/bin/cptransform opt examples/tiny_attention.py:attention --args 'f32[2,64,4,16]' -p canonicalize
"""
import jax
import jax.numpy as jnp


def attention(x):
    """Causal softmax attention of ``x`` with itself, written out by hand."""
    s, d = x.shape[1], x.shape[-1]
    logits = jnp.einsum("bqhd,bkhd->bhqk", x, x) / jnp.sqrt(jnp.float32(d))
    causal = jnp.arange(s)[:, None] >= jnp.arange(s)[None, :]
    probs = jax.nn.softmax(jnp.where(causal, logits, -jnp.inf), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, x)
