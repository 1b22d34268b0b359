"""A transformers Flax causal LM trained with optax, its loss under ``context_parallel``.

The model is transformers' own ``FlaxLlamaForCausalLM`` (RoPE, grouped-query attention,
RMSNorm, SwiGLU), built from a tiny ``LlamaConfig`` with random weights (nothing is
downloaded). Two copies of its parameters are trained the same number of AdamW steps by
the same jitted step; the only difference is that one step differentiates
``context_parallel(loss, cp=8)`` instead of ``loss``. At each step the transformed step
also runs from the single-device copy's state, and its loss and every gradient must agree
with that copy's to float32 rounding. The transformed copy's own parameters at the end must
stay within a hundredth of the distance AdamW can move them (``lr`` per step): AdamW divides
each gradient entry by its own magnitude, so an entry near zero turns a rounding-level
difference into a visible one, and the parameters cannot be held to ``rtol``.

The model is called as transformers documents it, ``model(tokens, params=params)``:
the loss is a function of the parameter pytree, which is what the transform traces.
transformers slices its causal mask out of one precomputed for
``max_position_embeddings`` positions; this example sets that to the sequence length.

Needs the ``models`` extra (``pip install -e '.[models]'``: transformers 4.x, the last
line with Flax models). Run: ``python examples/transformers_flax.py`` (8 simulated CPU
devices; exits 1 on a mismatch).
"""
from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # the example simulates 8 devices; must precede the jax import
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from transformers import FlaxLlamaForCausalLM, LlamaConfig  # noqa: E402


def make_model(*, seq: int, vocab: int = 128, dim: int = 32, layers: int = 2, heads: int = 8,
               kv_heads: int = 8) -> FlaxLlamaForCausalLM:
    """A tiny Llama with random weights whose causal mask covers ``seq`` positions."""
    config = LlamaConfig(vocab_size=vocab, hidden_size=dim, intermediate_size=2 * dim,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, max_position_embeddings=seq)
    return FlaxLlamaForCausalLM(config, seed=0)


def make_loss(model: FlaxLlamaForCausalLM):
    """Mean next-token cross-entropy of ``model`` as a function of its parameters."""
    def loss(params, tokens):
        logits = model(tokens, params=params).logits[:, :-1]
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
    return loss


def make_train_step(loss_fn, optimizer):
    """An AdamW step on ``loss_fn``; returns the loss, the gradients it applied, and the
    new parameters and optimizer state."""
    @jax.jit
    def train_step(params, opt_state, tokens):
        value, grads = jax.value_and_grad(loss_fn)(params, tokens)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return value, grads, optax.apply_updates(params, updates), opt_state
    return train_step


def batches(steps: int, *, vocab: int, batch: int, seq: int, seed: int = 1):
    """``steps`` random token batches ``[batch, seq]``."""
    keys = jax.random.split(jax.random.key(seed), steps)
    return [jax.random.randint(k, (batch, seq), 0, vocab) for k in keys]


def check(*, seq: int = 128, steps: int = 3, cp: int = 8, layers: int = 2,
          verbose: bool = True) -> bool:
    """Train both copies ``steps`` AdamW steps; whether losses, gradients and final
    parameters all agree (float32, relative 1e-5)."""
    import _check  # beside this file; the script's folder is on sys.path
    from cptransform import context_parallel

    say = print if verbose else (lambda *a: None)
    model = make_model(seq=seq, layers=layers, heads=cp, kv_heads=cp)
    loss = make_loss(model)
    cp_loss = context_parallel(loss, cp=cp)
    lr = 3e-3
    optimizer = optax.adamw(lr)
    data = batches(steps, vocab=model.config.vocab_size, batch=2, seq=seq)
    say(_check.report(cp_loss, model.params, data[0]))

    states = [(model.params, optimizer.init(model.params)) for _ in range(2)]
    steps_ok = []
    one_device, transformed = (make_train_step(loss, optimizer),
                               make_train_step(cp_loss, optimizer))
    say(f"\n{'step':>4} {'single device':>14} {f'cp={cp}':>14}  worst gradient error")
    for i, tokens in enumerate(data):
        ref_loss, ref_grads, *ref_state = one_device(*states[0], tokens)
        # The same step from the same state: the transform's contract, to rounding.
        got_loss, got_grads, *_ = transformed(*states[0], tokens)
        grads = _check.tree_error(got_grads, ref_grads)
        loss_err = _check.relative_error(got_loss, ref_loss)
        steps_ok.append(grads.worst <= _check.RTOL and loss_err <= _check.RTOL)
        say(f"{i:>4} {float(ref_loss):>14.7f} {float(got_loss):>14.7f}  {grads}")
        states = [tuple(ref_state), tuple(transformed(*states[1], tokens)[2:])]
    drift = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(
        jax.tree.leaves(states[1][0]), jax.tree.leaves(states[0][0]))) / (lr * steps)
    steps_ok.append(drift <= 1e-2)
    shards = _check.sharding(cp_loss, model.params, data[0])
    say(f"parameters after {steps} steps of each copy: largest difference {drift:.2e} of "
        f"the distance AdamW can move them (at most 1e-2)\n{shards}\n"
        + _check.verdict(shards, all(steps_ok)))
    return all(steps_ok) and shards.ok


def make():
    """``(loss, (params, tokens))`` for ``cptransform opt examples/transformers_flax.py:make``."""
    model = make_model(seq=64)
    return make_loss(model), (model.params, batches(1, vocab=128, batch=2, seq=64)[0])


if __name__ == "__main__":
    import _check  # beside this file; the script's folder is on sys.path
    sys.exit(_check.main(check))
