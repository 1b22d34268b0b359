"""The sizes of one attention that decide how it is run context-parallel.

:class:`AttentionShape` is what the planner compares schedules on, what the cost model
prices and what a schedule's feasibility check reads; :func:`attention_shape` builds it
from an attention's spec and operands (avals of an ``attention_p`` equation, or arrays).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from cptransform.op.attention_spec import AttentionSpec


@dataclass(frozen=True)
class AttentionShape:
    """One attention's sizes and the CP degree it is planned for.

    ``seq_len`` tokens, ``heads``/``kv_heads`` of ``head_dim`` (``v_head_dim`` for V, default
    ``head_dim``), ``batch`` sequences, ``dtype_bytes`` per q/k/v element, over ``cp`` devices
    of which ``ulysses`` form a Ulysses group (hybrid; 1 otherwise). Gradients of K/V are
    reduced in ``grad_bytes``. Positions (int32 ``[position_batch, seq_len]``) travel only
    when the mask reads them (``positions``: causal or window; XLA drops unused transfers);
    segment ids (``segments``) are ``[segment_batch, seq_len]`` of ``segment_bytes``.
    ``band`` is the mask's ``(lo, hi)`` band on ``kv_pos - q_pos`` (``None``: open; see
    :meth:`MaskSpec.band`) and ``layout`` the sequence layout, which together decide the
    work the chunked kernel skips.
    ``explicit_positions`` says the positions are operands of the caller rather than the
    token indices (so a key in the window may sit anywhere in the sequence).
    """

    seq_len: int
    heads: int
    kv_heads: int
    head_dim: int
    v_head_dim: int | None = None
    batch: int = 1
    dtype_bytes: int = 2
    cp: int = 1
    ulysses: int = 1
    position_batch: int = 1
    positions: bool = True
    segments: bool = False
    segment_batch: int = 1
    segment_bytes: int = 4
    grad_bytes: int = 4
    band: tuple[int | None, int | None] = (None, None)
    layout: str = "contiguous"
    explicit_positions: bool = False

    @property
    def dv(self) -> int:
        """V's head dim."""
        return self.head_dim if self.v_head_dim is None else self.v_head_dim


def attention_shape(spec: AttentionSpec, q, k, v, *, cp: int, ulysses: int = 1,
                    layout: str = "contiguous") -> AttentionShape:
    """The :class:`AttentionShape` of an attention with operands ``q, k, v`` (anything with
    ``shape`` and ``dtype``, in ``spec``'s layouts: an equation's avals or arrays) over
    ``cp`` devices, ``ulysses`` of them per Ulysses group, in sequence ``layout``."""
    def heads(x, layout):
        return x.shape[layout.heads] if layout.heads is not None else 1

    return AttentionShape(
        seq_len=q.shape[spec.q.seq], heads=heads(q, spec.q), kv_heads=heads(k, spec.k),
        head_dim=q.shape[spec.q.feature], v_head_dim=v.shape[spec.v.feature],
        batch=math.prod(q.shape[d] for d in spec.q.batch), dtype_bytes=q.dtype.itemsize,
        cp=cp, ulysses=ulysses, band=spec.mask.band(), layout=layout,
        explicit_positions=spec.positions)
