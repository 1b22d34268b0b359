"""TPU-style Pallas kernels (splash-attention structure): the grid walks key blocks, the
running softmax and gradient accumulators live in VMEM scratch, and the block table is
scalar-prefetched into SMEM so that skipped tiles cost one ``pl.when`` and full tiles skip the
mask. So is its :func:`~cptransform.lowering.kernels.block_table.fetch_order`: the index maps
of the operands that change along the reduction axis (K/V and the key side in the forward and
dQ kernels; Q, dO, ``lse``, ``delta`` and the query side in dK/dV) read the tile to fetch from
it, so a skipped step names the block the pipeline already holds and no DMA happens (splash
attention's ``data_next``).

Three ``pallas_call``\\ s, named so they can be read in a jaxpr:

* ``cp_attention_fwd``: grid ``(B, H, nq, nk)``, key blocks innermost (a reduction);
* ``cp_attention_dq``: the same Q-major grid, accumulating dQ (and writing dbias tiles);
* ``cp_attention_dkv``: the KV-major grid ``(B, Hkv, nk, G·nq)``: key blocks outer, the
  query blocks of all ``G`` query heads of a KV head folded into one reduction axis. Its
  table (:func:`kv_major_table`) and dense mask/selection/bias are the forward ones
  transposed (grid axes swapped, and each tile ``[bk, bq]``), and it computes the transposed
  tile ``Sᵀ = K·Qᵀ`` directly.

Positions, segment ids, ``lse`` and ``delta`` enter as ``[.., T, 1]`` columns or ``[.., 1, T]``
rows (a block dim equal to the array dim is legal for Mosaic whatever its size).
"""
from __future__ import annotations

import functools

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from cptransform.op.attention_spec import AttentionSpec
from cptransform.op.mask_terms import BlockKind
from cptransform.lowering.kernels.block_table import fetch_order
from cptransform.lowering.kernels.pallas_operands import Operands, head_index, out_struct
from cptransform.lowering.kernels.pallas_tiles import (
    F32, TileSides, as_column, as_row, dot_nn, dot_nt, finish_softmax, grad_logits,
    initial_state, online_softmax, tile_logits, valid_range, visible_tile)

_SEMANTICS = ("parallel", "parallel", "parallel", "arbitrary")


def _flat_table(table):
    """1-D for SMEM (a 2-D SMEM array pads its last dim to 128 words)."""
    return table.reshape(-1)


def _table_index(shape, b, h, i, j):
    bt, ht, n1, n2 = shape
    return ((head_index(bt, b) * ht + head_index(ht, h)) * n1 + i) * n2 + j


def fetched_tile(shape):
    """The tile index a grid step ``(b, h, i, j)`` fetches along the reduction axis, read
    from the prefetched :func:`fetch_order` (index-map arguments: the grid indices, then the
    table and the fetch order)."""
    return lambda b, h, i, j, table, fetch: fetch[_table_index(shape, b, h, i, j)]


def kv_major_table(table, groups: int, kv_heads: int):
    """The dK/dV grid's table ``[Bt, Hkv|1, nk, G·nq]``: the forward's with its block axes
    swapped and the ``G`` query heads of each KV head laid along the reduction axis (entry
    ``r`` is query block ``r % nq`` of query head ``hkv·G + r // nq``)."""
    t = jnp.swapaxes(table, 2, 3)
    bt, ht, nk, nq = t.shape
    if ht == 1:
        return jnp.tile(t, (1, 1, 1, groups))
    return t.reshape(bt, kv_heads, groups, nk, nq).transpose(0, 1, 3, 2, 4).reshape(
        bt, kv_heads, nk, groups * nq)


def _mask_inputs(ops: Operands, *, kv_major: bool, q_block, kv_block, head):
    """``(names, arrays, specs)`` of positions, segment ids, dense mask, top-k selection and
    bias.

    ``q_block(idx)``/``kv_block(idx)``/``head(idx)`` map grid indices to the query block,
    key block and query head. Q-major: queries as columns, keys as rows, tiles
    ``[bq, bk]``; KV-major: the transpose of each.
    """
    bq, bk = ops.bq, ops.bk
    names, arrays, specs = [], [], []

    def side(name, x, block, index, column):
        lead = lambda *g: head_index(x.shape[0], g[0])  # noqa: E731
        if column:
            arr, shape = as_column(x), (None, block, 1)
            imap = lambda *g: (lead(*g), index(g), 0)  # noqa: E731
        else:
            arr, shape = as_row(x), (None, 1, block)
            imap = lambda *g: (lead(*g), 0, index(g))  # noqa: E731
        names.append(name)
        arrays.append(arr)
        specs.append(pl.BlockSpec(shape, imap))

    for name, qx, kx in (("pos", ops.q_pos, ops.kv_pos), ("seg", ops.q_seg, ops.kv_seg)):
        if qx is not None:
            side("q_" + name, qx, bq, q_block, column=not kv_major)
            side("kv_" + name, kx, bk, kv_block, column=kv_major)
    for name, x in (("mask", ops.mask), ("picked", ops.picked), ("bias", ops.bias)):
        if x is None:
            continue
        if kv_major:
            x = jnp.swapaxes(x, 2, 3)
        imap = (lambda x: lambda *g: (
            head_index(x.shape[0], g[0]), head_index(x.shape[1], head(g)),
            *((kv_block(g), q_block(g)) if kv_major else (q_block(g), kv_block(g)))))(x)
        names.append(name)
        arrays.append(x)
        specs.append(pl.BlockSpec((None, None, bk, bq) if kv_major else (None, None, bq, bk),
                                  imap))
    return names, arrays, specs


def _sides(spec: AttentionSpec, refs, ops: Operands, q_start, kv_start, kv_major: bool):
    """The :class:`TileSides` of the current tile, loaded from the refs."""
    load = lambda name: refs[name][...] if name in refs else None  # noqa: E731
    q_valid = valid_range(q_start, ops.bq, ops.tq, axis=1 if kv_major else 0)
    kv_valid = valid_range(kv_start, ops.bk, ops.tkv, axis=0 if kv_major else 1)
    rows, cols = ("kv", "q") if kv_major else ("q", "kv")
    valid = {"q": q_valid, "kv": kv_valid}
    return TileSides(row_pos=load(rows + "_pos"), col_pos=load(cols + "_pos"),
                     row_seg=load(rows + "_seg"), col_seg=load(cols + "_seg"),
                     dense=load("mask"), picked=load("picked"), row_valid=valid[rows], col_valid=valid[cols],
                     transposed=kv_major)


def _call(kernel, names, arrays, in_specs, out_shape, out_specs, scratch, grid, name,
          interpret, table):
    """``pallas_call`` with ``table`` and its :func:`fetch_order` scalar-prefetched (the
    kernel's first two arguments)."""
    return pl.pallas_call(
        functools.partial(kernel, names=tuple(names)),
        out_shape=out_shape,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=grid, in_specs=in_specs, out_specs=out_specs,
            scratch_shapes=scratch),
        compiler_params=pltpu.CompilerParams(dimension_semantics=_SEMANTICS),
        interpret=interpret, name=name,
    )(_flat_table(table), _flat_table(fetch_order(table)), *arrays)


def _split(refs, names, n_out):
    n_in = len(names)
    return dict(zip(names, refs[:n_in])), refs[n_in:n_in + n_out], refs[n_in + n_out:]


def _q_major_inputs(ops: Operands):
    """The mask inputs of a Q-major grid ``(b, h, i, j)`` and its index maps: the query
    block ``i``, and the KV block the fetch order names (a skipped step keeps the block it
    holds, so no K/V moves)."""
    fetched = fetched_tile(ops.table.shape)
    names, arrays, specs = _mask_inputs(ops, kv_major=False, q_block=lambda idx: idx[2],
                                        kv_block=lambda idx: fetched(*idx),
                                        head=lambda idx: idx[1])
    g = ops.groups
    q_map = lambda bi, hi, i, j, *t: (bi, hi, i, 0)  # noqa: E731
    kv_map = lambda bi, hi, i, j, *t: (bi, hi // g, fetched(bi, hi, i, j, *t), 0)  # noqa: E731
    return names, arrays, specs, q_map, kv_map


def forward(ops: Operands, spec: AttentionSpec, interpret):
    """``(o [B, H, Tqp, Dv] f32, lse [B, H, Tqp] f32)``."""
    b, h, tqp, d = ops.q.shape
    dv, nq, nk, bq, bk = ops.v.shape[3], ops.nq, ops.nk, ops.bq, ops.bk
    tshape = ops.table.shape
    names, arrays, specs, q_map, kv_map = _q_major_inputs(ops)
    names = ["q", "k", "v"] + names
    arrays = [ops.q, ops.k, ops.v] + arrays
    specs = [pl.BlockSpec((None, None, bq, d), q_map), pl.BlockSpec((None, None, bk, d), kv_map),
             pl.BlockSpec((None, None, bk, dv), kv_map)] + specs

    def kernel(table, fetch, *refs, names):
        refs, (o_ref, lse_ref), scratch = _split(refs, names, 2)
        bi, hi, i, j = (pl.program_id(a) for a in range(4))

        @pl.when(j == 0)
        def _():
            for ref, x in zip(scratch, initial_state(bq, dv)):
                ref[...] = x

        def step(masked):
            s, _ = tile_logits(spec, refs["q"][...], refs["k"][...],
                               refs["bias"][...] if "bias" in refs else None)
            ok = visible_tile(spec, _sides(spec, refs, ops, i * bq, j * bk, False)) \
                if masked else None
            state = online_softmax(tuple(r[...] for r in scratch), s, ok, refs["v"][...])
            for ref, x in zip(scratch, state):
                ref[...] = x

        kind = table[_table_index(tshape, bi, hi, i, j)]
        pl.when(kind == BlockKind.FULL)(lambda: step(False))
        pl.when(kind == BlockKind.PARTIAL)(lambda: step(True))

        @pl.when(j == nk - 1)
        def _():
            o, lse = finish_softmax(tuple(r[...] for r in scratch))
            o_ref[...] = o
            lse_ref[...] = lse

    o, lse = _call(
        kernel, names, arrays, specs,
        [out_struct((b, h, tqp, dv), F32, arrays), out_struct((b, h, tqp, 1), F32, arrays)],
        [pl.BlockSpec((None, None, bq, dv), q_map), pl.BlockSpec((None, None, bq, 1), q_map)],
        [pltpu.VMEM((bq, 1), F32), pltpu.VMEM((bq, 1), F32), pltpu.VMEM((bq, dv), F32),
         pltpu.VMEM((bq, 1), F32)],
        (b, h, nq, nk), "cp_attention_fwd", interpret, ops.table)
    return o, lse[..., 0]


def backward_dq(ops: Operands, spec: AttentionSpec, do, lse, delta, interpret):
    """Q-major dQ kernel: ``(dq [B, H, Tqp, D] f32, dbias [B, H, Tqp, Tkvp] f32 | None)``.

    ``do [B, H, Tqp, Dv]``; ``lse``/``delta`` ``[B, H, Tqp]`` (merged; ``delta`` =
    ``rowsum(dO∘O) - dlse``). dbias tiles of skipped blocks are written as zeros.
    """
    b, h, tqp, d = ops.q.shape
    dv, nq, nk, bq, bk = ops.v.shape[3], ops.nq, ops.nk, ops.bq, ops.bk
    tkvp, tshape, has_bias = ops.k.shape[2], ops.table.shape, ops.bias is not None
    names, arrays, specs, q_map, kv_map = _q_major_inputs(ops)
    names = ["q", "k", "v", "do", "lse", "delta"] + names
    arrays = [ops.q, ops.k, ops.v, do, as_column(lse), as_column(delta)] + arrays
    specs = [pl.BlockSpec((None, None, bq, d), q_map), pl.BlockSpec((None, None, bk, d), kv_map),
             pl.BlockSpec((None, None, bk, dv), kv_map), pl.BlockSpec((None, None, bq, dv), q_map),
             pl.BlockSpec((None, None, bq, 1), q_map), pl.BlockSpec((None, None, bq, 1), q_map),
             ] + specs
    out_shape = [out_struct((b, h, tqp, d), F32, arrays)]
    out_specs = [pl.BlockSpec((None, None, bq, d), q_map)]
    if has_bias:
        out_shape.append(out_struct((b, h, tqp, tkvp), F32, arrays))
        out_specs.append(pl.BlockSpec((None, None, bq, bk),
                                      lambda bi, hi, i, j, *t: (bi, hi, i, j)))

    def kernel(table, fetch, *refs, names):
        refs, outs, (acc,) = _split(refs, names, len(out_shape))
        bi, hi, i, j = (pl.program_id(a) for a in range(4))

        @pl.when(j == 0)
        def _():
            acc[...] = jnp.zeros_like(acc)

        def step(masked):
            k = refs["k"][...]
            s, tanh = tile_logits(spec, refs["q"][...], k,
                                  refs["bias"][...] if has_bias else None)
            ok = visible_tile(spec, _sides(spec, refs, ops, i * bq, j * bk, False)) \
                if masked else None
            dp = dot_nt(refs["do"][...], refs["v"][...])
            ds, dbias, _ = grad_logits(spec, s, tanh, ok, refs["lse"][...],
                                       refs["delta"][...], dp)
            acc[...] += dot_nn(ds.astype(k.dtype), k)
            if has_bias:
                outs[1][...] = dbias

        kind = table[_table_index(tshape, bi, hi, i, j)]
        pl.when(kind == BlockKind.FULL)(lambda: step(False))
        pl.when(kind == BlockKind.PARTIAL)(lambda: step(True))
        if has_bias:
            @pl.when(kind == BlockKind.SKIP)
            def _():
                outs[1][...] = jnp.zeros_like(outs[1])

        @pl.when(j == nk - 1)
        def _():
            outs[0][...] = acc[...]

    out = _call(kernel, names, arrays, specs, out_shape, out_specs,
                [pltpu.VMEM((bq, d), F32)], (b, h, nq, nk), "cp_attention_dq", interpret,
                ops.table)
    return out[0], (out[1] if has_bias else None)


def backward_dkv(ops: Operands, spec: AttentionSpec, do, lse, delta, interpret):
    """KV-major dK/dV kernel: ``(dk [B, Hkv, Tkvp, D], dv [B, Hkv, Tkvp, Dv])`` float32.

    Grid ``(B, Hkv, nk, G·nq)``: the last axis ``r`` walks query block ``r % nq`` of query
    head ``hkv·G + r // nq``, so one KV head's gradient sums over its whole query group.
    """
    b, h, tqp, d = ops.q.shape
    hkv, tkvp = ops.k.shape[1], ops.k.shape[2]
    dv, g, nq, nk, bq, bk = ops.v.shape[3], ops.groups, ops.nq, ops.nk, ops.bq, ops.bk
    table_t = kv_major_table(ops.table, g, hkv)
    tshape = table_t.shape
    fetched = fetched_tile(tshape)
    q_head = lambda idx: idx[1] * g + fetched(*idx) // nq  # noqa: E731
    q_block = lambda idx: fetched(*idx) % nq  # noqa: E731
    names, arrays, specs = _mask_inputs(ops, kv_major=True, q_block=q_block,
                                        kv_block=lambda idx: idx[2], head=q_head)
    q_map = lambda *idx: (idx[0], q_head(idx), q_block(idx), 0)  # noqa: E731
    q_row = lambda *idx: (idx[0], q_head(idx), 0, q_block(idx))  # noqa: E731
    kv_map = lambda bi, hk, j, r, *t: (bi, hk, j, 0)  # noqa: E731
    names = ["q", "k", "v", "do", "lse", "delta"] + names
    arrays = [ops.q, ops.k, ops.v, do, as_row(lse), as_row(delta)] + arrays
    specs = [pl.BlockSpec((None, None, bq, d), q_map), pl.BlockSpec((None, None, bk, d), kv_map),
             pl.BlockSpec((None, None, bk, dv), kv_map), pl.BlockSpec((None, None, bq, dv), q_map),
             pl.BlockSpec((None, None, 1, bq), q_row), pl.BlockSpec((None, None, 1, bq), q_row),
             ] + specs

    def kernel(table, fetch, *refs, names):
        refs, (dk_ref, dv_ref), (dk_acc, dv_acc) = _split(refs, names, 2)
        bi, hk, j, r = (pl.program_id(a) for a in range(4))

        @pl.when(r == 0)
        def _():
            dk_acc[...] = jnp.zeros_like(dk_acc)
            dv_acc[...] = jnp.zeros_like(dv_acc)

        def step(masked):
            q, do_ = refs["q"][...], refs["do"][...]
            s_t, tanh = tile_logits(spec, refs["k"][...], q,
                                    refs["bias"][...] if "bias" in refs else None)
            ok = visible_tile(spec, _sides(spec, refs, ops, (r % nq) * bq, j * bk, True)) \
                if masked else None
            dp_t = dot_nt(refs["v"][...], do_)
            ds_t, _, p_t = grad_logits(spec, s_t, tanh, ok, refs["lse"][...],
                                       refs["delta"][...], dp_t)
            dv_acc[...] += dot_nn(p_t.astype(do_.dtype), do_)
            dk_acc[...] += dot_nn(ds_t.astype(q.dtype), q)

        kind = table[_table_index(tshape, bi, hk, j, r)]
        pl.when(kind == BlockKind.FULL)(lambda: step(False))
        pl.when(kind == BlockKind.PARTIAL)(lambda: step(True))

        @pl.when(r == g * nq - 1)
        def _():
            dk_ref[...] = dk_acc[...]
            dv_ref[...] = dv_acc[...]

    return _call(
        kernel, names, arrays, specs,
        [out_struct((b, hkv, tkvp, d), F32, arrays), out_struct((b, hkv, tkvp, dv), F32, arrays)],
        [pl.BlockSpec((None, None, bk, d), kv_map), pl.BlockSpec((None, None, bk, dv), kv_map)],
        [pltpu.VMEM((bk, d), F32), pltpu.VMEM((bk, dv), F32)],
        (b, hkv, nk, g * nq), "cp_attention_dkv", interpret, table_t)
