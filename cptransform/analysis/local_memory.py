"""Per-device memory of the local step: the building blocks of a schedule statement's
``memory`` (:mod:`cptransform.analysis.schedule_statement`).

The chunked kernel holds one (query chunk, key chunk) tile of float32 scores and
probabilities plus O(T) state (float32 output accumulator, log-sum-exp), so everything
here is linear in the local length; what differs between schedules is what they gather
(all-gather: every key; Ulysses: the whole sequence for ``H/n`` heads; ring: two KV blocks,
the one computed on and the one arriving) and what their backward keeps in float32.
The counts are of the attention's own operands, residuals and gradients, not of the rest
of the model.
"""
from __future__ import annotations

from cptransform.analysis.attention_shape import AttentionShape
from cptransform.analysis.block_work import DEFAULT_CHUNK, kernel_grid

F32 = 4


def shard_bytes(shape: AttentionShape) -> int:
    """q, k, v and o of the local ``seq_len / cp`` tokens (the inputs and the output)."""
    rows = shape.batch * shape.q_padded // shape.cp
    per_token = shape.heads * (shape.head_dim + shape.dv) + shape.kv_heads * (
        shape.head_dim + shape.dv)
    return rows * per_token * shape.dtype_bytes


def kv_bytes(shape: AttentionShape, tokens: int, kv_heads: int, element: int) -> int:
    """K and V of ``tokens`` tokens and ``kv_heads`` heads in ``element`` bytes."""
    return shape.batch * tokens * kv_heads * (shape.head_dim + shape.dv) * element


def query_state_bytes(shape: AttentionShape, tokens: int, heads: int) -> int:
    """The float32 state of ``tokens`` query rows over ``heads`` heads: the output
    accumulator and log-sum-exp forward, dQ backward."""
    return shape.batch * tokens * heads * (shape.dv + 1 + shape.head_dim) * F32


def tile_bytes(shape: AttentionShape, heads: int, q_tokens: int, k_tokens: int,
               target: int = DEFAULT_CHUNK) -> int:
    """One tile of float32 scores and probabilities over ``heads`` heads, for a kernel call
    on ``q_tokens`` queries and ``k_tokens`` keys (its chunks: :func:`kernel_grid`)."""
    (cq, _), (ck, _) = kernel_grid(q_tokens, k_tokens, target)
    return 2 * shape.batch * heads * cq * ck * F32
