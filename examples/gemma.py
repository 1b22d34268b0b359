"""A small Gemma-style decoder in plain JAX, its loss under ``context_parallel(cp=8)``.

Written the way Gemma writes it (``gemma/gm/nn/_modules.py``): layers alternate sliding-window
(local) and global causal attention; grouped-query attention reshapes the queries to
``[B, T, K, G, H]`` so the logits are ``[B, T, K, G, S]``, reshaped to ``[B, T, N, S]`` for
the soft-cap, the boolean ``[B, T, S]`` mask (filled with Gemma's ``K_MASK``) and the softmax,
and back for the value product; RMSNorm with a ``1 + scale`` weight, RoPE on ``[B, T]``
positions, a GeGLU MLP, embeddings scaled by ``sqrt(dim)`` and tied to the output, and a
soft-capped final logit. Nothing here knows about cptransform: the matcher recognises each
attention with its window, soft-cap and grouping, and the plan gives each layer a schedule —
the local layers a halo exchange with the neighbours, the global ones a schedule over the
whole sequence (``explain()`` prints each choice and why).

Run: ``python examples/gemma.py`` (8 simulated CPU devices; exits 1 on a mismatch).
"""
from __future__ import annotations

import math
import os
import sys

if __name__ == "__main__":  # the example simulates 8 devices; must precede the jax import
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=8")

from dataclasses import dataclass  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

#: Gemma's fill for masked logits.
K_MASK = -2.3819763e38


@dataclass(frozen=True)
class Config:
    """Model sizes; ``heads`` is a multiple of ``kv_heads`` (grouped-query attention).
    Layer ``i`` is local (sliding window of ``window`` tokens) when ``i`` is even."""

    vocab: int = 256
    dim: int = 64
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    mlp_dim: int = 128
    window: int = 8  # within one zigzag chunk at seq 128, cp 8: the halo schedule fits
    attn_softcap: float = 50.0
    final_softcap: float = 30.0
    rope_base: float = 10000.0

    def local(self, layer: int) -> bool:
        return layer % 2 == 0


def init_params(key, cfg: Config = Config()) -> dict:
    """Random parameters: one normal draw cut into tensors scaled by ``1/sqrt(fan_in)``
    (one random op compiles much faster on CPU than one per tensor); norm scales start at
    zero, Gemma's ``1 + scale`` making them the identity."""
    d, n, h = cfg.dim, cfg.layers, cfg.head_dim
    shapes = {  # name -> (shape, fan_in)
        "embed": ((cfg.vocab, d), d),
        "q": ((n, cfg.heads, d, h), d),
        "kv": ((n, 2, cfg.kv_heads, d, h), d),
        "out": ((n, cfg.heads, h, d), cfg.heads * h),
        "gating": ((n, 2, d, cfg.mlp_dim), d),
        "linear": ((n, cfg.mlp_dim, d), cfg.mlp_dim),
    }
    sizes = [math.prod(shape) for shape, _ in shapes.values()]
    flat = jax.random.normal(key, (sum(sizes),), jnp.float32)
    params, start = {}, 0
    for (name, (shape, fan_in)), size in zip(shapes.items(), sizes):
        params[name] = flat[start:start + size].reshape(shape) / math.sqrt(fan_in)
        start += size
    for name in ("pre_attn_norm", "post_attn_norm", "pre_mlp_norm", "post_mlp_norm"):
        params[name] = jnp.zeros((n, d), jnp.float32)
    params["final_norm"] = jnp.zeros((d,), jnp.float32)
    return params


def rms_norm(x, scale):
    """Gemma's RMSNorm: the weight is ``1 + scale``."""
    var = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    return x * jax.lax.rsqrt(var + 1e-6) * (1 + scale)


def apply_rope(x, positions, base: float):
    """RoPE of ``x [B, T, N, H]`` at ``positions [B, T]`` (Gemma's half-split spelling)."""
    half = x.shape[-1] // 2
    timescale = base ** (2 * jnp.arange(half, dtype=jnp.float32) / x.shape[-1])
    angle = positions[..., None, None] / timescale  # [B, T, 1, H/2]
    sin, cos = jnp.sin(angle), jnp.cos(angle)
    first, second = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


def sliding_mask(positions, window: int):
    """Gemma's local-attention mask ``|kv - q| < window`` on ``[B, T]`` positions."""
    kv, q = positions[..., None, :], positions[..., :, None]
    mask = kv > q - window
    mask *= kv < q + window
    return mask


def attention(x, positions, layer: dict, cfg: Config, local: bool):
    """Gemma's grouped-query attention of ``x [B, T, D]``; ``local``: sliding window."""
    q = jnp.einsum("BTD,NDH->BTNH", x, layer["q"])
    k, v = jnp.einsum("BSD,CKDH->CBSKH", x, layer["kv"])
    q = apply_rope(q, positions, cfg.rope_base) * cfg.head_dim ** -0.5
    k = apply_rope(k, positions, cfg.rope_base)

    b, t, n, h = q.shape
    kv_heads = cfg.kv_heads
    logits = jnp.einsum("BTKGH,BSKH->BTKGS", q.reshape(b, t, kv_heads, n // kv_heads, h), k)
    logits = logits.reshape(b, t, n, t)
    logits = jnp.tanh(logits / cfg.attn_softcap) * cfg.attn_softcap

    mask = positions[..., None, :] <= positions[..., :, None]  # causal, [B, T, S]
    if local:
        mask = mask * sliding_mask(positions, cfg.window)
    padded = jnp.where(mask[:, :, None, :], logits, K_MASK)
    probs = jax.nn.softmax(padded, axis=-1).reshape(b, t, kv_heads, n // kv_heads, t)
    encoded = jnp.einsum("BTKGS,BSKH->BTKGH", probs, v).reshape(b, t, n, h)
    return jnp.einsum("BTNH,NHD->BTD", encoded, layer["out"])


def mlp(x, layer: dict):
    """GeGLU feed-forward."""
    gate, up = jnp.einsum("BTD,CDF->CBTF", x, layer["gating"])
    return (jax.nn.gelu(gate) * up) @ layer["linear"]


def forward(params: dict, tokens, cfg: Config = Config()):
    """Logits ``[B, T, vocab]`` for integer ``tokens [B, T]``."""
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    x = params["embed"][tokens] * jnp.sqrt(jnp.float32(cfg.dim))
    for i in range(cfg.layers):
        layer = {name: w[i] for name, w in params.items() if name not in ("embed", "final_norm")}
        attn = attention(rms_norm(x, layer["pre_attn_norm"]), positions, layer, cfg, cfg.local(i))
        x = x + rms_norm(attn, layer["post_attn_norm"])
        x = x + rms_norm(mlp(rms_norm(x, layer["pre_mlp_norm"]), layer), layer["post_mlp_norm"])
    logits = rms_norm(x, params["final_norm"]) @ params["embed"].T
    return jnp.tanh(logits / cfg.final_softcap) * cfg.final_softcap


def loss(params: dict, tokens, cfg: Config = Config()):
    """Mean next-token cross-entropy: position ``t`` predicts ``tokens[:, t + 1]``."""
    logp = jax.nn.log_softmax(forward(params, tokens, cfg)[:, :-1], axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


def example_args(cfg: Config = Config(), *, batch: int = 2, seq: int = 128, seed: int = 0):
    """Random ``(params, tokens)`` for ``loss``."""
    pkey, tkey = jax.random.split(jax.random.key(seed))
    return init_params(pkey, cfg), jax.random.randint(tkey, (batch, seq), 0, cfg.vocab)


def make():
    """``(loss, (params, tokens))`` for ``cptransform plan examples/gemma.py:make --cp 8``."""
    return loss, example_args(seq=64)


def check(*, seq: int = 128, cp: int = 8, cfg: Config = Config(), verbose: bool = True) -> bool:
    """The example: report, then loss and every gradient against one device."""
    import _check  # beside this file; the script's folder is on sys.path
    from cptransform import context_parallel

    params, tokens = example_args(cfg, seq=seq)
    fn = lambda p, t: loss(p, t, cfg)  # noqa: E731
    sharded = context_parallel(fn, cp=cp)
    result = _check.compare_gradients(fn, sharded, params, tokens)
    if verbose:
        print(_check.report(sharded, params, tokens))
        print(f"\n{result}")
    return result.ok


if __name__ == "__main__":
    import _check  # beside this file; the script's folder is on sys.path
    sys.exit(_check.main(check))
