"""Ring attention: queries stay, key/value blocks travel around the CP ring.

At step ``i`` (``0 … cp-1``) rank ``r`` holds the KV block that started on rank
``(r - i) mod cp``, together with its segment ids and positions (they travel with it, so
masks need no layout knowledge). Positions the entry point built from the layout
(``spec.kv_positions_layout``; the caller's program gave none) do not travel: the block
from rank ``s`` holds the layout-order slots ``s·Tkv_loc + arange(Tkv_loc)``, whose
positions each step computes from ``axis_index`` and the step. Under hybrid the ring runs
over groups whose blocks are the ``U`` consecutive shards ``s·U … s·U+U-1``, i.e. the same
slots with ``Tkv_loc`` the group's length, so the same formula holds. Each step attends the local queries to that block and
merges the partial result exactly in float32 (:func:`attention_reference.merge`). The next
block is sent (``ppermute`` to rank ``r + 1``) before the current block is computed so XLA
can overlap the transfer with the compute. The running ``(o, lse)`` and the dQ, dK, dV
sums are handed to the kernel, which merges and accumulates into them in place (no
per-step partial beside the sum). Steps ``0 … cp-2`` are one ``lax.scan``, so
compile time does not grow with ``cp``; the last step sends nothing.

Each step is one kernel call on the local queries against the arrived block. The kernel
classifies its (query chunk, key chunk) pairs from the positions and skips the empty ones
(:mod:`cptransform.lowering.kernels.chunked`), so under a causal mask contiguous shards
skip about half the work and zigzag exactly the empty half-blocks (each zigzag rank holds
two chunks of the sequence, which never share a kernel chunk).

Dense masks and biases hold all key columns (in layout order); step ``i`` reads the column
block of its source rank ``(r - i) mod cp``. Top-k indices are global key positions of the
local queries: they never travel; each step compares them with the positions of the block
it holds, and the kernel skips the chunks no index falls in.

Communication, per device (``Tkv_loc`` local keys, ``B`` batch, element sizes in bytes):

* forward: ``cp - 1`` collective-permutes of K and V (concatenated on the feature dim into
  one send when they share a dtype), of the kv positions (only when the
  mask reads them: causal or window, and they are the caller's) and the kv segment ids
  (with a segment mask):
  ``(cp-1)·Tkv_loc·(B·Hkv·(D·|k| + Dv·|v|) [+ B_pos·|pos|] [+ B_seg·|seg|])`` bytes (the
  positions also travel under a top-k mask), where
  ``B_pos``/``B_seg`` are 1 for positions / segment ids shared by the batch;
* backward: the same ``cp - 1`` rotations of K, V, positions and segment ids, plus ``cp``
  rotations of the float32 dK and dV accumulators (two sends: the kernel adds into them in
  place, so they are never concatenated), which travel with their block and arrive at the
  owner after the last step
  (``cp·B·Tkv_loc·Hkv·(D + Dv)·4`` bytes). dQ and dbias stay local; ``rowsum(dO∘O)`` is
  computed once, not per step.

The backward is a ``custom_vjp``: residuals are q, k, v, o, lse and the mask operands
(positions, segment ids, dense mask, bias), never the probabilities.
"""
from __future__ import annotations

from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from cptransform.analysis.attention_shape import AttentionShape
from cptransform.analysis.block_work import rank_positions
from cptransform.analysis.cost_model import Transfer, metadata, operands
from cptransform.analysis.schedule_statement import LocalStep, Statement, rotated
from cptransform.ir import compat
from cptransform.lowering.block import KEY_DATA, Block
from cptransform.lowering.schedule import Schedule, any_length, differentiable, finished, \
    register_schedule
from cptransform.lowering.kernels import row_delta
from cptransform.op.accumulation import accumulator_dtype


def rotate(tree, axes, cp: int):
    """Send every array of ``tree`` one rank up the ring (rank r → r + 1 mod cp)."""
    perm = [(j, (j + 1) % cp) for j in range(cp)]
    return jax.tree.map(lambda x: compat.ppermute(x, axes, perm), tree)


def accumulator_zeros(like, shape, fill=0.0):
    """``fill`` of ``shape`` in ``like``'s accumulation dtype (:func:`accumulator_dtype`),
    varying over the same mesh axes as ``like``.

    Loop carries under ``shard_map`` must agree on which axes a value varies over; deriving
    constants from an operand keeps them in step with the kernel's outputs.
    """
    return jnp.full_like(like, fill, dtype=accumulator_dtype(like.dtype), shape=shape)


def packed(k, v):
    """K and V as what one send carries: concatenated on the feature dim when they share a
    dtype (one collective-permute per step), else the pair."""
    return jnp.concatenate([k, v], axis=-1) if k.dtype == v.dtype else (k, v)


def unpacked(kv, d: int):
    """Inverse of :func:`packed` for keys of ``d`` features."""
    return kv if isinstance(kv, tuple) else (kv[..., :d], kv[..., d:])


def travelling(spec, block: Block):
    """What moves around the ring: packed K/V, the terms' key data (:data:`KEY_DATA`: segment
    ids, validity), and the kv positions only when
    the mask (a term whose operands name them) or dropout reads them and they are the
    caller's; layout positions are derived on arrival (:func:`_layout_positions`), others not sent are stood
    in for by the local ones (:meth:`Block.with_keys`). Top-k indices stay: they belong
    to the queries and are compared with the arriving keys' positions."""
    # Dropout draws each pair's bits from the keys' positions too.
    reads_positions = spec.dropout is not None or any(
        "kv_positions" in term.operands for term in spec.mask.terms())
    sent = reads_positions and spec.kv_positions_layout is None
    return (packed(block.k, block.v),
            Block(kv_pos=block.kv_pos if sent else None,
                  **{name: getattr(block, name) for name in KEY_DATA}))


def _layout_positions(layout, source, tkv: int):
    """``[1, tkv]`` positions of the keys that started on ring rank ``source`` (traced):
    layout-order slots ``source·tkv …``, from an iota so no constant is captured."""
    slots = source * tkv + lax.iota(jnp.int32, tkv)
    return layout.position_of_slot(slots)[None].astype(jnp.int32)


def arrived(block: Block, keys, source, tkv: int, spec) -> Block:
    """One ring step's problem: the local queries against ``keys`` (from rank ``source``),
    with the mask and bias columns of those keys."""
    kv, meta = keys
    k, v = unpacked(kv, block.k.shape[-1])
    meta = meta.replace(k=k, v=v)
    if spec.kv_positions_layout is not None:
        meta = meta.replace(kv_pos=_layout_positions(spec.kv_positions_layout, source, tkv))
    return block.with_keys(meta).columns(source, tkv)


def around_the_ring(step, state, keys, axes, cp: int):
    """``state = step(i, state, keys_i)`` for ``i = 0 … cp-1``, ``keys_i`` the keys that
    started ``i`` ranks down the ring.

    Steps ``0 … cp-2`` run in a ``lax.scan`` (one compiled body whatever ``cp``), each
    sending the keys on before computing with them, so the transfer can overlap the compute;
    the last step runs after the loop and sends nothing: ``cp - 1`` rotations in all.
    """
    def body(carry, i):
        state, keys = carry
        with jax.named_scope("cptransform/ring/step"):  # the send and the compute
            following = rotate(keys, axes, cp)
            return (step(i, state, keys), following), None

    if cp > 1:
        (state, keys), _ = lax.scan(body, (state, keys), jnp.arange(cp - 1))
    with jax.named_scope("cptransform/ring/step"):
        return step(cp - 1, state, keys)


def _forward(block: Block, spec, axes, kernel):
    cp = lax.axis_size(axes)
    rank = lax.axis_index(axes)
    b, tq, h, _ = block.q.shape
    tkv, dv = block.k.shape[1], block.v.shape[3]

    def step(i, acc, keys):
        # The kernel classifies its chunk pairs, so the masked half of a step costs nothing;
        # it merges into the running (o, lse) in place.
        return kernel.forward(arrived(block, keys, (rank - i) % cp, tkv, spec), spec,
                              running=acc)

    empty = (accumulator_zeros(block.q, (b, tq, h, dv)), accumulator_zeros(block.q, (b, h, tq), -jnp.inf))
    o, lse = around_the_ring(step, empty, travelling(spec, block), axes, cp)
    o = o.astype(block.q.dtype)
    return (o, lse), (block, o, lse)


def _backward(spec, axes, kernel, residuals, cotangents):
    block, o, lse = residuals
    do, dlse = cotangents
    cp = lax.axis_size(axes)
    rank = lax.axis_index(axes)
    q, k, v, bias = block.q, block.k, block.v, block.bias
    tkv = k.shape[1]
    # rowsum(dO∘O) - dlse is the same for every key block: computed once, not per step.
    delta = row_delta(o, do, dlse)

    def step(i, state, keys):
        dq, (dk, dv), dbias = state
        source = (rank - i) % cp
        # dQ, dK and dV are the kernel's running sums: it accumulates into them in place.
        dq, dk, dv, g_b = kernel.backward(arrived(block, keys, source, tkv, spec), o, lse,
                                          do, spec, delta=delta, dq=dq, dk=dk, dv=dv)
        if dbias is not None:
            dbias = lax.dynamic_update_slice_in_dim(dbias, g_b, source * tkv, axis=3)
        # The float32 dK/dV accumulators travel with their keys and arrive home after the
        # last step.
        return dq, rotate((dk, dv), axes, cp), dbias

    zeros = (accumulator_zeros(q, q.shape), (accumulator_zeros(q, k.shape), accumulator_zeros(q, v.shape)),
             None if bias is None else accumulator_zeros(q, bias.shape))
    dq, (dk, dv), dbias = around_the_ring(step, zeros, travelling(spec, block), axes, cp)
    return dq, dk, dv, dbias


#: Ring attention of the local queries against all keys, ``(block, spec, axes, kernel) ->
#: (o, lse)``: runs inside ``shard_map``; ``block`` as in the schedule contract of
#: :mod:`cptransform.lowering.schedule`, ``axes`` the ring's mesh axes (ranks are their
#: linear index), ``kernel`` a :class:`~cptransform.lowering.kernels.Kernel`. ``o`` has q's
#: dtype; ``lse`` is float32 ``[B, H, Tq_loc]``, ``-inf`` for rows that see no key (their
#: ``o`` is 0; ``empty_rows`` is not applied here). Differentiable w.r.t. q, k, v and bias.
ring_attention = differentiable(_forward, _backward)


def ring(block: Block, *, spec, axes, kernel):
    """The ``ring`` schedule: :func:`ring_attention`, then the sinks and ``empty_rows``."""
    axes = tuple(axes)
    o, lse = ring_attention(block.replace(sinks=None), spec, axes, kernel)
    return finished(block, spec, o, lse, axes)


def ring_transfers(shape: AttentionShape, **fields) -> tuple[Transfer, ...]:
    """The ring over ``shape.cp`` devices: K, V and their positions (only the caller's:
    layout positions are derived, not sent) / segment ids make ``cp-1`` hops forward; the
    backward rotates K, V (and metadata) again ``cp-1`` times and the float32 dK/dV
    accumulators ``cp`` times, so that they arrive home. Every rotation is sent one step
    ahead of its compute (``overlapped``); ``fields`` as in :class:`Transfer` (hybrid: the
    ring's mesh axis)."""
    cp = shape.cp
    rows = shape.batch * shape.kv_padded // cp
    meta = replace(shape, positions=shape.positions and shape.explicit_positions)
    hop = dict(kind="collective_permute", overlapped=True, **fields)
    transfers = []
    for backward in (False, True):
        transfers += operands(shape, ("k", "v"), rows=rows, times=cp - 1, backward=backward,
                              **hop)
        transfers += metadata(meta, ("kv",), times=cp - 1, backward=backward, **hop)
    transfers += operands(shape, ("k", "v"), rows=rows, element=shape.grad_bytes, prefix="d",
                          times=cp, backward=True, **hop)
    return tuple(transfers)


def ring_rotation(cp: int) -> np.ndarray:
    """``[cp, cp]``: at step ``i`` rank ``r`` holds the KV block of rank ``(r - i) mod cp``
    (what the lowering runs, the work and the plan chart read)."""
    ranks, steps = np.meshgrid(np.arange(cp), np.arange(cp), indexing="ij")
    return (ranks - steps) % cp


def ring_step(shape: AttentionShape) -> LocalStep:
    """Each step: the local queries against one KV block; the float32 dK/dV accumulators
    travel (held and in flight)."""
    return LocalStep(shape.q_padded // shape.cp, shape.kv_padded // shape.cp, shape.heads,
                     shape.kv_heads, accumulators=2)


def ring_statement(shape: AttentionShape) -> Statement:
    """The ring's transfers (:func:`ring_transfers`), its rotation (:func:`ring_rotation`)
    and its step."""
    grid = rotated(f"ring over {shape.cp} devices, {{layout}} layout", "device",
                   rank_positions(shape), ring_rotation(shape.cp), shape.heads)
    return Statement(ring_transfers(shape), (grid,), ring_step(shape))


RING = register_schedule(Schedule("ring", mesh_axes=1, run=ring, statement=ring_statement,
                                  feasible=any_length, order=0))
