"""A recurrence along the sharded sequence: state passing instead of gathering.

Under ``shard_map`` over the CP axes each device holds its chunks of the recurrence's
steps: one per rank for the contiguous layout, chunks ``r`` and ``2cp-1-r`` for zigzag
(``recurrence.layout``; a chunked recurrence's layout is the layout of its chunks). Chunk
``k`` in natural order needs what the chunks before it computed (after it, for a reverse
recurrence); by :class:`~cptransform.op.recurrence.Method`:

* ``prefix of totals`` (cumulative ops, associative scans): each chunk is scanned locally,
  its total (the last row, the first for a reverse scan) all-gathered, an exclusive prefix
  of the totals in natural chunk order folded on every device, and the chunk's prefix
  combined into its local results (by the op's identity where it has one, else only on the
  chunks that have a predecessor);
* ``state passing`` (a scan whose carry is affine, ``h' = A·h + b``): each chunk's summary
  ``(A_k, b_k)`` is computed by one scan over the chunk that runs the body from a zero
  carry (``b_k``) and, alongside, its linear part on a basis of carries (``A_k``: the
  :class:`~cptransform.op.recurrence.CarryMap` says which dims it mixes, which it keeps
  diagonal, and along which it is one map, where basis columns are packed); the summaries
  are all-gathered and applied in chunk order from the scan's initial carry, giving every
  chunk its true incoming carry, from which it re-runs the scan (its outputs, its final
  carry);
* ``pipeline`` (any carry): the devices run their chunks' carries one after another in
  natural chunk order, each passing its final carry to the next by a collective-permute
  (each step rematerialised, so memory stays ``∝ S/cp``), then re-run their chunks.

The final carry of the whole scan is the one the last chunk (the first, reversed) computes,
taken from the device holding it. Gradients are JAX's of this program: the transposed
collectives carry the summaries' cotangents back (the backward of the recurrence runs the
same construction from the other end), and a custom derivative rule in the body is kept.
"""
from __future__ import annotations

import math
from functools import partial
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from cptransform.analysis.affine_carry import carry_slice
from cptransform.analysis.primitives import Linear, facts
from cptransform.ir import compat
from cptransform.ir.rewrite import interpret
from cptransform.op.recurrence import CUMULATIVE, CarryMap, Method, Recurrence

#: Chunks per rank of the layouts whose chunks stay whole on one rank.
CHUNKS = {"contiguous": 1, "zigzag": 2}


def _layout(rec: Recurrence) -> str:
    return "contiguous" if rec.layout is None else rec.layout.name


def natural_chunk(rank, piece: int, cp: int):
    """The natural-order index of local chunk ``piece`` of ``rank`` (piece 1: zigzag's
    high chunk)."""
    return rank if piece == 0 else 2 * cp - 1 - rank


def _owner(layout: str, k: int, cp: int) -> tuple[int, int]:
    """``(rank, piece)`` holding natural chunk ``k``."""
    if layout == "contiguous":
        return k, 0
    return (k, 0) if k < cp else (2 * cp - 1 - k, 1)


def _by_rank(x, seq):
    """``x`` of every rank, stacked in ``lax.axis_index(seq)`` order (whatever order the
    release gathers a multi-axis group in)."""
    rows = lax.all_gather(x, seq, axis=0, tiled=False)
    ranks = lax.all_gather(lax.axis_index(seq), seq, axis=0, tiled=False)
    return jax.tree.map(lambda r: r[jnp.argsort(ranks)], rows)


def _natural(gathered, layout: str, cp: int) -> list:
    """Per natural chunk, its rows of ``gathered`` (``[cp, pieces, ...]`` leaves)."""
    return [jax.tree.map(lambda g: g[rank, piece], gathered)
            for rank, piece in (_owner(layout, k, cp) for k in range(cp * CHUNKS[layout]))]


def _pick(values: list, index):
    """``values[index]`` for a traced ``index`` (pytrees of equal structure)."""
    return jax.tree.map(lambda *xs: jnp.stack(xs)[index], *values)


# -- prefix of totals ---------------------------------------------------------------------

def _combine_of(rec: Recurrence):
    """``(combine(a, b) over leaf lists, identity per leaf or None)``."""
    if rec.primitive is None:
        return rec.combine, None
    op, identity = CUMULATIVE[rec.primitive.name]
    return (lambda a, b: [op(a[0], b[0])]), identity


def _prefix(rec: Recurrence, xs: list, seq, cp, rank) -> list:
    layout, d = _layout(rec), rec.axis
    pieces = CHUNKS[layout]
    combine, identity = _combine_of(rec)
    parts = [[lax.slice_in_dim(x, j * x.shape[d] // pieces, (j + 1) * x.shape[d] // pieces,
                               axis=d) for x in xs] for j in range(pieces)]
    scanned = [rec.apply(*part) for part in parts]
    edge = 0 if rec.reverse else -1
    totals = [[lax.index_in_dim(y, edge, axis=d, keepdims=True) for y in ys] for ys in scanned]
    gathered = _by_rank(jax.tree.map(lambda *t: jnp.stack(t), *totals), seq)
    chunk_totals = _natural(gathered, layout, cp)
    order = range(len(chunk_totals) - 1, -1, -1) if rec.reverse else range(len(chunk_totals))
    before, acc = [None] * len(chunk_totals), None
    for k in order:
        before[k] = acc
        acc = chunk_totals[k] if acc is None else combine(acc, chunk_totals[k])
    first = order[0]
    if identity is not None:
        before[first] = [jnp.full_like(t, identity(t.dtype)) for t in chunk_totals[first]]
    else:
        before[first] = chunk_totals[first]
    outs = []
    for j, ys in enumerate(scanned):
        k = natural_chunk(rank, j, cp)
        offset = [jnp.broadcast_to(o, y.shape) for o, y in zip(_pick(before, k), ys)]
        if identity is not None:
            outs.append(combine(offset, ys))
        else:
            outs.append(lax.cond(k != first, lambda o, y: list(combine(o, y)),
                                 lambda o, y: list(y), offset, ys))
    return [jnp.concatenate(leaf, axis=d) if pieces > 1 else leaf[0]
            for leaf in zip(*outs)]


# -- state passing ------------------------------------------------------------------------

def _packing(shape: tuple, leaf: CarryMap) -> tuple[int, int | None, int]:
    """``(inputs, pack dim, columns)``: the map's input entries (its mixed dims'), the free
    dim whose entries carry one basis column each, and how many linear passes that takes."""
    inputs = math.prod(shape[m] for m in leaf.mixed)
    pack = max(leaf.free, key=lambda f: shape[f]) if leaf.mixed and leaf.free else None
    width = shape[pack] if pack is not None else 1
    return inputs, pack, -(-inputs // width)


def _basis(shape: tuple, dtype, leaf: CarryMap):
    """``[columns, *shape]``: column ``r`` is one at the entries whose mixed index is
    ``r·width + (index along the pack dim)``, broadcast along the other dims."""
    inputs, pack, columns = _packing(shape, leaf)
    flat = jnp.zeros(shape, jnp.int32)
    for m in leaf.mixed:
        flat = flat * shape[m] + lax.broadcasted_iota(jnp.int32, shape, m)
    width = 1 if pack is None else shape[pack]
    lane = 0 if pack is None else lax.broadcasted_iota(jnp.int32, shape, pack)
    r = lax.broadcasted_iota(jnp.int32, (columns,) + shape, 0)
    return (flat[None] == r * width + lane).astype(dtype)


def _map_of(shape: tuple, leaf: CarryMap, columns_out):
    """The chunk's map ``[*non-free dims, *mixed dims]`` from its linear passes."""
    inputs, pack, _ = _packing(shape, leaf)
    y, dims = columns_out, list(range(len(shape)))
    if pack is not None:
        y = jnp.moveaxis(y, 1 + pack, 1)
        y = y.reshape((-1,) + y.shape[2:])
        dims.remove(pack)
    y = y[:inputs]
    for f in sorted((f for f in leaf.free if f != pack), reverse=True):
        y = jnp.take(y, 0, axis=dims.index(f) + 1)
        dims.remove(f)
    y = y.reshape(tuple(shape[m] for m in leaf.mixed) + y.shape[1:])
    return jnp.moveaxis(y, tuple(range(len(leaf.mixed))),
                        tuple(range(y.ndim - len(leaf.mixed), y.ndim)))


def _apply(shape: tuple, leaf: CarryMap, a, h):
    """``A·h`` for a map ``a`` from :func:`_map_of`."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    into = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    dims = range(len(shape))
    out = "".join(letters[d] for d in dims)
    a_sub = "".join(letters[d] for d in dims if d not in leaf.free) + \
        "".join(into[m] for m in leaf.mixed)
    h_sub = "".join(into[d] if d in leaf.mixed else letters[d] for d in dims)
    return jnp.einsum(f"{a_sub},{h_sub}->{out}", a, h, precision=lax.Precision.HIGHEST)


def _linear(eqn, values: list, lin: dict, dep: list[int]) -> list:
    """The linear part of ``eqn`` on the basis columns of its carry-dependent operands
    (``dep``): those take their columns, the other float operands of a sum are zero, the
    factors of a product keep their values."""
    linear = facts(eqn.primitive.name).linear

    def one(*columns):
        args = list(values)
        for i, c in zip(dep, columns):
            args[i] = c
        if linear is Linear.JOINT:
            for i, x in enumerate(args):
                if i not in dep and jnp.issubdtype(jnp.result_type(x), jnp.floating):
                    args[i] = jnp.zeros_like(x)
        return compat.bind_eqn(eqn, args)

    return jax.vmap(one)(*[lin[eqn.invars[i]] for i in dep])


def _summary_step(rec: Recurrence, needed: list, consts, state, x):
    """One step of the summary scan: the carry from zero and the basis columns."""
    loop = rec.loop
    body = compat.open_jaxpr(loop.body)
    hb, columns = state
    carry_in = body.invars[loop.consts:loop.consts + loop.carries]
    lin = {v: c for v, c, leaf in zip(carry_in, columns, rec.carries) if leaf.depends}

    def step(eqn, read):
        values = [read(a) for a in eqn.invars]
        outs = compat.bind_eqn(eqn, values)
        dep = [i for i, a in enumerate(eqn.invars) if not compat.is_literal(a) and a in lin]
        if dep:
            lin.update(zip(eqn.outvars, _linear(eqn, values, lin, dep)))
        return outs

    # Only the equations the next carry depends on (the outputs are not needed here).
    outs = body.outvars[:loop.carries]
    carry = interpret(SimpleNamespace(constvars=body.constvars, invars=body.invars,
                                      eqns=[body.eqns[i] for i in needed], outvars=outs),
                      compat.consts_of(loop.body), list(consts) + list(hb) + list(x), step)
    new_columns = tuple(lin[v] if leaf.depends else c
                        for v, c, leaf in zip(outs, columns, rec.carries))
    return (tuple(carry), new_columns), None


def _summary(rec: Recurrence, consts, xs: list):
    """``(maps, offsets)`` of one chunk: per carry leaf its composed map and ``b``."""
    loop = rec.loop
    needed = carry_slice(loop.body, loop.carries)
    carry_avals = [compat.aval_of(v) for v in
                   compat.open_jaxpr(loop.body).invars[loop.consts:loop.consts + loop.carries]]
    zero = tuple(jnp.zeros(a.shape, a.dtype) for a in carry_avals)
    basis = tuple(_basis(a.shape, a.dtype, leaf) for a, leaf in zip(carry_avals, rec.carries))
    (offsets, columns), _ = lax.scan(partial(_summary_step, rec, needed, consts),
                                     (zero, basis), tuple(xs), reverse=loop.reverse)
    maps = tuple(_map_of(a.shape, leaf, c) if leaf.depends else None
                 for a, leaf, c in zip(carry_avals, rec.carries, columns))
    return maps, offsets


def _incoming(rec: Recurrence, init, summaries: list) -> list:
    """The carry entering each natural chunk, from the scan's initial carry and the
    chunks' summaries applied in order (from the end for a reverse scan)."""
    n = len(summaries)
    order = range(n - 1, -1, -1) if rec.reverse else range(n)
    states, h = [None] * n, tuple(init)
    for k in order:
        states[k] = h
        maps, offsets = summaries[k]
        h = tuple(b if a is None else _apply(b.shape, leaf, a, hh) + b
                  for a, b, hh, leaf in zip(maps, offsets, h, rec.carries))
    return states


def _split(xs: list, pieces: int) -> list[list]:
    return [[lax.slice_in_dim(x, j * x.shape[0] // pieces, (j + 1) * x.shape[0] // pieces)
             for x in xs] for j in range(pieces)]


def _state_passing(rec: Recurrence, operands: list, seq, cp, rank):
    loop, layout = rec.loop, _layout(rec)
    consts = operands[:loop.consts]
    init = operands[loop.consts:loop.consts + loop.carries]
    parts = _split(operands[loop.consts + loop.carries:], CHUNKS[layout])
    summaries = [_summary(rec, consts, part) for part in parts]
    gathered = _by_rank(jax.tree.map(lambda *s: jnp.stack(s), *summaries), seq)
    incoming = _incoming(rec, init, _natural(gathered, layout, cp))
    return _rerun(rec, consts, parts, incoming, rank, cp)


def _rerun(rec: Recurrence, consts, parts, incoming, rank, cp):
    """Each chunk's scan from its incoming carry: ``(final carry per chunk, ys)``."""
    finals, ys = [], []
    for j, part in enumerate(parts):
        h = _pick(incoming, natural_chunk(rank, j, cp))
        carry, out = rec.loop.run(consts, h, part)
        finals.append(carry)
        ys.append(out)
    stacked = [jnp.stack(c) for c in zip(*finals)]
    return stacked, [jnp.concatenate(y) if len(parts) > 1 else y[0] for y in zip(*ys)]


# -- pipeline -----------------------------------------------------------------------------

def _pipeline(rec: Recurrence, operands: list, seq, cp, rank):
    loop, layout = rec.loop, _layout(rec)
    consts = operands[:loop.consts]
    init = tuple(operands[loop.consts:loop.consts + loop.carries])
    parts = _split(operands[loop.consts + loop.carries:], CHUNKS[layout])
    n = cp * CHUNKS[layout]

    @jax.checkpoint
    def run(h, part):
        return tuple(loop.run(consts, h, part)[0])

    order = list(range(n - 1, -1, -1)) if rec.reverse else list(range(n))
    incoming = [None] * n
    h = init
    for step, k in enumerate(order):
        owner, piece = _owner(layout, k, cp)
        incoming[k] = h
        h = lax.cond(rank == owner, run, lambda h, part: tuple(h), h, parts[piece])
        if step + 1 < n:
            following = _owner(layout, order[step + 1], cp)[0]
            if following != owner:
                h = tuple(compat.ppermute(x, seq, [(owner, following)]) for x in h)
    return _rerun(rec, consts, parts, incoming, rank, cp)


# -- the shard_map ------------------------------------------------------------------------

def _local(*operands, rec: Recurrence, seq):
    cp, rank = lax.axis_size(seq), lax.axis_index(seq)
    if rec.method is Method.PREFIX_OF_TOTALS:
        return _prefix(rec, operands, seq, cp, rank)
    run = _state_passing if rec.method is Method.STATE_PASSING else _pipeline
    finals, ys = run(rec, list(operands), seq, cp, rank)
    return [f[None] for f in finals] + ys


def passed_recurrence(*operands, recurrence: Recurrence, mesh, seq: tuple[str, ...]) -> list:
    """``recurrence_p(*operands)`` with its steps (dim ``recurrence.axis`` of its iterated
    operands, in ``recurrence.layout`` order) sharded over the mesh axes ``seq``, by its
    method (see the module doc); its other operands replicated."""
    rec = recurrence
    axis = seq if len(seq) > 1 else seq[0]

    def along(ndim):
        spec = [None] * ndim
        spec[rec.axis] = axis
        return P(*spec)

    in_specs = tuple(along(np.ndim(x)) if it else P() for x, it in zip(operands, rec.iterated))
    outs = jax.eval_shape(lambda *xs: rec.apply(*xs), *operands)
    out_specs = [along(o.ndim) if it else P(axis) for o, it in zip(outs, rec.iterated_out)]
    layout = _layout(rec)
    # The body's equations are re-bound as traced, outside any shard_map: without the
    # varying-axes check, which would want each of their literals cast. Nothing leaves
    # replicated (a final carry leaves stacked per rank), so the check guards nothing
    # here, and the replicated operands' cotangents are summed over the ranks.
    got = jax.shard_map(partial(_local, rec=rec, seq=seq), mesh=mesh, in_specs=in_specs,
                        out_specs=out_specs, axis_names=set(seq), check_vma=False)(*operands)
    cp = math.prod(mesh.shape[a] for a in seq)
    # A final carry is the one its last chunk (first, reversed) computed, on its owner.
    last = 0 if rec.reverse else cp * CHUNKS[layout] - 1
    rank, piece = _owner(layout, last, cp)
    return [y if it else y[rank, piece] for y, it in zip(got, rec.iterated_out)]
