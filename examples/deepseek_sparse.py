"""A small DeepSeek-V3.2-style decoder with sparse attention, in plain JAX.

DeepSeek Sparse Attention: a *lightning indexer* scores every key for every query from its
own small projections (``sum_h w_h(x_q) · relu(q_h · k)`` over a few indexer heads, one
key vector shared by them, causal), keeps the ``top_k`` keys per query, and the main
attention only sees those: the indices are scattered into a boolean mask
(``zeros.at[b, q, idx].set(True)``, as ``index_mask.scatter_`` does in DeepSeek's
inference code) and-ed with the causal mask. The indexer is trained by an auxiliary loss:
the KL divergence from the main attention's distribution (summed over heads and
normalised, held constant) to the indexer's softmax, as in the paper's dense warm-up.
Nothing here knows about cptransform.

RMSNorm, RoPE from ``jnp.arange`` positions (on the main and the indexer queries/keys), a
SwiGLU MLP, layers stacked under ``lax.scan`` and a next-token cross-entropy loss.

Entry points: ``make()`` returns ``(loss, example_args)`` for ``cptransform opt
examples/deepseek_sparse.py:make``; run as a script, the same loss under
``@context_parallel(cp=8)`` on 8 simulated CPU devices is checked against the
single-device run (loss and every gradient), with the plan and the matches printed: the
scatter becomes ``topk_indices`` on ``attention_p`` (no S×S mask operand), and the
indexer runs sequence-sharded like every other op.
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
    """Model sizes; ``top_k`` keys per query (more than a query's causal keys is fine:
    the causal mask hides what top-k picks among ``-inf`` scores)."""

    vocab: int = 256
    dim: int = 64
    layers: int = 2
    heads: int = 8
    head_dim: int = 8
    index_heads: int = 4
    index_dim: int = 16
    top_k: int = 16
    mlp_dim: int = 128
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    aux_weight: float = 0.01


SMALL = Config()


def init_params(key, cfg: Config = SMALL) -> dict:
    """Random parameters, per-layer weights stacked on a leading ``layers`` axis (one normal
    draw cut into tensors, each scaled by ``1/sqrt(fan_in)``)."""
    d, n = cfg.dim, cfg.layers
    shapes = {  # name -> (shape, fan_in)
        "embed": ((cfg.vocab, d), 2500.0),
        "wq": ((n, d, cfg.heads, cfg.head_dim), d),
        "wk": ((n, d, cfg.heads, cfg.head_dim), d),
        "wv": ((n, d, cfg.heads, cfg.head_dim), d),
        "wo": ((n, cfg.heads, cfg.head_dim, d), cfg.heads * cfg.head_dim),
        "index_wq": ((n, d, cfg.index_heads, cfg.index_dim), d),
        "index_wk": ((n, d, cfg.index_dim), d),
        "index_w": ((n, d, cfg.index_heads), d),
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
    layers = {name: weights[name] for name in shapes if name not in ("embed", "unembed")}
    layers["attn_norm"] = jnp.ones((n, d), jnp.float32)
    layers["mlp_norm"] = jnp.ones((n, d), jnp.float32)
    return {"embed": weights["embed"], "layers": layers,
            "final_norm": jnp.ones((d,), jnp.float32), "unembed": weights["unembed"]}


def rms_norm(x, weight, eps: float):
    """RMSNorm in float32."""
    x32 = x.astype(jnp.float32)
    return (x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)) * weight


def rope(x, positions, base: float):
    """Rotary embedding of ``x [batch, seq, (heads,) dim]`` at ``positions [seq]``."""
    half = x.shape[-1] // 2
    freqs = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions.astype(jnp.float32)[:, None] * freqs[None, :]
    if x.ndim == 4:
        angles = angles[:, None, :]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def indexer_scores(x, layer: dict, cfg: Config, positions):
    """The lightning indexer's causal scores ``[batch, q, kv]`` (``-inf`` above the
    diagonal) and the causal mask."""
    q = rope(jnp.einsum("bsd,dhk->bshk", x, layer["index_wq"]), positions, cfg.rope_base)
    k = rope(x @ layer["index_wk"], positions, cfg.rope_base)
    w = (x @ layer["index_w"]) * cfg.index_heads ** -0.5
    scores = jnp.einsum("bshk,btk->bsht", q, k) * cfg.index_dim ** -0.5
    # max(·, 0) is ReLU; ``jax.nn.relu`` is a custom_jvp, which zigzag must run in natural
    # token order (an un-permute of the scores), while a max stays sequence-sharded.
    scores = jnp.sum(jnp.maximum(scores, 0.0) * w[..., None], axis=2)
    causal = positions[:, None] >= positions[None, :]
    return jnp.where(causal, scores, -jnp.inf), causal


def attention(x, layer: dict, cfg: Config):
    """Sparse causal attention over the indexer's top-k keys, and the indexer's loss."""
    b, s, _ = x.shape
    positions = jnp.arange(s)
    scores, causal = indexer_scores(x, layer, cfg, positions)
    _, idx = lax.top_k(scores, cfg.top_k)
    selected = jnp.zeros((b, s, s), bool).at[
        jnp.arange(b)[:, None, None], positions[None, :, None], idx].set(True)
    q = rope(jnp.einsum("bsd,dhk->bshk", x, layer["wq"]), positions, cfg.rope_base)
    k = rope(jnp.einsum("bsd,dhk->bshk", x, layer["wk"]), positions, cfg.rope_base)
    v = jnp.einsum("bsd,dhk->bshk", x, layer["wv"])
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(jnp.float32(cfg.head_dim))
    visible = (selected & causal)[:, None]
    probs = jax.nn.softmax(jnp.where(visible, logits, -jnp.inf), axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, v)
    # The indexer learns the main attention's distribution (dense, held constant).
    dense = jax.nn.softmax(jnp.where(causal, lax.stop_gradient(logits), -jnp.inf), axis=-1)
    target = jnp.sum(dense, axis=1) / cfg.heads
    log_p = jax.nn.log_softmax(scores, axis=-1)
    kl = jnp.sum(jnp.where(causal, target * (jnp.log(jnp.where(causal, target, 1.0)) - log_p),
                           0.0), axis=-1)
    return jnp.einsum("bshk,hkd->bsd", out, layer["wo"]), jnp.mean(kl)


def mlp(x, layer: dict):
    """SwiGLU feed-forward."""
    return (jax.nn.silu(x @ layer["w_gate"]) * (x @ layer["w_up"])) @ layer["w_down"]


def loss(params: dict, tokens, cfg: Config = SMALL):
    """Mean next-token cross-entropy plus ``aux_weight`` times the indexers' KL."""
    x = params["embed"][tokens]

    def step(h, layer):
        attn, aux = attention(rms_norm(h, layer["attn_norm"], cfg.norm_eps), layer, cfg)
        h = h + attn
        return h + mlp(rms_norm(h, layer["mlp_norm"], cfg.norm_eps), layer), aux

    x, aux = lax.scan(step, x, params["layers"])
    logits = (rms_norm(x, params["final_norm"], cfg.norm_eps) @ params["unembed"])[:, :-1]
    logp = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    return -jnp.mean(picked) + cfg.aux_weight * jnp.sum(aux)


def example_args(cfg: Config = SMALL, *, batch: int = 2, seq: int = 64, seed: int = 0):
    """Random ``(params, tokens)`` for ``loss``."""
    pkey, tkey = jax.random.split(jax.random.key(seed))
    tokens = jax.random.randint(tkey, (batch, seq), 0, cfg.vocab, dtype=jnp.int32)
    return init_params(pkey, cfg), tokens


def make():
    """``(loss, (params, tokens))`` with small shapes: batch 2, seq 64, 2 layers."""
    return loss, example_args()


def demo(seq: int = 64, cp: int = 8, batch: int = 2, **options) -> bool:
    """Transform, explain and check against one device; returns whether every number
    matched (loss and every gradient to 1e-5 relative) and every attention was sharded.
    ``options`` go to ``context_parallel`` (e.g. ``schedule="ring"``,
    ``load_balance="zigzag"``)."""
    import _check  # beside this file; the script's folder is on sys.path
    from cptransform import context_parallel

    params, tokens = example_args(batch=batch, seq=seq)
    sharded = context_parallel(loss, cp=cp, **options)
    print(sharded.explain(params, tokens))

    ref_loss, ref_grads = jax.jit(jax.value_and_grad(loss))(params, tokens)
    cp_loss, cp_grads = jax.jit(jax.value_and_grad(sharded))(params, tokens)
    print(f"\nloss: single device {float(ref_loss):.7f}, cp={cp} {float(cp_loss):.7f}")
    errors = {jax.tree_util.keystr(path): float(jnp.max(jnp.abs(got - ref)) /
                                                jnp.max(jnp.abs(ref)))
              for (path, ref), got in zip(jax.tree_util.tree_leaves_with_path(ref_grads),
                                          jax.tree_util.tree_leaves(cp_grads))}
    worst = max(errors, key=errors.get)
    print(f"gradients: {len(errors)} arrays (indexer's included), worst relative error "
          f"{errors[worst]:.2e} ({worst})")
    ok = abs(float(cp_loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss)) \
        and errors[worst] <= 1e-5
    shards = _check.sharding(sharded, params, tokens)
    print(f"{shards}\n{_check.verdict(shards, ok)}")
    return ok and shards.ok


if __name__ == "__main__":
    import _check  # beside this file; the script's folder is on sys.path
    sys.exit(_check.main(demo))
