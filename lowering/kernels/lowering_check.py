"""Lower the Pallas kernels for their real targets on a machine without them.

Interpret mode (how the kernels run on a CPU) never runs Pallas's Triton or Mosaic
lowering, so a kernel can pass every CPU test and still fail on its first GPU. Inside
``jax.sharding.use_abstract_mesh`` with an ``AbstractDevice`` of the target's kind,
``jax.jit(f).trace(...).lower(lowering_platforms=(platform,))`` runs Pallas → Triton IR
(GPU) or Pallas → Mosaic (TPU) from any host; only PTX / libtpu compilation is left to the
device. :func:`lower_case` does that for one :class:`Case` (the forward and both backward
kernels in one program) and :func:`cases` spans what the kernel's
:class:`~cptransform.lowering.kernels.capabilities.Capabilities` declare: every mask term,
every dtype, GQA groupings and head dims, so a declared capability that does not lower is
found on the CPU (``tests/test_kernel_lowering.py``, ``bench/lowering.py``).
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from cptransform.lowering.block import Block
from cptransform.lowering.kernels.pallas import PallasKernel
from cptransform.op.attention_spec import AttentionSpec, Layout, MaskSpec


@dataclass(frozen=True)
class Target:
    """A device the kernels are lowered for: the Pallas ``variant`` it runs, the lowering
    ``platform`` and the ``AbstractDevice`` it is described by."""

    name: str
    variant: str
    platform: str
    device_kind: str
    num_cores: int

    @property
    def backend(self) -> str:
        """The ``jax.default_backend()`` name the kernel capabilities are read for."""
        return "tpu" if self.variant == "tpu" else "gpu"

    def mesh(self):
        device = jax.sharding.AbstractDevice(device_kind=self.device_kind,
                                             num_cores=self.num_cores, platform=self.backend)
        return jax.sharding.AbstractMesh((1,), ("x",), (jax.sharding.AxisType.Explicit,),
                                         abstract_device=device)


TARGETS = {t.name: t for t in (
    Target("h200", "gpu", "cuda", "NVIDIA H200", 132),
    Target("a100", "gpu", "cuda", "NVIDIA A100-SXM4-80GB", 108),
    Target("tpu-v5e", "tpu", "tpu", "TPU v5 lite", 1),
    Target("tpu-v6e", "tpu", "tpu", "TPU v6 lite", 1),
)}

#: One mask per term the kernels read (and the options that change a kernel's body:
#: bias with a soft-cap, no mask at all), as ``MaskSpec`` plus ``softcap``.
MASKS = {
    "full": (MaskSpec(), None),
    "causal": (MaskSpec(causal=True), None),
    "window": (MaskSpec(window=(64, 0)), None),
    "chunk": (MaskSpec(causal=True, chunk=64), None),
    "segments": (MaskSpec(causal=True, segments=True), None),
    "padding": (MaskSpec(causal=True, q_padding=True, kv_padding=True), None),
    "dense": (MaskSpec(dense=True), None),
    "topk": (MaskSpec(causal=True, topk=True), None),
    "bias_softcap": (MaskSpec(causal=True, bias=True), 30.0),
}

#: ``(query heads per KV head, head dim)`` pairs; :func:`cases` cycles through them so each
#: mask meets several, and every pair meets every dtype.
SHAPES = ((1, 64), (4, 128), (2, 256), (1, 32))


@dataclass(frozen=True)
class Case:
    """One lowering: a target, a mask (key of :data:`MASKS`), a dtype, a GQA grouping and a
    head dim; ``tq`` / ``tkv`` queries and keys (unequal, and not a multiple of the block,
    so the padding and the rectangular block tables lower too)."""

    target: str
    mask: str
    dtype: str
    groups: int
    head_dim: int
    tq: int = 200
    tkv: int = 328
    kv_heads: int = 2
    topk: int = 16

    @property
    def id(self) -> str:
        return f"{self.target}-{self.mask}-{self.dtype}-g{self.groups}-d{self.head_dim}"


def declared(target: Target, mask: str, dtype: str, head_dim: int) -> bool:
    """Whether the Pallas kernel's capabilities declare this case on ``target``."""
    spec, _ = MASKS[mask]
    attention = AttentionSpec(*(Layout.parse("BTHD"),) * 3, scale=1.0, mask=spec)
    return PallasKernel.capabilities.refusal(attention, jnp.dtype(dtype), (head_dim,),
                                             target.backend) is None


def cases(targets=tuple(TARGETS)) -> list[Case]:
    """Every (target, mask, dtype) the capabilities declare, each with the next (groups,
    head dim) of :data:`SHAPES` in turn."""
    dtypes = sorted(PallasKernel.capabilities.dtypes)
    out = []
    for target in targets:
        shapes = itertools.cycle(SHAPES)
        for mask, dtype in itertools.product(MASKS, dtypes):
            groups, head_dim = next(shapes)
            if declared(TARGETS[target], mask, dtype, head_dim):
                out.append(Case(target, mask, dtype, groups, head_dim))
    return out


def abstract_operands(case: Case):
    """Abstract operands of ``case``: a ``Block`` of ``ShapeDtypeStruct`` and the spec."""
    spec_mask, softcap = MASKS[case.mask]
    dtype = jnp.dtype(case.dtype)
    h, hkv, d = case.kv_heads * case.groups, case.kv_heads, case.head_dim
    arr = jax.ShapeDtypeStruct
    block = Block(q=arr((1, case.tq, h, d), dtype), k=arr((1, case.tkv, hkv, d), dtype),
                  v=arr((1, case.tkv, hkv, d), dtype), q_pos=arr((1, case.tq), jnp.int32),
                  kv_pos=arr((1, case.tkv), jnp.int32))
    extra = {}
    if spec_mask.segments:
        extra.update(q_seg=arr((1, case.tq), jnp.int32), kv_seg=arr((1, case.tkv), jnp.int32))
    if spec_mask.q_padding:
        extra.update(q_valid=arr((1, case.tq), jnp.bool_), kv_valid=arr((1, case.tkv), jnp.bool_))
    if spec_mask.dense:
        extra["mask"] = arr((1, 1, case.tq, case.tkv), jnp.bool_)
    if spec_mask.bias:
        extra["bias"] = arr((1, h, case.tq, case.tkv), jnp.float32)
    if spec_mask.topk:
        extra["topk"] = arr((1, 1, case.tq, case.topk), jnp.int32)
    spec = AttentionSpec(*(Layout.parse("BTHD"),) * 3, scale=d ** -0.5, softcap=softcap,
                         groups=case.groups, mask=spec_mask, positions=True)
    return block.replace(**extra), spec


def lower_case(case: Case):
    """Lower ``case``'s forward and backward (dQ and the KV-major dK/dV kernels) for its
    target; returns ``(seconds, lowered)``. Raises whatever the lowering raises."""
    target = TARGETS[case.target]
    block, spec = abstract_operands(case)
    kernel = PallasKernel(variant=target.variant, interpret=False)

    def step(b: Block):
        o, lse = kernel.forward(b, spec)
        return kernel.backward(b, o, lse, o.astype(b.q.dtype), spec)

    start = time.perf_counter()
    with jax.sharding.use_abstract_mesh(target.mesh()):
        lowered = jax.jit(step).trace(block).lower(lowering_platforms=(target.platform,))
    return time.perf_counter() - start, lowered
