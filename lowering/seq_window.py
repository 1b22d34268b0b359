"""A windowed op along the sharded sequence: halo exchange, the local op, a slice.

A :class:`~cptransform.op.seq_window.Window` reads ``left`` tokens before and ``right``
after each output token. Under ``shard_map`` over the CP axes each local chunk of the
sequence gets its halos from the neighbouring ranks with
:func:`~cptransform.lowering.halo.receive_halos` (the pieces of the halo schedule:
:func:`~cptransform.lowering.halo.pieces`), the op runs on ``[left halo ‖ chunk ‖ right
halo]`` with its own padding, and the ``chunk`` outputs in the middle are kept:

* contiguous (natural order, ``window.layout`` None, or a contiguous layout): one chunk per
  rank; the left halo comes from rank ``r-1``, the right one from ``r+1``;
* zigzag (``reorder-sequence`` kept the op in layout order): rank ``r`` holds chunks ``r``
  and ``2cp-1-r`` and each gets its own neighbours, as the halo schedule's keys do; on rank
  ``cp-1`` the two chunks are each other's neighbours (taken locally);
* striped puts every neighbour of a token on another rank: ``reorder-sequence`` un-permutes
  the operand first (a gather, logged with its bytes), so the op runs contiguous.

A halo past an end of the sequence is the op's padding value (``window.fill``), so every
output is computed from exactly the entries it reads on one device, and its gradient is the
transpose JAX derives through ``shard_map`` (the halos' cotangents go back to their owners
by the reverse permutes; a conv kernel's gradient is summed over the ranks).

Communication per op and device, forward: ``n·(left + right)`` tokens of the operand
(``n`` chunks per rank: 1 contiguous, 2 zigzag) by two collective-permutes,
``n·(left + right)·(elements per token)·itemsize`` bytes; the backward sends as many
cotangent bytes back (plus an all-reduce of a conv kernel's gradient).
"""
from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from cptransform.ir.errors import ContextParallelError
from cptransform.lowering.halo import CHUNKS_PER_RANK, Piece, pieces, receive_halos
from cptransform.op.seq_window import Window


def window_layout(window: Window) -> str:
    """The layout name the operand of ``window`` is held in along the sequence."""
    return "contiguous" if window.layout is None else window.layout.name


def halo_bytes(window: Window, shape: tuple[int, ...], itemsize: int) -> int:
    """Forward bytes one rank receives for ``window`` on an operand of ``shape``."""
    per_token = math.prod(shape) // shape[window.dim]
    chunks = CHUNKS_PER_RANK.get(window_layout(window), 1)
    return chunks * (window.left + window.right) * per_token * itemsize


def check_window(window: Window, shape: tuple[int, ...], cp: int, where: str) -> None:
    """Refuse a window the halo exchange cannot compute exactly, naming the fix."""
    layout = window_layout(window)
    if layout not in CHUNKS_PER_RANK:
        raise ContextParallelError(
            f"{window.primitive.name} at {where} reads its neighbours along the sequence, "
            f"which the {layout} layout puts on other ranks; use load_balance='none' or "
            "'zigzag'")
    n = shape[window.dim]
    chunks = cp * CHUNKS_PER_RANK[layout]
    if n % chunks:
        raise ContextParallelError(
            f"{window.primitive.name} at {where} runs with a halo exchange, which needs the "
            f"sequence length {n} to split into {chunks} {layout} chunks (cp={cp}); pad the "
            f"sequence to a multiple of {chunks}")
    chunk = n // chunks
    if max(window.left, window.right) > chunk:
        raise ContextParallelError(
            f"{window.primitive.name} at {where} reads {window.left} tokens before and "
            f"{window.right} after each token, more than a {layout} chunk of {chunk} tokens "
            f"(cp={cp}); use a smaller cp, a longer sequence, or load_balance='none' "
            "(chunks of seq_len/cp)")


def _chunk_runs(runs: tuple[Piece, ...], left: int, right: int,
                chunks: int) -> list[list[Piece]]:
    """``runs`` cut into each local chunk's ``[left halo, chunk, right halo]``."""
    size = 1 + (left > 0) + (right > 0)
    return [list(runs[i * size:(i + 1) * size]) for i in range(chunks)]


def _local(x, *rest, window: Window, layout: str, seq, d: int, left: int, right: int):
    """The op on one rank's chunks (sequence dim ``d``) with halos of ``left`` and
    ``right`` tokens."""
    cp, rank = lax.axis_size(seq), lax.axis_index(seq)
    xs = jnp.moveaxis(x, d, 1)
    n = xs.shape[1]
    chunks = CHUNKS_PER_RANK[layout]
    c = n // chunks
    runs = pieces(layout, n, left, right)
    got = receive_halos(xs, runs, seq, cp)
    fill = jnp.asarray(window.fill, x.dtype)
    # A replicated operand (a conv kernel) meets per-rank chunks: its gradient is summed.
    rest = [lax.pcast(r, tuple(seq), to="varying") for r in rest]

    def piece(p: Piece):
        if not p.shift:
            return xs[:, p.offset:p.offset + p.width]
        if chunks == 2 and p.shift == 1:
            # On the last rank the low chunk's right neighbour is its own high chunk, and
            # the high chunk's left neighbour its own low chunk.
            start = (p.offset + c) % n
            return jnp.where(rank == cp - 1, xs[:, start:start + p.width], got[p])
        sent = (rank + p.shift >= 0) & (rank + p.shift < cp)
        return jnp.where(sent, got[p], fill)

    outs = []
    for group in _chunk_runs(runs, left, right, chunks):
        extended = jnp.moveaxis(jnp.concatenate([piece(p) for p in group], axis=1), 1, d)
        y = window.apply(extended, *rest)
        outs.append(lax.slice_in_dim(y, left, left + c, axis=d))
    return jnp.concatenate(outs, axis=d)


def windowed_op(x, *rest, window: Window, mesh, seq: tuple[str, ...], seq_dim: int,
                where: str = "?"):
    """``seq_window_p(x, *rest, window=window)`` with ``x``'s dim ``seq_dim`` (the sequence,
    in ``window.layout`` order) sharded over the mesh axes ``seq`` (major first), under
    ``shard_map``: with a halo exchange when the window runs along the sequence, without
    when it runs along another dim; ``rest`` (a conv kernel) is replicated."""
    cp = math.prod(mesh.shape[a] for a in seq)
    along = seq_dim == window.dim
    if along:
        check_window(window, x.shape, cp, where)
    layout = window_layout(window)
    spec = [None] * x.ndim
    spec[seq_dim] = seq if len(seq) > 1 else seq[0]
    run = partial(_local, window=window, layout=layout, seq=seq, d=seq_dim,
                  left=window.left if along else 0, right=window.right if along else 0)
    return jax.shard_map(run, mesh=mesh, in_specs=(P(*spec),) + (P(),) * len(rest),
                         out_specs=P(*spec), axis_names=set(seq))(x, *rest)
