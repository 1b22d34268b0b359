"""GPU-style (Triton) Pallas kernels: one program per (batch, head, block), the other
sequence walked by a ``lax.fori_loop`` inside it, carrying the running softmax or the
gradient accumulators in registers. The block table is an ordinary int32 input read per
loop step: skipped tiles take an empty ``lax.cond`` branch, full tiles skip the mask.

* ``cp_attention_fwd``: grid ``(B, H, nq)``, loop over the ``nk`` key blocks;
* ``cp_attention_dq``: the same Q-major grid, accumulating dQ (and writing dbias tiles);
* ``cp_attention_dkv``: KV-major grid ``(B, Hkv, nk)``, loop over the ``G·nq`` query blocks
  of the KV head's query group; table, dense mask and bias transposed (grid axes swapped,
  tiles ``[bk, bq]``), computing ``Sᵀ = K·Qᵀ`` directly.
"""
from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from cptransform.op.attention_spec import AttentionSpec
from cptransform.op.mask_terms import BlockKind
from cptransform.lowering.kernels.pallas_operands import Operands, head_index, out_struct
from cptransform.lowering.kernels.pallas_tiles import (
    F32, TileSides, as_column, as_row, dot_nn, dot_nt, finish_softmax, grad_logits,
    initial_state, online_softmax, tile_logits, valid_range, visible_tile)


def _whole(x):
    """A block that is the whole array (small: the block table)."""
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


def _sides(spec, refs, ops, q_start, kv_start, kv_major, head=0):
    """The :class:`TileSides` of the tile at ``(q_start, kv_start)``; ``head`` picks the
    query head inside a KV-major program's group."""
    bq, bk = ops.bq, ops.bk

    def load(name):
        if name not in refs:
            return None
        if kv_major:
            return refs[name][:, pl.ds(q_start, bq)] if name.startswith("q_") else refs[name][...]
        return refs[name][:, pl.ds(kv_start, bk)] if name.startswith("kv_") else refs[name][...]

    q_valid = valid_range(q_start, bq, ops.tq, axis=1 if kv_major else 0)
    kv_valid = valid_range(kv_start, bk, ops.tkv, axis=0 if kv_major else 1)

    def tile(name):
        """This tile of a ``[bq, Tkvp]`` row band (Q-major) or ``[group, bk, Tqp]`` (KV-major)."""
        if name not in refs:
            return None
        m = refs[name]
        return m[head if m.shape[0] > 1 else 0, :, pl.ds(q_start, bq)] if kv_major \
            else m[:, pl.ds(kv_start, bk)]

    rows, cols = ("kv", "q") if kv_major else ("q", "kv")
    valid = {"q": q_valid, "kv": kv_valid}
    return TileSides(row_pos=load(rows + "_pos"), col_pos=load(cols + "_pos"),
                     row_seg=load(rows + "_seg"), col_seg=load(cols + "_seg"),
                     dense=tile("mask"), picked=tile("picked"), row_valid=valid[rows],
                     col_valid=valid[cols], transposed=kv_major)


def _divmod(r, n: int):
    """``(r // n, r % n)`` for a non-negative int32 ``r`` as Triton lowers it: ``//`` and
    ``%`` go through ``jnp.floor_divide`` / ``jnp.remainder``, whose sign and zero-divisor
    fix-ups Pallas's Triton lowering fails on (``AssertionError: ('i32', 'i1')``)."""
    n = jnp.int32(n)
    return lax.div(r, n), lax.rem(r, n)


def _by_kind(kind, skip, full, partial, carry):
    """Run ``skip``, ``full`` or ``partial`` on ``carry`` by the table entry ``kind``."""
    return lax.cond(kind == BlockKind.SKIP, skip,
                    lambda c: lax.cond(kind == BlockKind.FULL, full, partial, c), carry)


def _call(kernel, names, arrays, in_specs, out_shape, out_specs, grid, name, interpret):
    params = None if interpret else pltriton.CompilerParams(num_warps=4, num_stages=2)
    return pl.pallas_call(functools.partial(kernel, names=tuple(names)), out_shape=out_shape,
                          grid=grid, in_specs=in_specs, out_specs=out_specs,
                          compiler_params=params, interpret=interpret, name=name)(*arrays)


def forward(ops: Operands, spec: AttentionSpec, interpret):
    """``(o [B, H, Tqp, Dv] f32, lse [B, H, Tqp] f32)``."""
    b, h, tqp, d = ops.q.shape
    tkvp, dv, g, nk, bq, bk = ops.k.shape[2], ops.v.shape[3], ops.groups, ops.nk, ops.bq, ops.bk
    bt, ht = ops.table.shape[:2]
    names, arrays, specs = _mask_inputs(ops, kv_major=False, group=g)
    names = ["q", "k", "v", "table"] + names
    arrays = [ops.q, ops.k, ops.v, ops.table] + arrays
    specs = [pl.BlockSpec((None, None, bq, d), lambda bi, hi, i: (bi, hi, i, 0)),
             pl.BlockSpec((None, None, tkvp, d), lambda bi, hi, i: (bi, hi // g, 0, 0)),
             pl.BlockSpec((None, None, tkvp, dv), lambda bi, hi, i: (bi, hi // g, 0, 0)),
             _whole(ops.table)] + specs

    def kernel(*refs, names):
        refs, (o_ref, lse_ref) = dict(zip(names, refs)), refs[len(names):]
        bi, hi, i = (pl.program_id(a) for a in range(3))
        q = refs["q"][...]

        def step(j, masked, state):
            kv = pl.ds(j * bk, bk)
            bias = refs["bias"][:, kv] if "bias" in refs else None
            s, _ = tile_logits(spec, q, refs["k"][kv, :], bias)
            ok = visible_tile(spec, _sides(spec, refs, ops, i * bq, j * bk, False)) \
                if masked else None
            return online_softmax(state, s, ok, refs["v"][kv, :])

        def body(j, state):
            kind = refs["table"][head_index(bt, bi), head_index(ht, hi), i, j]
            return _by_kind(kind, lambda st: st, functools.partial(step, j, False),
                            functools.partial(step, j, True), state)

        o, lse = finish_softmax(lax.fori_loop(0, nk, body, initial_state(bq, dv)))
        o_ref[...] = o
        lse_ref[...] = lse

    o, lse = _call(
        kernel, names, arrays, specs,
        [out_struct((b, h, tqp, dv), F32, arrays), out_struct((b, h, tqp, 1), F32, arrays)],
        [pl.BlockSpec((None, None, bq, dv), lambda bi, hi, i: (bi, hi, i, 0)),
         pl.BlockSpec((None, None, bq, 1), lambda bi, hi, i: (bi, hi, i, 0))],
        (b, h, ops.nq), "cp_attention_fwd", interpret)
    return o, lse[..., 0]


def backward_dq(ops: Operands, spec: AttentionSpec, do, lse, delta, interpret):
    """Q-major dQ kernel: ``(dq [B, H, Tqp, D] f32, dbias [B, H, Tqp, Tkvp] f32 | None)``;
    arguments as in :func:`~cptransform.lowering.kernels.pallas_tpu.backward_dq`."""
    b, h, tqp, d = ops.q.shape
    tkvp, dv, g, nk, bq, bk = ops.k.shape[2], ops.v.shape[3], ops.groups, ops.nk, ops.bq, ops.bk
    bt, ht = ops.table.shape[:2]
    has_bias = ops.bias is not None
    names, arrays, specs = _mask_inputs(ops, kv_major=False, group=g)
    q_map = lambda bi, hi, i: (bi, hi, i, 0)  # noqa: E731
    kv_map = lambda bi, hi, i: (bi, hi // g, 0, 0)  # noqa: E731
    names = ["q", "k", "v", "do", "lse", "delta", "table"] + names
    arrays = [ops.q, ops.k, ops.v, do, as_column(lse), as_column(delta), ops.table] + arrays
    specs = [pl.BlockSpec((None, None, bq, d), q_map), pl.BlockSpec((None, None, tkvp, d), kv_map),
             pl.BlockSpec((None, None, tkvp, dv), kv_map),
             pl.BlockSpec((None, None, bq, dv), q_map), pl.BlockSpec((None, None, bq, 1), q_map),
             pl.BlockSpec((None, None, bq, 1), q_map), _whole(ops.table)] + specs
    out_shape = [out_struct((b, h, tqp, d), F32, arrays)]
    out_specs = [pl.BlockSpec((None, None, bq, d), q_map)]
    if has_bias:
        out_shape.append(out_struct((b, h, tqp, tkvp), F32, arrays))
        out_specs.append(pl.BlockSpec((None, None, bq, tkvp), q_map))

    def kernel(*refs, names):
        refs, outs = dict(zip(names, refs)), refs[len(names):]
        bi, hi, i = (pl.program_id(a) for a in range(3))
        q, do_, lse_, delta_ = (refs[n][...] for n in ("q", "do", "lse", "delta"))

        def step(j, masked, acc):
            kv = pl.ds(j * bk, bk)
            k = refs["k"][kv, :]
            s, tanh = tile_logits(spec, q, k, refs["bias"][:, kv] if has_bias else None)
            ok = visible_tile(spec, _sides(spec, refs, ops, i * bq, j * bk, False)) \
                if masked else None
            ds, dbias, _ = grad_logits(spec, s, tanh, ok, lse_, delta_,
                                       dot_nt(do_, refs["v"][kv, :]))
            if has_bias:
                outs[1][:, kv] = dbias
            return acc + dot_nn(ds.astype(k.dtype), k)

        def skip(j, acc):
            if has_bias:
                outs[1][:, pl.ds(j * bk, bk)] = jnp.zeros((bq, bk), F32)
            return acc

        def body(j, acc):
            kind = refs["table"][head_index(bt, bi), head_index(ht, hi), i, j]
            return _by_kind(kind, functools.partial(skip, j), functools.partial(step, j, False),
                            functools.partial(step, j, True), acc)

        outs[0][...] = lax.fori_loop(0, nk, body, jnp.zeros((bq, d), F32))

    out = _call(kernel, names, arrays, specs, out_shape, out_specs, (b, h, ops.nq),
                "cp_attention_dq", interpret)
    return out[0], (out[1] if has_bias else None)


def backward_dkv(ops: Operands, spec: AttentionSpec, do, lse, delta, interpret):
    """KV-major dK/dV kernel: ``(dk [B, Hkv, Tkvp, D], dv [B, Hkv, Tkvp, Dv])`` float32.

    Grid ``(B, Hkv, nk)``; the loop index ``r`` walks query block ``r % nq`` of query head
    ``hkv·G + r // nq``, so one program sums its KV head's gradient over the whole group.
    """
    b, h, tqp, d = ops.q.shape
    hkv, tkvp = ops.k.shape[1], ops.k.shape[2]
    dv, g, nq, nk, bq, bk = ops.v.shape[3], ops.groups, ops.nq, ops.nk, ops.bq, ops.bk
    table_t = jnp.swapaxes(ops.table, 2, 3)
    bt, ht = table_t.shape[:2]
    names, arrays, specs = _mask_inputs(ops, kv_major=True, group=g)
    group_map = lambda bi, hk, j: (bi, hk, 0, 0)  # noqa: E731
    kv_map = lambda bi, hk, j: (bi, hk, j, 0)  # noqa: E731
    names = ["q", "k", "v", "do", "lse", "delta", "table"] + names
    arrays = [ops.q, ops.k, ops.v, do, as_row(lse), as_row(delta), table_t] + arrays
    specs = [pl.BlockSpec((None, g, tqp, d), group_map), pl.BlockSpec((None, None, bk, d), kv_map),
             pl.BlockSpec((None, None, bk, dv), kv_map), pl.BlockSpec((None, g, tqp, dv), group_map),
             pl.BlockSpec((None, g, 1, tqp), group_map), pl.BlockSpec((None, g, 1, tqp), group_map),
             _whole(table_t)] + specs

    def kernel(*refs, names):
        refs, (dk_ref, dv_ref) = dict(zip(names, refs)), refs[len(names):]
        bi, hk, j = (pl.program_id(a) for a in range(3))
        k, v = refs["k"][...], refs["v"][...]
        bias_ref = refs.get("bias")

        def step(r, masked, acc):
            head, i = _divmod(r, nq)
            qs = pl.ds(i * bq, bq)
            q, do_ = refs["q"][head, qs, :], refs["do"][head, qs, :]
            bias = None if bias_ref is None else \
                bias_ref[head if bias_ref.shape[0] > 1 else 0, :, qs]
            s_t, tanh = tile_logits(spec, k, q, bias)
            ok = visible_tile(spec, _sides(spec, refs, ops, i * bq, j * bk, True, head)) \
                if masked else None
            ds_t, _, p_t = grad_logits(spec, s_t, tanh, ok, refs["lse"][head, :, qs],
                                       refs["delta"][head, :, qs], dot_nt(v, do_))
            dk_acc, dv_acc = acc
            return (dk_acc + dot_nn(ds_t.astype(q.dtype), q),
                    dv_acc + dot_nn(p_t.astype(do_.dtype), do_))

        def body(r, acc):
            head, i = _divmod(r, nq)
            kind = refs["table"][head_index(bt, bi), head_index(ht, hk * g + head), j, i]
            return _by_kind(kind, lambda a: a, functools.partial(step, r, False),
                            functools.partial(step, r, True), acc)

        init = (jnp.zeros((bk, d), F32), jnp.zeros((bk, dv), F32))
        dk, dv_ = lax.fori_loop(0, g * nq, body, init)
        dk_ref[...] = dk
        dv_ref[...] = dv_

    return _call(
        kernel, names, arrays, specs,
        [out_struct((b, hkv, tkvp, d), F32, arrays), out_struct((b, hkv, tkvp, dv), F32, arrays)],
        [pl.BlockSpec((None, None, bk, d), kv_map), pl.BlockSpec((None, None, bk, dv), kv_map)],
        (b, hkv, nk), "cp_attention_dkv", interpret)
