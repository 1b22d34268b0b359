"""Ring attention: queries stay, key/value blocks travel around the CP ring.

At step ``i`` (``0 … cp-1``) rank ``r`` holds the KV block that started on rank
``(r - i) mod cp``, together with its positions and segment ids (they travel with it, so
masks need no layout knowledge). Each step attends the local queries to that block and
merges the partial result exactly in float32 (:func:`attention_reference.merge`). The next
block is sent (``ppermute`` to rank ``r + 1``) before the current block is computed so XLA
can overlap the transfer with the compute.

Each step is computed as a grid of tiles (2 × 2 when the local lengths are even, else
1 × 1); a tile that :func:`block_may_be_visible` proves fully masked is skipped with
``lax.cond`` while K/V still move. Under a causal mask this skips about half the work with
contiguous shards and exactly the empty half-blocks with zigzag (each zigzag rank holds
two chunks, which are the two tiles).

Dense masks and biases hold all key columns (in layout order); step ``i`` reads the column
block of its source rank ``(r - i) mod cp``.

Communication, per device (``Tkv_loc`` local keys, ``B`` batch, element sizes in bytes):

* forward: ``cp - 1`` collective-permutes each of K, V, kv positions (and kv segment ids):
  ``(cp-1)·B·Tkv_loc·(Hkv·D·|k| + Hkv·Dv·|v| + |pos| [+ |seg|])`` bytes (positions of
  size 1 along batch move only ``Tkv_loc`` elements);
* backward: the same ``cp - 1`` rotations of K, V, positions and segment ids, plus ``cp``
  rotations each of the float32 dK and dV accumulators, which travel with their block and
  arrive at the owner after the last step (``cp·B·Tkv_loc·Hkv·(D + Dv)·4`` bytes). dQ and
  dbias stay local.

The backward is a ``custom_vjp``: residuals are q, k, v, o, lse and the mask operands
(positions, segment ids, dense mask, bias), never the probabilities.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from cptransform.attention_reference import merge
from cptransform.lowering.context_parallel_attention import fill_empty_rows_sharded, \
    register_schedule
from cptransform.lowering.kernel import block_may_be_visible


def tiles_per_block(length: int) -> int:
    """How many tiles one local block is cut into along a sequence axis."""
    return 2 if length % 2 == 0 else 1


def _cut(x, axis: int, parts: int):
    """``x`` split into ``parts`` equal pieces along ``axis`` (``None`` stays ``None``)."""
    if x is None:
        return [None] * parts
    return jnp.split(x, parts, axis=axis)


def _rotate(xs, axes, cp: int):
    """Send every array in ``xs`` one rank up the ring (rank r → r + 1 mod cp)."""
    perm = [(j, (j + 1) % cp) for j in range(cp)]
    return tuple(None if x is None else lax.ppermute(x, axes, perm) for x in xs)


def _columns(x, source, width: int):
    """The key columns ``[source·width, (source+1)·width)`` of a mask or bias (or None)."""
    return None if x is None else lax.dynamic_slice_in_dim(x, source * width, width, axis=3)


def _zeros(like, shape, fill=0.0):
    """Float32 ``fill`` of ``shape``, varying over the same mesh axes as ``like``.

    Branches of ``lax.cond`` under ``shard_map`` must agree on which axes a value varies
    over; deriving constants from an operand keeps them in step with the kernel's outputs.
    """
    return jnp.full_like(like, fill, dtype=jnp.float32, shape=shape)


class _Grid:
    """One step's (query tile, key tile) grid: the operands of every tile."""

    def __init__(self, q, q_pos, q_seg, k, v, kv_pos, kv_seg, mask, bias):
        self.nq = tiles_per_block(q.shape[1])
        self.nk = tiles_per_block(k.shape[1])
        cut_q = lambda x, axis: _cut(x, axis, self.nq)  # noqa: E731
        cut_k = lambda x, axis: _cut(x, axis, self.nk)  # noqa: E731
        self.q, self.q_pos, self.q_seg = cut_q(q, 1), cut_q(q_pos, 1), cut_q(q_seg, 1)
        self.k, self.v = cut_k(k, 1), cut_k(v, 1)
        self.kv_pos, self.kv_seg = cut_k(kv_pos, 1), cut_k(kv_seg, 1)
        self.mask = [_cut(m, 3, self.nk) for m in cut_q(mask, 2)]
        self.bias = [_cut(b, 3, self.nk) for b in cut_q(bias, 2)]

    def operands(self, a: int, j: int):
        """Kernel operands of tile (query tile ``a``, key tile ``j``)."""
        return (self.q[a], self.k[j], self.v[j], self.q_pos[a], self.kv_pos[j],
                self.q_seg[a], self.kv_seg[j], self.mask[a][j], self.bias[a][j])

    def may_be_visible(self, spec, a: int, j: int):
        return block_may_be_visible(spec, self.q_pos[a], self.kv_pos[j], self.q_seg[a],
                                    self.kv_seg[j], self.mask[a][j])


def _forward(q, k, v, q_pos, kv_pos, q_seg, kv_seg, mask, bias, spec, axes, kernel):
    cp = lax.axis_size(axes)
    rank = lax.axis_index(axes)
    b, tq, h, _ = q.shape
    tkv, dv = k.shape[1], v.shape[3]
    nq = tiles_per_block(tq)
    tile_q = tq // nq
    acc = [(_zeros(q, (b, tile_q, h, dv)), _zeros(q, (b, h, tile_q), -jnp.inf))
           for _ in range(nq)]
    block = (k, v, kv_pos, kv_seg)
    for step in range(cp):
        following = _rotate(block, axes, cp) if step < cp - 1 else None
        source = (rank - step) % cp
        grid = _Grid(q, q_pos, q_seg, *block, _columns(mask, source, tkv),
                     _columns(bias, source, tkv))
        for a in range(grid.nq):
            for j in range(grid.nk):
                operands = grid.operands(a, j)
                o_t, lse_t = lax.cond(
                    grid.may_be_visible(spec, a, j),
                    lambda ops: kernel.forward(*ops, spec),
                    lambda ops: (_zeros(ops[0], acc[a][0].shape),
                                 _zeros(ops[0], acc[a][1].shape, -jnp.inf)),
                    operands)
                acc[a] = merge(*acc[a], o_t, lse_t)
        block = following
    o = jnp.concatenate([o for o, _ in acc], axis=1)
    lse = jnp.concatenate([lse for _, lse in acc], axis=2)
    return o.astype(q.dtype), lse


@partial(jax.custom_vjp, nondiff_argnums=(9, 10, 11))
def ring_attention(q, k, v, q_pos, kv_pos, q_seg, kv_seg, mask, bias, spec, axes, kernel):
    """Ring attention of the local queries against all keys; returns ``(o, lse)``.

    Runs inside ``shard_map``; operands as in the schedule contract of
    :mod:`cptransform.lowering.context_parallel_attention`, ``axes`` the ring's mesh axes
    (ranks are their linear index), ``kernel`` a ``LocalKernel``. ``o`` has q's dtype;
    ``lse`` is float32 ``[B, H, Tq_loc]``, ``-inf`` for rows that see no key (their ``o``
    is 0; ``empty_rows`` is not applied here). Differentiable w.r.t. q, k, v and bias.
    """
    return _forward(q, k, v, q_pos, kv_pos, q_seg, kv_seg, mask, bias, spec, axes, kernel)


def _ring_fwd(q, k, v, q_pos, kv_pos, q_seg, kv_seg, mask, bias, spec, axes, kernel):
    o, lse = _forward(q, k, v, q_pos, kv_pos, q_seg, kv_seg, mask, bias, spec, axes, kernel)
    return (o, lse), (q, k, v, q_pos, kv_pos, q_seg, kv_seg, mask, bias, o, lse)


def _ring_bwd(spec, axes, kernel, residuals, cotangents):
    q, k, v, q_pos, kv_pos, q_seg, kv_seg, mask, bias, o, lse = residuals
    do, dlse = cotangents
    cp = lax.axis_size(axes)
    rank = lax.axis_index(axes)
    tkv = k.shape[1]
    nq, nk = tiles_per_block(q.shape[1]), tiles_per_block(tkv)
    o_t, lse_t, do_t, dlse_t = _cut(o, 1, nq), _cut(lse, 2, nq), _cut(do, 1, nq), \
        _cut(dlse, 2, nq)
    dq = [_zeros(x, x.shape) for x in _cut(q, 1, nq)]
    dkv = (_zeros(k, k.shape), _zeros(v, v.shape))
    dbias = None if bias is None else _zeros(q, bias.shape)
    block = (k, v, kv_pos, kv_seg)
    for step in range(cp):
        following = _rotate(block, axes, cp) if step < cp - 1 else None
        source = (rank - step) % cp
        bias_cols = _columns(bias, source, tkv)
        grid = _Grid(q, q_pos, q_seg, *block, _columns(mask, source, tkv), bias_cols)
        dk_t, dv_t = _cut(dkv[0], 1, nk), _cut(dkv[1], 1, nk)
        dbias_rows = []
        for a in range(nq):
            dbias_row = []
            for j in range(nk):
                operands = grid.operands(a, j) + (o_t[a], lse_t[a], do_t[a], dlse_t[a])

                def compute(ops):
                    *tile, o_a, lse_a, do_a, dlse_a = ops
                    return kernel.backward(*tile, o_a, lse_a, do_a, spec, dlse=dlse_a)

                def skip(ops):
                    q_a, k_j, v_j, bias_aj = ops[0], ops[1], ops[2], ops[8]
                    return (_zeros(q_a, q_a.shape), _zeros(q_a, k_j.shape),
                            _zeros(q_a, v_j.shape),
                            None if bias_aj is None else _zeros(q_a, bias_aj.shape))

                g_q, g_k, g_v, g_b = lax.cond(grid.may_be_visible(spec, a, j), compute, skip,
                                              operands)
                dq[a] = dq[a] + g_q
                dk_t[j] = dk_t[j] + g_k
                dv_t[j] = dv_t[j] + g_v
                dbias_row.append(g_b)
            dbias_rows.append(dbias_row)
        if dbias is not None:
            cols = jnp.concatenate([jnp.concatenate(row, axis=3) for row in dbias_rows], axis=2)
            dbias = lax.dynamic_update_slice_in_dim(dbias, cols, source * tkv, axis=3)
        dkv = _rotate((jnp.concatenate(dk_t, axis=1), jnp.concatenate(dv_t, axis=1)), axes, cp)
        block = following
    dq = jnp.concatenate(dq, axis=1).astype(q.dtype)
    dbias = None if dbias is None else dbias.astype(bias.dtype)
    return (dq, dkv[0].astype(k.dtype), dkv[1].astype(v.dtype), None, None, None, None, None,
            dbias)


ring_attention.defvjp(_ring_fwd, _ring_bwd)


@register_schedule("ring")
def ring(q, k, v, q_pos, kv_pos, q_seg, kv_seg, mask, bias, *, spec, axes, kernel):
    """The ``ring`` schedule: :func:`ring_attention` plus ``empty_rows`` handling."""
    o, lse = ring_attention(q, k, v, q_pos, kv_pos, q_seg, kv_seg, mask, bias, spec,
                            tuple(axes), kernel)
    return fill_empty_rows_sharded(spec, o, lse, v, axes, k.shape[1] * lax.axis_size(axes))
