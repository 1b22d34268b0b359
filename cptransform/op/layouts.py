"""Sequence layouts: which global token positions each CP rank holds.

A layout is only a permutation of positions. Arrays are put *in layout order* (the
concatenation, rank by rank, of each rank's positions) and then sharded contiguously, so
rank ``r`` holds exactly ``positions(r)``. Schedules and kernels never special-case a
layout: they read positions.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np
from jax import lax

from cptransform.ir.errors import LayoutError, unknown_name
from cptransform.ir.spelled_enum import SpelledEnum
from cptransform.op.seq_permute import seq_permute_p


def _div_mod(index, n: int):
    """``(index // n, index % n)`` of a traced non-negative integer array: one division
    and one remainder (``jnp``'s floor division and modulo add sign corrections, about 25
    operations each, that non-negative indices never need; every layer's positions go
    through these, so they are a measurable part of a long program's compile)."""
    index = jnp.asarray(index)
    if not jnp.issubdtype(index.dtype, jnp.integer):
        # An iota of floats (``jnp.arange(s, dtype=float32)``) holds whole numbers.
        index = index.astype(jnp.int32)
    n = jnp.asarray(n, index.dtype)
    return lax.div(index, n), lax.rem(index, n)


class LayoutName(SpelledEnum):
    """The sequence layouts (see :class:`SequenceLayout`)."""

    CONTIGUOUS = "contiguous"
    ZIGZAG = "zigzag"
    STRIPED = "striped"


#: Every layout's name, read off :class:`LayoutName`.
LAYOUTS: tuple[str, ...] = LayoutName.spellings()


def layout_multiple(name: str, cp: int) -> int:
    """The multiple a sequence's length must be for layout ``name`` over ``cp`` ranks:
    ``2·cp`` for zigzag (two chunks per rank), ``cp`` otherwise."""
    return 2 * cp if name == "zigzag" else cp


def padded_length(seq_len: int, name: str, cp: int) -> int:
    """``seq_len`` rounded up to :func:`layout_multiple` (what the CP lowering pads to)."""
    parts = layout_multiple(name, cp)
    return -(-seq_len // parts) * parts


@dataclass(frozen=True)
class Conversion:
    """One place where a load-balanced program moves tokens between layout order and
    natural order, and what it costs: ``kind`` is ``un-permute`` (an operand taken back to
    natural order for an op that needs it), ``gather`` (only a slice's tokens, by
    position) or ``re-align`` (a shifted slice moved onto another); ``bytes`` the data
    moved."""

    op: str
    where: str
    kind: str
    bytes: int

    def describe(self) -> str:
        at = f" at {self.where}" if self.where else ""
        return f"{self.kind} for {self.op}{at}: {self.bytes} bytes"


@dataclass(frozen=True)
class SequenceLayout:
    """How a sequence of ``seq_len`` tokens is spread over ``cp`` ranks.

    * ``contiguous``: rank ``r`` holds ``[r*n/cp, (r+1)*n/cp)``;
    * ``zigzag``: cut into ``2*cp`` chunks; rank ``r`` holds chunks ``r`` and ``2*cp-1-r``
      (balances causal work);
    * ``striped``: token ``t`` lives on rank ``t % cp``.
    """

    name: LayoutName | str
    seq_len: int
    cp: int

    def __post_init__(self):
        if self.name not in LAYOUTS:
            raise LayoutError(unknown_name("layout", self.name, LAYOUTS))
        parts = layout_multiple(self.name, self.cp)
        if self.seq_len % parts:
            need = "2·cp" if self.name == "zigzag" else "cp"
            raise LayoutError(
                f"sequence length {self.seq_len} is not divisible by {need} = {parts} "
                f"({self.name} layout over cp={self.cp}); a layout is defined on lengths it "
                f"divides: pad to {padded_length(self.seq_len, self.name, self.cp)} first "
                "(context_parallel and context_parallel_attention pad internally)")

    @property
    def local_len(self) -> int:
        return self.seq_len // self.cp

    def positions(self, rank: int) -> np.ndarray:
        """Global positions held by ``rank`` (a static NumPy int32 array, in local order)."""
        n, cp, loc = self.seq_len, self.cp, self.local_len
        if self.name == "contiguous":
            return np.arange(rank * loc, (rank + 1) * loc, dtype=np.int32)
        if self.name == "striped":
            return np.arange(rank, n, cp, dtype=np.int32)
        c = n // (2 * cp)
        return np.concatenate([np.arange(rank * c, (rank + 1) * c),
                               np.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)]
                              ).astype(np.int32)

    def all_positions(self) -> np.ndarray:
        """``[cp, local_len]``: row ``r`` is :meth:`positions` of rank ``r``."""
        return np.stack([self.positions(r) for r in range(self.cp)])

    def permutation(self) -> np.ndarray:
        """``perm`` such that ``x[perm]`` is ``x`` in layout order."""
        return self.all_positions().reshape(-1)

    def position_of_slot(self, slot):
        """Natural position stored at layout-order index ``slot`` (traced, no constants;
        ``0 <= slot < seq_len``)."""
        loc, cp = self.local_len, self.cp
        if self.name == "contiguous":
            return slot
        rank, j = _div_mod(slot, loc)
        if self.name == "striped":
            return j * cp + rank
        c = loc // 2
        return lax.select(j < c, rank * c + j, (2 * cp - 1 - rank) * c + (j - c))

    def slot_of_position(self, pos):
        """Inverse of :meth:`position_of_slot` (``0 <= pos < seq_len``)."""
        loc, cp = self.local_len, self.cp
        if self.name == "contiguous":
            return pos
        if self.name == "striped":
            chunk, off = _div_mod(pos, cp)
            return off * loc + chunk
        c = loc // 2
        chunk, off = _div_mod(pos, c)
        return lax.select(chunk < cp, chunk * loc + off, (2 * cp - 1 - chunk) * loc + c + off)

    def coarsen(self, chunk: int) -> "SequenceLayout | None":
        """The layout of the ``seq_len // chunk`` chunks of ``chunk`` consecutive tokens,
        when this layout moves whole chunks and keeps the order inside each (zigzag when
        ``chunk`` divides its ``seq_len / 2cp`` tokens per piece, contiguous when it
        divides a rank's share, striped only for ``chunk == 1``); ``None`` otherwise: the
        layout then splits chunks across ranks, and a reshape into chunks needs natural
        order."""
        if chunk == 1:
            return self
        piece = {"contiguous": self.local_len, "zigzag": self.local_len // 2,
                 "striped": 1}[self.name]
        if piece % chunk:
            return None
        return SequenceLayout(self.name, self.seq_len // chunk, self.cp)

    def permute(self, x, axis: int, inner: int = 1):
        """Natural order → layout order along ``axis`` (identity for contiguous); a merged
        dim (``outer × seq_len × inner``) permutes its sequence digit. One
        :data:`~cptransform.op.seq_permute.seq_permute_p` equation: the CP lowering moves
        a sharded sequence with collectives instead of a gather; its index vector comes
        from an iota, so it works inside any traced body without hoisting constants."""
        if self.name == "contiguous":
            return x
        return seq_permute_p.bind(x, layout=self, dim=axis, inner=inner, inverse=False)

    def unpermute(self, x, axis: int, inner: int = 1):
        """Layout order → natural order along ``axis`` (a merged dim: as :meth:`permute`)."""
        if self.name == "contiguous":
            return x
        return seq_permute_p.bind(x, layout=self, dim=axis, inner=inner, inverse=True)
