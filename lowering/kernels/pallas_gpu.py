"""GPU-style (Triton) Pallas kernels: one program per (batch, head, block), the other
sequence walked by loops inside it, carrying the running softmax or the gradient
accumulators in float32 registers.

* ``cp_attention_fwd``: grid ``(B, H, nq)``, loops over the key tiles;
* ``cp_attention_dq``: the same Q-major grid, accumulating dQ (and writing dbias tiles);
* ``cp_attention_dkv``: KV-major grid ``(B, Hkv, nk)``, loops over the query tiles of each
  query head of the KV head's group; table, dense mask and bias transposed (grid axes
  swapped, tiles ``[bk, bq]``), computing ``Sᵀ = K·Qᵀ`` directly.

How a program walks its row of the block table (:func:`_walk`). The table's row is condensed
outside the kernel, by cheap XLA ops on the small table, into
:func:`~cptransform.lowering.kernels.block_table.loop_bounds` ``(lo, full_lo, full_hi, hi)``,
an ordinary int32 input. Two loops follow:

1. ``[full_lo, full_hi)``, the longest run of ``FULL`` tiles: no mask, no table read and
   no branch in the body, so Triton software-pipelines its K/V (Q/dO) loads over
   ``num_stages`` (a ``lax.cond`` per step, as the kernels had before, hides the loads in
   an ``scf.if`` the pipeliner does not enter);
2. the edge tiles ``[lo, full_lo)`` and ``[full_hi, hi)``, table-driven: a skipped tile takes
   an empty branch, a full one the unmasked body, a partial one the masked body.

Tiles outside ``[lo, hi)`` are ``SKIP`` and never visited. Every tile the kernels ran
before is run now, with the same body (full tiles unmasked, partial ones masked) and
nothing else, so the results are the old ones up to the rounding of float32 sums in
another order (the full run first, then the edges; a table tile in several loop steps;
about 1e-7 apart in interpret mode, bit-identical where neither changes), and the
``zero_times`` terms of skipped tiles are still added by the caller from the same table
(:mod:`.pallas_skipped`). The mask is
data (positions, segment ids, dense tiles, top-k selections), not program ids: even a
causal band is over positions that a ring rotates and a zigzag layout permutes, so the
bounds always come from the table rather than from ``pl.program_id`` arithmetic.

Tuning (:func:`tuning`, modelled on tokamax's Pallas-Triton heuristics): the loop's tile
along the walked sequence, ``step``, divides the table's tile (a table tile is walked in
``tile / step`` steps of its kind): 64 keys in the forward, 32 in both backward kernels
(tokamax's ``block_k`` / ``block_n2`` / ``block_m1``), halved for rows over 256 bytes;
``num_warps`` 8 for programs of at least 64 rows whose float32 accumulators hold over
64 × 128 values (dK/dV at D = 128, any 128-row program at D = 128), else 4; ``num_stages``
3 in a forward over rows of at most 256 bytes, 1 over rows of 1 KiB, else 2. The table's
tile (:func:`table_block`, the programs' rows) is 128 for rows of at most 128 bytes, 64 up
to 256 bytes (D = 128 in bf16) and 32 beyond. The row side of the mask (positions, segment
ids, padding of the program's own block) is loaded once per program; steps start at
``pl.multiple_of`` offsets (aligned, vectorised loads).

What was checked without a GPU: the lowered Triton IR, compiled for sm_90a by a pip Triton
(3.9) and ptxas, at S = 8K, bf16, D = 128, causal. Before (128-tiles, 4 warps, 2 stages, a
``lax.cond`` per step) the three kernels used 255 registers and spilled 4.0 / 2.6 / 6.0 KB
(forward / dQ / dK/dV) with no asynchronous copies (nothing pipelined); now none spills and
each loop's loads are ``cp.async`` multi-buffered (the same for D = 64 and every mask kind;
D = 256 at 32-row tiles, not 64, to stay spill-free). Speed is unmeasured: the command that
re-measures issue 32's table is in ``bench/kernels.py``'s docstring.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from cptransform.op.attention_spec import AttentionSpec
from cptransform.op.mask_terms import BlockKind
from cptransform.lowering.kernels.block_table import FULL_HI, FULL_LO, HI, LO, loop_bounds
from cptransform.lowering.kernels.pallas_operands import Operands, head_index, out_struct
from cptransform.lowering.kernels.pallas_tiles import (
    F32, TileSides, as_column, as_row, dot_nn, dot_nt, finish_softmax, grad_logits,
    initial_state, online_softmax, tile_logits, valid_range, visible_tile)


@dataclass(frozen=True)
class Tuning:
    """How one kernel walks its tiles: ``step`` rows or columns of the walked sequence per
    loop step (a divisor of the table's tile) and Triton's ``num_warps`` / ``num_stages``."""

    step: int
    num_warps: int
    num_stages: int


#: Loop step along the walked sequence, by kernel (tokamax: forward ``block_k`` 64,
#: backward ``block_n2`` / ``block_m1`` 32); halved for rows over 256 bytes.
STEP = {"fwd": 64, "dq": 32, "dkv": 32}


def tuning(kernel: str, rows: int, tile: int, d: int, dv: int, itemsize: int) -> Tuning:
    """The :class:`Tuning` of ``kernel`` (``"fwd"``, ``"dq"`` or ``"dkv"``) for programs of
    ``rows`` rows walking tiles of ``tile`` along the other sequence, head dims ``d`` /
    ``dv`` and an operand itemsize (see the module doc)."""
    width = max(d, dv) * itemsize
    step = min(tile, STEP[kernel] if width <= 256 else STEP[kernel] // 2)
    accumulator = rows * (d + dv if kernel == "dkv" else dv if kernel == "fwd" else d)
    warps = 8 if rows >= 64 and accumulator > 64 * 128 else 4
    stages = 1 if width >= 1024 else 3 if kernel == "fwd" and width <= 256 else 2
    return Tuning(step, warps, stages)


def table_block(head_dim: int, itemsize: int) -> int:
    """The default tile of the block table on a GPU (the programs' rows): 128 for rows of
    at most 128 bytes, 64 up to 256 bytes (tokamax's forward and backward programs), else
    32 (D = 256 in bf16, D ≥ 128 in float32: 64-row dK/dV programs spill registers)."""
    width = head_dim * itemsize
    return 128 if width <= 128 else 64 if width <= 256 else 32


def _whole(x):
    """A block that is the whole array (small: the block table and its loop bounds)."""
    return pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)


def _mask_inputs(ops: Operands, *, kv_major: bool, group: int):
    """``(names, arrays, specs)`` for positions, segment ids, dense mask, top-k selection and
    bias.

    Q-major (grid ``(b, h, i)``): this program's query block as a column, all keys as a
    row; mask/selection/bias rows ``[bq, Tkvp]``. KV-major (grid ``(b, hkv, j)``): this key
    block as a column, all queries as a row; the transposed ones ``[group, bk, Tqp]`` of the
    query heads of KV head ``hkv``.
    """
    bq, bk = ops.bq, ops.bk
    tqp, tkvp = ops.q.shape[2], ops.k.shape[2]
    names, arrays, specs = [], [], []
    for name, qx, kx in (("pos", ops.q_pos, ops.kv_pos), ("seg", ops.q_seg, ops.kv_seg)):
        if qx is None:
            continue
        lead = (lambda n: lambda b: head_index(n, b))(qx.shape[0])
        if kv_major:
            names += ["q_" + name, "kv_" + name]
            arrays += [as_row(qx), as_column(kx)]
            specs += [pl.BlockSpec((None, 1, tqp), lambda b, h, j, lead=lead: (lead(b), 0, 0)),
                      pl.BlockSpec((None, bk, 1), lambda b, h, j, lead=lead: (lead(b), j, 0))]
        else:
            names += ["q_" + name, "kv_" + name]
            arrays += [as_column(qx), as_row(kx)]
            specs += [pl.BlockSpec((None, bq, 1), lambda b, h, i, lead=lead: (lead(b), i, 0)),
                      pl.BlockSpec((None, 1, tkvp), lambda b, h, i, lead=lead: (lead(b), 0, 0))]
    for name, x in (("mask", ops.mask), ("picked", ops.picked), ("bias", ops.bias)):
        if x is None:
            continue
        nb, nh = x.shape[:2]
        names.append(name)
        if kv_major:
            heads = group if nh > 1 else 1
            arrays.append(jnp.swapaxes(x, 2, 3))
            specs.append(pl.BlockSpec(
                (None, heads, bk, tqp),
                lambda b, h, j, nb=nb, nh=nh: (head_index(nb, b), head_index(nh, h), j, 0)))
        else:
            arrays.append(x)
            specs.append(pl.BlockSpec(
                (None, None, bq, tkvp),
                lambda b, h, i, nb=nb, nh=nh: (head_index(nb, b), head_index(nh, h), i, 0)))
    return names, arrays, specs


@dataclass(frozen=True)
class _Rows:
    """The mask inputs of a program's own block (its tile rows), loaded once per program:
    positions and segment ids ``[rows, 1]`` (``None`` when absent) and the padding check."""

    pos: object
    seg: object
    valid: object


def _rows(refs, ops: Operands, kv_major: bool) -> _Rows:
    """This program's :class:`_Rows`: its query block (Q-major) or key block (KV-major)."""
    side, start, size, limit = ("kv", pl.program_id(2) * ops.bk, ops.bk, ops.tkv) if kv_major \
        else ("q", pl.program_id(2) * ops.bq, ops.bq, ops.tq)
    load = lambda name: refs[name][...] if name in refs else None  # noqa: E731
    return _Rows(load(side + "_pos"), load(side + "_seg"), valid_range(start, size, limit, 0))


def _sides(refs, ops: Operands, rows: _Rows, start, width: int, kv_major: bool,
           head=0) -> TileSides:
    """The :class:`TileSides` of the tile of ``rows`` against the ``width`` columns from
    ``start`` (keys Q-major, queries KV-major); ``head`` picks the query head inside a
    KV-major program's group."""
    cols = pl.ds(start, width)
    side = "q" if kv_major else "kv"
    load = lambda name: refs[name][:, cols] if name in refs else None  # noqa: E731

    def tile(name):
        """This tile of a ``[bq, Tkvp]`` row band (Q-major) or ``[group, bk, Tqp]`` (KV-major)."""
        if name not in refs:
            return None
        m = refs[name]
        return m[head if m.shape[0] > 1 else 0, :, cols] if kv_major else m[:, cols]

    limit = ops.tq if kv_major else ops.tkv
    return TileSides(row_pos=rows.pos, col_pos=load(side + "_pos"), row_seg=rows.seg,
                     col_seg=load(side + "_seg"), dense=tile("mask"), picked=tile("picked"),
                     row_valid=rows.valid, col_valid=valid_range(start, width, limit, 1),
                     transposed=kv_major)


def _by_kind(kind, skip, full, partial, carry):
    """Run ``skip``, ``full`` or ``partial`` on ``carry`` by the table entry ``kind``."""
    return lax.cond(kind == BlockKind.SKIP, skip,
                    lambda c: lax.cond(kind == BlockKind.FULL, full, partial, c), carry)


def _bounds(refs, at, per_tile: int):
    """``(lo, full_lo, full_hi, hi)`` of the table row ``at`` in loop steps (``per_tile``
    steps per table tile)."""
    return tuple(refs["bounds"][(*at, c)] * per_tile for c in (LO, FULL_LO, FULL_HI, HI))


def _walk(refs, at, per_tile: int, tile, carry, skip=None):
    """Run the tiles of table row ``at = (b, h, row)`` (indices into ``table`` and
    ``bounds``) on ``carry``: ``tile(t, masked, carry)`` runs loop step ``t`` (tile
    ``t // per_tile`` of the row), ``skip(t, carry)`` a skipped step inside the edges
    (default: nothing). First the run of full tiles, unmasked and unbranched, then the
    edge tiles by the table (see the module doc)."""
    lo, full_lo, full_hi, hi = _bounds(refs, at, per_tile)
    carry = lax.fori_loop(full_lo, full_hi, lambda t, c: tile(t, False, c), carry)
    before = full_lo - lo
    n = jnp.int32(per_tile)

    def edge(u, c):
        t = jnp.where(u < before, lo + u, full_hi + (u - before))
        kind = refs["table"][(*at, t if per_tile == 1 else lax.div(t, n))]
        return _by_kind(kind, (lambda c: c) if skip is None else functools.partial(skip, t),
                        functools.partial(tile, t, False), functools.partial(tile, t, True), c)

    return lax.fori_loop(0, before + (hi - full_hi), edge, carry)


def _at(step: int, t):
    """The ``step``-long slice of loop step ``t``, its start hinted as a multiple of ``step``
    (aligned, vectorised loads)."""
    return pl.ds(pl.multiple_of(t * step, step), step)


def _call(kernel, names, arrays, in_specs, out_shape, out_specs, grid, name, interpret,
          tune: Tuning):
    params = None if interpret else pltriton.CompilerParams(
        num_warps=tune.num_warps, num_stages=tune.num_stages)
    return pl.pallas_call(functools.partial(kernel, names=tuple(names)), out_shape=out_shape,
                          grid=grid, in_specs=in_specs, out_specs=out_specs,
                          compiler_params=params, interpret=interpret, name=name)(*arrays)


def _table_inputs(table):
    """``(names, arrays, specs)`` of a block table and its :func:`loop_bounds`."""
    bounds = loop_bounds(table)
    return ["table", "bounds"], [table, bounds], [_whole(table), _whole(bounds)]


def forward(ops: Operands, spec: AttentionSpec, interpret):
    """``(o [B, H, Tqp, Dv] f32, lse [B, H, Tqp] f32)``."""
    b, h, tqp, d = ops.q.shape
    tkvp, dv, g, bq, bk = ops.k.shape[2], ops.v.shape[3], ops.groups, ops.bq, ops.bk
    bt, ht = ops.table.shape[:2]
    tune = tuning("fwd", bq, bk, d, dv, ops.q.dtype.itemsize)
    step = tune.step
    t_names, t_arrays, t_specs = _table_inputs(ops.table)
    names, arrays, specs = _mask_inputs(ops, kv_major=False, group=g)
    names = ["q", "k", "v", *t_names] + names
    arrays = [ops.q, ops.k, ops.v, *t_arrays] + arrays
    specs = [pl.BlockSpec((None, None, bq, d), lambda bi, hi, i: (bi, hi, i, 0)),
             pl.BlockSpec((None, None, tkvp, d), lambda bi, hi, i: (bi, hi // g, 0, 0)),
             pl.BlockSpec((None, None, tkvp, dv), lambda bi, hi, i: (bi, hi // g, 0, 0)),
             *t_specs] + specs

    def kernel(*refs, names):
        refs, (o_ref, lse_ref) = dict(zip(names, refs)), refs[len(names):]
        bi, hi, i = (pl.program_id(a) for a in range(3))
        q = refs["q"][...]
        rows = _rows(refs, ops, False)

        def tile(t, masked, state):
            kv = _at(step, t)
            bias = refs["bias"][:, kv] if "bias" in refs else None
            s, _ = tile_logits(spec, q, refs["k"][kv, :], bias)
            ok = visible_tile(spec, _sides(refs, ops, rows, t * step, step, False)) \
                if masked else None
            return online_softmax(state, s, ok, refs["v"][kv, :])

        at = (head_index(bt, bi), head_index(ht, hi), i)
        o, lse = finish_softmax(_walk(refs, at, bk // step, tile, initial_state(bq, dv)))
        o_ref[...] = o
        lse_ref[...] = lse

    o, lse = _call(
        kernel, names, arrays, specs,
        [out_struct((b, h, tqp, dv), F32, arrays), out_struct((b, h, tqp, 1), F32, arrays)],
        [pl.BlockSpec((None, None, bq, dv), lambda bi, hi, i: (bi, hi, i, 0)),
         pl.BlockSpec((None, None, bq, 1), lambda bi, hi, i: (bi, hi, i, 0))],
        (b, h, ops.nq), "cp_attention_fwd", interpret, tune)
    return o, lse[..., 0]


def _zero_outside(ref, lo, hi, count, step: int):
    """Zero the ``step``-wide column tiles ``[0, lo)`` and ``[hi, count)`` of ``ref`` (the
    dbias tiles of the steps a dQ program never visits)."""
    def zero(u, c):
        ref[:, _at(step, jnp.where(u < lo, u, hi + (u - lo)))] = \
            jnp.zeros((ref.shape[0], step), ref.dtype)
        return c

    lax.fori_loop(0, lo + (count - hi), zero, 0)


def backward_dq(ops: Operands, spec: AttentionSpec, do, lse, delta, interpret):
    """Q-major dQ kernel: ``(dq [B, H, Tqp, D] f32, dbias [B, H, Tqp, Tkvp] f32 | None)``;
    arguments as in :func:`~cptransform.lowering.kernels.pallas_tpu.backward_dq`."""
    b, h, tqp, d = ops.q.shape
    tkvp, dv, g, bq, bk = ops.k.shape[2], ops.v.shape[3], ops.groups, ops.bq, ops.bk
    bt, ht = ops.table.shape[:2]
    has_bias = ops.bias is not None
    tune = tuning("dq", bq, bk, d, dv, ops.q.dtype.itemsize)
    step, per_tile = tune.step, bk // tune.step
    t_names, t_arrays, t_specs = _table_inputs(ops.table)
    names, arrays, specs = _mask_inputs(ops, kv_major=False, group=g)
    q_map = lambda bi, hi, i: (bi, hi, i, 0)  # noqa: E731
    kv_map = lambda bi, hi, i: (bi, hi // g, 0, 0)  # noqa: E731
    names = ["q", "k", "v", "do", "lse", "delta", *t_names] + names
    arrays = [ops.q, ops.k, ops.v, do, as_column(lse), as_column(delta), *t_arrays] + arrays
    specs = [pl.BlockSpec((None, None, bq, d), q_map), pl.BlockSpec((None, None, tkvp, d), kv_map),
             pl.BlockSpec((None, None, tkvp, dv), kv_map),
             pl.BlockSpec((None, None, bq, dv), q_map), pl.BlockSpec((None, None, bq, 1), q_map),
             pl.BlockSpec((None, None, bq, 1), q_map), *t_specs] + specs
    out_shape = [out_struct((b, h, tqp, d), F32, arrays)]
    out_specs = [pl.BlockSpec((None, None, bq, d), q_map)]
    if has_bias:
        out_shape.append(out_struct((b, h, tqp, tkvp), F32, arrays))
        out_specs.append(pl.BlockSpec((None, None, bq, tkvp), q_map))

    def kernel(*refs, names):
        refs, outs = dict(zip(names, refs)), refs[len(names):]
        bi, hi, i = (pl.program_id(a) for a in range(3))
        q, do_, lse_, delta_ = (refs[n][...] for n in ("q", "do", "lse", "delta"))
        rows = _rows(refs, ops, False)

        def tile(t, masked, acc):
            kv = _at(step, t)
            k = refs["k"][kv, :]
            s, tanh = tile_logits(spec, q, k, refs["bias"][:, kv] if has_bias else None)
            ok = visible_tile(spec, _sides(refs, ops, rows, t * step, step, False)) \
                if masked else None
            ds, dbias, _ = grad_logits(spec, s, tanh, ok, lse_, delta_,
                                       dot_nt(do_, refs["v"][kv, :]))
            if has_bias:
                outs[1][:, kv] = dbias
            return acc + dot_nn(ds.astype(k.dtype), k)

        def skip(t, acc):
            outs[1][:, _at(step, t)] = jnp.zeros((bq, step), F32)
            return acc

        at = (head_index(bt, bi), head_index(ht, hi), i)
        if has_bias:  # the dbias tiles of steps never visited
            lo, _, _, hi_ = _bounds(refs, at, per_tile)
            _zero_outside(outs[1], lo, hi_, ops.nk * per_tile, step)
        outs[0][...] = _walk(refs, at, per_tile, tile, jnp.zeros((bq, d), F32),
                             skip if has_bias else None)

    out = _call(kernel, names, arrays, specs, out_shape, out_specs, (b, h, ops.nq),
                "cp_attention_dq", interpret, tune)
    return out[0], (out[1] if has_bias else None)


def backward_dkv(ops: Operands, spec: AttentionSpec, do, lse, delta, interpret):
    """KV-major dK/dV kernel: ``(dk [B, Hkv, Tkvp, D], dv [B, Hkv, Tkvp, Dv])`` float32.

    Grid ``(B, Hkv, nk)``; a loop over the ``G`` query heads of KV head ``hkv`` walks each
    head's row of the transposed table (:func:`_walk`), so one program sums its KV head's
    gradient over the whole group.
    """
    b, h, tqp, d = ops.q.shape
    hkv, tkvp = ops.k.shape[1], ops.k.shape[2]
    dv, g, bq, bk = ops.v.shape[3], ops.groups, ops.bq, ops.bk
    table_t = jnp.swapaxes(ops.table, 2, 3)
    bt, ht = table_t.shape[:2]
    tune = tuning("dkv", bk, bq, d, dv, ops.q.dtype.itemsize)
    step = tune.step
    t_names, t_arrays, t_specs = _table_inputs(table_t)
    names, arrays, specs = _mask_inputs(ops, kv_major=True, group=g)
    group_map = lambda bi, hk, j: (bi, hk, 0, 0)  # noqa: E731
    kv_map = lambda bi, hk, j: (bi, hk, j, 0)  # noqa: E731
    names = ["q", "k", "v", "do", "lse", "delta", *t_names] + names
    arrays = [ops.q, ops.k, ops.v, do, as_row(lse), as_row(delta), *t_arrays] + arrays
    specs = [pl.BlockSpec((None, g, tqp, d), group_map), pl.BlockSpec((None, None, bk, d), kv_map),
             pl.BlockSpec((None, None, bk, dv), kv_map), pl.BlockSpec((None, g, tqp, dv), group_map),
             pl.BlockSpec((None, g, 1, tqp), group_map), pl.BlockSpec((None, g, 1, tqp), group_map),
             *t_specs] + specs

    def kernel(*refs, names):
        refs, (dk_ref, dv_ref) = dict(zip(names, refs)), refs[len(names):]
        bi, hk, j = (pl.program_id(a) for a in range(3))
        k, v = refs["k"][...], refs["v"][...]
        bias_ref = refs.get("bias")
        rows = _rows(refs, ops, True)

        def tile(head, t, masked, acc):
            qs = _at(step, t)
            q, do_ = refs["q"][head, qs, :], refs["do"][head, qs, :]
            bias = None if bias_ref is None else \
                bias_ref[head if bias_ref.shape[0] > 1 else 0, :, qs]
            s_t, tanh = tile_logits(spec, k, q, bias)
            ok = visible_tile(spec, _sides(refs, ops, rows, t * step, step, True, head)) \
                if masked else None
            ds_t, _, p_t = grad_logits(spec, s_t, tanh, ok, refs["lse"][head, :, qs],
                                       refs["delta"][head, :, qs], dot_nt(v, do_))
            dk_acc, dv_acc = acc
            return (dk_acc + dot_nn(ds_t.astype(q.dtype), q),
                    dv_acc + dot_nn(p_t.astype(do_.dtype), do_))

        def per_head(head, acc):
            at = (head_index(bt, bi), head_index(ht, hk * g + head), j)
            return _walk(refs, at, bq // step, functools.partial(tile, head), acc)

        init = (jnp.zeros((bk, d), F32), jnp.zeros((bk, dv), F32))
        dk, dv_ = per_head(0, init) if g == 1 else lax.fori_loop(0, g, per_head, init)
        dk_ref[...] = dk
        dv_ref[...] = dv_

    return _call(
        kernel, names, arrays, specs,
        [out_struct((b, hkv, tkvp, d), F32, arrays), out_struct((b, hkv, tkvp, dv), F32, arrays)],
        [pl.BlockSpec((None, None, bk, d), kv_map), pl.BlockSpec((None, None, bk, dv), kv_map)],
        (b, hkv, ops.nk), "cp_attention_dkv", interpret, tune)
