"""A Flax NNX decoder trained with optax, its loss under ``context_parallel(cp=8)``.

The model is ordinary NNX: ``nnx.Embed``, pre-norm blocks of ``nnx.RMSNorm``,
``nnx.MultiHeadAttention`` with a causal mask from ``nnx.make_causal_mask`` and a GELU MLP
of ``nnx.Linear``, then a next-token cross-entropy. Two copies of the same model are trained
the same number of AdamW steps by the same ``nnx.jit`` train step; the only difference is
that one step differentiates ``context_parallel(loss, cp=8)`` instead of ``loss``. The
losses and every gradient must agree at each step, and the parameters at the end.

The attention projections have no bias (``use_bias=False``, as in Llama or Gemma): a key
bias is cancelled exactly by the softmax, so its gradient is rounding noise (about 1e-9 here,
against gradients of 0.1) on one device as under CP, and AdamW, which divides by the
gradient's own magnitude, turns that noise into full-size updates of either sign — any
change in the order of a sum, on one device too, would change that parameter.

How ``context_parallel`` composes with NNX (what this file relies on):

* the decorator goes on the **loss**, whose first argument is the ``nnx.Module`` itself
  (NNX modules are pytrees; their arrays become the traced inputs), and the train step
  differentiates it with ``nnx.value_and_grad`` inside ``nnx.jit`` and applies
  ``nnx.Optimizer.update`` — exactly as with the undecorated loss;
* ``nnx.split`` / ``nnx.merge`` around a pure loss of the state works the same way
  (:func:`pure_loss`, checked in ``tests/test_examples.py``), for code that uses
  ``jax.value_and_grad`` directly;
* a loss that changes module state (``nnx.Dropout`` advancing its ``nnx.Rngs``,
  ``nnx.scan`` writing the layers back) works too: the new values come out of the
  transformed program and are written back into the module, as without the decorator
  (``tests/test_arguments_and_meshes.py``);
* decorating the **train step** itself is refused with a ``ContextParallelError``: the
  transform must see the forward program, and a step that already differentiates (and then
  updates the optimizer) is not one. The error says to move the decorator onto the loss.

Run: ``python examples/nnx_optax.py`` (8 simulated CPU devices; exits 1 on a mismatch).
"""
from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # the example simulates 8 devices; must precede the jax import
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402


class Block(nnx.Module):
    """Pre-norm decoder layer: causal multi-head self-attention, then a GELU MLP."""

    def __init__(self, dim: int, heads: int, rngs: nnx.Rngs):
        self.attn_norm = nnx.RMSNorm(dim, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=heads, in_features=dim, qkv_features=dim,
                                           use_bias=False, decode=False, rngs=rngs)
        self.mlp_norm = nnx.RMSNorm(dim, rngs=rngs)
        self.up = nnx.Linear(dim, 4 * dim, rngs=rngs)
        self.down = nnx.Linear(4 * dim, dim, rngs=rngs)

    def __call__(self, x):
        causal = nnx.make_causal_mask(x[..., 0])
        x = x + self.attn(self.attn_norm(x), mask=causal)
        return x + self.down(jax.nn.gelu(self.up(self.mlp_norm(x))))


class Decoder(nnx.Module):
    """Token embedding, ``layers`` blocks, final norm and an untied output projection."""

    def __init__(self, *, vocab: int = 128, dim: int = 32, heads: int = 4, layers: int = 2,
                 seed: int = 0):
        rngs = nnx.Rngs(seed)
        self.embed = nnx.Embed(vocab, dim, rngs=rngs)
        self.blocks = nnx.List([Block(dim, heads, rngs) for _ in range(layers)])
        self.norm = nnx.RMSNorm(dim, rngs=rngs)
        self.head = nnx.Linear(dim, vocab, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def loss(model: Decoder, tokens):
    """Mean next-token cross-entropy: position ``t`` predicts ``tokens[:, t + 1]``."""
    logits = model(tokens)[:, :-1]
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def pure_loss(graphdef):
    """``loss`` as a pure function of the model's state (the ``nnx.split`` spelling)."""
    return lambda state, tokens: loss(nnx.merge(graphdef, state), tokens)


def make_train_step(loss_fn):
    """An AdamW step on ``loss_fn``; returns the loss and the gradients it applied."""
    @nnx.jit
    def train_step(model, optimizer, tokens):
        value, grads = nnx.value_and_grad(loss_fn)(model, tokens)
        optimizer.update(model, grads)
        return value, grads
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
    vocab = 128
    models = [Decoder(vocab=vocab, layers=layers) for _ in range(2)]  # same seed: same weights
    optimizers = [nnx.Optimizer(m, optax.adamw(3e-3), wrt=nnx.Param) for m in models]
    cp_loss = context_parallel(loss, cp=cp)
    data = batches(steps, vocab=vocab, batch=2, seq=seq)
    say(_check.report(cp_loss, models[1], data[0]))

    steps_ok = []
    one_device, transformed = make_train_step(loss), make_train_step(cp_loss)
    say(f"\n{'step':>4} {'single device':>14} {f'cp={cp}':>14}  worst gradient error")
    for i, tokens in enumerate(data):
        ref_loss, ref_grads = one_device(models[0], optimizers[0], tokens)
        got_loss, got_grads = transformed(models[1], optimizers[1], tokens)
        grads = _check.tree_error(got_grads, ref_grads)
        loss_err = _check.relative_error(got_loss, ref_loss)
        steps_ok.append(grads.worst <= _check.RTOL and loss_err <= _check.RTOL)
        say(f"{i:>4} {float(ref_loss):>14.7f} {float(got_loss):>14.7f}  {grads}")
    params = _check.tree_error(nnx.state(models[1], nnx.Param), nnx.state(models[0], nnx.Param))
    steps_ok.append(params.worst <= _check.RTOL)
    shards = _check.sharding(cp_loss, models[1], data[0])
    say(f"parameters after {steps} steps: {params}\n{shards}\n"
        + _check.verdict(shards, all(steps_ok)))
    return all(steps_ok) and shards.ok


def make():
    """``(loss, (model, tokens))`` for ``cptransform opt examples/nnx_optax.py:make``."""
    return loss, (Decoder(), batches(1, vocab=128, batch=2, seq=64)[0])


if __name__ == "__main__":
    import _check  # beside this file; the script's folder is on sys.path
    sys.exit(_check.main(check))
