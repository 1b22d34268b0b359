"""Ring attention: queries stay, key/value blocks travel around the CP ring.

At step ``i`` (``0 … cp-1``) rank ``r`` holds the KV block that started on rank
``(r - i) mod cp``, together with its positions and segment ids (they travel with it, so
masks need no layout knowledge). Each step attends the local queries to that block and
merges the partial result exactly in float32 (:func:`attention_reference.merge`). The next
block is sent (``ppermute`` to rank ``r + 1``) before the current block is computed so XLA
can overlap the transfer with the compute. Steps ``0 … cp-2`` are one ``lax.scan``, so
compile time does not grow with ``cp``; the last step sends nothing.

Each step is computed as a grid of tiles (2 × 2 when the local lengths are even, else
1 × 1); a tile that :func:`block_may_be_visible` proves fully masked is skipped with
``lax.cond`` while K/V still move. Under a causal mask this skips about half the work with
contiguous shards and exactly the empty half-blocks with zigzag (each zigzag rank holds
two chunks, which are the two tiles).

Dense masks and biases hold all key columns (in layout order); step ``i`` reads the column
block of its source rank ``(r - i) mod cp``.

Communication, per device (``Tkv_loc`` local keys, ``B`` batch, element sizes in bytes):

* forward: ``cp - 1`` collective-permutes each of K, V, the kv positions (only when the
  mask reads them: causal or window) and the kv segment ids (with a segment mask):
  ``(cp-1)·Tkv_loc·(B·Hkv·(D·|k| + Dv·|v|) [+ B_pos·|pos|] [+ B_seg·|seg|])`` bytes, where
  ``B_pos``/``B_seg`` are 1 for positions / segment ids shared by the batch;
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

from cptransform.op.attention_reference import merge
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


def _travelling(spec, k, v, kv_pos, kv_seg):
    """The block that moves around the ring: K, V, segment ids, and the kv positions only
    when the mask reads them (causal or window)."""
    reads_positions = spec.mask.band() != (None, None)
    return k, v, kv_pos if reads_positions else None, kv_seg


def _arrived(block, local_kv_pos):
    """``(k, v, kv_pos, kv_seg)`` of a block that arrived; positions that were not sent
    (the mask does not read them) are stood in for by the local ones, same shape."""
    k, v, kv_pos, kv_seg = block
    return k, v, local_kv_pos if kv_pos is None else kv_pos, kv_seg


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


def _around_the_ring(step, state, block, axes, cp: int):
    """``state = step(i, state, block_i)`` for ``i = 0 … cp-1``, ``block_i`` the block that
    started ``i`` ranks down the ring.

    Steps ``0 … cp-2`` run in a ``lax.scan`` (one compiled body whatever ``cp``), each
    sending the block on before computing with it, so the transfer can overlap the compute;
    the last step runs after the loop and sends nothing: ``cp - 1`` rotations in all.
    """
    def body(carry, i):
        state, block = carry
        following = _rotate(block, axes, cp)
        return (step(i, state, block), following), None

    if cp > 1:
        (state, block), _ = lax.scan(body, (state, block), jnp.arange(cp - 1))
    return step(cp - 1, state, block)


def _forward(q, k, v, q_pos, kv_pos, q_seg, kv_seg, mask, bias, spec, axes, kernel):
    cp = lax.axis_size(axes)
    rank = lax.axis_index(axes)
    b, tq, h, _ = q.shape
    tkv, dv = k.shape[1], v.shape[3]
    nq = tiles_per_block(tq)
    tile_q = tq // nq

    def step(i, acc, block):
        source = (rank - i) % cp
        grid = _Grid(q, q_pos, q_seg, *_arrived(block, kv_pos), _columns(mask, source, tkv),
                     _columns(bias, source, tkv))
        acc = list(acc)
        for a in range(grid.nq):
            for j in range(grid.nk):
                o_t, lse_t = lax.cond(
                    grid.may_be_visible(spec, a, j),
                    lambda ops: kernel.forward(*ops, spec),
                    lambda ops: (_zeros(ops[0], (b, tile_q, h, dv)),
                                 _zeros(ops[0], (b, h, tile_q), -jnp.inf)),
                    grid.operands(a, j))
                acc[a] = merge(*acc[a], o_t, lse_t)
        return tuple(acc)

    empty = tuple((_zeros(q, (b, tile_q, h, dv)), _zeros(q, (b, h, tile_q), -jnp.inf))
                  for _ in range(nq))
    acc = _around_the_ring(step, empty, _travelling(spec, k, v, kv_pos, kv_seg), axes, cp)
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
    row_tiles = list(zip(_cut(o, 1, nq), _cut(lse, 2, nq), _cut(do, 1, nq), _cut(dlse, 2, nq)))

    def compute(ops):
        *tile, o_a, lse_a, do_a, dlse_a = ops
        return kernel.backward(*tile, o_a, lse_a, do_a, spec, dlse=dlse_a)

    def skip(ops):
        q_a, k_j, v_j, bias_aj = ops[0], ops[1], ops[2], ops[8]
        return (_zeros(q_a, q_a.shape), _zeros(q_a, k_j.shape), _zeros(q_a, v_j.shape),
                None if bias_aj is None else _zeros(q_a, bias_aj.shape))

    def step(i, state, block):
        dq, dk, dv, dbias = state
        source = (rank - i) % cp
        grid = _Grid(q, q_pos, q_seg, *_arrived(block, kv_pos), _columns(mask, source, tkv),
                     _columns(bias, source, tkv))
        dq, dk_t, dv_t = list(_cut(dq, 1, nq)), _cut(dk, 1, nk), _cut(dv, 1, nk)
        dbias_rows = []
        for a in range(nq):
            dbias_row = []
            for j in range(nk):
                g_q, g_k, g_v, g_b = lax.cond(grid.may_be_visible(spec, a, j), compute, skip,
                                              grid.operands(a, j) + row_tiles[a])
                dq[a] = dq[a] + g_q
                dk_t[j] = dk_t[j] + g_k
                dv_t[j] = dv_t[j] + g_v
                dbias_row.append(g_b)
            dbias_rows.append(dbias_row)
        if dbias is not None:
            cols = jnp.concatenate([jnp.concatenate(row, axis=3) for row in dbias_rows], axis=2)
            dbias = lax.dynamic_update_slice_in_dim(dbias, cols, source * tkv, axis=3)
        dk, dv = _rotate((jnp.concatenate(dk_t, axis=1), jnp.concatenate(dv_t, axis=1)),
                         axes, cp)
        return jnp.concatenate(dq, axis=1), dk, dv, dbias

    zeros = (_zeros(q, q.shape), _zeros(k, k.shape), _zeros(v, v.shape),
             None if bias is None else _zeros(q, bias.shape))
    dq, dk, dv, dbias = _around_the_ring(step, zeros, _travelling(spec, k, v, kv_pos, kv_seg),
                                         axes, cp)
    dbias = None if dbias is None else dbias.astype(bias.dtype)
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None,
            None, None, dbias)


ring_attention.defvjp(_ring_fwd, _ring_bwd)


@register_schedule("ring")
def ring(q, k, v, q_pos, kv_pos, q_seg, kv_seg, mask, bias, *, spec, axes, kernel):
    """The ``ring`` schedule: :func:`ring_attention` plus ``empty_rows`` handling."""
    o, lse = ring_attention(q, k, v, q_pos, kv_pos, q_seg, kv_seg, mask, bias, spec,
                            tuple(axes), kernel)
    return fill_empty_rows_sharded(spec, o, lse, v, axes, k.shape[1] * lax.axis_size(axes))
