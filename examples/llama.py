"""A small Llama-style decoder in plain JAX: the program cptransform is meant to rewrite.

Nothing here knows about cptransform: attention is written by hand (einsum, a causal mask
from an iota comparison, ``jax.nn.softmax``, float32 logits), as models usually write it.
RMSNorm, RoPE from ``jnp.arange`` positions, grouped-query attention, a SwiGLU MLP, layers
stacked and run under ``lax.scan``, and a next-token cross-entropy loss.

Entry points: ``make()`` returns ``(loss, example_args)`` for ``cptransform opt
examples/llama.py:make``; ``loss(params, tokens)`` uses the default :class:`Config`.

Run as a script, it is the README demo: the same loss under ``@context_parallel(cp=8)`` on
8 simulated CPU devices, checked against the single-device run (loss and every gradient),
with the plan, the matches and per-device memory printed.
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
from jax import lax  # noqa: E402


@dataclass(frozen=True)
class Config:
    """Model sizes. ``heads`` must be a multiple of ``kv_heads`` (GQA)."""

    vocab: int = 256
    dim: int = 64
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    mlp_dim: int = 128
    rope_base: float = 10000.0
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads


SMALL = Config()


def init_params(key, cfg: Config = SMALL) -> dict:
    """Random parameters; per-layer weights are stacked on a leading ``layers`` axis.

    Weights are drawn as one normal vector and cut into tensors (one random op compiles
    much faster on CPU than one per tensor), each scaled by ``1/sqrt(fan_in)``.
    """
    d, hd, n = cfg.dim, cfg.head_dim, cfg.layers
    shapes = {  # name -> (shape, fan_in)
        "embed": ((cfg.vocab, d), 2500.0),  # std 0.02
        "wq": ((n, d, cfg.heads, hd), d),
        "wk": ((n, d, cfg.kv_heads, hd), d),
        "wv": ((n, d, cfg.kv_heads, hd), d),
        "wo": ((n, cfg.heads, hd, d), d),
        "w_gate": ((n, d, cfg.mlp_dim), d),
        "w_up": ((n, d, cfg.mlp_dim), d),
        "w_down": ((n, cfg.mlp_dim, d), cfg.mlp_dim),
        "unembed": ((d, cfg.vocab), d),
    }
    sizes = [math.prod(shape) for shape, _ in shapes.values()]
    flat = jax.random.normal(key, (sum(sizes),), jnp.float32)
    weights, start = {}, 0
    for (name, (shape, fan_in)), size in zip(shapes.items(), sizes):
        weights[name] = flat[start:start + size].reshape(shape) / math.sqrt(fan_in)
        start += size
    layers = {name: weights[name] for name in
              ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")}
    layers["attn_norm"] = jnp.ones((n, d), jnp.float32)
    layers["mlp_norm"] = jnp.ones((n, d), jnp.float32)
    return {"embed": weights["embed"], "layers": layers,
            "final_norm": jnp.ones((d,), jnp.float32), "unembed": weights["unembed"]}


def rms_norm(x, weight, eps: float):
    """RMSNorm in float32."""
    x32 = x.astype(jnp.float32)
    scale = lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * scale).astype(x.dtype) * weight


def rope(x, positions, base: float):
    """Rotary embedding of ``x [batch, seq, heads, head_dim]`` at ``positions [seq]``."""
    half = x.shape[-1] // 2
    freqs = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions.astype(jnp.float32)[:, None] * freqs[None, :]
    cos = jnp.cos(angles)[None, :, None, :]
    sin = jnp.sin(angles)[None, :, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def attention(x, layer: dict, cfg: Config):
    """Causal grouped-query self-attention, written out by hand."""
    b, s, _ = x.shape
    positions = jnp.arange(s)
    q = rope(jnp.einsum("bsd,dhk->bshk", x, layer["wq"]), positions, cfg.rope_base)
    k = rope(jnp.einsum("bsd,dhk->bshk", x, layer["wk"]), positions, cfg.rope_base)
    v = jnp.einsum("bsd,dhk->bshk", x, layer["wv"])
    groups = cfg.heads // cfg.kv_heads
    q = q.reshape(b, s, cfg.kv_heads, groups, cfg.head_dim)
    logits = jnp.einsum("bqhgd,bkhd->bhgqk", q, k).astype(jnp.float32)
    logits = logits / jnp.sqrt(jnp.float32(cfg.head_dim))
    causal = positions[:, None] >= positions[None, :]
    logits = jnp.where(causal, logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", probs, v).reshape(b, s, cfg.heads, cfg.head_dim)
    return jnp.einsum("bshk,hkd->bsd", out, layer["wo"])


def mlp(x, layer: dict):
    """SwiGLU feed-forward."""
    gate = jax.nn.silu(x @ layer["w_gate"])
    return (gate * (x @ layer["w_up"])) @ layer["w_down"]


def block(x, layer: dict, cfg: Config):
    """One pre-norm decoder layer."""
    x = x + attention(rms_norm(x, layer["attn_norm"], cfg.norm_eps), layer, cfg)
    return x + mlp(rms_norm(x, layer["mlp_norm"], cfg.norm_eps), layer)


def forward(params: dict, tokens, cfg: Config = SMALL):
    """Logits ``[batch, seq, vocab]`` (float32) for integer ``tokens [batch, seq]``."""
    x = params["embed"][tokens]

    def step(h, layer):
        return block(h, layer, cfg), None

    x, _ = lax.scan(step, x, params["layers"])
    x = rms_norm(x, params["final_norm"], cfg.norm_eps)
    return (x @ params["unembed"]).astype(jnp.float32)


def loss(params: dict, tokens, cfg: Config = SMALL):
    """Mean next-token cross-entropy: position ``t`` predicts ``tokens[:, t + 1]``."""
    logits = forward(params, tokens, cfg)[:, :-1]
    labels = tokens[:, 1:]
    logp = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
    return -jnp.mean(picked)


def example_args(cfg: Config = SMALL, *, batch: int = 2, seq: int = 64, seed: int = 0):
    """Random ``(params, tokens)`` for ``loss``."""
    pkey, tkey = jax.random.split(jax.random.key(seed))
    tokens = jax.random.randint(tkey, (batch, seq), 0, cfg.vocab, dtype=jnp.int32)
    return init_params(pkey, cfg), tokens


def make():
    """``(loss, (params, tokens))`` with small shapes: batch 2, seq 64, 4 layers."""
    return loss, example_args()


def demo(seq: int = 256, cp: int = 8) -> bool:
    """The README demo; returns whether every number matched (each program is compiled
    once; its temporary memory per device is printed with the numbers)."""
    import _check  # beside this file; the script's folder is on sys.path
    from cptransform import context_parallel

    cfg = Config(heads=8, kv_heads=2)
    params, tokens = example_args(cfg, batch=2, seq=seq)
    fn = lambda p, t: loss(p, t, cfg)  # noqa: E731
    sharded = context_parallel(fn, cp=cp)
    print(_check.report(sharded, params, tokens))
    result = _check.compare_gradients(fn, sharded, params, tokens)
    print(result)
    return result.ok


if __name__ == "__main__":
    import _check  # beside this file; the script's folder is on sys.path
    sys.exit(_check.main(demo))
