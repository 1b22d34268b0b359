"""The local-step kernel: one block of queries against one block of keys, and its backward.

Every schedule is built from this step. Its interface is fixed so that Pallas kernels plug
in later without touching the schedules:

* ``forward(q, k, v, q_pos, kv_pos, q_seg, kv_seg, mask_tile, bias_tile, spec) -> (o, lse)``
* ``backward(q, k, v, q_pos, kv_pos, q_seg, kv_seg, mask_tile, bias_tile, o, lse, do, spec,
  dlse=None) -> (dq, dk, dv, dbias)``

Shapes are the canonical per-device ones: ``q [B, Tq, H, D]``, ``k [B, Tkv, Hkv, D]``,
``v [B, Tkv, Hkv, Dv]``; positions and segment ids ``[B|1, T]``; ``mask_tile`` (bool) and
``bias_tile`` ``[B|1, H|1, Tq, Tkv]`` or ``None``. ``o`` is float32 and normalised within
the block, ``lse`` float32 ``[B, H, Tq]`` and ``-inf`` for rows that see no key in the
block. In ``backward``, ``o``/``lse`` are the *merged* results over all key blocks (so the
probabilities of this block are ``exp(logits - lse)``) and ``dlse`` an optional cotangent
of ``lse``; all gradients are float32, ``dbias`` has ``bias_tile``'s shape (broadcast dims
summed) and is ``None`` without a bias.

:func:`block_may_be_visible` classifies a block from position / segment ranges so a
schedule can skip blocks that no query of the block can see.
"""
from __future__ import annotations

from typing import Protocol

import jax.numpy as jnp

from cptransform.op.attention_reference import attend, logits, visible
from cptransform.op.attention_spec import AttentionSpec


class LocalKernel(Protocol):
    """What a schedule calls for one (query block, key block) step; see the module doc."""

    name: str

    def forward(self, q, k, v, q_pos, kv_pos, q_seg, kv_seg, mask_tile, bias_tile,
                spec: AttentionSpec):
        ...

    def backward(self, q, k, v, q_pos, kv_pos, q_seg, kv_seg, mask_tile, bias_tile, o, lse,
                 do, spec: AttentionSpec, dlse=None):
        ...


def _grouped(x, hkv):
    """``[B, H, Tq, Tkv]`` → ``[B, Hkv, G, Tq, Tkv]`` (query head h reads KV head h // G)."""
    b, h, tq, tkv = x.shape
    return x.reshape(b, hkv, h // hkv, tq, tkv)


def _sum_to(x, shape):
    """Sum the dims of ``x`` that ``shape`` broadcasts (size 1) back down to ``shape``."""
    axes = tuple(i for i, (xs, s) in enumerate(zip(x.shape, shape)) if s == 1 and xs != 1)
    return jnp.sum(x, axis=axes, keepdims=True) if axes else x


class XlaKernel:
    """The local step in plain ``jax.numpy`` (XLA fuses it); float32 softmax and gradients.

    The backward recomputes the probabilities from ``lse`` (never stores them) and applies
    the flash-attention formulas: ``dV = Pᵀ dO``, ``dS = P ∘ (dO Vᵀ - rowsum(dO ∘ O) + dlse)``,
    then through soft-cap and scale to ``dQ = dS K``, ``dK = dSᵀ Q``; ``dbias = dS``.
    """

    name = "xla"

    def forward(self, q, k, v, q_pos, kv_pos, q_seg, kv_seg, mask_tile, bias_tile,
                spec: AttentionSpec):
        return attend(spec, q, k, v, q_pos, kv_pos, q_seg, kv_seg, mask_tile, bias_tile)

    def backward(self, q, k, v, q_pos, kv_pos, q_seg, kv_seg, mask_tile, bias_tile, o, lse,
                 do, spec: AttentionSpec, dlse=None):
        b, tq, h, d = q.shape
        _, tkv, hkv, dv_dim = v.shape
        f32 = jnp.float32
        raw = logits(spec.replace(softcap=None), q, k)
        if spec.softcap is not None:
            cap = f32(spec.softcap)
            tanh = jnp.tanh(raw / cap)
            s = tanh * cap
        else:
            s = raw
        if bias_tile is not None:
            s = s + bias_tile.astype(f32)
        row_ok = jnp.isfinite(lse)[..., None]
        ok = visible(spec.mask, q_pos, kv_pos, q_seg, kv_seg, mask_tile) & row_ok
        lse_safe = jnp.where(row_ok, lse[..., None], 0.0)
        p = jnp.where(ok, jnp.exp(jnp.where(ok, s - lse_safe, -jnp.inf)), 0.0)

        do32 = do.astype(f32)
        delta = jnp.swapaxes(jnp.sum(do32 * o.astype(f32), axis=-1), 1, 2)  # [B, H, Tq]
        if dlse is not None:
            delta = delta - dlse.astype(f32)
        dog = do32.reshape(b, tq, hkv, h // hkv, dv_dim)
        dv = jnp.einsum("bhgqk,bqhgd->bkhd", _grouped(p, hkv), dog,
                        preferred_element_type=f32)
        dp = jnp.einsum("bqhgd,bkhd->bhgqk", dog, v.astype(f32),
                        preferred_element_type=f32).reshape(b, h, tq, tkv)
        ds = p * (dp - delta[..., None])
        dbias = None if bias_tile is None else _sum_to(ds, bias_tile.shape)
        if spec.softcap is not None:
            ds = ds * (1.0 - tanh * tanh)
        ds = ds * f32(spec.scale)
        dsg = _grouped(ds, hkv)
        dq = jnp.einsum("bhgqk,bkhd->bqhgd", dsg, k.astype(f32),
                        preferred_element_type=f32).reshape(b, tq, h, d)
        qg = q.astype(f32).reshape(b, tq, hkv, h // hkv, d)
        dk = jnp.einsum("bhgqk,bqhgd->bkhd", dsg, qg, preferred_element_type=f32)
        return dq, dk, dv, dbias


#: Local-step kernels by name. The [kernels] issue registers ``"pallas"`` here.
KERNELS: dict[str, LocalKernel] = {"xla": XlaKernel()}


def get_kernel(name: str) -> LocalKernel:
    """The kernel called ``name``; ``"auto"`` picks Pallas when registered, else XLA."""
    if name == "auto":
        return KERNELS.get("pallas", KERNELS["xla"])
    if name in KERNELS:
        return KERNELS[name]
    if name == "pallas":
        raise NotImplementedError(
            "kernel='pallas' is not implemented yet (it arrives with the [kernels] issue); "
            "use kernel='xla' or kernel='auto'")
    raise ValueError(f"unknown kernel {name!r}; use one of "
                     f"{', '.join(sorted({*KERNELS, 'auto', 'pallas'}))}")


def block_may_be_visible(spec: AttentionSpec, q_pos, kv_pos, q_seg=None, kv_seg=None,
                         mask_tile=None):
    """Scalar bool: can any query of the block see any key of it?

    Decided from ranges (min/max positions and segment ids per batch row), exactly for a
    dense tile (``any``). ``False`` is a proof that the block is fully masked; ``True`` may
    be conservative (e.g. segment ranges that overlap without a common id).
    """
    may = jnp.ones((1,), dtype=bool)
    lo, hi = spec.mask.band()
    if lo is not None or hi is not None:
        d_max = jnp.max(kv_pos, axis=-1) - jnp.min(q_pos, axis=-1)
        d_min = jnp.min(kv_pos, axis=-1) - jnp.max(q_pos, axis=-1)
        if lo is not None:
            may = may & (d_max >= lo)
        if hi is not None:
            may = may & (d_min <= hi)
    if spec.mask.segments:
        may = may & (jnp.max(kv_seg, axis=-1) >= jnp.min(q_seg, axis=-1)) \
            & (jnp.max(q_seg, axis=-1) >= jnp.min(kv_seg, axis=-1))
    if spec.mask.dense:
        may = may & jnp.any(mask_tile, axis=(1, 2, 3))
    return jnp.any(may)
