"""A mask as a conjunction of terms, each owning its predicate, its operands and its block
classification.

Modelled on splash attention's ``Mask`` classes and ``MaskInfo``: one class per kind of
predicate. A term says

* which operands it reads (:attr:`MaskTerm.operands`, names of
  :meth:`~cptransform.op.attention_spec.AttentionSpec.operand_names`) and the
  :class:`~cptransform.op.operand_roles.Role` of each operand it brings
  (:attr:`MaskTerm.roles`, by canonical field name): how it is validated, sharded,
  permuted, sent, sliced and regrouped, which every layer reads from the roles alone;
* its element predicate (:meth:`MaskTerm.visible`) on a :class:`Tile` whose query side and
  key side are already broadcast against each other, so the reference, the chunked kernel
  and the Pallas tiles (keys as rows in the dK/dV kernel) share it;
* its block classification (:meth:`MaskTerm.block_kind`) from per-block ``(min, max)``
  ranges (:class:`Blocks`), never from a dense visibility: ``may`` is False only when no
  pair of the block is visible, ``full`` True only when every pair is;
* its band hull (:meth:`MaskTerm.band`): bounds on ``d = kv_pos - q_pos`` that every visible
  pair satisfies (what halo and the ring's step skipping need);
* the values of its operands at a padded query that let it see the first key
  (:meth:`MaskTerm.padding`), so padding a sequence never empties a row;
* for terms of positions alone, :meth:`MaskTerm.key_hull`: the key positions a query range
  can see, which the cost model counts with binary searches.

Every consumer — the reference, the chunked XLA kernel, both Pallas kernels, the cost model
and the plan chart — loops over the terms (:func:`visible`, :func:`meet`); a new mask kind
is one class here (and :data:`TERMS`), its matcher rule and its kernels' reading of it.

The code uses operators only (``&``, ``//``, comparisons) for the terms of positions, so
NumPy arrays (planner, chart) and traced JAX arrays (kernels) go through the same lines.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, ClassVar, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from cptransform.op.operand_roles import BASE_ROLES, Role, Side

class BlockKind(enum.IntEnum):
    """What a block of (query, key) pairs is under a mask. The values are the entries of the
    chunked kernel's and the Pallas kernels' block tables and the branch indices of a
    ``lax.switch`` on them (:meth:`branches`)."""

    #: No pair visible: the kernels compute nothing.
    SKIP = 0
    #: Every pair visible: no mask is computed.
    FULL = 1
    #: Some pairs visible: the element mask is computed.
    PARTIAL = 2
    #: Decided by data the classification does not have (segment ids, a dense mask, top-k
    #: indices): only the plan chart, which classifies before the data exist, says it.
    UNKNOWN = 3

    @classmethod
    def of(cls, may, full):
        """Int32 kinds of blocks from :func:`meet`'s ``(may, full)`` (any broadcastable
        shapes; traced or NumPy)."""
        return jnp.where(may, jnp.where(full, cls.FULL, cls.PARTIAL), cls.SKIP).astype(jnp.int32)

    @staticmethod
    def branches(*, skip, full, partial) -> tuple:
        """The branches of a ``lax.switch`` on a kernel's block kind, in value order."""
        return skip, full, partial


@dataclass(frozen=True)
class Ranges:
    """Per-block ``lo`` (minimum) and ``hi`` (maximum) of one operand along the sequence."""

    lo: object
    hi: object


@dataclass(frozen=True)
class Blocks:
    """What the terms classify a grid of ``nq × nk`` blocks from.

    Per-token ranges (:class:`Ranges`, one per per-token operand of :data:`TOKEN_ROLES`)
    are ``[B|1, nq]`` on the query side and ``[B|1, nk]`` on the key side; ``dense`` is the
    mask cut into tiles ``[B|1, H|1, nq, bq, nk, bk]`` (padding repeats real entries or is
    ``False``) and ``topk`` the indices grouped per query block ``[B|1, H|1, nq, bq·k]``.
    Absent operands are ``None``.
    """

    q_pos: Ranges
    kv_pos: Ranges
    q_seg: Ranges | None = None
    kv_seg: Ranges | None = None
    dense: object = None
    topk: object = None
    q_coord: Ranges | None = None
    q_valid: Ranges | None = None
    kv_valid: Ranges | None = None
    kv_inside: Ranges | None = None
    kv_outside: Ranges | None = None

    @classmethod
    def cut(cls, q_pos, kv_pos, bq: int, bk: int, *, mask=None, topk=None,
            **per_token) -> "Blocks":
        """The blocks of ``bq`` queries × ``bk`` keys of one kernel call's operands:
        positions and the terms' per-token operands (by field name, ``[B|1, T]``), ``mask``
        ``[B|1, H|1, Tq, Tkv]`` and ``topk`` ``[B|1, H|1, Tq, k]`` (``None`` when absent).
        The last blocks are padded by repeating the last entry, which leaves every range,
        ``any`` and ``all`` that of the real entries."""
        nq, nk = -(-q_pos.shape[-1] // bq), -(-kv_pos.shape[-1] // bk)
        grid = {Side.QUERY: (bq, nq), Side.KEY: (bk, nk)}
        ranges = {name: None if x is None else _ranges(x, *grid[TOKEN_ROLES[name].side])
                  for name, x in dict(per_token, q_pos=q_pos, kv_pos=kv_pos).items()}
        if mask is not None:
            mask = _pad_edge(_pad_edge(mask, 2, nq * bq), 3, nk * bk)
            mask = mask.reshape(*mask.shape[:2], nq, bq, nk, bk)
        if topk is not None:
            topk = _pad_edge(topk, 2, nq * bq)
            topk = topk.reshape(*topk.shape[:2], nq, bq * topk.shape[-1])
        return cls(dense=mask, topk=topk, **ranges)


def _pad_edge(x, axis: int, to: int):
    """``x`` padded along ``axis`` to length ``to`` by repeating its last entry."""
    if x.shape[axis] == to:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, to - x.shape[axis])
    return jnp.pad(x, widths, mode="edge")


def _ranges(x, size: int, count: int) -> Ranges:
    """Per-block (min, max) of ``x [B|1, T]`` cut into ``count`` blocks of ``size``."""
    x = _pad_edge(x, 1, size * count).reshape(x.shape[0], count, size)
    return Ranges(jnp.min(x, axis=-1), jnp.max(x, axis=-1))


@dataclass(frozen=True)
class Tile:
    """One tile's mask inputs with the query side and key side broadcastable against each
    other (e.g. ``[…, Tq, 1]`` and ``[…, 1, Tkv]``, or transposed): the per-token operands
    of :data:`TOKEN_ROLES` by field name, ``dense`` the boolean mask tile and ``picked``
    the top-k selection of the tile. ``None`` for absent operands."""

    q_pos: object = None
    kv_pos: object = None
    q_seg: object = None
    kv_seg: object = None
    dense: object = None
    picked: object = None
    q_coord: object = None
    q_valid: object = None
    kv_valid: object = None
    kv_inside: object = None
    kv_outside: object = None

    @classmethod
    def of(cls, operands, query, key, *, dense=None, picked=None) -> "Tile":
        """The tile of the per-token entries of ``operands`` (a mapping by field name, e.g.
        :meth:`~cptransform.lowering.block.Block.term_operands` and the positions; ``None``
        stays ``None``): the query side's through ``query``, the key side's through ``key``
        (each broadcasts ``[B|1, T]`` to the tile's side)."""
        side = {Side.QUERY: query, Side.KEY: key}
        return cls(dense=dense, picked=picked, **{
            name: None if x is None else side[TOKEN_ROLES[name].side](x)
            for name, x in operands.items() if name in TOKEN_ROLES})


def _query_side(x):
    """``[B|1, nq]`` → ``[B|1, 1, nq, 1]``."""
    return x[:, None, :, None]


def _key_side(x):
    """``[B|1, nk]`` → ``[B|1, 1, 1, nk]``."""
    return x[:, None, None, :]


def _inside(d, lo: int | None, hi: int | None):
    """``lo ≤ d ≤ hi`` elementwise (``None``: that side open; ``True`` when both are)."""
    ok = True
    if lo is not None:
        ok = ok & (d >= lo)
    if hi is not None:
        ok = ok & (d <= hi)
    return ok


def offset_within(lo: int | None, hi: int | None) -> int:
    """A ``d`` in ``[lo, hi]`` (``None``: open), 0 when it can be: where a padded query
    sits relative to the key it must see."""
    d = 0 if lo is None else max(0, lo)
    return d if hi is None else min(d, hi)


def _spans_kind(keys: Ranges, queries: Ranges, lo: int | None, hi: int | None):
    """``(may, full)`` of ``lo ≤ key - query ≤ hi`` over blocks whose key-side and
    query-side values lie in the given ranges: ``d`` spans at most
    ``[k_lo - q_hi, k_hi - q_lo]``."""
    d_min = _key_side(keys.lo) - _query_side(queries.hi)
    d_max = _key_side(keys.hi) - _query_side(queries.lo)
    may = full = True
    if lo is not None:
        may, full = may & (d_max >= lo), full & (d_min >= lo)
    if hi is not None:
        may, full = may & (d_min <= hi), full & (d_max <= hi)
    return may, full


class MaskTerm(Protocol):
    """What every term of :data:`TERMS` is (a structural type: the terms are frozen
    dataclasses of their static parameters)."""

    #: What its operands are called in messages, e.g. ``"segment ids"``.
    label: ClassVar[str]
    #: The ``attention_p`` operands it reads (positions included).
    operands: ClassVar[tuple[str, ...]]
    #: The role of each operand it brings, by canonical field name.
    roles: ClassVar[dict[str, Role]]
    #: For a term of positions alone, ``key_hull(q_lo, q_hi)``: the first and last key
    #: positions a block of queries may see; ``None`` for a term decided by data.
    key_hull: Callable | None

    def visible(self, t: Tile):
        """Bool, broadcast over the tile: the pairs it lets through."""

    def block_kind(self, b: Blocks):
        """``(may, full)`` per block (see :func:`meet`)."""

    def band(self) -> tuple[int | None, int | None]:
        """Bounds on ``kv_pos - q_pos`` every visible pair satisfies (``None``: open)."""

    def padding(self, first) -> dict:
        """The values (by field name) of the operands it brings at a padded query that let
        the query see the first key; ``first`` maps ``kv_pos`` and ``kv_seg`` to the first
        key's ``[B|1, 1]``."""

    def describe(self) -> str:
        """Compact text for reports."""


@dataclass(frozen=True)
class Band:
    """``lo ≤ kv_pos - q_pos ≤ hi`` (``None``: that side open): causal (``hi`` = the offset),
    sliding windows, and both together."""

    lo: int | None
    hi: int | None
    label = "band"
    operands = ("q_positions", "kv_positions")
    roles = {}

    def visible(self, t: Tile):
        return _inside(t.kv_pos - t.q_pos, self.lo, self.hi)

    def block_kind(self, b: Blocks):
        # d = kv - q over a block spans [kv_lo - q_hi, kv_hi - q_lo] (both attained when the
        # ranges are contiguous; otherwise the kinds are conservative).
        return _spans_kind(b.kv_pos, b.q_pos, self.lo, self.hi)

    def band(self):
        return self.lo, self.hi

    def key_hull(self, q_lo, q_hi):
        return (None if self.lo is None else q_lo + self.lo,
                None if self.hi is None else q_hi + self.hi)

    def padding(self, first) -> dict:
        # Positions are every attention's: a padded query's follows the hull of all the
        # terms' bands (``offset_within(*band_of(terms))``), not one term's.
        return {}

    def describe(self) -> str:
        return f"band[{self.lo}, {self.hi}]"


@dataclass(frozen=True)
class Chunks:
    """Llama-4 chunked attention's chunk term: ``q_pos // size == kv_pos // size`` (a token
    sees only keys of its own fixed chunk of ``size`` positions; with causal, only the
    earlier ones)."""

    size: int
    label = "chunks"
    operands = ("q_positions", "kv_positions")
    roles = {}

    def visible(self, t: Tile):
        return t.q_pos // self.size == t.kv_pos // self.size

    def block_kind(self, b: Blocks):
        c = self.size
        q_lo, q_hi = _query_side(b.q_pos.lo) // c, _query_side(b.q_pos.hi) // c
        k_lo, k_hi = _key_side(b.kv_pos.lo) // c, _key_side(b.kv_pos.hi) // c
        may = (k_hi >= q_lo) & (k_lo <= q_hi)
        full = (q_lo == q_hi) & (k_lo == k_hi) & (q_lo == k_lo)
        return may, full

    def band(self):
        return -(self.size - 1), self.size - 1

    def key_hull(self, q_lo, q_hi):
        c = self.size
        return q_lo // c * c, q_hi // c * c + c - 1

    def padding(self, first) -> dict:
        # As the band's: a padded query's position follows the hull of every term's band.
        return {}

    def describe(self) -> str:
        return f"chunks({self.size})"


@dataclass(frozen=True)
class Segments:
    """``q_segment_ids[q] == kv_segment_ids[kv]`` (packed documents)."""

    label = "segment ids"
    operands = ("q_segment_ids", "kv_segment_ids")
    roles = {"q_seg": Role(Side.QUERY, "q_segment_ids", mask=True),
             "kv_seg": Role(Side.KEY, "kv_segment_ids", mask=True)}

    def visible(self, t: Tile):
        return t.q_seg == t.kv_seg

    def block_kind(self, b: Blocks):
        q, k = b.q_seg, b.kv_seg
        may = (_key_side(k.hi) >= _query_side(q.lo)) & (_query_side(q.hi) >= _key_side(k.lo))
        # Conservative: ranges that overlap without a common id are partial.
        full = (_query_side(q.lo == q.hi) & _key_side(k.lo == k.hi)
                & (_query_side(q.lo) == _key_side(k.lo)))
        return may, full

    def band(self):
        return None, None

    key_hull = None

    def padding(self, first) -> dict:
        return {"q_seg": first["kv_seg"]}

    def describe(self) -> str:
        return "segments"


class _Padding:
    """Base of the padding terms: ``valid[token]`` of one side's boolean per-token operand
    (``field``), from a validity vector read from the tokens (``tokens != pad``)."""

    field: ClassVar[str]
    key_hull = None

    def visible(self, t: Tile):
        return getattr(t, self.field)

    def block_kind(self, b: Blocks):
        # A boolean's block range: its max says "some valid", its min "all valid".
        r = getattr(b, self.field)
        side = _query_side if self.roles[self.field].side is Side.QUERY else _key_side
        return side(r.hi), side(r.lo)

    def band(self):
        return None, None


@dataclass(frozen=True)
class QueryPadding(_Padding):
    """``q_valid[q]``: a query that is padding sees no key (``valid[:, :, None]``)."""

    label = "query padding"
    field = "q_valid"
    operands = ("q_valid",)
    roles = {"q_valid": Role(Side.QUERY, "q_valid", boolean=True, mask=True)}

    def padding(self, first) -> dict:
        return {"q_valid": True}

    def describe(self) -> str:
        return "query_padding"


@dataclass(frozen=True)
class KeyPadding(_Padding):
    """``kv_valid[kv]``: a key that is padding is seen by no query (``valid[:, None, :]``);
    its operand travels with the keys as their segment ids do."""

    label = "key padding"
    field = "kv_valid"
    operands = ("kv_valid",)
    roles = {"kv_valid": Role(Side.KEY, "kv_valid", boolean=True, mask=True)}

    def padding(self, first) -> dict:
        # It brings no query-side operand: a padded query is aimed at a valid key
        # (``lowering/padding.py`` picks the first one as ``first``).
        return {}

    def describe(self) -> str:
        return "key_padding"


@dataclass(frozen=True)
class RegionPadding:
    """``kv_inside[kv]`` where ``lo ≤ kv_pos - q_pos ≤ hi`` (the region), ``kv_outside[kv]``
    elsewhere: a key test that depends on where the pair lies (``None``: that side open).

    What an integer padding mask merged with a causal or window mask by arithmetic and
    then tested means: keras-hub's ``minimum(mask[:, None, :], causal) != 0`` is
    ``mask != 0`` on the causal region and ``mask < 0`` above it (a negative entry keeps
    its key visible past the diagonal, as on one device). Both operands are boolean
    ``[B|1, Tkv]`` and travel with the keys like :class:`KeyPadding`'s.

    The outside test may hold anywhere, so the band hull is open (no ring step is skipped
    by position alone) and the cost model counts its blocks as data-decided; per block, a
    block wholly outside the region whose ``kv_outside`` is all False is skipped from the
    operands' ranges (the upper triangle of typical data, with no negative entry)."""

    lo: int | None
    hi: int | None
    label = "region padding"
    operands = ("q_positions", "kv_positions", "kv_inside", "kv_outside")
    roles = {"kv_inside": Role(Side.KEY, "kv_inside", boolean=True, mask=True),
             "kv_outside": Role(Side.KEY, "kv_outside", boolean=True, mask=True)}
    key_hull = None

    def visible(self, t: Tile):
        region = _inside(t.kv_pos - t.q_pos, self.lo, self.hi)
        return (region & t.kv_inside) | (~region & t.kv_outside)

    def block_kind(self, b: Blocks):
        # A block may hold a visible pair inside the region (some pair there, some key's
        # inside test True) or outside it; it is full when every pair passes its side's
        # test: all inside (or all outside) with that test True for every key, or both
        # tests True for every key.
        some_in, all_in = _spans_kind(b.kv_pos, b.q_pos, self.lo, self.hi)
        inside, outside = _key_side(b.kv_inside.hi), _key_side(b.kv_outside.hi)
        may = (some_in & inside) | (~all_in & outside)
        every_in, every_out = _key_side(b.kv_inside.lo), _key_side(b.kv_outside.lo)
        full = (all_in & every_in) | (~some_in & every_out) | (every_in & every_out)
        return may, full

    def band(self):
        return None, None

    def padding(self, first) -> dict:
        # Key operands only: a padded query is aimed at a key whose inside test holds,
        # placed inside the region (``lowering/padding.py``).
        return {}

    def describe(self) -> str:
        return f"region_padding[{self.lo}, {self.hi}]"


@dataclass(frozen=True)
class CoordinateBand:
    """``lo ≤ kv_pos - q_coordinates[q] ≤ hi`` (``None``: that side open): a window around a
    per-query data coordinate rather than the query's position, e.g. DeepMind gemma's local
    layer, whose queries sit at ``cumsum(input_mask) - 1`` (padding is not counted).

    The coordinate is data, so the band hull on ``kv_pos - q_pos`` is open: no halo, and
    the cost model counts its blocks as data-decided, like segments."""

    lo: int | None
    hi: int | None
    label = "coordinate bands"
    operands = ("q_coordinates", "kv_positions")
    roles = {"q_coord": Role(Side.QUERY, "q_coordinates", integer=True, mask=True)}

    def visible(self, t: Tile):
        return _inside(t.kv_pos - t.q_coord, self.lo, self.hi)

    def block_kind(self, b: Blocks):
        # Coordinates need not be contiguous in a block: the span of d is a hull, so the
        # kinds are conservative.
        return _spans_kind(b.kv_pos, b.q_coord, self.lo, self.hi)

    def band(self):
        return None, None

    key_hull = None

    def padding(self, first) -> dict:
        return {"q_coord": first["kv_pos"] - offset_within(self.lo, self.hi)}

    def describe(self) -> str:
        return f"coordinate_band[{self.lo}, {self.hi}]"


@dataclass(frozen=True)
class Dense:
    """A boolean operand ``mask[..., q, kv]``."""

    label = "dense masks"
    operands = ("mask",)
    roles = {"mask": Role(Side.ROWS, "mask", columns=True, mask=True, boolean=True)}

    def visible(self, t: Tile):
        return t.dense

    def block_kind(self, b: Blocks):
        return jnp.any(b.dense, axis=(3, 5)), jnp.all(b.dense, axis=(3, 5))

    def band(self):
        return None, None

    key_hull = None

    def padding(self, first) -> dict:
        # All True: the padded rows see every key (the padding's segment ids hide the
        # padded keys from the real rows).
        return {"mask": True}

    def describe(self) -> str:
        return "dense"


@dataclass(frozen=True)
class TopK:
    """A sparse indexer's top-k: key ``kv`` is visible to ``q`` iff its position is one of
    ``topk_indices[..., q, :]``."""

    label = "top-k indices"
    operands = ("topk_indices", "kv_positions")
    roles = {"topk": Role(Side.ROWS, "topk_indices", integer=True, mask=True)}

    def visible(self, t: Tile):
        return t.picked

    def block_kind(self, b: Blocks):
        # A top-k row sees at most k keys: only a proof of emptiness is worth having.
        return _topk_hits(b.topk, b.kv_pos), False

    def band(self):
        return None, None

    key_hull = None

    def padding(self, first) -> dict:
        return {"topk": first["kv_pos"]}

    def describe(self) -> str:
        return "top-k"


def _topk_hits(topk, kv_pos: Ranges):
    """Bool ``[B, 1, nq, nk]``: some index of query block ``i`` (any head) lies in the
    position range of key block ``j``.

    Each query block's indices are sorted once and the key blocks' ranges looked up in them
    (two ``searchsorted``), so the work is ``Tq·k·log`` and the memory ``Tq·k``, never
    ``Tq·k·nk``.
    """
    bi, h, nq, width = topk.shape
    idx = jnp.sort(jnp.moveaxis(topk, 1, 2).reshape(bi, nq, h * width), axis=-1)
    b = max(bi, kv_pos.lo.shape[0])
    idx = jnp.broadcast_to(idx, (b, *idx.shape[1:]))
    k_min = jnp.broadcast_to(kv_pos.lo, (b, kv_pos.lo.shape[-1]))
    k_max = jnp.broadcast_to(kv_pos.hi, (b, kv_pos.hi.shape[-1]))

    def row(sorted_idx, lo, hi):
        return jnp.searchsorted(sorted_idx, hi, side="right") \
            > jnp.searchsorted(sorted_idx, lo, side="left")

    # vmap over batch rows, then query blocks; the key blocks' bounds are a vector.
    per_block = lambda s, lo, hi: jax.vmap(row, in_axes=(0, None, None))(s, lo, hi)  # noqa: E731
    return jax.vmap(per_block)(idx, k_min, k_max)[:, None]


#: Every mask term class (``label``: what its operands are called in messages).
TERMS = (Band, Chunks, Segments, CoordinateBand, Dense, TopK, QueryPadding, KeyPadding,
         RegionPadding)
#: The roles of the operands the terms bring, by canonical field name.
TERM_ROLES: dict[str, Role] = {name: role for term in TERMS for name, role in term.roles.items()}
#: The per-token operands the terms read (positions and the terms' own), by field name:
#: what :class:`Blocks` takes ranges of and :meth:`Tile.of` broadcasts.
TOKEN_ROLES: dict[str, Role] = {name: role for name, role in {**BASE_ROLES, **TERM_ROLES}.items()
                                if role.mask and role.per_token}


def visible(terms, t: Tile):
    """The conjunction of the terms' predicates on one tile (``True`` without terms)."""
    ok = True
    for term in terms:
        ok = ok & term.visible(t)
    return ok


def meet(terms, b: Blocks):
    """``(may, full)`` of a grid of blocks under all ``terms``: a block is skipped when one
    term proves it empty and full when every term proves it full (both ``True`` without
    terms; otherwise broadcastable to ``[B|1, H|1, nq, nk]``)."""
    may = full = True
    for term in terms:
        m, f = term.block_kind(b)
        may, full = may & m, full & f
    return may, full


def band_of(terms) -> tuple[int | None, int | None]:
    """The intersection of the terms' band hulls on ``d = kv_pos - q_pos``."""
    lo = hi = None
    for term in terms:
        t_lo, t_hi = term.band()
        if t_lo is not None:
            lo = t_lo if lo is None else max(lo, t_lo)
        if t_hi is not None:
            hi = t_hi if hi is None else min(hi, t_hi)
    return lo, hi


def positional(terms) -> bool:
    """True when every term is a predicate of positions alone (no data decides a block)."""
    return all(term.key_hull is not None for term in terms)


def key_hull(terms, q_lo, q_hi):
    """``(first, last)``: the key positions a block of queries in ``[q_lo, q_hi]`` may see
    under positional ``terms`` (NumPy arrays of block ranges; ``None``: that side open). A key block ``[k_lo, k_hi]`` is
    skipped by :func:`meet` exactly when ``k_hi < first`` or ``k_lo > last``."""
    first = last = None
    for term in terms:
        t_first, t_last = term.key_hull(q_lo, q_hi)
        if t_first is not None:
            first = t_first if first is None else np.maximum(first, t_first)
        if t_last is not None:
            last = t_last if last is None else np.minimum(last, t_last)
    return first, last
