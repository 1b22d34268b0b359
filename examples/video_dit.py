"""A small video diffusion transformer (DiT) in plain JAX, under ``@context_parallel(cp=8)``.

The model denoises a video latent ``[batch, frames, height, width, channels]``: it cuts each
frame into ``patch × patch`` patches and flattens frames × rows × columns into one sequence
of ``T·(H/p)·(W/p)`` tokens (patchify), embeds them, rotates queries and keys by a 3-D RoPE
(a third of each head's frequencies per axis: frame, row, column, positions from
``jnp.meshgrid`` of ``jnp.arange``s), and runs full (non-causal) self-attention blocks
modulated by the diffusion timestep (adaLN-zero: shift, scale and a gate per block from an
MLP of the timestep embedding; the gate's weights start at zero in training, small random
numbers here so that every path carries a gradient). The output is un-patchified back to
the latent's shape, and the loss is the usual noise-prediction MSE.

Nothing here knows about cptransform. The transform finds the sequence in the latent: its
frames, rows and columns merged, rows and columns in patches (``explain()`` prints
``dims (1, 2, 3) merged in patches of 1x2x2, sharded on dim 1``: each device gets whole
frames), and every attention is rewritten into the planned schedule (Ulysses and ring are
what DiT trainers use; ``schedule=`` picks one, the default ``auto`` predicts).

Run: ``python examples/video_dit.py [auto|ring|ulysses]`` (8 simulated CPU devices; prints
the plan, then the loss and every gradient against one device; exits 1 unless every
attention was sharded and the numbers match).
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
from jax import lax  # noqa: E402


@dataclass(frozen=True)
class Config:
    """Model and latent sizes: ``height`` and ``width`` are multiples of ``patch``;
    ``head_dim`` is a multiple of 6 (three RoPE axes, pairs of halves)."""

    frames: int = 8
    height: int = 16
    width: int = 16
    channels: int = 4
    patch: int = 2
    dim: int = 96
    heads: int = 8
    layers: int = 2
    mlp_dim: int = 192

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    @property
    def grid(self) -> tuple[int, int, int]:
        """Tokens along frames, rows and columns."""
        return self.frames, self.height // self.patch, self.width // self.patch


SMALL = Config()


def init_params(key, cfg: Config = SMALL) -> dict:
    """Random weights, each scaled by ``1/sqrt(fan_in)`` (the adaLN gates by 0.02)."""
    d, n, pp = cfg.dim, cfg.layers, cfg.patch * cfg.patch * cfg.channels
    shapes = {"embed": ((pp, d), pp), "t1": ((d, d), d), "t2": ((d, d), d),
              "wq": ((n, d, d), d), "wk": ((n, d, d), d), "wv": ((n, d, d), d),
              "wo": ((n, d, d), d), "w1": ((n, d, cfg.mlp_dim), d),
              "w2": ((n, cfg.mlp_dim, d), cfg.mlp_dim), "ada": ((n, d, 6 * d), 2500.0),
              "final": ((d, pp), d)}
    keys = jax.random.split(key, len(shapes))
    params = {name: jax.random.normal(k, shape, jnp.float32) / math.sqrt(fan_in)
              for k, (name, (shape, fan_in)) in zip(keys, shapes.items())}
    layer_names = ("wq", "wk", "wv", "wo", "w1", "w2", "ada")
    return {"layers": {name: params.pop(name) for name in layer_names}, **params}


def patchify(x, p: int):
    """``[B, T, H, W, C] -> [B, T·(H/p)·(W/p), p·p·C]``: frames, rows, columns of patches."""
    b, t, h, w, c = x.shape
    x = x.reshape(b, t, h // p, p, w // p, p, c).transpose(0, 1, 2, 4, 3, 5, 6)
    return x.reshape(b, t * (h // p) * (w // p), p * p * c)


def unpatchify(y, cfg: Config):
    """The inverse of :func:`patchify`."""
    t, hh, ww = cfg.grid
    p, c = cfg.patch, cfg.channels
    y = y.reshape(y.shape[0], t, hh, ww, p, p, c).transpose(0, 1, 2, 4, 3, 5, 6)
    return y.reshape(y.shape[0], t, hh * p, ww * p, c)


def rope_3d(x, cfg: Config, base: float = 10000.0):
    """3-D rotary embedding of ``x [B, S, heads, head_dim]``: a third of the frequencies
    rotate by the frame, a third by the row, a third by the column of each token."""
    third = cfg.head_dim // 6
    inv = base ** (-jnp.arange(third, dtype=jnp.float32) / third)
    grid = jnp.meshgrid(*(jnp.arange(n) for n in cfg.grid), indexing="ij")
    angles = jnp.concatenate([g.astype(jnp.float32)[..., None] * inv for g in grid], -1)
    angles = angles.reshape(-1, 3 * third)[None, :, None, :]     # [1, S, 1, head_dim/2]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    x1, x2 = x[..., :3 * third], x[..., 3 * third:]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)


def layer_norm(x, eps: float = 1e-6):
    """LayerNorm without affine parameters (adaLN supplies shift and scale)."""
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * lax.rsqrt(var + eps)


def attention(x, layer: dict, cfg: Config):
    """Full multi-head self-attention over all tokens, written out by hand."""
    b, s, _ = x.shape
    q, k, v = ((x @ layer[w]).reshape(b, s, cfg.heads, cfg.head_dim) for w in ("wq", "wk", "wv"))
    q, k = rope_3d(q, cfg), rope_3d(k, cfg)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(cfg.head_dim)
    out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), v)
    return out.reshape(b, s, cfg.dim) @ layer["wo"]


def block(x, cond, layer: dict, cfg: Config):
    """A DiT block: adaLN-zero modulated attention and MLP, each gated."""
    shift1, scale1, gate1, shift2, scale2, gate2 = jnp.split(cond @ layer["ada"], 6, -1)
    h = layer_norm(x) * (1 + scale1[:, None]) + shift1[:, None]
    x = x + gate1[:, None] * attention(h, layer, cfg)
    h = layer_norm(x) * (1 + scale2[:, None]) + shift2[:, None]
    return x + gate2[:, None] * (jax.nn.gelu(h @ layer["w1"]) @ layer["w2"])


def timestep_embedding(t, dim: int):
    """Sinusoidal embedding of the diffusion times ``t [B]``."""
    freqs = jnp.exp(-math.log(10000.0) * jnp.arange(dim // 2) / (dim // 2))
    return jnp.concatenate([jnp.sin(t[:, None] * freqs), jnp.cos(t[:, None] * freqs)], -1)


def loss(params: dict, latent, noise, t, cfg: Config = SMALL):
    """Noise-prediction MSE at diffusion times ``t [B]`` (in ``(0, 1)``) for clean latents
    ``latent`` and their ``noise`` (both ``[B, T, H, W, C]``)."""
    alpha = jnp.cos(t * math.pi / 2)[:, None, None, None, None]
    noisy = alpha * latent + jnp.sqrt(1 - alpha ** 2) * noise
    x = patchify(noisy, cfg.patch) @ params["embed"]
    cond = jax.nn.silu(timestep_embedding(t, cfg.dim) @ params["t1"]) @ params["t2"]
    for i in range(cfg.layers):
        x = block(x, cond, jax.tree_util.tree_map(lambda w: w[i], params["layers"]), cfg)
    predicted = unpatchify(layer_norm(x) @ params["final"], cfg)
    return jnp.mean((predicted - noise) ** 2)


def example_args(cfg: Config = SMALL, *, batch: int = 2, seed: int = 0):
    """Random ``(params, latent, noise, t)`` for :func:`loss`."""
    keys = jax.random.split(jax.random.key(seed), 4)
    shape = (batch, cfg.frames, cfg.height, cfg.width, cfg.channels)
    return (init_params(keys[0], cfg), jax.random.normal(keys[1], shape, jnp.float32),
            jax.random.normal(keys[2], shape, jnp.float32),
            jax.random.uniform(keys[3], (batch,), jnp.float32, 0.05, 0.95))


def make():
    """``(loss, args)`` with small shapes, for ``cptransform opt examples/video_dit.py:make``."""
    return loss, example_args()


def check(cfg: Config = SMALL, *, cp: int = 8, schedule: str = "auto",
          verbose: bool = True) -> bool:
    """The example: the plan, then loss and every gradient against one device; True when
    every attention was sharded and the numbers match."""
    import _check  # beside this file; the script's folder is on sys.path
    from cptransform import context_parallel

    fn = lambda p, x, n, t: loss(p, x, n, t, cfg)  # noqa: E731
    args = example_args(cfg)
    sharded = context_parallel(fn, cp=cp, schedule=schedule)
    if verbose:
        print(_check.report(sharded, *args))
    result = _check.compare_gradients(fn, sharded, *args)
    print(result)
    return result.ok


if __name__ == "__main__":
    import _check  # beside this file; the script's folder is on sys.path
    sys.exit(_check.main(lambda: check(schedule=sys.argv[1] if len(sys.argv) > 1 else "auto")))
