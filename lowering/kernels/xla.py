"""The dense XLA kernel: the local step in plain ``jax.numpy`` on the whole logits tile.

Not registered: the default ``"xla"`` kernel is the chunked one
(:mod:`cptransform.lowering.kernels.chunked`); this one stays as the tests' oracle for a
kernel's backward."""
from __future__ import annotations

import jax.numpy as jnp

from cptransform.op import dropout
from cptransform.op.accumulation import accumulator_dtype
from cptransform.op.attention_reference import attend, empty_rows_of, logits_and_tanh, \
    masked_logits, visible
from cptransform.op.attention_spec import AttentionSpec
from cptransform.lowering.block import Block
from cptransform.lowering.kernels import sum_to


def _grouped(x, hkv):
    """``[B, H, Tq, Tkv]`` → ``[B, Hkv, G, Tq, Tkv]`` (query head h reads KV head h // G)."""
    b, h, tq, tkv = x.shape
    return x.reshape(b, hkv, h // hkv, tq, tkv)


class XlaKernel:
    """The local step in plain ``jax.numpy`` (XLA fuses it); float32 softmax and gradients.

    The backward recomputes the probabilities from ``lse`` (never stores them) and applies
    the flash-attention formulas: ``dV = Pᵀ dO``, ``dS = P ∘ (dO Vᵀ - rowsum(dO ∘ O) + dlse)``,
    then through soft-cap and scale to ``dQ = dS K``, ``dK = dSᵀ Q``; ``dbias = dS``.
    """

    name = "xla"

    def forward(self, block: Block, spec: AttentionSpec):
        return attend(spec, block.q, block.k, block.v, block.q_pos, block.kv_pos,
                      bias=block.bias, seed=block.dropout, **block.term_operands())

    def backward(self, block: Block, o, lse, do, spec: AttentionSpec, dlse=None):
        q, k, v, bias = block.q, block.k, block.v, block.bias
        b, tq, h, d = q.shape
        _, tkv, hkv, dv_dim = v.shape
        accum = accumulator_dtype(q.dtype)
        s, tanh = logits_and_tanh(spec, q, k, bias)
        ok = visible(spec.mask, block.q_pos, block.kv_pos, **block.term_operands())
        # Empty rows (lse = -inf) get p = 0; a NaN row keeps its NaN lse, so its p is NaN
        # at every key, masked ones too, as exp(x - max(x)) is on one device.
        lse_safe = jnp.where(empty_rows_of(lse), 0.0, lse)[..., None]
        p = jnp.exp(masked_logits(spec.mask, ok, s) - lse_safe)
        if spec.mask.fill is None:
            p = jnp.where(ok, p, 0.0)
        p = p + 0.0 * lse_safe

        do32 = do.astype(accum)
        delta = jnp.swapaxes(jnp.sum(do32 * o.astype(accum), axis=-1), 1, 2)  # [B, H, Tq]
        if dlse is not None:
            delta = delta - dlse.astype(accum)
        dog = do32.reshape(b, tq, hkv, h // hkv, dv_dim)
        drop = None if spec.dropout is None else dropout.multiplier(
            spec.dropout, block.dropout, block.q_pos, block.kv_pos)
        dv = jnp.einsum("bhgqk,bqhgd->bkhd", _grouped(dropout.applied(spec.dropout, p, drop),
                                                      hkv), dog,
                        preferred_element_type=accum)
        dp = jnp.einsum("bqhgd,bkhd->bhgqk", dog, v.astype(accum),
                        preferred_element_type=accum).reshape(b, h, tq, tkv)
        dp = dropout.applied(spec.dropout, dp, drop)
        # A masked logit's gradient is an exact 0 (the fill does not depend on it), even
        # where dp or delta is NaN.
        ds = jnp.where(ok, p * (dp - delta[..., None]), 0.0)
        dbias = None if bias is None else sum_to(ds, bias.shape)
        if spec.softcap is not None:
            ds = ds * (1.0 - tanh * tanh)
        ds = ds * accum.type(spec.scale)
        dsg = _grouped(ds, hkv)
        dq = jnp.einsum("bhgqk,bkhd->bqhgd", dsg, k.astype(accum),
                        preferred_element_type=accum).reshape(b, tq, h, d)
        qg = q.astype(accum).reshape(b, tq, hkv, h // hkv, d)
        dk = jnp.einsum("bhgqk,bqhgd->bkhd", dsg, qg, preferred_element_type=accum)
        return dq, dk, dv, dbias

