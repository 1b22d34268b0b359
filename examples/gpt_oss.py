"""A small gpt-oss-style decoder in plain JAX: attention sinks, GQA, alternating windows.

Nothing here knows about cptransform. The attention is written the way gpt-oss writes it
(``gpt_oss/torch/model.py``, ``sdpa``): a learned logit per query head (the *sink*) is
concatenated as one extra column after the masked logits, the softmax runs over keys and
sink, and the sink's column is sliced away before the value product. Layers alternate
between a sliding window (``window`` keys back) and full causal attention, as gpt-oss's do;
masked logits are ``-inf``. RMSNorm, RoPE from ``jnp.arange`` positions, grouped-query
attention, a SwiGLU MLP (dense: gpt-oss's mixture of experts is left out, it is token-wise
and adds nothing to context parallelism), layer pairs under ``lax.scan``, next-token loss.

Entry points: ``make()`` returns ``(loss, example_args)`` for ``cptransform opt
examples/gpt_oss.py:make``; ``loss(params, tokens)`` uses the default :class:`Config`.

Run as a script (``python examples/gpt_oss.py [--seq N] [--cp N] [--schedule S]``), it
transforms the loss with ``@context_parallel(cp=8)`` on 8 simulated CPU devices, prints
what the transform did (matches, schedule per layer, bytes per device) and checks the loss
and every gradient (the sinks' included) against the single-device run.
"""
from __future__ import annotations

import argparse
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
    """Model sizes. ``heads`` must be a multiple of ``kv_heads``; ``layers`` is even (pairs
    of a sliding-window layer and a full causal layer); ``window``: keys a sliding layer
    sees before the query (gpt-oss: 128)."""

    vocab: int = 256
    dim: int = 64
    layers: int = 4
    heads: int = 8
    kv_heads: int = 2
    mlp_dim: int = 128
    window: int = 16
    rope_base: float = 150000.0
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads


SMALL = Config()
#: The sinks' path in the parameters (``jax.tree_util.keystr``).
SINKS = "['layers']['sinks']"


def init_params(key, cfg: Config = SMALL) -> dict:
    """Random parameters; per-layer weights are stacked on a leading ``layers`` axis. One
    normal draw cut into tensors (faster to compile on CPU), scaled by ``1/sqrt(fan_in)``;
    the sinks are drawn around 0, like trained gpt-oss sinks (a few units either side)."""
    d, hd, n = cfg.dim, cfg.head_dim, cfg.layers
    shapes = {  # name -> (shape, fan_in)
        "embed": ((cfg.vocab, d), 2500.0),  # std 0.02
        "wq": ((n, d, cfg.heads, hd), d),
        "wk": ((n, d, cfg.kv_heads, hd), d),
        "wv": ((n, d, cfg.kv_heads, hd), d),
        "wo": ((n, cfg.heads, hd, d), d),
        "sinks": ((n, cfg.heads), 1.0),
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
              ("wq", "wk", "wv", "wo", "sinks", "w_gate", "w_up", "w_down")}
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


def attention(x, layer: dict, cfg: Config, window: int | None):
    """gpt-oss attention: GQA, causal (and ``window`` keys back when given), sinks."""
    b, s, _ = x.shape
    positions = jnp.arange(s)
    q = rope(jnp.einsum("bsd,dhk->bshk", x, layer["wq"]), positions, cfg.rope_base)
    k = rope(jnp.einsum("bsd,dhk->bshk", x, layer["wk"]), positions, cfg.rope_base)
    v = jnp.einsum("bsd,dhk->bshk", x, layer["wv"])
    groups = cfg.heads // cfg.kv_heads
    q = q.reshape(b, s, cfg.kv_heads, groups, cfg.head_dim)
    logits = jnp.einsum("bqhgd,bkhd->bhgqk", q, k) * cfg.head_dim ** -0.5
    visible = positions[None, :] <= positions[:, None]
    if window is not None:
        visible &= positions[None, :] >= positions[:, None] - window
    logits = jnp.where(visible, logits, -jnp.inf)
    sinks = layer["sinks"].reshape(cfg.kv_heads, groups, 1, 1)
    sinks = jnp.broadcast_to(sinks, (b, cfg.kv_heads, groups, s, 1))
    weights = jax.nn.softmax(jnp.concatenate([logits, sinks], axis=-1), axis=-1)[..., :-1]
    out = jnp.einsum("bhgqk,bkhd->bqhgd", weights, v).reshape(b, s, cfg.heads, cfg.head_dim)
    return jnp.einsum("bshk,hkd->bsd", out, layer["wo"])


def mlp(x, layer: dict):
    """SwiGLU feed-forward."""
    gate = jax.nn.silu(x @ layer["w_gate"])
    return (gate * (x @ layer["w_up"])) @ layer["w_down"]


def block(x, layer: dict, cfg: Config, window: int | None):
    """One pre-norm decoder layer."""
    x = x + attention(rms_norm(x, layer["attn_norm"], cfg.norm_eps), layer, cfg, window)
    return x + mlp(rms_norm(x, layer["mlp_norm"], cfg.norm_eps), layer)


def forward(params: dict, tokens, cfg: Config = SMALL):
    """Logits ``[batch, seq, vocab]`` (float32) for integer ``tokens [batch, seq]``."""
    x = params["embed"][tokens]
    pairs = jax.tree.map(lambda w: w.reshape((cfg.layers // 2, 2) + w.shape[1:]),
                         params["layers"])

    def step(h, pair):
        first, second = (jax.tree.map(lambda w: w[i], pair) for i in (0, 1))
        h = block(h, first, cfg, cfg.window)
        return block(h, second, cfg, None), None

    x, _ = lax.scan(step, x, pairs)
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


def demo(seq: int = 128, cp: int = 8, schedule: str = "auto", cfg: Config = SMALL,
         batch: int = 2) -> bool:
    """Transform, explain and check; returns whether every attention was sharded and the
    loss and every gradient match the single-device run (relative error ≤ 1e-5)."""
    import _check  # beside this file; the script's folder is on sys.path
    from cptransform import context_parallel

    params, tokens = example_args(cfg, batch=batch, seq=seq)
    fn = lambda p, t: loss(p, t, cfg)  # noqa: E731
    sharded = context_parallel(fn, cp=cp, schedule=schedule)
    print(sharded.explain(params, tokens, verbose=True))

    ref_loss, ref_grads = jax.jit(jax.value_and_grad(fn))(params, tokens)
    cp_loss, cp_grads = jax.jit(jax.value_and_grad(sharded))(params, tokens)
    print(f"\nloss: single device {float(ref_loss):.7f}, cp={cp} {float(cp_loss):.7f}")
    errors = {jax.tree_util.keystr(path): float(jnp.max(jnp.abs(got - ref)) /
                                                jnp.max(jnp.abs(ref)))
              for (path, ref), got in zip(jax.tree_util.tree_leaves_with_path(ref_grads),
                                          jax.tree_util.tree_leaves(cp_grads))}
    worst = max(errors.values())
    print(f"gradients: {len(errors)} arrays, worst relative error {worst:.2e} "
          f"(sinks {errors[SINKS]:.2e})")
    ok = abs(float(cp_loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss)) and worst <= 1e-5
    shards = _check.sharding(sharded, params, tokens)
    print(f"{shards}\n{_check.verdict(shards, ok)}")
    return ok and shards.ok


def main(argv=None) -> int:
    from cptransform.api.options import OPTIONS

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--cp", type=int, default=8, help="context-parallel devices")
    parser.add_argument("--schedule", default=OPTIONS["schedule"].default,
                        help=f"one of {', '.join(OPTIONS['schedule'].choices())}")
    args = parser.parse_args(argv)
    import _check  # beside this file; the script's folder is on sys.path
    return _check.main(lambda: demo(args.seq, args.cp, args.schedule))


if __name__ == "__main__":
    sys.exit(main())
