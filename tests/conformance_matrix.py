"""The conformance matrix: every registered schedule in every layout × every registered
local-step kernel × every mask term and attention feature, and what each cell must do.

Nothing here lists schedules, kernels or mask terms by hand: the placements come from
:func:`~cptransform.lowering.schedule.schedules` (each record's ``mesh_axes`` and ``inner``
axis names give its mesh) × :data:`~cptransform.op.layouts.LAYOUTS`, the kernels from
:func:`~cptransform.lowering.kernels.kernels`, and the mask terms are checked against
:data:`~cptransform.lowering.kernels.capabilities.ALL_TERMS` (``test_conformance`` fails when
a registered term has no case in :data:`FEATURES`). What a cell must do is decided by the
library's own declarations, in the order ``context_parallel_attention`` checks them: the
kernel's :class:`Capabilities` refusal (a ``KernelError``), then the schedule's
``feasible`` (a ``ContextParallelError``), else the run must match the single-device
reference in value and gradients.

Shapes rotate across the cells: for each schedule and layout the mesh size (2, 4, 8
devices; a costly kernel of :data:`COST` stays on the smallest), the head sharing (MHA,
GQA, MQA) and the value head dim (8, 12, where the kernel takes it) vary with the
feature, so every pair of (layout, size), (layout, heads) and (size, heads) occurs per
schedule.
"""
from __future__ import annotations

import dataclasses
import inspect
import math
from dataclasses import dataclass, replace
from functools import lru_cache

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from schedule_cases import (BTHD, HEAD_KINDS, Case, mask_spec, schedule_axes,
                            schedule_mesh_shapes)

from cptransform.analysis.attention_shape import attention_shape
from cptransform.lowering.kernels import kernels
from cptransform.lowering.kernels.capabilities import ALL_TERMS
from cptransform.lowering.schedule import schedules
from cptransform.op import dropout, mask_terms
from cptransform.op.attention_spec import AttentionSpec
from cptransform.op.layouts import LAYOUTS

BACKEND = jax.default_backend()
SEQ, D, BATCH = 32, 8, 2
#: Per kernel cost of a case here, relative to the XLA kernel's: the fast sample prefers
#: cheap cells, and a costly kernel runs on each schedule's smallest mesh only
#: (interpreted Pallas is slow on a CPU: a ring step over 8 devices took 70 s).
COST = {"pallas": 8}


def _stand_in_cudnn():
    """cuDNN's kernel with the two cuDNN calls done in XLA (``test_cudnn_kernel.STANDIN``)."""
    from test_cudnn_kernel import STANDIN

    from cptransform.lowering.kernels.cudnn import CudnnKernel
    return CudnnKernel(calls=STANDIN)


#: Kernels that do not run on this backend, by name: a builder of a stand-in that does (its
#: capabilities are widened to this backend when the matrix uses it). A new kernel that
#: cannot run here needs one, or ``test_conformance`` fails.
STAND_INS = {"cudnn": _stand_in_cudnn}


@lru_cache(maxsize=None)
def suite_kernel(name: str):
    """The kernel the suite runs as ``name``: the registered one, or its stand-in where
    the registered one cannot run on this backend; ``None`` for neither."""
    kernel = kernels()[name]
    if BACKEND in kernel.capabilities.backends:
        return kernel
    if name not in STAND_INS:
        return None
    stand_in = STAND_INS[name]()
    caps = kernel.capabilities
    object.__setattr__(stand_in, "capabilities",
                       replace(caps, backends=caps.backends | {BACKEND}))
    return stand_in


def _dtype(kernel):
    """The case dtype for ``kernel``: float32 where it computes in it, else bfloat16."""
    return jnp.float32 if "float32" in kernel.capabilities.dtypes else jnp.bfloat16


# --- the features: one case builder per mask term or attention feature ------------------

def _normal(rng, dtype, *shape):
    return jnp.asarray(rng.normal(size=shape), dtype)


def _base(rng, kind, heads, dv, dtype, **extra):
    """q, k, v (and the operands of the mask kind of :func:`schedule_cases.mask_spec`)."""
    h, hkv = HEAD_KINDS[heads]
    ops = [_normal(rng, dtype, BATCH, SEQ, h, D), _normal(rng, dtype, BATCH, SEQ, hkv, D),
           _normal(rng, dtype, BATCH, SEQ, hkv, dv)]
    mspec = mask_spec(kind)
    if mspec.segments:
        ids = jnp.asarray(np.sort(rng.integers(0, 4, (BATCH, SEQ)), axis=1), jnp.int32)
        ops += [ids, ids]
    if mspec.dense:
        dense = rng.random((BATCH, h, SEQ, SEQ)) < 0.3
        dense[:, :, 1] = False  # a query that sees no key
        ops.append(jnp.asarray(dense))
    if mspec.bias:
        ops.append(_normal(rng, dtype, 1, h, SEQ, SEQ))
    spec = AttentionSpec(q=BTHD, k=BTHD, v=BTHD, scale=1 / math.sqrt(D), groups=h // hkv,
                         mask=mspec, **extra)
    return ops, spec


def _kind(kind):
    """The feature of :func:`schedule_cases.mask_spec`'s mask kind ``kind``."""
    def build(rng, heads, dv, dtype):
        ops, spec = _base(rng, kind, heads, dv, dtype)
        return Case(tuple(ops), spec)
    return build


def _chunks(rng, heads, dv, dtype):
    """Llama-4 chunked attention: causal within chunks of 8 positions."""
    ops, spec = _base(rng, "causal", heads, dv, dtype)
    return Case(tuple(ops), spec.replace(mask=spec.mask.replace(chunk=8)))


def _topk(rng, heads, dv, dtype):
    """A sparse indexer's top-k (4 random key positions per row), causal too."""
    ops, spec = _base(rng, "causal", heads, dv, dtype)
    ops.append(jnp.asarray(rng.integers(0, SEQ, (BATCH, 1, SEQ, 4)), jnp.int32))
    return Case(tuple(ops), spec.replace(mask=spec.mask.replace(topk=True)))


def _coordinate_band(rng, heads, dv, dtype):
    """A window of keys around a data coordinate per query (gemma's local layer: the
    coordinate of a padded token repeats its predecessor's)."""
    ops, spec = _base(rng, "causal", heads, dv, dtype)
    real = rng.random((BATCH, SEQ)) < 0.8
    ops.append(jnp.asarray(np.maximum(np.cumsum(real, axis=1) - 1, 0), jnp.int32))
    return Case(tuple(ops), spec.replace(mask=spec.mask.replace(coordinate_band=(-3, 3))))


def _padding(rng, heads, dv, dtype):
    """A padded batch: query and key padding (``tokens != pad``), causal; the second row
    left-padded (its first queries see no key), the first with padding inside."""
    ops, spec = _base(rng, "causal", heads, dv, dtype)
    valid = np.ones((BATCH, SEQ), bool)
    valid[0, SEQ // 2:SEQ // 2 + 3] = False
    valid[-1, :5] = False
    ops += [jnp.asarray(valid), jnp.asarray(valid)]
    return Case(tuple(ops), spec.replace(mask=spec.mask.replace(q_padding=True,
                                                                kv_padding=True)))


def _region_padding(rng, heads, dv, dtype):
    """keras-hub's ``minimum(int mask, causal) != 0``: on the causal region a key is seen
    where its entry is non-zero, past it where its entry is negative; the second row
    left-padded (its first queries see no key), a few keys visible past the diagonal."""
    ops, spec = _base(rng, "none", heads, dv, dtype)
    data = rng.integers(1, 3, (BATCH, SEQ))
    data[-1, :5] = 0
    data[rng.random((BATCH, SEQ)) < 0.15] = -1
    ops += [jnp.asarray(data != 0), jnp.asarray(data < 0)]
    return Case(tuple(ops), spec.replace(mask=spec.mask.replace(region_padding=(None, 0))))


def _softcap(rng, heads, dv, dtype):
    """A soft-cap of the logits (Gemma 2), causal."""
    ops, spec = _base(rng, "causal", heads, dv, dtype)
    return Case(tuple(ops), spec.replace(softcap=2.0))


def _sinks(rng, heads, dv, dtype):
    """A learned sink logit per query head (gpt-oss), causal."""
    ops, spec = _base(rng, "causal", heads, dv, dtype, sinks=True)
    ops.append(_normal(rng, dtype, 1, HEAD_KINDS[heads][0]))
    return Case(tuple(ops), spec)


def _dropout(rng, heads, dv, dtype):
    """Dropout of half the probabilities (a pair is kept when its bits are below 2**31,
    then scaled by 2), causal; the seed holds the key and each (batch, head)'s offset."""
    ops, spec = _base(rng, "causal", heads, dv, dtype)
    h = HEAD_KINDS[heads][0]
    keep = dropout.Step(lax.lt_p, (), ("bits", dropout.Const(2 ** 31, "uint32")))
    multiplier = dropout.MultiplierMap((keep,), (dropout.Const(2.0, "float32"),), (0,))
    where = dropout.offsets({"b": h * SEQ * SEQ, "h": SEQ * SEQ}, {"b": BATCH, "h": h},
                            ["b"], ("h",))
    key = np.broadcast_to(np.asarray(jax.random.key_data(jax.random.key(7))), (BATCH, h, 2))
    ops.append(jnp.asarray(np.concatenate([key, where], axis=-1), jnp.uint32))
    return Case(tuple(ops), spec.replace(dropout=dropout.DropoutSpec(SEQ, 1, multiplier,
                                                                       zeroes=True)))


#: Every mask term and attention feature the suite crosses with the schedules and kernels:
#: name -> ``build(rng, heads, dv, dtype) -> Case``. Each term of ``ALL_TERMS`` must occur
#: in at least one (``test_conformance`` checks); GQA/MQA rotate through every feature.
FEATURES = {
    "none": _kind("none"), "causal": _kind("causal"), "window": _kind("window"),
    "causal_window": _kind("causal_window"), "chunks": _chunks,
    "segments": _kind("segments"), "dense": _kind("dense"),
    "dense_causal": _kind("dense_causal"), "topk": _topk,
    "coordinate_band": _coordinate_band, "padding": _padding,
    "region_padding": _region_padding, "bias": _kind("bias"),
    "softcap": _softcap,
    "sinks": _sinks, "dropout": _dropout,
}


# --- the cells ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Cell:
    """One case of the matrix: a schedule on ``mesh`` (shape) in ``layout``, a kernel, a
    feature with its head sharing and value head dim."""

    schedule: str
    layout: str
    mesh: tuple[int, ...]
    kernel: str
    feature: str
    heads: str
    dv: int

    @property
    def id(self) -> str:
        mesh = "x".join(map(str, self.mesh))
        return (f"{self.schedule}-{self.layout}-{mesh}-{self.kernel}-{self.feature}-"
                f"{self.heads}-dv{self.dv}")

    @property
    def axes(self) -> tuple[str, ...]:
        return schedule_axes(self.schedule)

    def case(self) -> Case:
        """The cell's random operands and spec (seeded: the same case on every call)."""
        kernel = suite_kernel(self.kernel)
        return FEATURES[self.feature](np.random.default_rng(0), self.heads, self.dv,
                                      _dtype(kernel))

    def expected(self) -> tuple[str, str | None]:
        """``("kernel", why)``, ``("schedule", why)`` or ``("run", None)``: what
        ``context_parallel_attention`` must do with this cell."""
        case, kernel = self.case(), suite_kernel(self.kernel)
        q, k, v = case.operands[:3]
        why = kernel.capabilities.refusal(case.spec, q.dtype, (q.shape[-1], v.shape[-1]),
                                          BACKEND)
        if why is not None:
            return "kernel", why
        record = schedules()[self.schedule]
        cp = math.prod(self.mesh)
        shape = attention_shape(case.spec, q, k, v, cp=cp, layout=self.layout,
                                ulysses=self.mesh[0] if record.inner is not None else 1)
        why = record.feasible(shape)
        return ("schedule", why) if why else ("run", None)


@lru_cache(maxsize=None)
def _dims_accepted(kernel_name: str, dv: int) -> bool:
    """Whether the suite's kernel ``kernel_name`` runs a plain causal attention of head
    dims (``D``, ``dv``): Dv ≠ D rotates in only where it does (cuDNN needs them equal)."""
    kernel = suite_kernel(kernel_name)
    ops, spec = _base(np.random.default_rng(0), "causal", "mha", dv, _dtype(kernel))
    return kernel.capabilities.refusal(spec, ops[0].dtype, (D, dv), BACKEND) is None


def cells() -> list[Cell]:
    """The whole matrix, schedule (registry order), layout, kernel (by name), feature."""
    heads, out = tuple(HEAD_KINDS), []
    for name in schedules():
        shapes = schedule_mesh_shapes(name)
        for li, layout in enumerate(LAYOUTS):
            # Sorted: kernels() lists them in the order their modules were imported, which
            # differs between test processes; the cells and their sample must not.
            for kernel_name in sorted(kernels()):
                for fi, feature in enumerate(FEATURES):
                    # (size, heads) = (l + f, l + 2f) mod 3 is onto: every pair occurs.
                    dv = 12 if (li + fi) % 2 and _dims_accepted(kernel_name, 12) else D
                    mesh = shapes[0 if kernel_name in COST else (li + fi) % 3]
                    out.append(Cell(name, layout, mesh, kernel_name, feature,
                                    heads[(li + 2 * fi) % 3], dv))
    return out


def fast_sample(all_cells: list[Cell], outcomes: dict) -> set[Cell]:
    """The cells the fast tier runs: a greedy covering design over the cells that run
    (every schedule, layout, kernel and feature at least once, preferring the cheapest
    cell that covers the most new values), plus the first refusal of each (kernel,
    feature) and (schedule, feature) pair (a refusal costs no compile)."""
    running = [c for c in all_cells if outcomes[c][0] == "run"]
    uncovered = {(f, getattr(c, f)) for c in running
                 for f in ("schedule", "layout", "kernel", "feature")}
    chosen = set()
    while uncovered:
        def gain(c):
            new = sum((f, getattr(c, f)) in uncovered
                      for f in ("schedule", "layout", "kernel", "feature"))
            return new / COST.get(c.kernel, 1) / math.prod(c.mesh) ** 0.5
        best = max(running, key=gain)
        chosen.add(best)
        uncovered -= {(f, getattr(best, f)) for f in ("schedule", "layout", "kernel", "feature")}
    seen = set()
    for c in all_cells:
        kind = outcomes[c][0]
        key = (kind, c.kernel if kind == "kernel" else c.schedule, c.feature)
        if kind != "run" and key not in seen:
            seen.add(key)
            chosen.add(c)
    return chosen


def term_classes() -> set[type]:
    """Every mask term class :mod:`cptransform.op.mask_terms` defines (a dataclass with an
    element predicate and a block classification; the ``MaskTerm`` protocol is none)."""
    return {cls for _, cls in inspect.getmembers(mask_terms, inspect.isclass)
            if cls.__module__ == mask_terms.__name__ and dataclasses.is_dataclass(cls)
            and hasattr(cls, "visible") and hasattr(cls, "block_kind")}


__all__ = ["ALL_TERMS", "Cell", "FEATURES", "STAND_INS", "cells", "fast_sample",
           "suite_kernel", "term_classes"]
