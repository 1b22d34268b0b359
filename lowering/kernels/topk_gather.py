"""Top-k attention by gathering: a local step whose cost follows the picks, not the keys.

A top-k mask (:class:`~cptransform.op.mask_terms.TopK`, DeepSeek-V3.2's sparse indexer)
lets a query see at most ``k`` keys, named by global position. The chunked kernel's sweep
computes a ``[cq, ck]`` tile for every key chunk some pick of a query chunk reaches, and
an indexer's picks reach almost every chunk, so its cost grows with the keys (``S²``).
Here each query's picks are looked up among the call's keys and only those are computed,
one query chunk at a time:

* **locate** (:func:`locate`): a chunk's picks are sorted, a repeated pick kept once (the
  mask is a set, as :func:`~cptransform.op.attention_reference.selected` reads it), and
  found by binary search among the call's key positions, sorted once per call: any layout
  works (zigzag and striped shards hold positions that are not one range; a ring step
  holds another rank's keys). A pick that names no key of the call is masked;
* **forward**: the picked rows of K and V are gathered and the ``[B, Hkv, G, cq, k]``
  logits computed, the mask's other terms evaluated at the picked keys (their positions,
  segment ids, dense-mask entries; a bias gathered likewise), a plain softmax over them;
  the ``(o, lse)`` merge across calls is the protocol's;
* **backward**: dQ from the gathered keys; dK and dV of each pick scatter-added
  (``.at[].add``) into its key row, a bias gradient into its column.

Work is ``Tq·k·(D + Dv)`` per call and memory one chunk's gathered rows
(:data:`CHUNK_PICKS` picks). A ring calls the kernel once per step with all its queries, so
a device computes ``S·k`` picks in all (``S/cp·k`` under all-gather and Ulysses).

NaN and Inf follow the dense computation (the contract in
:mod:`cptransform.lowering.kernels`): keys no pick names are never read, so the ``0·x``
the dense softmax adds for the pairs a mask hides is added from sums over the call:
``0·K`` to dQ and ``0·Q`` to dK (:func:`_key_zeros`, :func:`_query_zeros`: a non-finite
K or Q reaches every row and key through the logits anyway), and ``0·V`` to o and ``0·dO``
to dV per row and key (:func:`_unseen_values`, :func:`_unseeing_rows`: a row that sees an
Inf of V gets ``p·Inf = Inf`` where the rows that do not see it get NaN, so the non-finite
values each row or key meets are counted, in a second pass taken only when there are
any).

One pick names several keys when key positions repeat, which a lookup cannot return.
Positions built from the layout never repeat; for the caller's positions the kernel checks
at run time and falls back to the sweep (``lax.cond``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax

from cptransform.analysis.block_work import chunk_size
from cptransform.lowering.block import Block
from cptransform.lowering.kernels import merged_into, pad_axis, row_delta, sum_to, zero_times
from cptransform.op import mask_terms
from cptransform.op.accumulation import accumulator_dtype
from cptransform.op.attention_reference import capped_logits, empty_rows_of
from cptransform.op.attention_spec import AttentionSpec
from cptransform.op.operand_roles import Side

#: Picks (query rows × k) per query chunk: a chunk gathers this many rows of K and of V.
CHUNK_PICKS = 1 << 14


def applies(block: Block, spec: AttentionSpec) -> bool:
    """Whether a call takes the gather: a top-k mask whose queries pick fewer keys each than
    the call holds (with as many picks as keys the gather saves nothing; ``bench/topk.py``
    on a CPU measures the two even at ``k = Tkv/2``, as the sweep looks every key up in
    the picks). Dropout is drawn by the sweep only, and so is a finite fill (the keys not
    picked keep a share of the row)."""
    return bool(spec.mask.topk) and block.topk is not None and spec.dropout is None \
        and spec.mask.fill is None \
        and block.topk.shape[-1] < block.k.shape[1]


@dataclass(frozen=True)
class Call:
    """One call's operands: the query side padded to ``nq`` chunks of ``cq`` rows (keys as
    given), and the keys' positions sorted (``keys``) with their local indices
    (``order``), both ``[B|1, Tkv]``."""

    block: Block
    spec: AttentionSpec
    tq: int
    cq: int
    nq: int
    keys: jax.Array
    order: jax.Array

    @classmethod
    def build(cls, block: Block, spec: AttentionSpec, cq: int | None = None) -> "Call":
        """The call of ``block``, its queries in chunks of ``cq`` rows (``None``: of about
        :data:`CHUNK_PICKS` picks)."""
        tq = block.q.shape[1]
        cq = cq or chunk_size(tq, max(1, CHUNK_PICKS // block.topk.shape[-1]))
        nq = -(-tq // cq)

        def rows(x, r):
            if r.side not in (Side.QUERY, Side.ROWS):
                return x
            return pad_axis(x, r.token_axis, cq * nq, 0 if r.heavy else None)
        padded = block.by_role(rows)
        order = jnp.argsort(block.kv_pos, axis=-1).astype(jnp.int32)
        return cls(padded, spec, tq, cq, nq, jnp.take_along_axis(block.kv_pos, order, -1),
                   order)

    @property
    def acc(self):
        """The dtype the softmax and the gradients accumulate in."""
        return accumulator_dtype(self.block.q.dtype)

    @property
    def hkv(self) -> int:
        return self.block.k.shape[2]

    @property
    def groups(self) -> int:
        return self.block.q.shape[2] // self.hkv

    def distinct_keys(self):
        """Traced bool: no two keys of the call share a position (in any batch row)."""
        return jnp.all(self.keys[:, 1:] != self.keys[:, :-1])

    def rows(self, x, i, axis: int = 1):
        """Query chunk ``i`` of ``x`` along ``axis``."""
        return lax.dynamic_slice_in_dim(x, i * self.cq, self.cq, axis=axis)

    def heads(self, x):
        """``[B, cq, H, …]`` → ``[B, Hkv, G, cq, …]`` (query head ``hkv·G + g``)."""
        b, cq, _, *rest = x.shape
        x = x.reshape(b, cq, self.hkv, self.groups, *rest)
        return jnp.moveaxis(x, 1, 3)

    def tokens(self, x):
        """Inverse of :meth:`heads`."""
        b, _, _, cq, *rest = x.shape
        return jnp.moveaxis(x, 3, 1).reshape(b, cq, self.hkv * self.groups, *rest)

    def per_head(self, x):
        """A tile ``[Bx, H|1, cq, k]`` → ``[Bx, Hkv|1, G|1, cq, k]``."""
        if x.shape[1] == 1:
            return x[:, :, None]
        return x.reshape(x.shape[0], self.hkv, self.groups, *x.shape[2:])


@dataclass(frozen=True)
class Picks:
    """Query chunk ``i``'s picks: ``local`` int32 ``[B', Hi, cq, k]``, the call's index of
    each picked key (clamped where ``valid`` is False: no such key, a repeat, a padded
    query row); ``ok`` the mask at the picks and ``bias`` the bias there, as
    ``[Bx, Hkv|1, G|1, cq, k]`` (``bias`` ``None`` without one)."""

    local: jax.Array
    valid: jax.Array
    ok: jax.Array
    bias: jax.Array | None

    @property
    def shared(self) -> bool:
        """Whether every query head of a row has the same picks (``Hi`` is 1)."""
        return self.local.shape[1] == 1

    @property
    def letter(self) -> str:
        """The einsum letter of the gathered rows' group dim (none when shared)."""
        return "" if self.shared else "g"

    def at(self, call: Call, drop: bool = False):
        """The key index of each pick as :func:`_take` reads it: ``[B', 1, cq, k]`` when
        shared, else ``[B', Hkv, G, cq, k]``; ``drop``: invalid picks past the keys."""
        local = jnp.where(self.valid, self.local, call.block.k.shape[1]) if drop else self.local
        return local if self.shared else local.reshape(
            local.shape[0], call.hkv, call.groups, *local.shape[2:])


def _at_keys(x, local):
    """``x[b, local[b]]`` of a per-key operand ``x [B|1, Tkv]`` (batch rows broadcast)."""
    if x.shape[0] == 1:
        return x[0][local]
    local = jnp.broadcast_to(local, (x.shape[0], *local.shape[1:]))
    return jax.vmap(lambda row, at: row[at])(x, local)


def locate(call: Call, i) -> Picks:
    """Query chunk ``i``'s picks among the call's keys, and the mask and bias there."""
    blk = call.block
    picks = jnp.sort(call.rows(blk.topk, i, axis=2), axis=-1)          # [Bt, Hi, cq, k]
    # A repeated pick selects its key once (a set, as a scatter of True makes it).
    first = jnp.concatenate([jnp.ones_like(picks[..., :1], bool),
                             picks[..., 1:] != picks[..., :-1]], axis=-1)
    b = max(picks.shape[0], call.keys.shape[0])
    wide = lambda x: jnp.broadcast_to(x, (b, *x.shape[1:]))  # noqa: E731

    def lookup(keys, order, p):
        at = jnp.minimum(jnp.searchsorted(keys, p), keys.shape[0] - 1)
        return order[at], keys[at] == p

    local, found = jax.vmap(lookup)(wide(call.keys), wide(call.order), wide(picks))
    real = i * call.cq + lax.iota(jnp.int32, call.cq)[:, None] < call.tq
    valid = found & first & real
    q_side = lambda x: call.rows(x, i)[:, None, :, None]  # noqa: E731
    columns = lambda x: None if x is None else jnp.take_along_axis(  # noqa: E731
        call.rows(x, i, axis=2), local, axis=3)
    tile = dataclasses.replace(mask_terms.Tile.of(
        dict(blk.term_operands(), q_pos=blk.q_pos), q_side, lambda x: _at_keys(x, local),
        dense=columns(blk.mask), picked=valid), kv_pos=picks)
    ok = mask_terms.visible(call.spec.mask.terms(), tile)
    bias = None if blk.bias is None else call.per_head(columns(blk.bias))
    return Picks(local, valid, call.per_head(ok), bias)


def _index(x, at):
    """The batch and KV-head indices that go with ``at`` into ``x [B, Tkv, Hkv, …]``."""
    b = lax.broadcasted_iota(jnp.int32, (x.shape[0],) + (1,) * (at.ndim - 1), 0)
    h = lax.broadcasted_iota(jnp.int32, (1, x.shape[2]) + (1,) * (at.ndim - 2), 1)
    return b, at, h


def _take(x, at):
    """The picked rows of ``x [B, Tkv, Hkv, F]``: ``[B, Hkv, (G,) cq, k, F]``."""
    return x[_index(x, at)]


def _put(buf, at, rows):
    """``rows`` (as :func:`_take` returns them) added into ``buf``; indices past the keys
    are dropped."""
    return buf.at[_index(buf, at)].add(rows, mode="drop")


def _key_zeros(x, groups: int):
    """``Σ 0·x`` over the keys of ``x [B, Tkv, Hkv, F]``, per query head: ``[B, 1, H, F]``
    (0, or NaN where a key holds NaN or ±Inf)."""
    return jnp.repeat(jnp.sum(zero_times(x), axis=1), groups, axis=1)[:, None]


def _query_zeros(x, hkv: int):
    """``Σ 0·x`` over the query rows and the group's heads of ``x [B, Tq, H, F]``, per KV
    head: ``[B, 1, Hkv, F]``."""
    z = jnp.sum(zero_times(x), axis=1)
    return jnp.sum(z.reshape(z.shape[0], hkv, -1, z.shape[-1]), axis=2)[:, None]


def _full_mask(call: Call, p: Picks, b: int):
    """``p.ok`` as float ``[B, Hkv, G, cq, k]`` (what the counts multiply)."""
    shape = (b, call.hkv, call.groups, call.cq, p.local.shape[-1])
    return jnp.broadcast_to(p.ok, shape).astype(call.acc)


def _unseen_values(call: Call, v):
    """``Σ 0·V`` over the keys each query row does not see, ``[B, Tq, H, Dv]``: NaN where
    one of them holds a NaN or ±Inf, else 0. A row that sees an Inf gets it (``p·Inf``)
    from its picks, so non-finite values are counted (all the keys' against the row's
    picks'); only when V holds one, the common case costing one reduction."""
    acc = call.acc
    bad = ~jnp.isfinite(v)
    b, tqp, h, _ = call.block.q.shape
    rows = lambda n: jnp.zeros_like(call.block.q, acc, (b, n, h, v.shape[-1]))  # noqa: E731

    def count():
        def chunk(i, seen):
            p = locate(call, i)
            n = jnp.einsum(f"bhgqj,bh{p.letter}qjd->bhgqd", _full_mask(call, p, b),
                           _take(bad.astype(acc), p.at(call)), preferred_element_type=acc)
            return lax.dynamic_update_slice_in_dim(seen, call.tokens(n), i * call.cq, axis=1)
        return lax.fori_loop(0, call.nq, chunk, rows(tqp))[:, :call.tq]

    seen = lax.cond(jnp.any(bad), count, lambda: rows(call.tq))
    total = jnp.repeat(jnp.sum(bad, axis=1, dtype=acc), call.groups, axis=1)[:, None]
    return jnp.where(total > seen, jnp.nan, 0.0)


def _unseeing_rows(call: Call, do):
    """``Σ 0·dO`` over the query rows that do not see each key, ``[B, Tkv, Hkv, Dv]``: NaN
    where one of them holds a NaN or ±Inf, else 0; counted as :func:`_unseen_values`
    counts, the rows' picks scatter-added."""
    acc, blk = call.acc, call.block
    bad = ~jnp.isfinite(do)
    padded = pad_axis(bad.astype(acc), 1, call.cq * call.nq, 0)

    def count():
        def chunk(i, seen):
            p = locate(call, i)
            n = jnp.einsum(f"bhgqj,bhgqd->bh{p.letter}qjd", _full_mask(call, p, do.shape[0]),
                           call.heads(call.rows(padded, i)), preferred_element_type=acc)
            return _put(seen, p.at(call, drop=True), n)
        return lax.fori_loop(0, call.nq, chunk, jnp.zeros_like(blk.v, acc))

    seen = lax.cond(jnp.any(bad), count, lambda: jnp.zeros_like(blk.v, acc))
    total = jnp.sum(bad, axis=1, dtype=acc)
    total = jnp.sum(total.reshape(total.shape[0], call.hkv, -1, total.shape[-1]), axis=2)
    return jnp.where(total[:, None] > seen, jnp.nan, 0.0)


def _chunk_logits(call: Call, p: Picks, q, k):
    """``(s, tanh)`` of the chunk's queries ``q [B, Hkv, G, cq, D]`` (accumulation dtype)
    at their gathered keys: ``[B, Hkv, G, cq, k]``, not masked."""
    acc = call.acc
    # The scale goes on q, as in the sweep (the same rounding of huge logits).
    qs = q * acc.type(call.spec.scale)
    s = jnp.einsum(f"bhgqd,bh{p.letter}qjd->bhgqj", qs, _take(k, p.at(call)).astype(acc),
                   preferred_element_type=acc)
    return capped_logits(call.spec, s, p.bias)


def _chunk_forward(call: Call, i, k, v):
    """``(o [B, Hkv, G, cq, Dv], lse [B, Hkv, G, cq])`` of query chunk ``i``, as
    :func:`~cptransform.op.attention_reference.attend` computes them over its picks."""
    acc = call.acc
    p = locate(call, i)
    s, _ = _chunk_logits(call, p, call.heads(call.rows(call.block.q, i)).astype(acc), k)
    s = jnp.where(p.ok, s, -jnp.inf)
    m = jnp.max(s, axis=-1)
    # Only the no-mass case is shifted by 0: a NaN or +inf maximum makes the row NaN.
    m_safe = jnp.where(m == -jnp.inf, 0.0, m)
    w = jnp.where(p.ok, jnp.exp(s - m_safe[..., None]), 0.0)
    total = jnp.sum(w, axis=-1)
    total_safe = jnp.where(total == 0, 1.0, total)
    o = jnp.einsum(f"bhgqj,bh{p.letter}qjd->bhgqd", w / total_safe[..., None],
                   _take(v, p.at(call)).astype(acc), preferred_element_type=acc)
    return o, jnp.where(total == 0, -jnp.inf, jnp.log(total_safe) + m_safe)


class XlaLoops:
    """The gathered computation in XLA: one query chunk at a time (``fori_loop``), the
    picked rows gathered into ``[B, Hkv, G, cq, k, D]`` tiles and contracted by einsum.
    :mod:`.pallas_topk` is the other implementation of the two methods."""

    def call(self, block: Block, spec: AttentionSpec) -> Call:
        """The :class:`Call` these loops walk (chunks of :data:`CHUNK_PICKS` picks)."""
        return Call.build(block, spec)

    def forward(self, call: Call):
        """``(o [B, Tq', H, Dv], lse [B, H, Tq'])`` over the picks alone (accumulation
        dtype; the padded rows included, the ``0·V`` of unseen keys not yet added)."""
        k, v, acc = call.block.k, call.block.v, call.acc
        b, tqp, h, _ = call.block.q.shape

        def chunk(i, out):
            o, lse = _chunk_forward(call, i, k, v)
            at = i * call.cq
            return (lax.dynamic_update_slice_in_dim(out[0], call.tokens(o), at, axis=1),
                    lax.dynamic_update_slice_in_dim(out[1], lse.reshape(b, h, call.cq), at,
                                                    axis=2))

        # zeros_like, not zeros: the buffers vary over the mesh axes as the queries do.
        out = (jnp.zeros_like(call.block.q, acc, (b, tqp, h, v.shape[-1])),
               jnp.full_like(call.block.q, -jnp.inf, acc, (b, h, tqp)))
        return lax.fori_loop(0, call.nq, chunk, out)

    def backward(self, call: Call, rows: "Rows", start):
        """``start`` (the running ``(dq [B, Tq', H, D], dk, dv, dbias | None)`` sums, padded
        rows included) plus the gradients of the picks (no ``0·x`` terms)."""
        blk = call.block

        def chunk(i, state):
            dq, dk, dv, dbias = state
            p, g_q, g_k, g_v, g_b = _chunk_backward(call, rows, i, blk.k, blk.v)
            at = i * call.cq
            dq = lax.dynamic_update_slice_in_dim(
                dq, call.rows(dq, i) + call.tokens(g_q), at, axis=1)
            dk, dv = _put(dk, p.at(call, drop=True), g_k), _put(dv, p.at(call, drop=True), g_v)
            if dbias is not None:
                dbias = lax.dynamic_update_slice_in_dim(dbias, _bias_rows(call, p, g_b), at, 2)
            return dq, dk, dv, dbias

        return lax.fori_loop(0, call.nq, chunk, start)


#: The loops the XLA kernel gathers with.
XLA_LOOPS = XlaLoops()


def _forward(call: Call, loops, running):
    """The gathered forward of the whole call (see :func:`forward`)."""
    o, lse = loops.forward(call)
    # A key a row does not see adds 0·V, as a masked key does in the dense softmax.
    o = o[:, :call.tq] + _unseen_values(call, call.block.v)
    return merged_into(running, o, lse[:, :, :call.tq])


@dataclass(frozen=True)
class Rows:
    """What the backward reads per query row, padded to the chunks: ``lse`` (``-inf`` made
    0, as the dense backward shifts empty rows) and ``delta`` ``[B, H, Tq']``, ``do``
    ``[B, Tq', H, Dv]``. Padded rows are zeros: their picks are invalid."""

    lse: jax.Array
    delta: jax.Array
    do: jax.Array

    @classmethod
    def build(cls, call: Call, lse, delta, do) -> "Rows":
        tqp, acc = call.cq * call.nq, call.acc
        lse = jnp.where(empty_rows_of(lse), 0.0, lse).astype(acc)
        return cls(pad_axis(lse, 2, tqp, 0), pad_axis(delta.astype(acc), 2, tqp, 0),
                   pad_axis(do, 1, tqp, 0))

    def at(self, call: Call, i):
        """Chunk ``i``'s ``lse``, ``delta`` ``[B, Hkv, G, cq]`` and ``do``
        ``[B, Hkv, G, cq, Dv]`` (accumulation dtype)."""
        per_row = lambda x: call.heads(jnp.swapaxes(call.rows(x, i, axis=2), 1, 2))  # noqa: E731
        return (per_row(self.lse), per_row(self.delta),
                call.heads(call.rows(self.do, i)).astype(call.acc))


def _chunk_backward(call: Call, rows: Rows, i, k, v):
    """``(picks, g_q [B, Hkv, G, cq, D], g_k, g_v (per pick, as :func:`_take` returns
    them), g_b [B, Hkv, G, cq, k])`` of query chunk ``i``: the dense backward's formulas
    at its picks."""
    acc = call.acc
    p = locate(call, i)
    q = call.heads(call.rows(call.block.q, i)).astype(acc)
    s, tanh = _chunk_logits(call, p, q, k)
    lse, delta, do = rows.at(call, i)
    # s ≤ lse; a recomputed logit can round a few ulps above it (minimum keeps NaN).
    w = jnp.where(p.ok, jnp.exp(jnp.minimum(s - lse[..., None], 0.0)), 0.0)
    e = p.letter
    kg, vg = (_take(x, p.at(call)).astype(acc) for x in (k, v))
    g_v = jnp.einsum(f"bhgqj,bhgqd->bh{e}qjd", w, do, preferred_element_type=acc)
    dp = jnp.einsum(f"bhgqd,bh{e}qjd->bhgqj", do, vg, preferred_element_type=acc)
    # A masked logit's gradient is an exact 0, even where dp or delta is NaN.
    g_b = jnp.where(p.ok, w * (dp - delta[..., None]), 0.0)
    ds = g_b if tanh is None else g_b * (1.0 - tanh * tanh)
    ds = ds * acc.type(call.spec.scale)
    g_q = jnp.einsum(f"bhgqj,bh{e}qjd->bhgqd", ds, kg, preferred_element_type=acc)
    g_k = jnp.einsum(f"bhgqj,bhgqd->bh{e}qjd", ds, q, preferred_element_type=acc)
    return p, g_q, g_k, g_v, g_b


def _bias_rows(call: Call, p: Picks, g_b):
    """A chunk's bias gradient at its picks ``[B, Hkv, G, cq, k]`` scattered into its key
    columns and summed to the bias's broadcast dims: ``[Bb, Hb, cq, Tkv]``."""
    b, hkv, g, cq, k = g_b.shape
    bias = call.block.bias
    cols = jnp.where(p.valid, p.local, call.block.k.shape[1])
    zeros = jnp.zeros_like(bias, call.acc, (b, hkv * g, cq, call.block.k.shape[1]))
    at = tuple(lax.broadcasted_iota(jnp.int32, zeros.shape[:3] + (1,), d) for d in range(3))
    full = zeros.at[(*at, cols)].add(g_b.reshape(b, hkv * g, cq, k), mode="drop")
    return sum_to(full, (*bias.shape[:2], cq, full.shape[-1]))


def _backward(call: Call, loops, lse, delta, do, dq, dk, dv):
    """The gathered backward of the whole call (see :func:`backward`)."""
    blk, acc, tqp = call.block, call.acc, call.cq * call.nq
    start = (pad_axis(dq.astype(acc), 1, tqp, 0) if dq is not None else
             jnp.zeros_like(blk.q, acc),
             jnp.zeros_like(blk.k, acc) if dk is None else dk.astype(acc),
             jnp.zeros_like(blk.v, acc) if dv is None else dv.astype(acc),
             None if blk.bias is None else jnp.zeros_like(
                 blk.bias, acc, (*blk.bias.shape[:2], tqp, blk.k.shape[1])))
    g_q, g_k, g_v, dbias = loops.backward(call, Rows.build(call, lse, delta, do), start)
    # What the masked pairs add in the dense backward: 0·K to dQ and 0·Q to dK (a
    # non-finite K or Q makes its column NaN whether seen or not), 0·dO to dV and a NaN
    # row's NaN probabilities to every key.
    nan_rows = jnp.swapaxes(jnp.where(jnp.isnan(lse), jnp.nan, 0.0), 1, 2)[..., None]
    g_q = g_q[:, :call.tq] + _key_zeros(blk.k, call.groups)
    g_k = g_k + _query_zeros(blk.q[:, :call.tq], call.hkv)
    g_v = g_v + _unseeing_rows(call, do) + _query_zeros(nan_rows, call.hkv)
    return g_q, g_k, g_v, None if dbias is None else dbias[:, :, :call.tq]


def forward(block: Block, spec: AttentionSpec, running, sweep, loops=XLA_LOOPS):
    """``(o, lse)`` of ``block`` under its top-k mask by gathering (kernel protocol, see
    :mod:`cptransform.lowering.kernels`) with ``loops`` (:class:`XlaLoops` or the Pallas
    ones); ``sweep`` is the dense forward (same arguments) taken when the caller's key
    positions repeat."""
    call = loops.call(block, spec)
    if spec.kv_positions_layout is not None:  # the layout's positions never repeat
        return _forward(call, loops, running)
    return lax.cond(call.distinct_keys(), lambda: _forward(call, loops, running),
                    lambda: sweep(block, spec, running))


def backward(block: Block, o, lse, do, spec: AttentionSpec, dlse, delta, dq, dk, dv, sweep,
             loops=XLA_LOOPS):
    """``(dq, dk, dv, dbias)`` of ``block`` under its top-k mask by gathering and
    scatter-adding (kernel protocol); ``sweep`` and ``loops`` as in :func:`forward`."""
    call = loops.call(block, spec)
    if delta is None:
        delta = row_delta(o, do, dlse)

    def gathered():
        return _backward(call, loops, lse, delta, do, dq, dk, dv)

    if spec.kv_positions_layout is not None:
        return gathered()
    return lax.cond(call.distinct_keys(), gathered,
                    lambda: sweep(block, o, lse, do, spec, None, delta, dq, dk, dv))
