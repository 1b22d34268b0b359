"""Top-k attention by gathering, as Pallas-Triton kernels: the picked K/V rows are loaded
straight into a program's registers, never written out as a gathered tile.

:mod:`.topk_gather` computes a top-k mask's attention over the picks alone in XLA, which
materialises every query's gathered ``[k, D]`` rows of K and V in memory and contracts them
by small batched einsums. Here one program per (batch, pick group, query) walks its picks
``step`` at a time: ``K[picks]`` and ``V[picks]`` are gather loads (a pointer per row), the
query heads that share the picks (a GQA group, or every head of an indexer shared across
heads) are the rows of the tile, padded to 16 for the tensor cores, and the running softmax
and the gradients are the Pallas tiles' (:mod:`.pallas_tiles`). The backward computes dQ in
the same program and scatter-adds each pick's dK/dV rows with Triton atomics into float32
buffers (a key can be picked by any query; one program's picks are distinct, as
:func:`~cptransform.lowering.kernels.topk_gather.locate` keeps a repeated pick once).

Everything around the loops is :mod:`.topk_gather`'s: locating the picks among the call's
keys (any layout, any ring step), the mask's other terms at the picks, the ``0·x`` terms of
the keys a row does not see, the sweep taken when key positions repeat. Only
:class:`TritonLoops` differs from :class:`~.topk_gather.XlaLoops`. A bias at the picks is
not read here (the XLA loops take it).

Interpreted on a CPU the kernels run only outside ``shard_map`` (the tests call them
directly): Pallas's generic interpreter fails JAX's varying-axes check on a loop inside a
kernel under ``shard_map``, and the TPU interpreter refuses gather indexing, so
:class:`~.pallas.PallasKernel` interpreted takes the XLA loops. The interpreter discharges
atomics without a mask only, so interpreted a masked pick's rows go to a scratch row of its
own past the keys (one per lane, so a tile's scatter never repeats an index); compiled,
the atomic's mask drops them.

Checked without a GPU: the lowered Triton IR compiled for sm_90a by Triton 3.9 and ptxas
(bf16, 32-pick steps, 2 stages). A gathered ``[32, D]`` tile needs a 64-bit pointer per
element, so the forward, holding K's and V's, needs 255 registers and spills 0.2–0.9 KB
with 4 warps (D = 64 / 128); with 8 warps it uses 167–219 and spills none (12 bytes with a
GQA group of 4 at D = 128). The backward (dQ in registers, dK/dV atomics) uses 94–206
registers without spilling at 4 warps. Both pipeline their gathers (``cp.async``); the
forward's dots are ``wgmma``, the backward's ``mma``. Speed is unmeasured (module doc of
``bench/kernels.py``).
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from cptransform.lowering.block import Block
from cptransform.lowering.kernels import pad_axis
from cptransform.lowering.kernels.pallas_operands import out_struct
from cptransform.lowering.kernels.pallas_tiles import (
    F32, as_column, dot_nn, finish_softmax, grad_logits, initial_state, online_softmax,
    tile_logits)
from cptransform.lowering.kernels.topk_gather import Call, Rows, locate
from cptransform.op.attention_spec import AttentionSpec

#: Picks per loop step (rows of a gathered tile).
STEP = 32
#: The fewest rows a Triton dot takes: the heads sharing the picks are padded to it.
MIN_ROWS = 16
#: Triton warps of the forward and the backward program (module doc: registers).
FORWARD_WARPS, BACKWARD_WARPS = 8, 4


def _dot_tn(a, b):
    """``aᵀ @ b`` with float32 accumulation (contract the first dims)."""
    return lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=F32)


@dataclass(frozen=True)
class _Grid:
    """How a call's heads map to programs: ``hkv`` KV heads, each with ``sets`` pick sets
    (1 when the group's heads share their picks, else ``G``) of ``shared`` heads, padded to
    ``rows``; ``idx_heads``/``idx_groups`` the pick array's head dims (1 or ``Hkv``, 1 or
    ``G``)."""

    hkv: int
    groups: int
    sets: int
    rows: int
    idx_heads: int
    idx_groups: int

    @classmethod
    def build(cls, call: Call, idx) -> "_Grid":
        sets = idx.shape[2]
        shared = call.groups // sets
        return cls(call.hkv, call.groups, sets, max(MIN_ROWS, 1 << (shared - 1).bit_length()),
                   idx.shape[1], idx.shape[2])

    @property
    def shared(self) -> int:
        return self.groups // self.sets

    @property
    def programs(self) -> int:
        """Programs per (batch, query): one per pick set of each KV head."""
        return self.hkv * self.sets

    def picks_of(self, n):
        """The pick array's head index of program ``n``."""
        head = n // self.sets if self.idx_heads > 1 else 0
        return head * self.idx_groups + (n % self.sets if self.idx_groups > 1 else 0)

    def rows_of(self, x):
        """``[B, T, H, F]`` → ``[B, Hkv·sets, T, rows, F]`` (the padded head rows)."""
        b, t, _, f = x.shape
        x = x.reshape(b, t, self.hkv, self.sets, self.shared, f)
        x = pad_axis(x, 4, self.rows, 0)
        return jnp.moveaxis(x, 1, 3).reshape(b, self.programs, t, self.rows, f)

    def tokens_of(self, x):
        """Inverse of :meth:`rows_of` on ``[B, Hkv·sets, T, rows, F]`` (padding dropped)."""
        b, _, t, _, f = x.shape
        x = x.reshape(b, self.hkv, self.sets, t, self.rows, f)[:, :, :, :, :self.shared]
        return jnp.moveaxis(x, 3, 1).reshape(b, t, self.hkv * self.groups, f)


@dataclass(frozen=True)
class _Launch:
    """One call's kernel operands: the picks ``idx [Bx, Hi·Gi, Tq, k']`` (the call's key
    index, ``-1`` where the mask hides the pick; ``k'`` a multiple of :data:`STEP`), the
    grid, and the block specs shared by both kernels."""

    grid: _Grid
    idx: jax.Array
    tq: int
    tkv: int
    batch: int

    @classmethod
    def build(cls, call: Call) -> "_Launch":
        p = locate(call, 0)
        local = call.per_head(p.local)
        shape = jnp.broadcast_shapes(local.shape, p.ok.shape)
        idx = jnp.where(jnp.broadcast_to(p.ok, shape), jnp.broadcast_to(local, shape), -1)
        idx = pad_axis(idx, 4, -(-idx.shape[4] // STEP) * STEP, -1)
        grid = _Grid.build(call, idx)
        idx = idx.reshape(idx.shape[0], -1, *idx.shape[3:])
        return cls(grid, idx, call.block.q.shape[1], call.block.k.shape[1],
                   call.block.q.shape[0])

    @property
    def steps(self) -> int:
        return self.idx.shape[-1] // STEP

    def launch_grid(self):
        return (self.batch, self.grid.programs, self.tq)

    def picks_spec(self):
        many = self.idx.shape[0] > 1
        return pl.BlockSpec((None, None, None, self.idx.shape[-1]),
                            lambda b, n, t: (b if many else 0, self.grid.picks_of(n), t, 0))

    def row_spec(self, features: int):
        """A program's padded head rows of a ``[B, Hkv·sets, Tq, rows, F]`` array."""
        return pl.BlockSpec((None, None, None, self.grid.rows, features),
                            lambda b, n, t: (b, n, t, 0, 0))

    def vector_spec(self):
        """A program's rows of a ``[B, Hkv·sets, Tq, rows]`` array."""
        return pl.BlockSpec((None, None, None, self.grid.rows), lambda b, n, t: (b, n, t, 0))

    def keys_spec(self, length: int, features: int):
        """Every key of the program's batch row and KV head: ``[length, F]``."""
        return pl.BlockSpec((None, length, None, features),
                            lambda b, n, t: (b, 0, n // self.grid.sets, 0))


def _gathered(idx_ref, j, refs):
    """Pick step ``j``: ``(ok [1, STEP], rows [STEP], loaded tiles of refs)`` (a hidden
    pick loads key 0, which its mask drops)."""
    ids = idx_ref[pl.ds(pl.multiple_of(j * STEP, STEP), STEP)]
    ok = ids >= 0
    at = jnp.maximum(ids, 0)
    return ok, ids, tuple(ref[at, :] for ref in refs)


def _forward_kernel(idx_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, spec: AttentionSpec,
                    steps: int):
    q = q_ref[...]

    def step(j, state):
        ok, _, (k, v) = _gathered(idx_ref, j, (k_ref, v_ref))
        s, _ = tile_logits(spec, q, k)
        return online_softmax(state, s, ok[None, :], v)

    o, lse = finish_softmax(lax.fori_loop(0, steps, step,
                                          initial_state(q.shape[0], v_ref.shape[-1])))
    o_ref[...] = o
    lse_ref[...] = lse[:, 0]


def _scatter_add(ref, ids, ok, rows, tkv: int, interpret: bool):
    """``ref[ids] += rows`` for the visible picks (see the module doc for the
    interpreter's scratch rows)."""
    cols = lax.broadcasted_iota(jnp.int32, rows.shape, 1)
    if interpret:
        at = jnp.where(ok, ids, tkv + lax.iota(jnp.int32, ids.shape[0]))
        pltriton.atomic_add(ref, (at[:, None], cols), rows)
    else:
        pltriton.atomic_add(ref, (jnp.maximum(ids, 0)[:, None], cols), rows,
                            mask=ok[:, None] & (cols >= 0))


def _backward_kernel(idx_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_in, dv_in,
                     dq_ref, dk_ref, dv_ref, *, spec: AttentionSpec, steps: int, tkv: int,
                     interpret: bool):
    del dk_in, dv_in  # aliased to dk_ref / dv_ref
    q, do = q_ref[...], do_ref[...]
    lse, delta = as_column(lse_ref[...]), as_column(delta_ref[...])

    def step(j, dq):
        ok, ids, (k, v) = _gathered(idx_ref, j, (k_ref, v_ref))
        s, tanh = tile_logits(spec, q, k)
        ds, _, p = grad_logits(spec, s, tanh, ok[None, :], lse, delta,
                               lax.dot_general(do, v, (((1,), (1,)), ((), ())),
                                               preferred_element_type=F32))
        _scatter_add(dk_ref, ids, ok, _dot_tn(ds.astype(q.dtype), q), tkv, interpret)
        _scatter_add(dv_ref, ids, ok, _dot_tn(p.astype(do.dtype), do), tkv, interpret)
        return dq + dot_nn(ds.astype(k.dtype), k)

    dq_ref[...] = lax.fori_loop(0, steps, step, jnp.zeros(q.shape, F32))


def _params(interpret: bool, num_warps: int):
    return None if interpret else pltriton.CompilerParams(num_warps=num_warps, num_stages=2)


@dataclass(frozen=True)
class TritonLoops:
    """:class:`~.topk_gather.XlaLoops`'s two methods as Pallas-Triton kernels (module
    doc); ``interpret`` runs them in Pallas's generic interpreter (outside ``shard_map``
    only)."""

    interpret: bool = False

    def call(self, block: Block, spec: AttentionSpec) -> Call:
        """The :class:`~.topk_gather.Call` of ``block``: its queries in one chunk (the
        programs, not a loop, walk the queries)."""
        return Call.build(block, spec, cq=block.q.shape[1])

    def forward(self, call: Call):
        """``(o [B, Tq, H, Dv] f32, lse [B, H, Tq])`` over the picks (as
        :meth:`~.topk_gather.XlaLoops.forward`)."""
        blk, spec = call.block, call.spec
        run = _Launch.build(call)
        g = run.grid
        q = g.rows_of(blk.q)
        dv = blk.v.shape[-1]
        inputs = (run.idx, q, blk.k, blk.v)
        o, lse = pl.pallas_call(
            lambda *refs: _forward_kernel(*refs, spec=spec, steps=run.steps),
            out_shape=(out_struct(q.shape[:4] + (dv,), F32, inputs),
                       out_struct(q.shape[:4], F32, inputs)),
            grid=run.launch_grid(),
            in_specs=[run.picks_spec(), run.row_spec(q.shape[-1]),
                      run.keys_spec(run.tkv, blk.k.shape[-1]), run.keys_spec(run.tkv, dv)],
            out_specs=(run.row_spec(dv), run.vector_spec()),
            compiler_params=_params(self.interpret, FORWARD_WARPS), interpret=self.interpret,
            name="cp_topk_gather_fwd")(*inputs)
        lse = g.tokens_of(lse[..., None])[..., 0]
        return g.tokens_of(o), jnp.swapaxes(lse, 1, 2)

    def backward(self, call: Call, rows: Rows, start):
        """``start`` plus the gradients of the picks (as
        :meth:`~.topk_gather.XlaLoops.backward`; no bias)."""
        blk, spec = call.block, call.spec
        run = _Launch.build(call)
        g = run.grid
        q, do = g.rows_of(blk.q), g.rows_of(rows.do.astype(blk.v.dtype))
        per_row = lambda x: g.rows_of(jnp.swapaxes(x, 1, 2)[..., None])[..., 0]  # noqa: E731
        d, dv = blk.k.shape[-1], blk.v.shape[-1]
        scratch = run.tkv + (STEP if self.interpret else 0)
        zeros = lambda f: jnp.zeros_like(blk.k, F32, (run.batch, scratch, g.hkv, f))  # noqa: E731
        inputs = (run.idx, q, blk.k, blk.v, do, per_row(rows.lse), per_row(rows.delta),
                  zeros(d), zeros(dv))
        g_q, g_k, g_v = pl.pallas_call(
            lambda *refs: _backward_kernel(*refs, spec=spec, steps=run.steps, tkv=run.tkv,
                                           interpret=self.interpret),
            out_shape=(out_struct(q.shape, F32, inputs),
                       out_struct(inputs[7].shape, F32, inputs),
                       out_struct(inputs[8].shape, F32, inputs)),
            grid=run.launch_grid(),
            in_specs=[run.picks_spec(), run.row_spec(d), run.keys_spec(run.tkv, d),
                      run.keys_spec(run.tkv, dv), run.row_spec(dv), run.vector_spec(),
                      run.vector_spec(), run.keys_spec(scratch, d), run.keys_spec(scratch, dv)],
            out_specs=(run.row_spec(d), run.keys_spec(scratch, d), run.keys_spec(scratch, dv)),
            input_output_aliases={7: 1, 8: 2},
            compiler_params=_params(self.interpret, BACKWARD_WARPS), interpret=self.interpret,
            name="cp_topk_gather_bwd")(*inputs)
        dq, dk, dv_sum, dbias = start
        return (dq + g.tokens_of(g_q), dk + g_k[:, :run.tkv], dv_sum + g_v[:, :run.tkv],
                dbias)
