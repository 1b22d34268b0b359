"""A small hybrid language model, recurrent layers between attentions, under
``context_parallel(cp=8)``.

Hybrid models (Jamba, Zamba, RecurrentGemma, Qwen3-Next) interleave causal attention with
layers that are recurrences over the tokens. This one stacks a Mamba-style selective scan
(``lax.scan``, a diagonal state), a causal attention, a gated-linear-attention layer in
chunk form (``lax.scan`` across chunks of 8 tokens), and a second attention, each with
RMSNorm, a residual and a SwiGLU MLP; the layers are ``examples/recurrent_layers.py``'s, in
plain JAX. Nothing here knows about cptransform: the attentions get schedules, and each
recurrence is sharded by passing its state between the devices (``explain()`` lists each
with its method and bytes); no device ever holds the whole sequence.

Run: ``python examples/hybrid_recurrent.py`` (8 simulated CPU devices; exits 1 on a
mismatch).
"""
from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # the example simulates 8 devices; must precede the jax import
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import recurrent_layers as layers  # noqa: E402  (beside this file)

VOCAB, DIM, MLP = 128, 32, 64
#: The mixing layer of each block, in order.
MIXERS = ("mamba", "attention", "gla", "attention")


def init_params(key) -> dict:
    keys = jax.random.split(key, 2 * len(MIXERS) + 1)
    blocks = []
    for i, mixer in enumerate(MIXERS):
        up, down = jax.random.split(keys[2 * i + 1])
        blocks.append({
            "mix": layers.init("linear_attention" if mixer == "attention" else mixer,
                               keys[2 * i], DIM),
            "up": jax.random.normal(up, (DIM, 2 * MLP)) / jnp.sqrt(DIM),
            "down": jax.random.normal(down, (MLP, DIM)) / jnp.sqrt(MLP)})
    return {"embed": jax.random.normal(keys[-1], (VOCAB, DIM)) / jnp.sqrt(DIM),
            "blocks": blocks}


def forward(params: dict, tokens):
    x = params["embed"][tokens]
    for mixer, block in zip(MIXERS, params["blocks"]):
        mix = layers.attention if mixer == "attention" else layers.LAYERS[mixer]
        x = x + mix(block["mix"], layers.rms(x))
        gate, value = jnp.split(layers.rms(x) @ block["up"], 2, axis=-1)
        x = x + (jax.nn.silu(gate) * value) @ block["down"]
    return layers.rms(x) @ params["embed"].T


def loss(params: dict, tokens):
    """Mean next-token cross-entropy: position ``t`` predicts ``tokens[:, t + 1]``."""
    logp = jax.nn.log_softmax(forward(params, tokens)[:, :-1], axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


def example_args(*, batch: int = 2, seq: int = 256, seed: int = 0):
    """Random ``(params, tokens)`` for ``loss``."""
    pkey, tkey = jax.random.split(jax.random.key(seed))
    return init_params(pkey), jax.random.randint(tkey, (batch, seq), 0, VOCAB)


def check(*, seq: int = 256, cp: int = 8, verbose: bool = True) -> bool:
    """The example: report, then loss and every gradient against one device."""
    import _check  # beside this file; the script's folder is on sys.path
    from cptransform import context_parallel

    params, tokens = example_args(seq=seq)
    sharded = context_parallel(loss, cp=cp)
    result = _check.compare_gradients(loss, sharded, params, tokens)
    if verbose:
        print(_check.report(sharded, params, tokens))
        print(f"\n{result}")
    return result.ok


if __name__ == "__main__":
    import _check  # beside this file; the script's folder is on sys.path
    sys.exit(_check.main(check))
