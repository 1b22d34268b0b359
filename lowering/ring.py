"""Ring attention: queries stay, key/value blocks travel around the CP ring.

At step ``i`` (``0 … cp-1``) rank ``r`` holds the KV block that started on rank
``(r - i) mod cp``, together with its positions and segment ids (they travel with it, so
masks need no layout knowledge). Each step attends the local queries to that block and
merges the partial result exactly in float32 (:func:`attention_reference.merge`). The next
block is sent (``ppermute`` to rank ``r + 1``) before the current block is computed so XLA
can overlap the transfer with the compute. Steps ``0 … cp-2`` are one ``lax.scan``, so
compile time does not grow with ``cp``; the last step sends nothing.

Each step is computed as a grid of tiles (2 × 2 when the local lengths are even, else
1 × 1); a tile that :meth:`Block.may_be_visible` proves fully masked is skipped with
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

from cptransform.analysis.attention_shape import AttentionShape
from cptransform.analysis.cost_model import CommVolume, Transfer, kv_elements, metadata
from cptransform.lowering.block import Block
from cptransform.lowering.kernels import skipped_backward, skipped_forward
from cptransform.lowering.schedule import Schedule, divides_sequence, \
    fill_empty_rows_sharded, register_schedule
from cptransform.op.attention_reference import merge


def tiles_per_block(length: int) -> int:
    """How many tiles one local block is cut into along a sequence axis."""
    return 2 if length % 2 == 0 else 1


def _cut(x, axis: int, parts: int):
    """``x`` split into ``parts`` equal pieces along ``axis``."""
    return jnp.split(x, parts, axis=axis)


def _rotate(tree, axes, cp: int):
    """Send every array of ``tree`` one rank up the ring (rank r → r + 1 mod cp)."""
    perm = [(j, (j + 1) % cp) for j in range(cp)]
    return jax.tree.map(lambda x: lax.ppermute(x, axes, perm), tree)


def _zeros(like, shape, fill=0.0):
    """Float32 ``fill`` of ``shape``, varying over the same mesh axes as ``like``.

    Branches of ``lax.cond`` under ``shard_map`` must agree on which axes a value varies
    over; deriving constants from an operand keeps them in step with the kernel's outputs.
    """
    return jnp.full_like(like, fill, dtype=jnp.float32, shape=shape)


def _travelling(spec, block: Block) -> Block:
    """The keys that move around the ring: K, V, segment ids, and the kv positions only
    when the mask reads them (causal or window); positions not sent are stood in for by the
    local ones on arrival (:meth:`Block.with_keys`)."""
    keys = block.keys()
    reads_positions = spec.mask.band() != (None, None)
    return keys if reads_positions else keys.replace(kv_pos=None)


def _around_the_ring(step, state, keys, axes, cp: int):
    """``state = step(i, state, keys_i)`` for ``i = 0 … cp-1``, ``keys_i`` the keys that
    started ``i`` ranks down the ring.

    Steps ``0 … cp-2`` run in a ``lax.scan`` (one compiled body whatever ``cp``), each
    sending the keys on before computing with them, so the transfer can overlap the compute;
    the last step runs after the loop and sends nothing: ``cp - 1`` rotations in all.
    """
    def body(carry, i):
        state, keys = carry
        following = _rotate(keys, axes, cp)
        return (step(i, state, keys), following), None

    if cp > 1:
        (state, keys), _ = lax.scan(body, (state, keys), jnp.arange(cp - 1))
    return step(cp - 1, state, keys)


def _step_tiles(block: Block, keys: Block, source, tkv: int) -> list[list[Block]]:
    """The tiles of one ring step: the local queries against ``keys`` (from rank
    ``source``), with the mask and bias columns of those keys."""
    step = block.with_keys(keys).columns(source, tkv)
    return step.tiles(tiles_per_block(block.q.shape[1]), tiles_per_block(tkv))


def _forward(block: Block, spec, axes, kernel):
    cp = lax.axis_size(axes)
    rank = lax.axis_index(axes)
    b, tq, h, _ = block.q.shape
    tkv, dv = block.k.shape[1], block.v.shape[3]
    nq = tiles_per_block(tq)
    tile_q = tq // nq

    def skip(tile):
        return skipped_forward(tile, spec)

    def step(i, acc, keys):
        acc = list(acc)
        for a, row in enumerate(_step_tiles(block, keys, (rank - i) % cp, tkv)):
            for tile in row:
                o_t, lse_t = lax.cond(tile.may_be_visible(spec),
                                      lambda t: kernel.forward(t, spec), skip, tile)
                acc[a] = merge(*acc[a], o_t, lse_t)
        return tuple(acc)

    empty = tuple((_zeros(block.q, (b, tile_q, h, dv)),
                   _zeros(block.q, (b, h, tile_q), -jnp.inf)) for _ in range(nq))
    acc = _around_the_ring(step, empty, _travelling(spec, block), axes, cp)
    o = jnp.concatenate([o for o, _ in acc], axis=1)
    lse = jnp.concatenate([lse for _, lse in acc], axis=2)
    return o.astype(block.q.dtype), lse


@partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def ring_attention(block: Block, spec, axes, kernel):
    """Ring attention of the local queries against all keys; returns ``(o, lse)``.

    Runs inside ``shard_map``; ``block`` as in the schedule contract of
    :mod:`cptransform.lowering.schedule`, ``axes`` the ring's mesh axes (ranks are their
    linear index), ``kernel`` a :class:`~cptransform.lowering.kernels.Kernel`. ``o`` has q's
    dtype; ``lse`` is float32 ``[B, H, Tq_loc]``, ``-inf`` for rows that see no key (their
    ``o`` is 0; ``empty_rows`` is not applied here). Differentiable w.r.t. q, k, v and bias.
    """
    return _forward(block, spec, axes, kernel)


def _ring_fwd(block: Block, spec, axes, kernel):
    o, lse = _forward(block, spec, axes, kernel)
    return (o, lse), (block, o, lse)


def _ring_bwd(spec, axes, kernel, residuals, cotangents):
    block, o, lse = residuals
    do, dlse = cotangents
    cp = lax.axis_size(axes)
    rank = lax.axis_index(axes)
    q, k, v, bias = block.q, block.k, block.v, block.bias
    tkv = k.shape[1]
    nq, nk = tiles_per_block(q.shape[1]), tiles_per_block(tkv)
    row_tiles = list(zip(_cut(o, 1, nq), _cut(lse, 2, nq), _cut(do, 1, nq), _cut(dlse, 2, nq)))

    def compute(tile, o_a, lse_a, do_a, dlse_a):
        return kernel.backward(tile, o_a, lse_a, do_a, spec, dlse=dlse_a)

    def skip(tile, o_a, lse_a, do_a, dlse_a):
        return skipped_backward(tile, lse_a, do_a, spec)

    def step(i, state, keys):
        dq, dk, dv, dbias = state
        source = (rank - i) % cp
        dq, dk_t, dv_t = list(_cut(dq, 1, nq)), _cut(dk, 1, nk), _cut(dv, 1, nk)
        dbias_rows = []
        for a, row in enumerate(_step_tiles(block, keys, source, tkv)):
            dbias_row = []
            for j, tile in enumerate(row):
                g_q, g_k, g_v, g_b = lax.cond(tile.may_be_visible(spec), compute, skip, tile,
                                              *row_tiles[a])
                dq[a] = dq[a] + g_q
                dk_t[j] = dk_t[j] + g_k
                dv_t[j] = dv_t[j] + g_v
                dbias_row.append(g_b)
            dbias_rows.append(dbias_row)
        if dbias is not None:
            cols = jnp.concatenate([jnp.concatenate(row, axis=3) for row in dbias_rows], axis=2)
            dbias = lax.dynamic_update_slice_in_dim(dbias, cols, source * tkv, axis=3)
        # dK/dV accumulators travel with their keys and arrive home after the last step.
        dk, dv = _rotate((jnp.concatenate(dk_t, axis=1), jnp.concatenate(dv_t, axis=1)),
                         axes, cp)
        return jnp.concatenate(dq, axis=1), dk, dv, dbias

    zeros = (_zeros(q, q.shape), _zeros(k, k.shape), _zeros(v, v.shape),
             None if bias is None else _zeros(q, bias.shape))
    dq, dk, dv, dbias = _around_the_ring(step, zeros, _travelling(spec, block), axes, cp)
    return (Block(q=dq.astype(q.dtype), k=dk.astype(k.dtype), v=dv.astype(v.dtype),
                  bias=None if bias is None else dbias.astype(bias.dtype)),)


ring_attention.defvjp(_ring_fwd, _ring_bwd)


def ring(block: Block, *, spec, axes, kernel):
    """The ``ring`` schedule: :func:`ring_attention` plus ``empty_rows`` handling."""
    o, lse = ring_attention(block, spec, tuple(axes), kernel)
    return fill_empty_rows_sharded(spec, o, lse, block.v, axes,
                                   block.k.shape[1] * lax.axis_size(axes))


def ring_volume(shape: AttentionShape) -> CommVolume:
    """The ring over ``shape.cp`` devices: K, V and their positions / segment ids make
    ``cp-1`` hops forward; the backward rotates K, V (and metadata) again ``cp-1`` times and
    the float32 dK/dV accumulators ``cp`` times, so that they arrive home."""
    cp = shape.cp
    rows = shape.batch * shape.seq_len // cp
    kv_elems = kv_elements(shape)
    hops = cp - 1
    transfers = [Transfer(name, "collective_permute", hops * rows * e * shape.dtype_bytes)
                 for name, e in kv_elems.items()]
    meta = metadata(shape, ("kv",))
    transfers += [Transfer(name, "collective_permute", hops * shape.seq_len // cp * b,
                           payload=False) for name, b in meta]
    transfers += [Transfer(name, "collective_permute", hops * rows * e * shape.dtype_bytes,
                           backward=True) for name, e in kv_elems.items()]
    transfers += [Transfer(name, "collective_permute", hops * shape.seq_len // cp * b,
                           backward=True, payload=False) for name, b in meta]
    transfers += [Transfer("d" + name, "collective_permute", cp * rows * e * shape.grad_bytes,
                           backward=True) for name, e in kv_elems.items()]
    return CommVolume("ring", tuple(transfers))


RING = register_schedule(Schedule("ring", mesh_axes=1, run=ring, volume=ring_volume,
                                  feasible=divides_sequence, overlaps=True, order=0))
