"""The dtype attention computes its softmax, merges and gradients in.

``promote_types(dtype, float32)``: float32 for bf16, fp16 and float32 inputs (their logits and
running sums need float32's range and precision), float64 for float64 inputs, whose
single-device softmax runs in float64 — fixing float32 there would return float64 arrays
with only float32 accuracy.
"""
from __future__ import annotations

import jax.numpy as jnp


def accumulator_dtype(*dtypes) -> jnp.dtype:
    """The accumulation dtype for operands of ``dtypes`` (at least float32)."""
    return jnp.promote_types(jnp.result_type(*dtypes), jnp.float32)
