"""The chunked XLA kernel: flash-style attention in plain ``jax.numpy`` (kernel ``"xla"``).

The local problem is cut into a static grid of query chunks × key chunks. Each (query
chunk, key chunk) pair is classified once per call (:func:`chunk_kinds`) by the mask's terms
(:mod:`cptransform.op.mask_terms`: position and segment-id ranges per chunk, ``any``/``all``
of dense tiles, whether an index of the query chunk falls in the key chunk's positions):

* ``SKIP`` pairs are skipped (``lax.switch`` runs a branch that does nothing); the ``0·V``
  (backward: ``0·K``, ``0·Q``, ``0·dO``) a dense softmax adds for them is added once per
  call from per-chunk ``Σ 0·x`` sums (:meth:`_Problem.skipped`), so a NaN or Inf in V still
  reaches every row that skipped it, see :mod:`cptransform.lowering.kernels`;
* ``FULL`` pairs compute without building a mask;
* ``PARTIAL`` pairs build the mask of the pair (:func:`visible`) and apply it.

Forward: a ``lax.scan`` over query chunks, inside it a ``lax.fori_loop`` over key chunks
keeping a running max, sum and accumulator per row; normalised once at the end. Backward:
a ``lax.scan`` over key chunks (dK/dV of the chunk accumulate over the query chunks of a
``fori_loop``) with dQ accumulated across the scan, the probabilities recomputed from the
merged ``lse`` and ``delta = rowsum(dO∘O) - dlse`` computed once per call. Working memory
is one pair's ``[B, Hkv, G·cq, ck]`` tile plus O(T) state, so it grows linearly with the
local length, and compile time does not grow with the grid.

A top-k mask whose queries pick fewer keys than the call holds skips all of this: its
picks alone are gathered and computed (:mod:`~cptransform.lowering.kernels.topk_gather`),
so its cost follows ``k``, not the keys.

GQA/MQA fold the query-head group into the rows (``q [B, T, H, D] → [B, Hkv, G·T, D]``),
so every product is a plain batched matmul over ``(B, Hkv)``.

Lengths that the chunk does not divide are padded: padded keys are masked (their pairs are
never ``FULL``), padded queries are dropped from the result and carry ``lse = +inf`` in the
backward so they contribute nothing. A row is empty (``lse = -inf``, ``o = Σ 0·V``) exactly
when its mask excludes every key; that is tracked from the mask, never read off ``l`` or
``lse``, so NaN and Inf in the inputs propagate as in :func:`attention_reference.attend`
(the contract in :mod:`cptransform.lowering.kernels`).
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax

from cptransform.analysis.block_work import DEFAULT_CHUNK, kernel_grid
from cptransform.lowering.block import Block
from cptransform.lowering.kernels import pad_axis, register_kernel, row_delta, sum_to, \
    topk_gather, zero_times
from cptransform.op.accumulation import accumulator_dtype
from cptransform.lowering.kernels.capabilities import Capabilities
from cptransform.op import dropout, mask_terms
from cptransform.op.mask_terms import BlockKind
from cptransform.op.attention_reference import capped_logits, empty_rows_of, masked_logits, \
    visible
from cptransform.op.attention_spec import AttentionSpec
from cptransform.op.operand_roles import Side


def _grid(block: Block, target: int):
    """``((cq, nq), (ck, nk))``: chunk length and count for queries and keys."""
    return kernel_grid(block.q.shape[1], block.k.shape[1], target)


def chunk_kinds(block: Block, spec: AttentionSpec, target: int = DEFAULT_CHUNK):
    """Int32 ``[nq, nk]``: the :class:`~cptransform.op.mask_terms.BlockKind` (``SKIP``,
    ``FULL`` or ``PARTIAL``) of each (query chunk, key chunk) pair of ``block`` cut as the
    kernel with chunk ``target`` cuts it.

    ``SKIP`` is a proof that no query of the chunk sees a key of the chunk in any batch
    row and head; ``FULL`` that every query sees every key; the mask's terms decide both
    from ranges (:func:`~cptransform.op.mask_terms.meet`), so both are conservative (e.g.
    segment ranges that overlap without a common id are ``PARTIAL``).
    """
    (cq, _), (ck, nk) = _grid(block, target)
    may, full = mask_terms.meet(spec.mask.terms(), mask_terms.Blocks.cut(
        block.q_pos, block.kv_pos, cq, ck, **block.term_operands()))
    # Under a finite fill the masked pairs keep a share of the row: none is skipped.
    may = may | (spec.mask.fill is not None)
    # Padded keys must be masked, so the last key chunk is never FULL when it is padded.
    # (An iota, not a NumPy constant: a body that gains constants cannot stay under remat.)
    complete = jnp.arange(nk) * ck + ck <= block.k.shape[1]
    grid = jnp.ones((1, 1, -(-block.q.shape[1] // cq), nk), bool)
    may = jnp.any(grid & may, axis=(0, 1))
    full = jnp.all(grid & full, axis=(0, 1)) & complete
    return BlockKind.of(may, full)


def executed_fraction(block: Block, spec: AttentionSpec, target: int = DEFAULT_CHUNK):
    """Scalar: the fraction of the ``Tq × Tkv`` score matrix the kernel computes (pairs
    that are not ``SKIP``, padding included)."""
    (cq, _), (ck, _) = _grid(block, target)
    computed = jnp.sum(chunk_kinds(block, spec, target) != BlockKind.SKIP)
    return computed * (cq * ck) / (block.q.shape[1] * block.k.shape[1])


def _rows(x, g: int):
    """A per-head tile ``[Bx, H|1, cq, ck]`` → ``[Bx, Hkv|1, G·cq, ck]`` (the folded
    query rows: query head ``hkv·G + g`` is row block ``g`` of KV head ``hkv``)."""
    bx, hx, cq, ck = x.shape
    if hx == 1:
        return jnp.broadcast_to(x[:, :, None], (bx, 1, g, cq, ck)).reshape(bx, 1, g * cq, ck)
    return x.reshape(bx, hx // g, g * cq, ck)


@dataclass(frozen=True)
class _Problem:
    """One kernel call's operands padded to the chunk grid, in the caller's layout.

    The operands are never transposed or folded whole: each step slices its chunk out of
    ``[B, T, H, D]`` and reshapes it into tile rows (:meth:`rows`), and the results are
    written back into ``[B, T, H, …]`` buffers in place (:meth:`put_rows`), so a call holds
    no copy of the local shards beyond its outputs."""

    block: Block          # q_pos/kv_pos/seg/mask/bias padded to the grid
    spec: AttentionSpec
    q: object             # [B, Tq', H, D]
    k: object             # [B, Tkv', Hkv, D]
    v: object             # [B, Tkv', Hkv, Dv]
    cq: int
    nq: int
    ck: int
    nk: int
    tkv: int
    kinds: object

    @classmethod
    def build(cls, block: Block, spec: AttentionSpec, target: int) -> "_Problem":
        (cq, nq), (ck, nk) = _grid(block, target)
        kinds = chunk_kinds(block, spec, target)
        tqp, tkp = cq * nq, ck * nk

        def pad(x, r):
            # Repeating the last entry keeps every range the block kinds were read from.
            if r.heavy or r.side is Side.HEADS:
                return x
            x = pad_axis(x, r.token_axis, tkp if r.side is Side.KEY else tqp)
            return pad_axis(x, 3, tkp) if r.columns else x
        padded = block.by_role(pad)
        return cls(padded, spec, pad_axis(block.q, 1, tqp, 0), pad_axis(block.k, 1, tkp, 0),
                   pad_axis(block.v, 1, tkp, 0), cq, nq, ck, nk, block.k.shape[1], kinds)

    @property
    def acc(self):
        """The dtype the softmax and the gradients accumulate in (:func:`accumulator_dtype`)."""
        return accumulator_dtype(self.q.dtype)

    @property
    def hkv(self) -> int:
        return self.k.shape[2]

    @property
    def groups(self) -> int:
        return self.q.shape[2] // self.hkv

    def rows(self, x, i):
        """Query chunk ``i`` of ``x [B, Tq', H, …]`` as tile rows ``[B, Hkv, G·cq, …]``
        (query head ``hkv·G + g`` is row block ``g`` of KV head ``hkv``)."""
        b, _, h = x.shape[:3]
        rest = x.shape[3:]
        c = lax.dynamic_slice_in_dim(x, i * self.cq, self.cq, axis=1)
        c = c.reshape(b, self.cq, self.hkv, self.groups, *rest)
        return jnp.moveaxis(c, 1, 3).reshape(b, self.hkv, self.groups * self.cq, *rest)

    def put_rows(self, buf, x, i):
        """``buf [B, Tq', H, …]`` with query chunk ``i`` replaced by the tile rows ``x``
        (the inverse of :meth:`rows`)."""
        b, _, h = buf.shape[:3]
        rest = buf.shape[3:]
        x = jnp.moveaxis(x.reshape(b, self.hkv, self.groups, self.cq, *rest), 3, 1)
        return lax.dynamic_update_slice_in_dim(buf, x.reshape(b, self.cq, h, *rest).astype(
            buf.dtype), i * self.cq, axis=1)

    def q_rows(self, i):
        """Query chunk ``i`` as ``[B, Hkv, G·cq, D]``."""
        return self.rows(self.q, i)

    def keys(self, x, j):
        """Key chunk ``j`` of ``x [B, Tkv', Hkv, …]`` as ``[B, Hkv, ck, …]``."""
        return jnp.swapaxes(lax.dynamic_slice_in_dim(x, j * self.ck, self.ck, axis=1), 1, 2)

    def kv(self, j):
        """Key chunk ``j``: ``(k [B, Hkv, ck, D], v [B, Hkv, ck, Dv])``."""
        return self.keys(self.k, j), self.keys(self.v, j)

    def put_keys(self, buf, x, j):
        """``buf [B, Tkv', Hkv, …]`` with key chunk ``j`` replaced by ``x [B, Hkv, ck, …]``."""
        return lax.dynamic_update_slice_in_dim(buf, jnp.swapaxes(x, 1, 2).astype(buf.dtype),
                                               j * self.ck, axis=1)

    def skipped(self, zero_sums, per_query: bool):
        """``Σ 0·x`` over the ``SKIP`` pairs, what a dense softmax adds there (see the
        kernel contract): NaN exactly where a skipped pair's chunk of ``x`` holds a NaN or
        ±Inf, else 0. ``zero_sums`` holds that per chunk (0 or NaN, ``[B, Hkv, n, …]``,
        from :meth:`key_poison` or :meth:`query_poison`): per key chunk for a result per
        query chunk (``per_query``), or the other way round.

        A select on the block kinds and a sum, so the result is linear in ``zero_sums``:
        the backward reads ``dO`` through here and must stay linear in it, or forward mode
        (the transpose of the VJP, :mod:`cptransform.api.forward_mode`) cannot transpose
        it. XLA fuses the select into the reduction: no ``[n, n, …]`` buffer."""
        skip = self.kinds == BlockKind.SKIP
        skip = skip if per_query else skip.T                       # [n_out, n_in]
        skip = skip.reshape(skip.shape + (1,) * (zero_sums.ndim - 3))
        picked = jnp.where(skip, zero_sums[:, :, None], 0.0)      # [B, Hkv, n_out, n_in, …]
        return jnp.sum(picked, axis=3).astype(self.acc)

    def key_poison(self, x):
        """``Σ 0·x`` per key chunk (0, or NaN where the chunk holds a NaN or ±Inf):
        ``x [B, Tkv', Hkv, …]`` → ``[B, Hkv, nk, …]``. Read off ``any`` over one axis, which
        fuses here; a float sum of ``0·x`` (as :meth:`query_poison` needs) measured 32 MiB
        more on the ring's sliced V. ``isfinite`` is not linear: this is for K and V only,
        never for ``dO``."""
        b, _, hkv = x.shape[:3]
        bad = ~jnp.isfinite(x).reshape(b, self.nk, self.ck, hkv, *x.shape[3:])
        return jnp.where(jnp.moveaxis(jnp.any(bad, axis=2), 1, 2), jnp.nan, 0.0)

    def query_poison(self, x):
        """``Σ 0·x`` per query chunk and KV head (over the chunk's rows and the group's
        query heads): ``x [B, Tq', H, …]`` → ``[B, Hkv, nq, …]``, 0 or NaN, linear in ``x``
        (it reads ``dO``). XLA fuses that reduction into one pass, with no bool copy."""
        b = x.shape[0]
        z = zero_times(x).reshape(b, self.nq, self.cq, self.hkv, self.groups, *x.shape[3:])
        return jnp.moveaxis(jnp.sum(z, axis=(2, 4)), 1, 2)

    def head_rows(self, x, i):
        """Query chunk ``i`` of a per-row ``x [B, H, Tq']`` as ``[B, Hkv, G·cq]``."""
        c = lax.dynamic_slice_in_dim(x, i * self.cq, self.cq, axis=2)
        return c.reshape(x.shape[0], self.hkv, self.groups * self.cq)

    def put_head_rows(self, buf, x, i):
        """``buf [B, H, Tq']`` with query chunk ``i`` replaced by ``x [B, Hkv, G·cq]``."""
        x = x.reshape(buf.shape[0], buf.shape[1], self.cq).astype(buf.dtype)
        return lax.dynamic_update_slice_in_dim(buf, x, i * self.cq, axis=2)

    def _tile(self, x, i, j):
        bx, hx = x.shape[:2]
        return lax.dynamic_slice(x, (0, 0, i * self.cq, j * self.ck), (bx, hx, self.cq, self.ck))

    def logits(self, qc, kc, i, j):
        """``(s, tanh)`` (:attr:`acc` dtype) of pair ``(i, j)``: scaled, soft-capped (``tanh`` is the
        soft-cap's ``tanh`` for the backward, else ``None``) and biased; not masked."""
        spec, accum = self.spec, self.acc
        # The scale goes on q, not on the product: XLA contracts ``product * scale - max``
        # into an FMA, which rounds the logit differently from the max it is compared with;
        # at huge logits (~1e29) that one-ulp gap is exp(±4e22) instead of 1.
        qs = qc.astype(accum) * accum.type(spec.scale)
        s = jnp.einsum("bhqd,bhkd->bhqk", qs, kc.astype(accum), preferred_element_type=accum)
        bias = None if self.block.bias is None else _rows(self._tile(self.block.bias, i, j),
                                                          self.groups)
        return capped_logits(spec, s, bias)

    def dropout(self, i, j):
        """The dropout multiplier ``[B|1, Hkv, G·cq, ck]`` of pair ``(i, j)`` (the bits one
        device draws for those pairs), or ``None`` without dropout."""
        if self.spec.dropout is None:
            return None
        blk = self.block
        q_pos = lax.dynamic_slice_in_dim(blk.q_pos, i * self.cq, self.cq, axis=1)
        kv_pos = lax.dynamic_slice_in_dim(blk.kv_pos, j * self.ck, self.ck, axis=1)
        return _rows(dropout.multiplier(self.spec.dropout, blk.dropout, q_pos, kv_pos),
                     self.groups)

    def masked(self, s, i, j):
        """``(s, ok, fed)`` of pair ``(i, j)`` under its mask: the logits ``s`` with the
        masked pairs set as the mask sets them (``-inf``, or its finite fill) and padded
        keys ``-inf``; ``ok`` (bool ``[B|1, Hkv|1, G·cq, ck]``) the pairs that keep their
        own logit; ``fed`` those that receive probability (``ok``, or under a fill every
        real key)."""
        ck = self.ck
        mine = self.block
        blk = Block(q_pos=mine.q_pos, kv_pos=mine.kv_pos, **mine.term_operands()).tile(
            i * self.cq, self.cq, j * ck, ck)
        ok = _rows(visible(self.spec.mask, blk.q_pos, blk.kv_pos, **blk.term_operands()),
                   self.groups)
        s = masked_logits(self.spec.mask, ok, s)
        fed = ok if self.spec.mask.fill is None else jnp.ones_like(ok)
        if self.ck * self.nk != self.tkv:
            real = j * ck + jnp.arange(ck) < self.tkv
            ok, fed, s = ok & real, fed & real, jnp.where(real, s, -jnp.inf)
        return s, ok, fed


@dataclass(frozen=True)
class _BackwardRows:
    """What the backward reads per query chunk, padded to the grid: ``lse``, ``delta`` and
    ``nan`` (NaN for NaN rows, else 0) ``[B, H, Tq']``, and ``do [B, Tq', H, Dv]`` in its
    own dtype (each chunk is cast as it is read)."""

    lse: jax.Array
    delta: jax.Array
    nan: jax.Array
    do: jax.Array

    @classmethod
    def build(cls, pb: _Problem, lse, delta, do) -> "_BackwardRows":
        accum = pb.acc
        tqp = pb.cq * pb.nq
        # Padded query rows: lse = +inf makes their probabilities 0, do = 0 their dV terms.
        lse = pad_axis(lse.astype(accum), 2, tqp, jnp.inf)
        nan = jnp.where(jnp.isnan(lse), jnp.nan, 0.0).astype(accum)
        return cls(lse, pad_axis(delta.astype(accum), 2, tqp, 0), nan, pad_axis(do, 1, tqp, 0))

    def at(self, pb: _Problem, i):
        """Query chunk ``i``'s ``(lse, delta, nan)`` as ``[B, Hkv, G·cq]`` and ``do`` as
        ``[B, Hkv, G·cq, Dv]`` (accumulation dtype)."""
        return (pb.head_rows(self.lse, i), pb.head_rows(self.delta, i),
                pb.head_rows(self.nan, i), pb.rows(self.do, i).astype(pb.acc))


def _pair_gradients(pb: _Problem, rows: _BackwardRows, spec: AttentionSpec, i, j, kc, vc,
                    masked: bool):
    """``(g_q, g_k, g_v, g_b)`` of query chunk ``i`` against key chunk ``j`` (``kc``,
    ``vc``), the mask applied when ``masked`` (a partial pair)."""
    accum = pb.acc
    b = pb.q.shape[0]
    bias = pb.block.bias
    scale = accum.type(spec.scale)
    qc = pb.q_rows(i)
    lse_i, delta_i, nan_i, do_i = rows.at(pb, i)
    s, tanh = pb.logits(qc, kc, i, j)
    # A NaN row has NaN probabilities at masked keys too (as a dense softmax).
    # s ≤ lse; a recomputed logit can still round a few ulps above it at huge
    # magnitudes, where exp would overflow (minimum keeps NaN).
    if masked:
        s_fed, ok, fed = pb.masked(s, i, j)
        p = jnp.where(fed, jnp.exp(jnp.minimum(s_fed - lse_i[..., None], 0.0)), 0.0)
    else:
        p = jnp.exp(jnp.minimum(s - lse_i[..., None], 0.0))
    p = p + nan_i[..., None]
    # Dropout (o = Σ p·M·v): dV = (P∘M)ᵀ dO and dP = (dO Vᵀ)∘M; delta is unchanged.
    drop = pb.dropout(i, j)
    g_v = jnp.einsum("bhqk,bhqd->bhkd", dropout.applied(spec.dropout, p, drop), do_i,
                     preferred_element_type=accum)
    dp = jnp.einsum("bhqd,bhkd->bhqk", do_i, vc.astype(accum), preferred_element_type=accum)
    dp = dropout.applied(spec.dropout, dp, drop)
    ds = p * (dp - delta_i[..., None])
    if masked:  # a masked logit's gradient is an exact 0
        ds = jnp.where(ok, ds, 0.0)
    g_b = None
    if bias is not None:
        g_b = sum_to(ds.reshape(b, pb.hkv * pb.groups, pb.cq, pb.ck),
                      (*bias.shape[:2], pb.cq, pb.ck))
    if tanh is not None:
        ds = ds * (1.0 - tanh * tanh)
    ds = ds * scale
    g_q = jnp.einsum("bhqk,bhkd->bhqd", ds, kc.astype(accum), preferred_element_type=accum)
    g_k = jnp.einsum("bhqk,bhqd->bhkd", ds, qc.astype(accum), preferred_element_type=accum)
    return g_q, g_k, g_v, g_b


def _dbias_unfolded(pb: _Problem, block: Block, dbias):
    """The chunked bias gradient ``[nk, nq, Bb, Hb, cq, ck]`` as ``[Bb, Hb, Tq, Tkv]``."""
    if dbias is None:
        return None
    bb, hb = pb.block.bias.shape[:2]
    return jnp.transpose(dbias, (2, 3, 1, 4, 0, 5)).reshape(
        bb, hb, pb.nq * pb.cq, pb.nk * pb.ck)[:, :, :block.q.shape[1], :block.k.shape[1]]


@dataclass(frozen=True)
class ChunkedKernel:
    """Flash-style local step in plain JAX; see the module doc. ``chunk`` is the target
    chunk length for queries and keys (:func:`~cptransform.analysis.block_work.chunk_size`).
    ``gather_topk``: a top-k mask whose queries pick fewer keys than the call holds is
    computed over the picks alone (:mod:`~cptransform.lowering.kernels.topk_gather`, cost
    ``Tq·k``) instead of swept chunk by chunk (``False``: always swept)."""

    chunk: int = DEFAULT_CHUNK
    name: str = "xla"
    gather_topk: bool = True
    #: Every mask term, dtype, head dim and backend; plain JAX needs no self-check.
    capabilities = Capabilities()

    def forward(self, block: Block, spec: AttentionSpec, running=None):
        """``(o, lse)`` of the queries of ``block`` against its keys (kernel contract).
        ``running``, when given, is a partial ``(o, lse)`` over other keys: each row's
        online softmax starts from it (``m = lse``, ``l = 1``, ``acc = o``), so the merged
        result is written into its buffers in place."""
        if self.gather_topk and topk_gather.applies(block, spec):
            return topk_gather.forward(block, spec, running, self._swept_forward)
        return self._swept_forward(block, spec, running)

    def _swept_forward(self, block: Block, spec: AttentionSpec, running=None):
        """:meth:`forward` chunk pair by chunk pair (the module doc)."""
        pb = _Problem.build(block, spec, self.chunk)
        b, tqp, h, _ = pb.q.shape
        dv = pb.v.shape[-1]
        accum = pb.acc

        skipped_v = pb.skipped(pb.key_poison(pb.v), per_query=True)   # [B, Hkv, nq, Dv]

        def q_chunk(i, out):
            qc = pb.q_rows(i)
            # A fresh call starts from the empty partial (lse = -inf, o = 0).
            m0 = pb.head_rows(out[1], i)
            state = (m0, jnp.ones_like(m0), pb.rows(out[0], i),
                     ~empty_rows_of(m0))

            def update(state, s, vc, j):
                m, l, acc, seen = state
                m_new = jnp.maximum(m, jnp.max(s, axis=-1))
                # A row that has seen no key yet keeps m = -inf; shift it by 0 instead.
                m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
                alpha = jnp.exp(m - m_safe)
                p = jnp.exp(s - m_safe[..., None])
                # Dropout scales the numerator only: the row sum l is of p itself.
                pm = dropout.applied(spec.dropout, p, pb.dropout(i, j))
                pv = jnp.einsum("bhqk,bhkd->bhqd", pm, vc.astype(accum), preferred_element_type=accum)
                return m_new, alpha * l + jnp.sum(p, axis=-1), alpha[..., None] * acc + pv, seen

            def full(j, state):
                kc, vc = pb.kv(j)
                s, _ = pb.logits(qc, kc, i, j)
                m, l, acc, seen = update(state, s, vc, j)
                return m, l, acc, seen | True

            def partial(j, state):
                kc, vc = pb.kv(j)
                s, _ = pb.logits(qc, kc, i, j)
                s, _, fed = pb.masked(s, i, j)
                m, l, acc, seen = update(state, s, vc, j)
                return m, l, acc, seen | jnp.any(fed, axis=-1)

            def step(j, state):
                # A skipped pair adds only Σ 0·V, added once per query chunk below.
                branches = BlockKind.branches(skip=lambda j, state: state, full=full,
                                              partial=partial)
                return lax.switch(pb.kinds[i, j], branches, j, state)

            m, l, acc, seen = lax.fori_loop(0, pb.nk, step, state)
            # An empty row keeps o = Σ 0·V (0, or NaN where V holds NaN/Inf).
            o = acc / jnp.where(l == 0, 1.0, l)[..., None] + \
                lax.dynamic_index_in_dim(skipped_v, i, axis=2)
            lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)
            return pb.put_rows(out[0], o, i), pb.put_head_rows(out[1], lse, i)

        if running is None:
            # zeros_like, not zeros: the buffers vary over the mesh axes as the queries do.
            out = (jnp.zeros_like(pb.q, accum, (b, tqp, h, dv)),
                   jnp.full_like(pb.q, -jnp.inf, accum, (b, h, tqp)))
        else:
            out = (pad_axis(running[0].astype(accum), 1, tqp, 0),
                   pad_axis(running[1].astype(accum), 2, tqp, -jnp.inf))
        o, lse = lax.fori_loop(0, pb.nq, q_chunk, out)
        tq = block.q.shape[1]
        return o[:, :tq], lse[:, :, :tq]

    def backward(self, block: Block, o, lse, do, spec: AttentionSpec, dlse=None, delta=None,
                 dq=None, dk=None, dv=None):
        """``(dq, dk, dv, dbias)`` (kernel contract). ``delta``, when given, is
        :func:`row_delta` of the merged output (then ``o`` and ``dlse`` are not read);
        ``dq``, ``dk`` and ``dv``, when given, are the running sums the loops add to in
        place (no second buffer)."""
        if self.gather_topk and topk_gather.applies(block, spec):
            return topk_gather.backward(block, o, lse, do, spec, dlse, delta, dq, dk, dv,
                                        self._swept_backward)
        return self._swept_backward(block, o, lse, do, spec, dlse, delta, dq, dk, dv)

    def _swept_backward(self, block: Block, o, lse, do, spec: AttentionSpec, dlse=None,
                        delta=None, dq=None, dk=None, dv=None):
        """:meth:`backward` chunk pair by chunk pair (the module doc)."""
        pb = _Problem.build(block, spec, self.chunk)
        accum = pb.acc
        if delta is None:
            delta = row_delta(o, do, dlse)
        rows = _BackwardRows.build(pb, lse, delta, do)
        bias = pb.block.bias

        def k_chunk(state, j):
            dq, dk, dv = state
            kc, vc = pb.kv(j)
            dbias_col = None if bias is None else jnp.zeros_like(
                bias, dtype=accum, shape=(pb.nq, *bias.shape[:2], pb.cq, pb.ck))

            zeros = (jnp.zeros_like(kc, dtype=accum, shape=(*kc.shape[:2], pb.groups * pb.cq,
                                                           pb.q.shape[-1])),
                     jnp.zeros_like(kc, dtype=accum), jnp.zeros_like(vc, dtype=accum),
                     None if bias is None else jnp.zeros_like(
                         bias, dtype=accum, shape=(*bias.shape[:2], pb.cq, pb.ck)))
            # A skipped pair adds only 0·K, 0·Q and 0·dO (NaN rows: NaN) sums, added once
            # per call (_skipped_gradients); its bias gradient stays 0. The switch returns
            # tiles, not the state: a conditional that carries the dQ buffer copies it.
            branches = BlockKind.branches(
                skip=lambda i: zeros,
                full=lambda i: _pair_gradients(pb, rows, spec, i, j, kc, vc, False),
                partial=lambda i: _pair_gradients(pb, rows, spec, i, j, kc, vc, True))

            def step(i, state):
                dq, dk_j, dv_j, dbias_col = state
                g_q, g_k, g_v, g_b = lax.switch(pb.kinds[i, j], branches, i)
                dq = pb.put_rows(dq, pb.rows(dq, i) + g_q, i)
                if dbias_col is not None:
                    dbias_col = lax.dynamic_update_index_in_dim(dbias_col, g_b, i, axis=0)
                return dq, dk_j + g_k, dv_j + g_v, dbias_col

            # Key chunk j's sums start with what its skipped pairs add.
            start_k, start_v = (pb.keys(x, j) + lax.dynamic_index_in_dim(add, j, axis=2)
                                for x, add in ((dk, add_k), (dv, add_v)))
            dq, dk_j, dv_j, dbias_col = lax.fori_loop(0, pb.nq, step,
                                                      (dq, start_k, start_v, dbias_col))
            return (dq, pb.put_keys(dk, dk_j, j), pb.put_keys(dv, dv_j, j)), dbias_col

        start = tuple(jnp.zeros_like(x, accum) if running is None else
                      pad_axis(running.astype(accum), 1, x.shape[1], 0)
                      for x, running in ((pb.q, dq), (pb.k, dk), (pb.v, dv)))
        add_q, add_k, add_v = _skipped_gradients(pb, rows)
        (dq, dk, dv), dbias = lax.scan(k_chunk, (start[0] + add_q, *start[1:]),
                                       jnp.arange(pb.nk))
        tq, tkv = block.q.shape[1], block.k.shape[1]
        return dq[:, :tq], dk[:, :tkv], dv[:, :tkv], _dbias_unfolded(pb, block, dbias)


def _skipped_gradients(pb: _Problem, rows: _BackwardRows):
    """What the ``SKIP`` pairs add to the gradients in a dense softmax: ``Σ 0·K`` to dQ as
    ``[B, Tq', H, D]``, ``Σ 0·Q`` to dK and ``Σ (0·dO + NaN rows)`` to dV per key chunk as
    ``[B, Hkv, nk, D|Dv]`` (exact zeros when everything is finite), from per-chunk
    sums instead of per pair."""
    b, tqp, h, d = pb.q.shape
    add_q = jnp.broadcast_to(
        jnp.moveaxis(pb.skipped(pb.key_poison(pb.k), per_query=True), 1, 2)[:, :, None, :, None],
        (b, pb.nq, pb.cq, pb.hkv, pb.groups, d)).reshape(b, tqp, h, d)
    nan_rows = jnp.swapaxes(rows.nan, 1, 2)[..., None]   # NaN rows' NaN, else 0
    add_k = pb.skipped(pb.query_poison(pb.q), per_query=False)
    add_v = pb.skipped(pb.query_poison(nan_rows + rows.do), per_query=False)
    return add_q, add_k, add_v


register_kernel(ChunkedKernel())
