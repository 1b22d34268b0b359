"""The ``"pallas"`` kernel: one registered object that runs the TPU-style or the GPU-style
Pallas kernels (:mod:`.pallas_tpu`, :mod:`.pallas_gpu`) by ``jax.default_backend()``.

On CPU there is no Pallas backend: the variant comes from ``variant=`` or the environment
variable ``CPTRANSFORM_PALLAS_VARIANT`` (``tpu``, the default, or ``gpu``) and runs in
interpret mode (``pltpu.InterpretParams()``; slow, for tests). Both variants share the block table
(:mod:`.block_table`), the operand layout (:mod:`.pallas_operands`) and the tile math
(:mod:`.pallas_tiles`), and implement the :class:`~cptransform.lowering.kernels.Kernel`
protocol exactly as the XLA kernel does.
"""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from cptransform.op.attention_spec import AttentionSpec
from cptransform.lowering.block import Block
from cptransform.lowering.kernels.capabilities import ALL_TERMS, Capabilities
from cptransform.lowering.kernels import pallas_gpu, pallas_tpu, register_kernel, row_delta, \
    added_to, merged_into, sum_to, topk_gather
from cptransform.lowering.kernels.pallas_topk import TritonLoops
from cptransform.lowering.kernels.pallas_operands import TILE_OPERANDS, heads_major, prepare, \
    tokens_major
from cptransform.lowering.kernels.pallas_skipped import skipped_backward, skipped_forward
from cptransform.lowering.kernels.padding_segments import as_segments
from cptransform.op.mask_terms import KeyPadding, QueryPadding

VARIANTS = {"tpu": pallas_tpu, "gpu": pallas_gpu}
#: Head dims the GPU variant lowers: Pallas's Triton lowering needs every array in a kernel
#: to have power-of-two dims (a head dim of 80 or 96 is refused there).
GPU_HEAD_DIMS = frozenset({16, 32, 64, 128, 256})
_BACKEND_VARIANT = {"tpu": "tpu", "gpu": "gpu", "cuda": "gpu", "rocm": "gpu"}


class PallasKernel:
    """Pallas local-step kernels (see the module doc).

    Args:
      variant: ``"tpu"`` or ``"gpu"``; ``None`` follows the backend (on CPU:
        ``$CPTRANSFORM_PALLAS_VARIANT``, default ``tpu``).
      block_q, block_kv: tile sizes; ``None`` is ``min(T, 128)`` on the TPU variant and
        ``min(T, pallas_gpu.table_block(D, itemsize))`` on the GPU one (which rounds up to a
        power of two, at least 16, as Triton needs). Lengths are padded to a multiple.
      interpret: run in interpret mode; ``None`` means exactly when the backend is CPU.
    """

    name = "pallas"
    #: Every mask term whose operands the tiles carry (:data:`TILE_OPERANDS`), and the
    #: padding terms, read as segment ids (:mod:`.padding_segments`); never compiled on a
    #: GPU or TPU by the test suite, so ``auto`` takes it there only after its on-device
    #: self-check.
    capabilities = Capabilities(
        mask_terms=frozenset(t for t in ALL_TERMS if t.roles.keys() <= TILE_OPERANDS)
        | {QueryPadding, KeyPadding},
        dtypes=frozenset({"float16", "bfloat16", "float32"}),
        head_dims=lambda d, backend: d > 0 and (
            _BACKEND_VARIANT.get(backend) != "gpu" or d in GPU_HEAD_DIMS),
        needs_check=frozenset({"gpu", "cuda", "rocm", "tpu"}), dropout=False,
        finite_fill=False)

    def __init__(self, variant: str | None = None, block_q: int | None = None,
                 block_kv: int | None = None, interpret: bool | None = None):
        if variant is not None and variant not in VARIANTS:
            raise ValueError(f"unknown Pallas variant {variant!r}; use 'tpu' or 'gpu'")
        self.variant, self.block_q, self.block_kv = variant, block_q, block_kv
        self.interpret = interpret

    def _setup(self):
        """``(variant name, module, interpret argument)`` for the current backend."""
        backend = jax.default_backend()
        variant = self.variant or _BACKEND_VARIANT.get(backend) or os.environ.get(
            "CPTRANSFORM_PALLAS_VARIANT", "tpu")
        if variant not in VARIANTS:
            raise ValueError(f"CPTRANSFORM_PALLAS_VARIANT={variant!r}; use 'tpu' or 'gpu'")
        interpret = backend == "cpu" if self.interpret is None else self.interpret
        if interpret:
            # The TPU interpreter for both variants: the generic one (interpret=True) fails
            # JAX's varying-axes check on in-kernel dynamic slices inside shard_map.
            interpret = pltpu.InterpretParams()
        return variant, VARIANTS[variant], interpret

    def _block(self, given: int | None, length: int, variant: str, block: Block) -> int:
        if variant != "gpu":
            return given or min(length, 128)
        size = given or min(length, pallas_gpu.table_block(
            max(block.q.shape[-1], block.v.shape[-1]), block.q.dtype.itemsize))
        return max(16, 1 << (size - 1).bit_length())

    def _operands(self, block: Block, spec: AttentionSpec, variant: str):
        return prepare(block, spec, self._block(self.block_q, block.q.shape[1], variant, block),
                       self._block(self.block_kv, block.k.shape[1], variant, block))

    def _gathered(self, block: Block, spec: AttentionSpec):
        """The loops a top-k mask is gathered with on this call (:mod:`.pallas_topk`),
        ``None`` where its tiles are swept instead: the GPU variant's gather kernels for
        picks fewer than the keys (:func:`.topk_gather.applies`), the XLA loops where they
        cannot run (a bias at the picks; interpreted, see :mod:`.pallas_topk`). The TPU
        variant sweeps: Mosaic has no gather loads."""
        variant, _, interpret = self._setup()
        if variant != "gpu" or not topk_gather.applies(block, spec):
            return None
        if interpret or block.bias is not None:
            return topk_gather.XLA_LOOPS
        return TritonLoops()

    def forward(self, block: Block, spec: AttentionSpec, running=None):
        """``(o [B, Tq, H, Dv] f32, lse [B, H, Tq] f32)`` of ``block``; see the protocol."""
        block, spec = as_segments(block, spec)
        loops = self._gathered(block, spec)
        if loops is not None:
            return topk_gather.forward(block, spec, running, self._swept_forward, loops)
        return self._swept_forward(block, spec, running)

    def _swept_forward(self, block: Block, spec: AttentionSpec, running=None):
        variant, module, interpret = self._setup()
        ops = self._operands(block, spec, variant)
        o, lse = module.forward(ops, spec, interpret)
        o = o + skipped_forward(ops)
        return merged_into(running, tokens_major(o, ops.tq), lse[:, :, :ops.tq])

    def backward(self, block: Block, o, lse, do, spec: AttentionSpec, dlse=None, delta=None,
                 dq=None, dk=None, dv=None):
        """``(dq, dk, dv, dbias)`` float32 from the merged ``o``/``lse``; see the protocol
        (``delta``, when given, is :func:`row_delta` of them, computed once by the caller)."""
        block, spec = as_segments(block, spec)
        loops = self._gathered(block, spec)
        if loops is not None:
            return topk_gather.backward(block, o, lse, do, spec, dlse, delta, dq, dk, dv,
                                        self._swept_backward, loops)
        return self._swept_backward(block, o, lse, do, spec, dlse, delta, dq, dk, dv)

    def _swept_backward(self, block: Block, o, lse, do, spec: AttentionSpec, dlse=None,
                        delta=None, dq=None, dk=None, dv=None):
        variant, module, interpret = self._setup()
        ops = self._operands(block, spec, variant)
        tqp = ops.q.shape[2]
        if delta is None:  # one [B, H, Tq] vector, cheaper here than per tile
            delta = row_delta(o, do, dlse)
        pad = ((0, 0), (0, 0), (0, tqp - ops.tq))
        # Padded rows: lse 0 keeps exp(s - lse) finite there (the mask zeroes them anyway).
        lse_p = jnp.pad(lse.astype(jnp.float32), pad)
        delta_p = jnp.pad(delta, pad)
        do_p = heads_major(do.astype(block.v.dtype), tqp)
        g_q, dbias = module.backward_dq(ops, spec, do_p, lse_p, delta_p, interpret)
        g_k, g_v = module.backward_dkv(ops, spec, do_p, lse_p, delta_p, interpret)
        skipped = skipped_backward(ops, do_p, lse_p)
        g_q, g_k, g_v = g_q + skipped[0], g_k + skipped[1], g_v + skipped[2]
        if dbias is not None:
            dbias = sum_to(dbias[:, :, :ops.tq, :ops.tkv], block.bias.shape)
        return (added_to(dq, tokens_major(g_q, ops.tq)),
                added_to(dk, tokens_major(g_k, ops.tkv)),
                added_to(dv, tokens_major(g_v, ops.tkv)), dbias)


register_kernel(PallasKernel())
