"""A decoder written the MaxText way, trained with optax under ``jax.jit`` with context
parallelism beside its own data, FSDP and tensor parallelism.

The model is Flax linen with logical axis names, as MaxText writes it: every activation is
annotated with ``nn.with_logical_constraint`` (``activation_batch``, ``activation_length``,
``activation_heads``, ``activation_mlp``, ...) and ``logical_axis_rules`` map the names to
the axes of one mesh, ``(data, fsdp, tensor, cp)`` over 8 devices. Its attention is MaxText's
``dot_product`` path: grouped-query logits ``[B, K, G, T, S]``, a where-mask with MaxText's
finite fill, the unnormalised exponentials multiplied with V, and the division by the row sum
only after the value product and a reshape, with the sum moved to the output's dim order.

``context_parallel(loss, mesh=mesh, axis="cp")`` shards the sequence over ``cp``; the model's
own constraints keep batch on ``data``/``fsdp`` and heads and MLP features on ``tensor``
(docs/sharded_models.md). Two copies of the same parameters take the same AdamW steps by the
same ``jax.jit`` train step, one differentiating the undecorated loss on one device, the
other the transformed loss on the mesh; losses, gradients and the final parameters must
agree.

Run: ``python examples/maxtext_style.py`` (8 simulated CPU devices; exits 1 on a mismatch).
"""
from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # the example simulates 8 devices; must precede the jax import
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=8")

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType  # noqa: E402

VOCAB, EMBED, HEADS, KV_HEADS, HEAD_DIM, MLP = 128, 32, 4, 2, 8, 64
#: MaxText's masked-logit fill.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
#: Logical axis → mesh axis, as MaxText's ``logical_axis_rules``.
RULES = (("activation_batch", ("data", "fsdp")), ("activation_length", "cp"),
         ("activation_heads", "tensor"), ("activation_kv_heads", "tensor"),
         ("activation_kv", None), ("activation_embed", None), ("activation_mlp", "tensor"),
         ("activation_vocab", "tensor"))
MESH_SHAPE, MESH_AXES = (1, 2, 2, 2), ("data", "fsdp", "tensor", "cp")


def constrain(x, *names):
    return nn.with_logical_constraint(x, names)


def dot_product_attention(q, k, v):
    """MaxText's ``AttentionOp`` on its ``dot_product`` path: q ``[B, T, N, D]``, k and v
    ``[B, S, K, D]`` → ``[B, T, N, D]``, normalised after the value product."""
    b, t, n, d = q.shape
    kv = k.shape[2]
    q = q.reshape(b, t, kv, n // kv, d)
    logits = jnp.einsum("btkgd,bskd->bkgts", q, k)
    causal = jnp.tril(jnp.ones((t, k.shape[1]), bool))[None, None, None]
    logits = jnp.where(causal, logits, MASK_VALUE)
    local_max = jnp.max(logits, axis=-1, keepdims=True)
    local_exps = jnp.exp(logits - local_max)
    local_sum = jnp.sum(local_exps, axis=-1, keepdims=True)
    local_sum = jnp.moveaxis(local_sum, -2, 1).reshape(b, t, n, 1)
    out = jnp.einsum("bkgts,bskd->btkgd", local_exps, v).reshape(b, t, n, d)
    return out / local_sum


class RMSNorm(nn.Module):
    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],))
        return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale


class DecoderLayer(nn.Module):
    """Pre-norm attention with GQA, then a SwiGLU MLP, activations annotated as in MaxText."""

    @nn.compact
    def __call__(self, x):
        h = constrain(RMSNorm()(x), "activation_batch", "activation_length", "activation_embed")
        q = nn.DenseGeneral((HEADS, HEAD_DIM), use_bias=False, name="query")(h) / np.sqrt(HEAD_DIM)
        k = nn.DenseGeneral((KV_HEADS, HEAD_DIM), use_bias=False, name="key")(h)
        v = nn.DenseGeneral((KV_HEADS, HEAD_DIM), use_bias=False, name="value")(h)
        q = constrain(q, "activation_batch", "activation_length", "activation_heads",
                      "activation_kv")
        k, v = (constrain(a, "activation_batch", "activation_length", "activation_kv_heads",
                          "activation_kv") for a in (k, v))
        o = constrain(dot_product_attention(q, k, v), "activation_batch", "activation_length",
                      "activation_heads", "activation_kv")
        x = x + nn.DenseGeneral(EMBED, axis=(-2, -1), use_bias=False, name="out")(o)
        h = RMSNorm()(x)
        gate = nn.Dense(MLP, use_bias=False, name="wi_0")(h)
        up = nn.Dense(MLP, use_bias=False, name="wi_1")(h)
        mlp = constrain(nn.silu(gate) * up, "activation_batch", "activation_length",
                        "activation_mlp")
        return constrain(x + nn.Dense(EMBED, use_bias=False, name="wo")(mlp),
                         "activation_batch", "activation_length", "activation_embed")


class Transformer(nn.Module):
    layers: int = 2

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, EMBED, name="token_embedder")(tokens)
        for i in range(self.layers):
            x = DecoderLayer(name=f"layers_{i}")(x)
        logits = nn.Dense(VOCAB, use_bias=False, name="logits")(RMSNorm()(x))
        return constrain(logits, "activation_batch", "activation_length", "activation_vocab")


def make_loss(model: Transformer):
    def loss(params, tokens):
        logits = model.apply(params, tokens)[:, :-1]
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
    return loss


def make_train_step(loss_fn, optimizer):
    @jax.jit
    def train_step(params, opt_state, tokens):
        value, grads = jax.value_and_grad(loss_fn)(params, tokens)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value, grads
    return train_step


def check(*, seq: int = 64, steps: int = 3, layers: int = 2, verbose: bool = True) -> bool:
    """Train both copies ``steps`` AdamW steps; whether losses, gradients and final
    parameters agree (float32, relative 1e-5) and the attention is sharded."""
    import _check  # beside this file; the script's folder is on sys.path
    from cptransform import context_parallel

    say = print if verbose else (lambda *a: None)
    mesh = jax.make_mesh(MESH_SHAPE, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))
    model = Transformer(layers=layers)
    keys = jax.random.split(jax.random.key(1), steps)
    data = [jax.random.randint(k, (2, seq), 0, VOCAB) for k in keys]
    params = model.init(jax.random.key(0), data[0])
    optimizer = optax.adamw(3e-3)
    loss = make_loss(model)
    cp_loss = context_parallel(loss, mesh=mesh, axis="cp")
    one_device = make_train_step(loss, optimizer)
    state = [(params, optimizer.init(params)) for _ in range(2)]
    ok = []
    with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
        say(_check.report(cp_loss, params, data[0]))
        transformed = make_train_step(cp_loss, optimizer)
        say(f"\n{'step':>4} {'single device':>14} {'cp mesh':>14}  worst gradient error")
        for i, tokens in enumerate(data):
            with jax.set_mesh(None), nn.logical_axis_rules(()):
                *state[0], ref_loss, ref_grads = one_device(*state[0], tokens)
            *state[1], got_loss, got_grads = transformed(*state[1], tokens)
            grads = _check.tree_error(got_grads, ref_grads)
            loss_err = _check.relative_error(got_loss, ref_loss)
            ok.append(grads.worst <= _check.RTOL and loss_err <= _check.RTOL)
            say(f"{i:>4} {float(ref_loss):>14.7f} {float(got_loss):>14.7f}  {grads}")
        shards = _check.sharding(cp_loss, params, data[0])
    final = _check.tree_error(jax.device_get(state[1][0]), jax.device_get(state[0][0]))
    ok.append(final.worst <= _check.RTOL)
    say(f"parameters after {steps} steps: {final}\n{shards}\n"
        + _check.verdict(shards, all(ok)))
    return all(ok) and shards.ok


if __name__ == "__main__":
    import _check  # beside this file; the script's folder is on sys.path
    sys.exit(_check.main(check))
