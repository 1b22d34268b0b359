"""Packed documents: several documents of different lengths in one sequence, under
``context_parallel(cp=8, load_balance="zigzag")``.

The data pipeline packs documents end to end into rows of ``seq`` tokens, as MaxText and
Megatron do, and hands the model two more ``[batch, seq]`` arrays: the segment id of each
token (1, 2, ... per document; 0 for the padding after the last one) and its position within
its document (RoPE restarts at 0 in each). The model is the Llama decoder of ``llama.py``
with attention causal *within* each document (a segment-equality mask and'ed with the
causal one) and a loss that skips the last token of each document and the padding.

Under zigzag each device holds two chunks of every row (the ring schedule is asked for, so
the block chart applies step by step); the inputs (tokens, segment ids,
positions) are permuted together and attention masks by the segment ids and positions that
travel with the keys. How much work each device does depends on where the documents end,
so ``explain()`` cannot say it from the program; the example draws the ring for this batch
(``ring_chart`` with the segment ids: which blocks the kernel skips) and counts the visible
(query, key) pairs per device under zigzag and under contiguous shards.

Run: ``python examples/packed_documents.py`` (8 simulated CPU devices; exits 1 on a mismatch).
"""
from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # the example simulates 8 devices; must precede the jax import
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

from llama import Config, init_params, mlp, rms_norm  # noqa: E402  (beside this file)

CFG = Config(heads=4, kv_heads=2, layers=2)


def rope(x, positions, base: float):
    """Rotary embedding of ``x [batch, seq, heads, head_dim]`` at ``positions [batch, seq]``
    (positions within each document)."""
    half = x.shape[-1] // 2
    freqs = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions.astype(jnp.float32)[:, :, None, None] * freqs
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def attention(x, segment_ids, positions, layer: dict, cfg: Config):
    """Grouped-query self-attention, causal within each document."""
    b, s, _ = x.shape
    q = rope(jnp.einsum("bsd,dhk->bshk", x, layer["wq"]), positions, cfg.rope_base)
    k = rope(jnp.einsum("bsd,dhk->bshk", x, layer["wk"]), positions, cfg.rope_base)
    v = jnp.einsum("bsd,dhk->bshk", x, layer["wv"])
    groups = cfg.heads // cfg.kv_heads
    q = q.reshape(b, s, cfg.kv_heads, groups, cfg.head_dim)
    logits = jnp.einsum("bqhgd,bkhd->bhgqk", q, k) / jnp.sqrt(jnp.float32(cfg.head_dim))
    token = jnp.arange(s)
    causal = token[:, None] >= token[None, :]
    same_doc = segment_ids[:, :, None] == segment_ids[:, None, :]  # [b, q, k]
    visible = (same_doc & causal)[:, None, None]
    probs = jax.nn.softmax(jnp.where(visible, logits, -1e30), axis=-1)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", probs, v).reshape(b, s, cfg.heads, cfg.head_dim)
    return jnp.einsum("bshk,hkd->bsd", out, layer["wo"])


def loss(params: dict, tokens, segment_ids, positions, cfg: Config = CFG):
    """Next-token cross-entropy over the tokens whose successor is in the same document."""
    def step(h, layer):
        h = h + attention(rms_norm(h, layer["attn_norm"], cfg.norm_eps), segment_ids, positions,
                          layer, cfg)
        return h + mlp(rms_norm(h, layer["mlp_norm"], cfg.norm_eps), layer), None

    x, _ = lax.scan(step, params["embed"][tokens], params["layers"])
    logits = rms_norm(x, params["final_norm"], cfg.norm_eps) @ params["unembed"]
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    picked = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    keep = (segment_ids[:, 1:] == segment_ids[:, :-1]) & (segment_ids[:, 1:] > 0)
    return -jnp.sum(jnp.where(keep, picked, 0.0)) / jnp.sum(keep)


def pack(batch: int, seq: int, *, documents: int = 4, seed: int = 0):
    """Segment ids and in-document positions ``[batch, seq]`` (numpy int32) for rows of
    ``documents`` documents of random lengths followed by padding (segment 0)."""
    rng = np.random.default_rng(seed)
    segment_ids = np.zeros((batch, seq), np.int32)
    positions = np.zeros((batch, seq), np.int32)
    for row in range(batch):
        used = int(seq * rng.uniform(0.8, 0.95))  # the rest is padding
        cuts = np.sort(rng.choice(np.arange(1, used), documents - 1, replace=False))
        bounds = [0, *cuts, used]
        for doc, (start, end) in enumerate(zip(bounds[:-1], bounds[1:]), start=1):
            segment_ids[row, start:end] = doc
            positions[row, start:end] = np.arange(end - start)
        positions[row, used:] = np.arange(seq - used)
    return segment_ids, positions


def example_args(cfg: Config = CFG, *, batch: int = 2, seq: int = 128, seed: int = 0):
    """Random ``(params, tokens, segment_ids, positions)`` for ``loss``."""
    pkey, tkey = jax.random.split(jax.random.key(seed))
    tokens = jax.random.randint(tkey, (batch, seq), 0, cfg.vocab, dtype=jnp.int32)
    segment_ids, positions = pack(batch, seq, seed=seed)
    return init_params(pkey, cfg), tokens, jnp.asarray(segment_ids), jnp.asarray(positions)


def check(*, seq: int = 128, cp: int = 8, verbose: bool = True) -> bool:
    """The example: report and work balance, then loss and every gradient against one
    device."""
    import _check  # beside this file; the script's folder is on sys.path
    from cptransform import context_parallel
    from cptransform.api.plan_chart import device_work
    from cptransform.op.layouts import SequenceLayout

    args = example_args(seq=seq)
    # The ring, so the chart below is what each device computes and skips at each step.
    sharded = context_parallel(loss, cp=cp, load_balance="zigzag", schedule="ring")
    result = _check.compare_gradients(loss, sharded, *args)
    if verbose:
        segment_ids = np.asarray(args[2])
        for row, ids in enumerate(segment_ids):
            counts = np.bincount(ids)
            print(f"row {row}: documents of {' '.join(map(str, counts[1:]))} tokens, "
                  f"then {counts[0]} padding")
        print(_check.report(sharded, *args, segment_ids=segment_ids))
        print("\nwork per device for this batch (visible query-key pairs / mean):")
        (plan,) = sharded.module(*args).facts.plan
        for layout in ("zigzag", "contiguous"):
            positions = SequenceLayout(layout, seq, cp).all_positions()
            work = device_work(plan.mask, positions, seq, segment_ids)
            print(f"  {layout:>10}: " + " ".join(f"{w / work.mean():.2f}" for w in work)
                  + f"  (slowest {work.max() / work.mean():.2f}x the mean)")
        print(f"\n{result}")
    return result.ok


if __name__ == "__main__":
    import _check  # beside this file; the script's folder is on sys.path
    sys.exit(_check.main(check))
