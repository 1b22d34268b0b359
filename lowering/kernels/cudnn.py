"""The ``"cudnn"`` kernel: the local step by cuDNN's fused flash attention, the steps cuDNN
cannot express by the chunked XLA kernel.

cuDNN (through JAX's private module, :func:`~cptransform.ir.compat.cudnn_attention`) runs
one of two masks per call: none, or causal aligned to the block's top-left corner (query
``i`` sees keys ``j <= i``), optionally with a left window (``i - w < j``). Each call is
classified at run time from its positions, segment ids and validity (:func:`step_kind`, the mask
terms' own block classification over the whole block) and a ``lax.switch`` runs one of:

* ``SKIP``: no query sees a key. Nothing is computed; the ``0·x`` terms of the kernel
  contract are added (:func:`~cptransform.lowering.kernels.zero_times`).
* ``FULL``: every query sees every key: cuDNN without a mask.
* ``CAUSAL``: the mask's band is ``Band(lo, 0)`` (causal, with a left window when ``lo``
  is set), every other term is full, and the positions make it cuDNN's top-left causal
  mask (:func:`top_left`: key ``j`` visible to query ``i`` exactly when ``j <= i``; so a
  diagonal block of the contiguous, zigzag or striped layouts, and a striped block from an
  earlier rank; with a window the positions must be consecutive and equal, and
  ``Tq <= Tkv`` so that no row is empty). cuDNN with its causal mask.
* ``SHIFTED``: as ``CAUSAL`` without a window, but key ``j`` visible exactly when
  ``j < i`` (a striped block from a later rank): query 0 sees no key, queries ``1…`` run
  cuDNN causal against all the keys.
* ``OTHER``: the block is cut into ``pieces × pieces`` equal sub-blocks; when each of them
  is one of the kinds above, each runs as such (a zigzag rank's block from another rank:
  two full and two skipped sub-blocks), else the whole block runs the chunked XLA kernel
  (exact), as does a block the sizes do not cut evenly.

What cuDNN cannot run at all is delegated to the XLA kernel for the whole call, statically:
operands not all float16 or all bfloat16, a head dim it does not support or ``Dq != Dv``, a
soft-cap, an operand beyond :data:`CUDNN_READS` (a bias, a dense mask, top-k indices, any
other term's data), and attention sinks (their
``lse`` cotangent cannot reach cuDNN's backward, which computes ``rowsum(dO∘O)`` itself).
:attr:`CudnnKernel.capabilities` refuses those attentions, and bands cuDNN cannot run as
causal, so ``kernel="auto"`` takes the Pallas kernel for them.

Backward: cuDNN's backward primitive fed the *merged* ``o`` and ``lse`` (so the block's
probabilities are ``exp(s - lse)``); ``delta`` and ``dlse`` are read only by delegated steps
(without sinks the schedules' ``dlse`` is zero). ``o`` reaches cuDNN in the operands' dtype.

NaN and Inf: cuDNN never reads a masked key, where the dense computation multiplies exact-zero
probabilities with V (and in the backward with K, Q and dO). Each causal call adds those
``0·x`` sums over its masked keys (forward: ``0·V`` of keys ``j > i``; backward: ``0·K`` to
dQ, ``0·Q`` and ``0·dO`` plus NaN rows to dK and dV) from cumulative sums along the
sequence (``O(T·D)``: 0 unless a NaN or Inf is there). Non-finite values among the visible
logits are cuDNN's to propagate.

float32 is refused, not cast: cuDNN has no float32 fused attention, and rounding q, k and v
to bfloat16 would return numbers far from the float32 ones the contract promises
(``auto`` takes Pallas or XLA for float32).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from cptransform.ir import compat
from cptransform.lowering.block import Block
from cptransform.lowering.kernels import added_to, merged_into, register_kernel, row_delta, \
    zero_times
from cptransform.lowering.kernels.capabilities import Capabilities
from cptransform.lowering.kernels.chunked import ChunkedKernel
from cptransform.op import mask_terms
from cptransform.op.attention_spec import ROLES, AttentionSpec

#: The operands (by field name) a call gives cuDNN; a block holding any other (a dense
#: mask, a bias, top-k indices, a term's data) goes to the XLA kernel whole.
CUDNN_READS = frozenset({"q", "k", "v", "q_pos", "kv_pos", "q_seg", "kv_seg", "q_valid",
                         "kv_valid"})
#: The dtypes cuDNN's fused attention computes in (q, k and v alike).
DTYPES = frozenset({"float16", "bfloat16"})


class StepKind(enum.IntEnum):
    """What one call (or sub-block) is to cuDNN; the branch index of its ``lax.switch``."""

    SKIP = 0
    FULL = 1
    CAUSAL = 2
    SHIFTED = 3
    OTHER = 4


@dataclass(frozen=True)
class CudnnCalls:
    """The two cuDNN calls the kernel makes, with the signature and semantics of
    :func:`~cptransform.ir.compat.cudnn_attention`: ``forward(q, k, v, *, scale, causal,
    window) -> (o, lse)`` and ``backward(q, k, v, o, lse, do, *, scale, causal, window) ->
    (dq, dk, dv)``. Tests on a CPU pass a stand-in."""

    forward: Callable
    backward: Callable


#: JAX's private cuDNN attention.
CUDNN = CudnnCalls(compat.cudnn_attention,
                   lambda *args, **kw: compat.cudnn_attention(*args, backward=True, **kw))


def head_dim_limit() -> int:
    """cuDNN's largest head dim, as JAX checks it: 256 from Hopper (compute capability 9.0)
    on, 128 before (and where the device says none)."""
    capability = getattr(jax.devices()[0], "compute_capability", None)
    if not capability:
        return 128
    return 256 if tuple(int(x) for x in str(capability).split(".")[:2]) >= (9, 0) else 128


def _band(spec: AttentionSpec):
    """``(lo, hi)`` of the mask's band terms together, or ``None`` without one."""
    bands = [t for t in spec.mask.terms() if isinstance(t, mask_terms.Band)]
    return mask_terms.band_of(bands) if bands else None


def causal_window(spec: AttentionSpec, tq: int, tkv: int):
    """``(True, window)`` when cuDNN's top-left causal mask (with ``sliding_window_length``
    ``window``, ``None`` for none) can run this spec's band on a ``tq × tkv`` block whose
    positions are aligned (:func:`step_kind`), else ``(False, None)``."""
    band = _band(spec)
    if band is None or band[1] != 0:
        return False, None
    lo = band[0]
    if lo is None:
        return True, None
    # A window leaves rows past the last key's window empty when Tq > Tkv; cuDNN's
    # output for an empty row is not the contract's.
    return (True, 1 - lo) if lo <= 0 and tq <= tkv else (False, None)


def top_left(q_pos, kv_pos, shift: int = 0):
    """Traced bool: under ``kv_pos - q_pos <= 0`` key ``j`` is visible to query ``i``
    exactly when ``j <= i - shift`` (every batch row). With both increasing it suffices
    that the last key a query should see is visible and the next one is not."""
    tq, tkv = q_pos.shape[1], kv_pos.shape[1]
    ok = True
    for p in (q_pos, kv_pos):
        ok = ok & jnp.all(p[:, 1:] > p[:, :-1])
    # Query i sees key i - shift (where both exist) ...
    end = min(tq, tkv + shift)
    if end > shift:
        ok = ok & jnp.all(kv_pos[:, :end - shift] <= q_pos[:, shift:end])
    # ... and not key i - shift + 1.
    start, end = max(0, shift - 1), min(tq, tkv + shift - 1)
    if end > start:
        ok = ok & jnp.all(kv_pos[:, start - shift + 1:end - shift + 1] > q_pos[:, start:end])
    return ok


def _consecutive(q_pos, kv_pos):
    """Traced bool: query and key positions both run ``p, p + 1, …`` from the same ``p``
    (what makes a window on positions cuDNN's window on indices)."""
    ok = jnp.all(q_pos[:, :1] == kv_pos[:, :1])
    for p in (q_pos, kv_pos):
        ok = ok & jnp.all(p[:, 1:] - p[:, :-1] == 1)
    return ok


def step_kind(block: Block, spec: AttentionSpec):
    """Int32 scalar :class:`StepKind` of ``block`` (see the module doc). ``SKIP`` and
    ``FULL`` are the mask terms' proofs over the whole block (every batch row and head);
    ``CAUSAL`` and ``SHIFTED`` need those of the non-band terms, the band of
    :func:`causal_window` and positions that make it cuDNN's mask (:func:`top_left`)."""
    tq, tkv = block.q.shape[1], block.k.shape[1]
    terms = spec.mask.terms()
    blocks = mask_terms.Blocks.cut(block.q_pos, block.kv_pos, tq, tkv, **block.term_operands())
    may, full = mask_terms.meet(terms, blocks)
    may, full = jnp.any(may), jnp.all(full)
    kind = jnp.where(full, StepKind.FULL, StepKind.OTHER)
    runs, window = causal_window(spec, tq, tkv)
    if runs:
        rest = [t for t in terms if not isinstance(t, mask_terms.Band)]
        partial = ~full & jnp.all(mask_terms.meet(rest, blocks)[1])
        if window is not None:
            diagonal = _consecutive(block.q_pos, block.kv_pos)
        else:
            diagonal = top_left(block.q_pos, block.kv_pos)
            if tq > 1:
                kind = jnp.where(partial & top_left(block.q_pos, block.kv_pos, 1),
                                 StepKind.SHIFTED, kind)
        kind = jnp.where(partial & diagonal, StepKind.CAUSAL, kind)
    return jnp.where(may, kind, StepKind.SKIP).astype(jnp.int32)


def _rows(x, offset: int, length: int):
    """``[B, length, …]``: row ``r`` is ``x[:, clip(r + offset, 0, n - 1)]`` (``n`` rows;
    the first and last rows repeat, which is how a running sum clips)."""
    n = x.shape[1]
    front = max(0, -offset)
    back = max(0, offset + front + length - (n + front))
    widths = [(0, 0)] * x.ndim
    widths[1] = (front, back)
    x = jnp.pad(x, widths, mode="edge") if front or back else x
    return lax.slice_in_dim(x, offset + front, offset + front + length, axis=1)


def _running(z, inclusive_from_end: bool):
    """``[B, n + 1, …]`` sums along dim 1 of ``z [B, n, …]``: ``Σ_{m < r} z[m]``, or with
    ``inclusive_from_end`` ``Σ_{m >= r} z[m]`` (row ``n`` is 0)."""
    zero = jnp.zeros_like(z[:, :1])
    if inclusive_from_end:
        return jnp.concatenate([lax.cumsum(z, axis=1, reverse=True), zero], axis=1)
    return jnp.concatenate([zero, lax.cumsum(z, axis=1)], axis=1)


def _heads(x, groups: int):
    """KV-head ``[B, T, Hkv, F]`` → query-head ``[B, T, Hkv·G, F]`` (head ``h`` reads ``h//G``)."""
    return jnp.repeat(x, groups, axis=2) if groups > 1 else x


def _kv_heads(x, groups: int):
    """Query-head ``[B, T, H, F]`` → sums per KV head ``[B, T, H/G, F]``."""
    if groups == 1:
        return x
    b, t, h, f = x.shape
    return jnp.sum(x.reshape(b, t, h // groups, groups, f), axis=3)


def masked_keys(z, tq: int, kind: str, lo, groups: int):
    """Per query row, the sum of ``z [B, Tkv, Hkv, F]`` (``0·x`` of the keys, float32) over
    the keys the row does not see, ``[B, tq, H, F]``: all of them (``kind="skip"``), or
    under the top-left causal mask those after the row (``j > i``) and, with a window
    ``lo``, before it (``j < i + lo``)."""
    if kind == "skip":
        out = jnp.broadcast_to(jnp.sum(z, axis=1, keepdims=True), (z.shape[0], tq) + z.shape[2:])
    else:
        out = _rows(_running(z, True), 1, tq)
        if lo is not None:
            out = out + _rows(_running(z, False), lo, tq)
    return _heads(out, groups)


def masked_queries(z, tkv: int, kind: str, lo, groups: int):
    """Per key, the sum of ``z [B, Tq, H, F]`` (``0·x`` of the queries) over the queries that
    do not see it, summed per KV head: ``[B, tkv, Hkv, F]`` (``kind`` and ``lo`` as in
    :func:`masked_keys`: under the causal mask the queries before the key, ``i < j``, and
    with a window those past it, ``i > j - lo``)."""
    z = _kv_heads(z, groups)
    if kind == "skip":
        return jnp.broadcast_to(jnp.sum(z, axis=1, keepdims=True),
                                (z.shape[0], tkv) + z.shape[2:])
    out = _rows(_running(z, False), 0, tkv)
    if lo is not None:
        out = out + _rows(_running(z, True), 1 - lo, tkv)
    return out


def piece(block: Block, i: int, j: int, bq: int, bk: int) -> Block:
    """Sub-block ``(i, j)``: queries ``[i·bq, (i+1)·bq)`` against keys ``[j·bk, (j+1)·bk)``."""
    return block.query_slice(i * bq, (i + 1) * bq).key_slice(j * bk, (j + 1) * bk)


def delegated(block: Block, spec: AttentionSpec) -> str | None:
    """Why the whole call goes to the XLA kernel (see the module doc), or ``None``."""
    dtypes = {jnp.dtype(x.dtype).name for x in (block.q, block.k, block.v)}
    d, dv = block.q.shape[-1], block.v.shape[-1]
    if len(dtypes) > 1 or not dtypes <= DTYPES:
        return f"operands in {sorted(dtypes)}"
    if d != dv or d % 8 or d > head_dim_limit():
        return f"head dims {d}, {dv}"
    if spec.softcap is not None or spec.sinks:
        return "a soft-cap or sinks"
    unread = [role.operand for name, role in ROLES.items()
              if getattr(block, name) is not None and name not in CUDNN_READS]
    if unread:
        return f"operands cuDNN does not take: {', '.join(unread)}"
    return None


def refusal(spec: AttentionSpec, head_dims: tuple) -> str | None:
    """What :attr:`CudnnKernel.capabilities` refuses beyond the mask terms, dtypes, head dims
    and backends (``kernel="auto"`` then takes the next kernel)."""
    missing = compat.cudnn_missing()
    if missing:
        return missing
    if spec.softcap is not None or spec.mask.bias:
        return "it applies no soft-cap or bias"
    if spec.sinks:
        return "its backward cannot take the lse cotangent that sinks send"
    if len(set(head_dims)) > 1:
        return f"it needs equal q/k and v head dims, got {head_dims}"
    band = _band(spec)
    if band is not None and band[1] != 0:
        return (f"it runs a band only as causal with a left window, band[lo, 0], not "
                f"band[{band[0]}, {band[1]}]")
    return None


@dataclass(frozen=True)
class CudnnKernel:
    """The cuDNN local step (see the module doc).

    Args:
      pieces: how many equal parts queries and keys of an ``OTHER`` call are cut into
        (1: such a call runs XLA whole).
      calls: the two cuDNN calls (:class:`CudnnCalls`); ``None`` is JAX's private cuDNN
        attention. Tests on a CPU pass an XLA stand-in.
    """

    pieces: int = 2
    calls: CudnnCalls | None = None
    name: str = "cudnn"
    #: cuDNN (and Hopper's head dims up to 256) only on NVIDIA GPUs; the band as causal
    #: with a left window (:func:`refusal`); a private API, so ``auto`` takes it only after
    #: its on-device self-check.
    capabilities = Capabilities(
        mask_terms=frozenset({mask_terms.Band, mask_terms.QueryPadding, mask_terms.KeyPadding}),
        dtypes=DTYPES,
        head_dims=lambda d, backend: d > 0 and d % 8 == 0 and d <= head_dim_limit(),
        backends=frozenset({"gpu", "cuda"}), needs_check=frozenset({"gpu", "cuda"}),
        dropout=False, finite_fill=False, refuses=refusal)

    @property
    def _cudnn(self) -> CudnnCalls:
        return self.calls or CUDNN

    def _plan(self, block: Block, spec: AttentionSpec):
        """``(kind, sizes, kinds)``: the int32 branch of the call (a :class:`StepKind`, or
        ``SPLIT`` when it is ``OTHER`` and every one of its ``pieces × pieces`` sub-blocks
        of ``sizes = (bq, bk)`` is not), and the sub-blocks' kinds ``[pieces, pieces]``
        (``sizes``, ``kinds``: ``None`` when the sizes do not cut evenly)."""
        kind = step_kind(block, spec)
        p, tq, tkv = self.pieces, block.q.shape[1], block.k.shape[1]
        if p < 2 or tq % p or tkv % p:
            return kind, None, None
        sizes = (tq // p, tkv // p)
        kinds = jnp.stack([jnp.stack([step_kind(piece(block, i, j, *sizes), spec)
                                      for j in range(p)]) for i in range(p)])
        split = (kind == StepKind.OTHER) & jnp.all(kinds != StepKind.OTHER)
        return jnp.where(split, SPLIT, kind), sizes, kinds

    def forward(self, block: Block, spec: AttentionSpec, running=None):
        """``(o [B, Tq, H, Dv] f32, lse [B, H, Tq] f32)`` of ``block``, merged into
        ``running``; see the kernel protocol."""
        if delegated(block, spec):
            return _XLA.forward(block, spec, running)
        kind, sizes, kinds = self._plan(block, spec)

        def split(blk, kinds):
            rows = []
            for i in range(self.pieces):
                acc = None
                for j in range(self.pieces):
                    acc = merged_into(acc, *self._leaf_forward(
                        piece(blk, i, j, *sizes), spec, kinds[i, j]))
                rows.append(acc)
            return tuple(jnp.concatenate(x, axis=a) for x, a in zip(zip(*rows), (1, 2)))

        o, lse = lax.switch(kind, (
            lambda blk, kinds: self._leaf_forward(blk, spec, StepKind.SKIP),
            lambda blk, kinds: self._leaf_forward(blk, spec, StepKind.FULL),
            lambda blk, kinds: self._leaf_forward(blk, spec, StepKind.CAUSAL),
            lambda blk, kinds: self._leaf_forward(blk, spec, StepKind.SHIFTED),
            lambda blk, kinds: _XLA.forward(blk, spec),
            split if sizes else lambda blk, kinds: _XLA.forward(blk, spec)), block, kinds)
        return merged_into(running, o, lse)

    def _leaf_forward(self, block: Block, spec: AttentionSpec, kind):
        """``(o, lse)`` float32 of a ``SKIP``, ``FULL``, ``CAUSAL`` or ``SHIFTED`` block
        (``kind`` a Python or a traced :class:`StepKind`: a ``lax.switch`` then picks)."""
        b, tq, h, _ = block.q.shape
        groups = h // block.k.shape[2]
        runs, window = causal_window(spec, tq, block.k.shape[1])
        lo = None if window is None else 1 - window

        def skip(blk):
            o = masked_keys(zero_times(blk.v), tq, "skip", None, groups)
            return o, jnp.full_like(blk.q, -jnp.inf, jnp.float32, (b, h, tq))

        def cudnn(blk, causal):
            o, lse = self._cudnn.forward(blk.q, blk.k, blk.v, scale=spec.scale, causal=causal,
                                         window=window if causal else None)
            o = o.astype(jnp.float32)
            if causal:  # what the masked keys add in the dense softmax: 0·V
                o = o + masked_keys(zero_times(blk.v), tq, "causal", lo, groups)
            return o, lse.astype(jnp.float32)

        def shifted(blk):  # query 0 sees no key, query i >= 1 the keys j <= i - 1
            first = self._leaf_forward(blk.query_slice(0, 1), spec, StepKind.SKIP)
            rest = self._leaf_forward(blk.query_slice(1, tq), spec, StepKind.CAUSAL)
            return tuple(jnp.concatenate(x, axis=a) for x, a in zip(zip(first, rest), (1, 2)))

        return _pick(kind, (skip, lambda blk: cudnn(blk, False),
                            (lambda blk: cudnn(blk, True)) if runs else skip,
                            shifted if runs and window is None and tq > 1 else skip), block)

    def backward(self, block: Block, o, lse, do, spec: AttentionSpec, dlse=None, delta=None,
                 dq=None, dk=None, dv=None):
        """``(dq, dk, dv, None)`` float32 from the merged ``o``/``lse``, added to the running
        sums; see the kernel protocol (``dlse`` and ``delta`` reach delegated steps only)."""
        if delegated(block, spec):
            return _XLA.backward(block, o, lse, do, spec, dlse, delta, dq, dk, dv)
        if delta is None:  # the delegated steps' rowsum(dO∘O) - dlse, computed once
            delta = row_delta(o, do, dlse)
        kind, sizes, kinds = self._plan(block, spec)
        lse = lse.astype(jnp.float32)

        def leaf(kind):
            return lambda blk, o, lse, do, delta, kinds: self._leaf_backward(
                blk, o, lse, do, spec, kind)

        def xla(blk, o, lse, do, delta, kinds):
            return _XLA.backward(blk, o, lse, do, spec, delta=delta)[:3]

        def split(blk, o, lse, do, delta, kinds):
            def rows(x, i, axis):
                return lax.slice_in_dim(x, i * sizes[0], (i + 1) * sizes[0], axis=axis)

            g_q, g_k, g_v = [None] * self.pieces, [None] * self.pieces, [None] * self.pieces
            for i in range(self.pieces):
                for j in range(self.pieces):
                    g = self._leaf_backward(piece(blk, i, j, *sizes), rows(o, i, 1),
                                            rows(lse, i, 2), rows(do, i, 1), spec, kinds[i, j])
                    g_q[i] = added_to(g_q[i], g[0])
                    g_k[j], g_v[j] = added_to(g_k[j], g[1]), added_to(g_v[j], g[2])
            return tuple(jnp.concatenate(g, axis=1) for g in (g_q, g_k, g_v))

        g_q, g_k, g_v = lax.switch(kind, (
            leaf(StepKind.SKIP), leaf(StepKind.FULL), leaf(StepKind.CAUSAL),
            leaf(StepKind.SHIFTED), xla,
            split if sizes else xla), block, o, lse, do, delta, kinds)
        return added_to(dq, g_q), added_to(dk, g_k), added_to(dv, g_v), None

    def _leaf_backward(self, block: Block, o, lse, do, spec: AttentionSpec, kind):
        """Float32 ``(dq, dk, dv)`` of a ``SKIP``, ``FULL``, ``CAUSAL`` or ``SHIFTED``
        block, as :meth:`_leaf_forward`."""
        tq, h = block.q.shape[1:3]
        tkv = block.k.shape[1]
        groups = h // block.k.shape[2]
        runs, window = causal_window(spec, tq, tkv)
        lo = None if window is None else 1 - window

        def masked(blk, kind):
            # What the dense backward adds at masked pairs: 0·K to dQ, 0·Q to dK, and
            # 0·dO (NaN for a NaN row, whose probabilities are NaN everywhere) to dV.
            nan_rows = jnp.swapaxes(jnp.where(jnp.isnan(lse), jnp.nan, 0.0), 1, 2)[..., None]
            return (masked_keys(zero_times(blk.k), tq, kind, lo, groups),
                    masked_queries(zero_times(blk.q), tkv, kind, lo, groups),
                    masked_queries(zero_times(do) + nan_rows, tkv, kind, lo, groups))

        def cudnn(blk, causal):
            dtype = blk.q.dtype
            grads = self._cudnn.backward(blk.q, blk.k, blk.v, o.astype(dtype), lse,
                                         do.astype(dtype), scale=spec.scale, causal=causal,
                                         window=window if causal else None)
            grads = tuple(g.astype(jnp.float32) for g in grads)
            if causal:
                grads = tuple(g + m for g, m in zip(grads, masked(blk, "causal")))
            return grads

        def shifted(blk):
            first = self._leaf_backward(blk.query_slice(0, 1), o[:, :1], lse[:, :, :1],
                                        do[:, :1], spec, StepKind.SKIP)
            rest = self._leaf_backward(blk.query_slice(1, tq), o[:, 1:], lse[:, :, 1:],
                                       do[:, 1:], spec, StepKind.CAUSAL)
            return (jnp.concatenate([first[0], rest[0]], axis=1), first[1] + rest[1],
                    first[2] + rest[2])

        skip = lambda blk: masked(blk, "skip")  # noqa: E731
        return _pick(kind, (skip, lambda blk: cudnn(blk, False),
                            (lambda blk: cudnn(blk, True)) if runs else skip,
                            shifted if runs and window is None and tq > 1 else skip), block)


#: The top-level branch of a call whose sub-blocks cuDNN runs (:meth:`CudnnKernel._plan`).
SPLIT = len(StepKind)


def _pick(kind, branches, *operands):
    """``branches[kind](*operands)``: directly for a Python kind, else by ``lax.switch``."""
    if isinstance(kind, int):
        return branches[kind](*operands)
    return lax.switch(jnp.minimum(kind, len(branches) - 1), branches, *operands)


#: The kernel the steps cuDNN cannot run go to.
_XLA = ChunkedKernel()


register_kernel(CudnnKernel())
