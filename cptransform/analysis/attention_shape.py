"""The sizes of one attention that decide how it is run context-parallel.

:class:`AttentionShape` is what the planner compares schedules on, what the cost model
prices and what a schedule's feasibility check reads; :func:`attention_shape` builds it
from an attention's spec and operands (avals of an ``attention_p`` equation, or arrays).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from cptransform.op import mask_terms
from cptransform.op.attention_spec import AttentionSpec
from cptransform.op.layouts import layout_multiple


@dataclass(frozen=True)
class AttentionShape:
    """One attention's sizes and the CP degree it is planned for.

    ``seq_len`` queries and ``kv_seq_len`` keys (default ``seq_len``; they differ for
    cross-attention), ``heads``/``kv_heads`` of ``head_dim`` (``v_head_dim`` for V, default
    ``head_dim``), ``batch`` sequences, ``dtype_bytes`` per q/k/v element, over ``cp`` devices
    of which ``ulysses`` form a Ulysses group (hybrid; 1 otherwise). Gradients of K/V are
    reduced in ``grad_bytes``. Positions (int32 ``[position_batch, seq_len]``) travel only
    when the mask reads them (``positions``: causal or window; XLA drops unused transfers);
    segment ids (``segments``) are ``[segment_batch, seq_len]`` of ``segment_bytes``.
    ``band`` is the mask's ``(lo, hi)`` band on ``kv_pos - q_pos`` (``None``: open; see
    :meth:`MaskSpec.band`), ``chunk`` the chunk of Llama-4 chunked attention (``None``:
    none) and ``layout`` the sequence layout, which together decide the work the kernels
    skip.
    ``explicit_positions`` says the positions are operands of the caller rather than the
    token indices (so a key in the window may sit anywhere in the sequence); without them
    the ring derives the kv positions from the layout rather than sending them.
    Schedules move both sequences padded to ``multiple`` (the layout's: ``cp``, zigzag
    ``2·cp``; see :attr:`q_padded`), so the volumes are those of the padded lengths.
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
    kv_seq_len: int | None = None
    multiple: int = 1
    chunk: int | None = None

    @property
    def position_terms(self) -> tuple:
        """The mask's terms of positions alone: the band and, for Llama-4 chunked attention,
        the chunk (what the block skipping the cost model counts depends on)."""
        lo, hi = self.band
        band = () if (lo, hi) == (None, None) else (mask_terms.Band(lo, hi),)
        return band + (() if self.chunk is None else (mask_terms.Chunks(self.chunk),))

    @property
    def kv_len(self) -> int:
        """Keys (``seq_len`` unless cross-attention)."""
        return self.seq_len if self.kv_seq_len is None else self.kv_seq_len

    @property
    def q_padded(self) -> int:
        """Queries after padding to ``multiple``."""
        return -(-self.seq_len // self.multiple) * self.multiple

    @property
    def kv_padded(self) -> int:
        """Keys after padding to ``multiple``."""
        return -(-self.kv_len // self.multiple) * self.multiple

    @property
    def padding_bytes(self) -> int:
        """Bytes of the pad tokens' q, o, k and v over all devices (what padding adds to
        the activations the schedule holds)."""
        q_side = (self.q_padded - self.seq_len) * self.heads * (self.head_dim + self.dv)
        kv_side = (self.kv_padded - self.kv_len) * self.kv_heads * (self.head_dim + self.dv)
        return self.batch * (q_side + kv_side) * self.dtype_bytes

    @property
    def operand_bytes(self) -> int:
        """Bytes of q, o, k and v over all devices (what an all-to-all moving the attention
        to another sharding sends, across the devices)."""
        return self.batch * self.dtype_bytes * (
            self.seq_len * self.heads * (self.head_dim + self.dv)
            + self.kv_len * self.kv_heads * (self.head_dim + self.dv))

    def describe_padding(self) -> str:
        """``queries 19 -> 24 (+5), keys …; +N bytes``, or ``none``."""
        sides = [f"{name} {n} -> {p} (+{p - n})" for name, n, p in (
            ("queries", self.seq_len, self.q_padded), ("keys", self.kv_len, self.kv_padded))
            if p != n]
        if not sides:
            return "none"
        return (", ".join(sides) + f" to a multiple of {self.multiple}; "
                f"+{self.padding_bytes} bytes of q/k/v/o over all devices")

    @property
    def dv(self) -> int:
        """V's head dim."""
        return self.head_dim if self.v_head_dim is None else self.v_head_dim


def attention_shape(spec: AttentionSpec, q, k, v, *, cp: int, ulysses: int = 1,
                    layout: str = "contiguous") -> AttentionShape:
    """The :class:`AttentionShape` of an attention with operands ``q, k, v`` (anything with
    ``shape`` and ``dtype``, in ``spec``'s layouts: an equation's avals or arrays) over
    ``cp`` devices, ``ulysses`` of them per Ulysses group, in sequence layout ``layout``."""
    def heads(x, layout):
        return x.shape[layout.heads] if layout.heads is not None else 1

    return AttentionShape(
        seq_len=q.shape[spec.q.seq], heads=heads(q, spec.q), kv_heads=heads(k, spec.k),
        head_dim=q.shape[spec.q.feature], v_head_dim=v.shape[spec.v.feature],
        batch=math.prod(q.shape[d] for d in spec.q.batch), dtype_bytes=q.dtype.itemsize,
        cp=cp, ulysses=ulysses, band=spec.mask.band(), layout=layout,
        explicit_positions=spec.positions, kv_seq_len=k.shape[spec.k.seq],
        multiple=layout_multiple(layout, cp),
        # A finite fill skips no block: the chunks then hide nothing the cost model drops.
        chunk=spec.mask.chunk if spec.mask.fill is None else None)
