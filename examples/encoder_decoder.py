"""A small encoder-decoder (translation-style) in plain JAX, for cross-attention under CP.

Nothing here knows about cptransform. The encoder runs bidirectional self-attention over
``src [batch, src_len]``; the decoder runs causal self-attention over ``tgt [batch,
tgt_len]`` and cross-attention from its tokens to the encoder's output; the loss is the
decoder's next-token cross-entropy. Every attention is written by hand (einsum, masks from
iotas, ``jax.nn.softmax``). The encoder and the decoder have different lengths, so the
program holds two sequences: the transform shards each on its own, and pads a length the
layout does not divide (the default decoder length, 27, is not a multiple of 2·cp = 16).

Entry points: ``make()`` returns ``(loss, example_args)`` for ``cptransform opt
examples/encoder_decoder.py:make``; ``loss(params, src, tgt)`` uses the default
:class:`Config`. Run as a script, it transforms the loss with ``context_parallel(cp=8)`` on
8 simulated CPU devices, prints ``explain()`` and checks the loss and every gradient
against the single-device run.
"""
from __future__ import annotations

import math
import os
import sys

if __name__ == "__main__":  # the demo simulates 8 devices; must precede the jax import
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=8")

from dataclasses import dataclass  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402


@dataclass(frozen=True)
class Config:
    """Model sizes (one encoder layer, one decoder layer)."""

    vocab: int = 64
    dim: int = 32
    heads: int = 8
    mlp_dim: int = 64

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads


SMALL = Config()

#: Weight matrices of one attention (query, key, value, output projections).
ATTENTION = ("wq", "wk", "wv", "wo")


def init_params(key, cfg: Config = SMALL) -> dict:
    """Random parameters: embeddings, encoder self-attention, decoder self- and
    cross-attention, one MLP each, the unembedding."""
    d = cfg.dim
    names = ([f"enc_{w}" for w in ATTENTION] + [f"dec_{w}" for w in ATTENTION]
             + [f"cross_{w}" for w in ATTENTION])
    shapes = {"src_embed": (cfg.vocab, d), "tgt_embed": (cfg.vocab, d),
              **{n: (d, d) for n in names},
              "enc_up": (d, cfg.mlp_dim), "enc_down": (cfg.mlp_dim, d),
              "dec_up": (d, cfg.mlp_dim), "dec_down": (cfg.mlp_dim, d), "unembed": (d, cfg.vocab)}
    keys = jax.random.split(key, len(shapes))
    return {name: jax.random.normal(k, shape) / math.sqrt(shape[0])
            for k, (name, shape) in zip(keys, shapes.items())}


def attend(x, memory, params: dict, prefix: str, cfg: Config, causal: bool):
    """Multi-head attention from ``x [B, Tq, d]`` to ``memory [B, Tkv, d]`` (``memory is
    x`` for self-attention); ``causal`` lets query ``i`` see keys ``j <= i + Tkv - Tq``
    (the keys end where the queries end, as with a KV cache)."""
    b, tq, d = x.shape
    tkv = memory.shape[1]

    def heads(y, w):
        return (y @ params[f"{prefix}_{w}"]).reshape(b, y.shape[1], cfg.heads, cfg.head_dim)

    q, k, v = heads(x, "wq"), heads(memory, "wk"), heads(memory, "wv")
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(cfg.head_dim)
    if causal:
        visible = jnp.arange(tkv)[None, :] <= jnp.arange(tq)[:, None] + (tkv - tq)
        logits = jnp.where(visible, logits, jnp.finfo(jnp.float32).min)
    o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), v)
    return o.reshape(b, tq, d) @ params[f"{prefix}_wo"]


def mlp(x, params: dict, prefix: str):
    return jax.nn.gelu(x @ params[f"{prefix}_up"]) @ params[f"{prefix}_down"]


def encode(params: dict, src, cfg: Config = SMALL):
    """The encoder's output ``[B, src_len, d]``: bidirectional self-attention and an MLP."""
    x = params["src_embed"][src]
    x = x + attend(x, x, params, "enc", cfg, causal=False)
    return x + mlp(x, params, "enc")


def decode(params: dict, memory, tgt, cfg: Config = SMALL):
    """Logits ``[B, tgt_len, vocab]``: causal self-attention, cross-attention to
    ``memory``, an MLP."""
    y = params["tgt_embed"][tgt]
    y = y + attend(y, y, params, "dec", cfg, causal=True)
    y = y + attend(y, memory, params, "cross", cfg, causal=False)
    y = y + mlp(y, params, "dec")
    return y @ params["unembed"]


def loss(params: dict, src, tgt, cfg: Config = SMALL):
    """Mean next-token cross-entropy of the decoder: position ``t`` predicts ``tgt[:, t+1]``."""
    logits = decode(params, encode(params, src, cfg), tgt, cfg)[:, :-1]
    logp = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(logp, tgt[:, 1:, None], axis=-1)[..., 0]
    return -jnp.mean(picked)


def example_args(cfg: Config = SMALL, *, batch: int = 2, src_len: int = 48,
                 tgt_len: int = 27, seed: int = 0):
    """Random ``(params, src, tgt)`` for ``loss``."""
    pkey, skey, tkey = jax.random.split(jax.random.key(seed), 3)
    src = jax.random.randint(skey, (batch, src_len), 0, cfg.vocab, dtype=jnp.int32)
    tgt = jax.random.randint(tkey, (batch, tgt_len), 0, cfg.vocab, dtype=jnp.int32)
    return init_params(pkey, cfg), src, tgt


def make():
    """``(loss, (params, src, tgt))`` with the default shapes."""
    return loss, example_args()


def transformed(cfg: Config = SMALL, *, src_len: int = 48, tgt_len: int = 27, cp: int = 8,
                load_balance: str = "zigzag"):
    """``(loss, its context_parallel transform, (params, src, tgt))`` at these sizes."""
    from cptransform import context_parallel

    args = example_args(cfg, src_len=src_len, tgt_len=tgt_len)
    fn = lambda p, s, t: loss(p, s, t, cfg)  # noqa: E731
    return fn, context_parallel(fn, cp=cp, load_balance=load_balance), args


def check(cfg: Config = SMALL, *, verbose: bool = True, **sizes) -> float:
    """Transform ``loss`` with ``context_parallel`` (:func:`transformed`'s ``sizes``), print
    what it did, and return the worst relative error of the loss and every gradient against
    one device."""
    return worst_error(*transformed(cfg, **sizes), verbose=verbose)


def worst_error(fn, sharded, args, *, verbose: bool = True) -> float:
    """The worst relative error of ``sharded``'s loss and gradients against ``fn``'s."""
    cp = sharded.options.cp
    if verbose:
        print(sharded.explain(*args))
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(fn))(*args)
    cp_loss, cp_grads = jax.jit(jax.value_and_grad(sharded))(*args)
    errors = {"loss": abs(float(cp_loss) - float(ref_loss)) / abs(float(ref_loss))}
    for path, ref in jax.tree_util.tree_flatten_with_path(ref_grads)[0]:
        got = cp_grads[path[0].key]
        errors[path[0].key] = float(jnp.max(jnp.abs(got - ref)) / jnp.max(jnp.abs(ref)))
    worst = max(errors, key=errors.get)
    if verbose:
        print(f"\nloss: single device {float(ref_loss):.7f}, cp={cp} {float(cp_loss):.7f}")
        print(f"gradients: {len(errors) - 1} arrays; worst relative error {errors[worst]:.2e} "
              f"({worst})")
    return errors[worst]


def demo(**sizes) -> bool:
    """The example as a script runs it: :func:`check`, then whether every attention (each
    layer's self- and cross-attention) was sharded and every number matched."""
    import _check  # beside this file; the script's folder is on sys.path
    fn, sharded, args = transformed(**sizes)
    error = worst_error(fn, sharded, args)
    shards = _check.sharding(sharded, *args)
    print(f"{shards}\n{_check.verdict(shards, error <= _check.RTOL)}")
    return shards.ok and error <= _check.RTOL


if __name__ == "__main__":
    import _check  # beside this file; the script's folder is on sys.path
    sys.exit(_check.main(demo))
