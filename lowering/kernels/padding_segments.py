"""Query and key padding as segment ids, for kernels whose tiles carry segment ids but no
validity vectors (the Pallas kernels).

A pair is visible under segments and padding exactly when its segment ids are equal and both
tokens are valid: without segments a valid token gets id 0, a padded query 1 and a padded key
2; with segments, a padded query and a padded key get ids no token of the call has
(:func:`~cptransform.lowering.padding.unused_id`, so no arithmetic on the user's ids can
overflow). Elementwise on one call's ``[B|1, T]`` operands: each ring step's keys carry
their own validity, as they carry their segment ids.
"""
from __future__ import annotations

import jax.numpy as jnp

from cptransform.lowering.block import Block
from cptransform.lowering.padding import unused_id
from cptransform.op.attention_spec import AttentionSpec


def as_segments(block: Block, spec: AttentionSpec) -> tuple[Block, AttentionSpec]:
    """``block`` and ``spec`` with the padding terms' operands folded into segment ids
    (unchanged without padding)."""
    mask = spec.mask
    if not (mask.q_padding or mask.kv_padding):
        return block, spec
    tq, tkv = block.q.shape[1], block.k.shape[1]
    if mask.segments:
        q_seg, kv_seg = block.q_seg.astype(jnp.int32), block.kv_seg.astype(jnp.int32)
        both = jnp.concatenate([q_seg.reshape(-1), kv_seg.reshape(-1)])
        hidden_q = unused_id(both)
        hidden_kv = unused_id(jnp.concatenate([both, hidden_q[None]]))
    else:
        q_seg, kv_seg = jnp.zeros((1, tq), jnp.int32), jnp.zeros((1, tkv), jnp.int32)
        hidden_q, hidden_kv = jnp.int32(1), jnp.int32(2)
    if block.q_valid is not None:
        q_seg = jnp.where(block.q_valid, q_seg, hidden_q)
    if block.kv_valid is not None:
        kv_seg = jnp.where(block.kv_valid, kv_seg, hidden_kv)
    folded = block.replace(q_seg=q_seg, kv_seg=kv_seg, q_valid=None, kv_valid=None)
    return folded, spec.replace(mask=mask.replace(segments=True, q_padding=False,
                                                  kv_padding=False))
