"""Halo exchange for sliding-window attention: each device fetches only its neighbours' edges.

Under a window ``-left <= kv_pos - q_pos <= right`` (:meth:`MaskSpec.band`; causal gives
``right = causal_offset``) a query sees only keys at most ``left`` tokens before it and
``right`` after it. When both sides fit in one chunk of the layout, the keys a device's
queries can see are its own and the *halos*: the last ``left`` keys of the chunk before
each local chunk and the first ``right`` keys of the chunk after it. Each device receives
them with two non-cyclic collective-permutes, "up" (rank ``j`` → ``j + 1``) and "down"
(``j`` → ``j - 1``), K and V concatenated on the feature dim (one send when they share a
dtype) with their positions and segment ids, then runs one kernel call of its local queries
against ``[halos ‖ local keys]`` (in position order, so the kernel's chunk classification
skips what the window hides).

Layouts (``c`` = keys per chunk):

* ``contiguous`` (one chunk per rank, ``c = T/cp``): the left halo comes up from rank
  ``r-1`` (its last ``left`` keys), the right halo down from rank ``r+1`` (its first
  ``right`` keys);
* ``zigzag`` (rank ``r`` holds chunks ``r`` and ``2cp-1-r``, ``c = T/(2cp)``): the low
  chunk's left halo and the high chunk's right halo come up from rank ``r-1`` (the tail of
  its low chunk ``r-1``, the head of its high chunk ``2cp-r``); the low chunk's right halo
  and the high chunk's left halo come down from rank ``r+1`` (head of chunk ``r+1``, tail of
  chunk ``2cp-2-r``). Each permute carries edges of both chunks. On rank ``cp-1`` the two
  chunks are neighbours, and on ranks ``0``/``cp-1`` a chunk is the first/last of the
  sequence: those halos have no sender;
* ``striped`` is refused: every neighbour of a token is on another rank.

A halo without a sender (edge ranks) arrives as zeros and gets the position
:data:`NO_KEY`, outside every finite window, so the kernel masks it exactly; no key is ever
counted twice. Dense masks and biases hold all key columns in layout order: the kernel reads
the column slices of the halo keys, and the bias gradient of a halo is added back into its
columns.

Non-finite values follow one device (docs/contract.md, "NaN and Inf"): there every query
multiplies every value
by its probability, an exact 0 outside the window, so a NaN anywhere in V reaches every row.
The forward adds ``Σ 0·V`` over all keys (a psum of ``[B, 1, Hkv, Dv]``), the backward the
kernel contract's ``Σ 0·K``, ``Σ 0·Q`` and ``Σ (0·lse + 0·dO)`` over all keys / queries
(one psum): exact zeros unless something is NaN or infinite.

Communication per device (``L``/``R`` the window's sides, ``n`` = 1 chunk per rank
contiguous, 2 zigzag, ``B`` batch, element sizes in bytes):

* forward: collective-permutes of ``n·(L+R)`` keys: ``n·(L+R)·(B·Hkv·(D·|k| + Dv·|v|) +
  B_pos·4 [+ B_seg·|seg|])``, plus an all-reduce of ``B·Hkv·Dv`` float32 (the ``Σ 0·V``);
* backward: the halos' float32 dK/dV go back to their owners by the reverse permutes,
  ``n·(L+R)·B·Hkv·(D + Dv)·4``, plus one all-reduce of ``B·(Hkv·D + H·D + H·Dv)`` float32.
  The halos are residuals, so the backward sends no K/V again.

Bytes grow with the window, not the sequence. The backward is a ``custom_vjp``: residuals
are the kernel's block (local queries, halos and local keys, their mask and bias columns),
the local block, o and lse; never the probabilities.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from cptransform.analysis.attention_shape import AttentionShape
from cptransform.analysis.block_work import rank_positions
from cptransform.analysis.cost_model import Transfer, metadata, operands
from cptransform.analysis.local_memory import F32
from cptransform.analysis.schedule_statement import Calls, Grid, LocalStep, Statement
from cptransform.ir import compat
from cptransform.lowering.block import KEY_DATA, Block
from cptransform.lowering.kernels import row_delta, zero_times
from cptransform.lowering.ring import packed, unpacked
from cptransform.lowering.schedule import Schedule, differentiable, finished, \
    register_schedule

#: The position of a halo key that has no sender: ``kv_pos - q_pos`` is below ``-left``
#: for every query of a sequence shorter than 2**30, so every finite window hides it.
NO_KEY = -(2 ** 30)

#: Chunks per rank of the layouts halo supports.
CHUNKS_PER_RANK = {"contiguous": 1, "zigzag": 2}


@dataclass(frozen=True)
class Piece:
    """A run of ``width`` keys in the kernel's key order on rank ``r``, taken from offset
    ``offset`` of the local keys of rank ``r + shift``: ``shift`` 0 for local keys, -1 for a
    halo sent up by the left neighbour, +1 for one sent down by the right neighbour."""

    shift: int
    offset: int
    width: int


def halo_sides(band: tuple[int | None, int | None]) -> tuple[int, int] | None:
    """``(left, right)``: how many keys before and after a chunk its queries can see, from
    the mask's ``band`` on ``kv_pos - q_pos``; ``None`` when a side is open."""
    lo, hi = band
    if lo is None or hi is None:
        return None
    return -lo, max(hi, 0)


def pieces(layout: str, tkv: int, left: int, right: int) -> tuple[Piece, ...]:
    """The kernel's keys on a rank holding ``tkv`` local keys in ``layout``, in position
    order (see the module doc), without empty pieces."""
    if layout == "contiguous":
        runs = (Piece(-1, tkv - left, left), Piece(0, 0, tkv), Piece(1, 0, right))
    else:
        c = tkv // 2
        runs = (Piece(-1, c - left, left), Piece(0, 0, c), Piece(1, 0, right),
                Piece(1, 2 * c - left, left), Piece(0, c, c), Piece(-1, c, right))
    return tuple(p for p in runs if p.width)


def _cut(tree, start: int, width: int):
    """Keys ``[start, start + width)`` of every key-side array of ``tree`` (sequence on
    dim 1)."""
    return jax.tree.map(lambda x: x[:, start:start + width], tree)


def _joined(trees):
    """Key-side trees of the same structure concatenated along the sequence (dim 1)."""
    return jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=1), *trees)


def _offsets(runs) -> list[int]:
    """Where each piece of ``runs`` starts when they are concatenated."""
    return [sum(p.width for p in runs[:i]) for i in range(len(runs))]


def _permute(tree, axes, cp: int, shift: int, back: bool = False):
    """Send ``tree`` from each rank ``j`` to ``j - shift`` (``back``: to ``j + shift``), where
    that rank exists; ranks without a sender receive zeros."""
    step = shift if back else -shift
    perm = [(j, j + step) for j in range(cp) if 0 <= j + step < cp]
    return jax.tree.map(lambda x: compat.ppermute(x, axes, perm), tree)


def receive_halos(tree, runs, axes, cp: int) -> dict:
    """The halo pieces of ``runs`` (``shift`` ±1) of every array of ``tree`` (sequence on
    dim 1), received from the neighbours in one permute per direction: ``{piece: tree}``,
    zeros where the neighbour does not exist."""
    got = {}
    for shift in (-1, 1):
        mine = [p for p in runs if p.shift == shift]
        if not mine:
            continue
        arrived = _permute(_joined([_cut(tree, p.offset, p.width) for p in mine]),
                           axes, cp, shift)
        for p, start in zip(mine, _offsets(mine)):
            got[p] = _cut(arrived, start, p.width)
    return got


def _exchange(block: Block, runs, axes, cp: int, rank):
    """The kernel's keys ``(kv, kv_pos, key data)`` (``kv`` :func:`packed`, the terms' key
    data :data:`KEY_DATA` by name), the pieces of ``runs`` concatenated: local pieces cut
    from ``block``, halos received from the neighbours (:func:`receive_halos`), with
    positions :data:`NO_KEY` where the neighbour does not exist."""
    keys = (packed(block.k, block.v), block.kv_pos,
            {name: getattr(block, name) for name in KEY_DATA})
    got = receive_halos(keys, runs, axes, cp)

    def piece(p: Piece):
        if not p.shift:
            return _cut(keys, p.offset, p.width)
        kv, pos, data = got[p]
        sent = (rank + p.shift >= 0) & (rank + p.shift < cp)
        return kv, jnp.where(sent, pos, NO_KEY), data

    return _joined([piece(p) for p in runs])


def _columns(x, runs, rank, tkv: int):
    """The mask or bias columns (all keys, layout order) of the kernel's keys ``runs``."""
    if x is None:
        return None
    return jnp.concatenate([lax.dynamic_slice_in_dim(x, (rank + p.shift) * tkv + p.offset,
                                                     p.width, axis=3) for p in runs], axis=3)


def _unseen(x, axes):
    """``Σ 0·x`` over every token of the sequence (``x [B, T_loc, heads, d]``), as
    ``[B, 1, heads, d]`` float32: 0, or NaN where some token's entry is NaN or infinite."""
    return lax.psum(jnp.sum(zero_times(x), axis=1, keepdims=True), axes)


def _runs(block: Block, spec, layout: str) -> tuple[Piece, ...]:
    """The kernel's key pieces for ``block`` under ``spec``'s window in ``layout``."""
    return pieces(layout, block.k.shape[1], *halo_sides(spec.mask.band()))


def _kernel_block(block: Block, spec, axes, layout: str) -> Block:
    """The one kernel call's problem: the local queries against halos and local keys."""
    cp, rank = lax.axis_size(axes), lax.axis_index(axes)
    runs = _runs(block, spec, layout)
    kv, pos, data = _exchange(block, runs, axes, cp, rank)
    k, v = unpacked(kv, block.k.shape[-1])
    tkv = block.k.shape[1]
    return block.replace(k=k, v=v, kv_pos=pos, **data,
                         mask=_columns(block.mask, runs, rank, tkv),
                         bias=_columns(block.bias, runs, rank, tkv))


def _forward(block: Block, spec, axes, kernel, layout):
    local = _kernel_block(block, spec, axes, layout)
    o, lse = kernel.forward(local, spec)
    groups = block.q.shape[2] // block.v.shape[2]
    # One device multiplies every V by a probability (0 outside the window): NaN in any V
    # reaches every row of its head.
    o = o + jnp.repeat(_unseen(block.v, axes), groups, axis=2)
    o = o.astype(block.q.dtype)
    return (o, lse), (block, local, o, lse)


def _backward(spec, axes, kernel, layout, residuals, cotangents):
    block, local, o, lse = residuals
    do, dlse = cotangents
    cp, rank = lax.axis_size(axes), lax.axis_index(axes)
    runs = _runs(block, spec, layout)
    q, k, v, bias = block.q, block.k, block.v, block.bias
    b, _, h, d = q.shape
    hkv, dv, tkv = k.shape[2], v.shape[3], k.shape[1]
    g_q, g_k, g_v, g_b = kernel.backward(local, o, lse, do, spec, delta=row_delta(o, do, dlse))

    # dK/dV of each piece go home: local ones in place, halos by the reverse permute.
    g_kv = packed(g_k, g_v)
    dkv = packed(jnp.zeros(k.shape, g_k.dtype), jnp.zeros(v.shape, g_v.dtype))
    for shift in (0, -1, 1):
        mine = [(p, start) for p, start in zip(runs, _offsets(runs)) if p.shift == shift]
        if not mine:
            continue
        back = _joined([_cut(g_kv, start, p.width) for p, start in mine])
        if shift:
            back = _permute(back, axes, cp, shift, back=True)
        for (p, _), start in zip(mine, _offsets([p for p, _ in mine])):
            dkv = jax.tree.map(lambda acc, x: acc.at[:, p.offset:p.offset + p.width].add(x),
                               dkv, _cut(back, start, p.width))
    dk, dv_ = unpacked(dkv, d)

    # What the query-key pairs outside the window add on one device (kernel contract):
    # dq += Σ 0·K, dk += Σ 0·Q, dv += Σ (0·lse + 0·dO), over all keys / queries; one psum.
    groups = h // hkv
    nan_rows = jnp.where(jnp.isnan(jnp.swapaxes(lse, 1, 2)), jnp.nan, 0.0)[..., None]
    terms = (zero_times(k), zero_times(q), nan_rows + zero_times(do))
    sums = lax.psum(jnp.concatenate([jnp.sum(x, axis=1).reshape(b, -1) for x in terms],
                                    axis=1), axes)
    sum_k, sum_q, sum_do = (s.reshape(b, 1, heads, width) for s, heads, width in zip(
        jnp.split(sums, [hkv * d, hkv * d + h * d], axis=1), (hkv, h, h), (d, d, dv)))
    g_q = g_q + jnp.repeat(sum_k, groups, axis=2)
    dk = dk + jnp.sum(sum_q.reshape(b, 1, hkv, groups, d), axis=3)
    dv_ = dv_ + jnp.sum(sum_do.reshape(b, 1, hkv, groups, dv), axis=3)

    dbias = None
    if bias is not None:
        dbias = jnp.zeros(bias.shape, g_b.dtype)
        for p, offset in zip(runs, _offsets(runs)):
            start = (rank + p.shift) * tkv + p.offset
            here = lax.dynamic_slice_in_dim(dbias, start, p.width, axis=3)
            dbias = lax.dynamic_update_slice_in_dim(
                dbias, here + g_b[..., offset:offset + p.width], start, axis=3)
    return g_q, dk, dv_, dbias


#: Windowed attention of the local queries against their halos and local keys,
#: ``(block, spec, axes, kernel, layout) -> (o, lse)`` like
#: :func:`~cptransform.lowering.ring.ring_attention` (``empty_rows`` not applied). Runs
#: inside ``shard_map`` over ``axes``; ``layout`` is ``contiguous`` or ``zigzag`` and
#: ``spec``'s window must fit in one chunk (:func:`halo_feasible`). Differentiable w.r.t.
#: q, k, v and bias.
halo_attention = differentiable(_forward, _backward)


def halo(block: Block, *, spec, axes, kernel):
    """The ``halo`` schedule: :func:`halo_attention`, then the sinks and ``empty_rows``
    (the ``uniform`` mean is over every key of the sequence, not only the halos)."""
    axes = tuple(axes)
    o, lse = halo_attention(block.replace(sinks=None), spec, axes, kernel, spec.layout)
    return finished(block, spec, o, lse, axes)


def halo_feasible(shape: AttentionShape) -> str | None:
    """Halo needs a window finite on both sides whose sides fit in one chunk of a contiguous
    or zigzag layout, and positions that are the token indices."""
    if shape.kv_len != shape.seq_len:
        return ("halo exchanges the neighbours of one sequence, but this attention has "
                f"{shape.seq_len} queries and {shape.kv_len} keys; use schedule='ring'")
    if shape.q_padded != shape.seq_len:
        return (f"sequence length {shape.seq_len} is not a multiple of {shape.multiple} "
                f"({shape.layout}, cp={shape.cp}) and halo does not pad (a pad query would "
                "need a key from the far end); pad it or use schedule='ring'")
    if shape.layout not in CHUNKS_PER_RANK:
        return (f"the {shape.layout} layout puts every neighbour of a token on another rank, "
                "so halo would send everything; use load_balance='none' (contiguous) or "
                "'zigzag', or schedule='ring'")
    chunks = shape.cp * CHUNKS_PER_RANK[shape.layout]
    if shape.seq_len % chunks:
        return (f"sequence length {shape.seq_len} does not split into {chunks} {shape.layout} "
                f"chunks; pad it to a multiple of {chunks}")
    sides = halo_sides(shape.band)
    if sides is None:
        return ("halo needs a sliding window bounded on both sides (window=(left, right), or "
                "a window's left side with causal); this mask reaches keys arbitrarily far "
                "away: use schedule='ring'")
    chunk = shape.seq_len // chunks
    if max(sides) > chunk:
        return (f"the window (left {sides[0]}, right {sides[1]}) reaches past the neighbouring "
                f"chunk of {chunk} tokens ({shape.layout}, cp={shape.cp}); use a smaller cp, "
                "load_balance='none' (chunks of seq_len/cp), or schedule='ring'")
    if shape.explicit_positions:
        return ("halo finds a token's window by its index, but this attention takes explicit "
                "positions, so a key in the window may sit on any rank; drop the positions "
                "(use the token indices) or use schedule='ring'")
    return None


def _kernel_keys(shape: AttentionShape) -> tuple[int, tuple[Piece, ...]]:
    """How many keys the kernel call of a rank holds, and their pieces (an infeasible side
    is priced at a whole chunk)."""
    chunks = CHUNKS_PER_RANK.get(shape.layout, 1)
    local = shape.q_padded // shape.cp
    chunk = local // chunks
    left, right = (min(side, chunk) for side in halo_sides(shape.band) or (chunk, chunk))
    runs = pieces("zigzag" if chunks == 2 else "contiguous", local, left, right)
    return sum(p.width for p in runs), runs


def key_pieces(shape: AttentionShape) -> list[list[np.ndarray]]:
    """``[rank][piece]``: the positions of each piece of keys a rank's kernel call holds, in
    the kernel's key order; a missing neighbour's halo sits at :data:`NO_KEY` (never seen)."""
    ranks = rank_positions(shape)
    cp = shape.cp
    _, runs = _kernel_keys(shape)
    return [[ranks[r + p.shift, p.offset:p.offset + p.width] if 0 <= r + p.shift < cp
             else np.full(p.width, NO_KEY) for p in runs] for r in range(cp)]


def halo_statement(shape: AttentionShape) -> Statement:
    """The halo exchange over ``shape.cp`` devices (see the module doc; a side that is open
    or wider than a chunk, an infeasible shape, is priced at a whole chunk): one kernel call
    per rank, its queries against its halos and local keys (:func:`key_pieces`), which
    keeps the halos (residuals) and the float32 dK/dV of all of them."""
    local = shape.q_padded // shape.cp
    keys, _ = _kernel_keys(shape)
    halos = keys - local
    permute = "collective_permute"
    transfers = (operands(shape, ("k", "v"), permute, shape.batch * halos)
                 + metadata(shape, ("kv",), permute, tokens=halos)
                 + operands(shape, ("k", "v"), permute, shape.batch * halos,
                            element=shape.grad_bytes, prefix="d", backward=True))
    # The Σ 0·x terms that carry NaN/Inf from outside the window (float32 all-reduces).
    reduce = dict(kind="all_reduce", group=shape.cp, payload=False)
    zero_qkv = shape.kv_heads * shape.head_dim + shape.heads * (shape.head_dim + shape.dv)
    transfers += [Transfer("zero_v", held=shape.batch * shape.kv_heads * shape.dv * F32,
                           **reduce),
                  Transfer("zero_qkv", held=shape.batch * zero_qkv * F32, backward=True,
                           **reduce)]
    grid = Grid(f"halo over {shape.cp} devices, {{layout}} layout (one kernel call per "
                "device: neighbours' halos and local keys)", "device", "key piece",
                tuple(rank_positions(shape)), tuple(map(tuple, key_pieces(shape))),
                Calls.EACH_ROW, shape.heads)
    return Statement(tuple(transfers), (grid,),
                     LocalStep(local, keys, shape.heads, shape.kv_heads))


HALO = register_schedule(Schedule("halo", mesh_axes=1, run=halo, statement=halo_statement,
                                  feasible=halo_feasible, order=4))
