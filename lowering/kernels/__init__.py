"""Local-step kernels: one block of queries against one block of keys, and its backward.

Every schedule is built from this step. A kernel is an object with a ``name`` and two
methods (:class:`Kernel`); each module of this package registers its kernels with
:func:`register_kernel`, and :func:`get_kernel` imports them on first use, so a new kernel
is one new module here.

* ``forward(block, spec, running=None) -> (o, lse)``
* ``backward(block, o, lse, do, spec, dlse=None, delta=None, dq=None, dk=None, dv=None)
  -> (dq, dk, dv, dbias)``

``block`` is a :class:`~cptransform.lowering.block.Block` in the canonical per-device shapes
with the mask and bias holding only this block's key columns. ``o`` is float32 and
normalised within the block, ``lse`` float32 ``[B, H, Tq]`` and ``-inf`` for rows that see
no key in the block; ``running``, when given, is a float32 partial ``(o, lse)`` of the same
queries over other keys, and the result is their exact merge
(:func:`~cptransform.op.attention_reference.merge`; a schedule that visits key blocks one
after another passes it, so a kernel can merge in place, see :func:`merged_into`). In
``backward``, ``o``/``lse`` are the *merged* results over all key blocks (so the
probabilities of this block are ``exp(logits - lse)``) and ``dlse`` an
optional cotangent of ``lse``; ``delta``, when given, is :func:`row_delta` of those (a schedule
that calls the backward once per key block computes it once), and then ``o`` and ``dlse``
are not read; ``dq``, ``dk`` and ``dv``, when given, are float32 running sums
(``[B, Tq, H, D]``, ``[B, Tkv, Hkv, D]``, ``[B, Tkv, Hkv, Dv]``) that the block's gradients
are added to (the returned ones are the new sums: a schedule that sums over key blocks
passes them, so a kernel can accumulate in place, see :func:`added_to`); all
gradients are float32, ``dbias`` has the bias's shape
(broadcast dims summed) and is ``None`` without a bias.

Non-finite values (docs/contract.md, "NaN and Inf") follow the dense single-device
computation: an empty row is
one with ``lse == -inf`` exactly (:func:`~cptransform.op.attention_reference.empty_rows_of`,
never ``isfinite``), a NaN ``lse`` is a NaN row, a masked probability is an exact 0 (so
``0·NaN`` in V still reaches the output) and a masked logit's gradient is an exact 0. A
kernel that skips a block no query can see still adds what the dense computation would:
``o += Σ 0·V`` (forward), ``dq += Σ 0·K``, ``dk += Σ 0·Q``, ``dv += Σ (0·lse + 0·dO)``
(backward; NaN rows give NaN), with :func:`zero_times`.
"""
from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import Protocol

import jax
import jax.numpy as jnp

from cptransform.ir.errors import ContextParallelOptionError, unknown_name
from cptransform.op.accumulation import accumulator_dtype
from cptransform.op.attention_reference import merge
from cptransform.op.attention_spec import AttentionSpec
from cptransform.lowering.block import Block


class Kernel(Protocol):
    """What a schedule calls for one (query block, key block) step; see the module doc."""

    name: str
    #: What it can run (:class:`~cptransform.lowering.kernels.capabilities.Capabilities`).
    capabilities: object

    def forward(self, block: Block, spec: AttentionSpec, running=None):
        ...

    def backward(self, block: Block, o, lse, do, spec: AttentionSpec, dlse=None, delta=None,
                 dq=None, dk=None, dv=None):
        ...


@dataclass(frozen=True)
class ProfiledKernel:
    """``kernel`` with its calls under ``jax.named_scope`` names, so a profile (and the
    lowered program's op metadata) shows the local step:
    ``cptransform/kernel/<name>/forward`` and ``.../backward``."""

    kernel: Kernel

    @property
    def name(self) -> str:
        return self.kernel.name

    def forward(self, block: Block, spec: AttentionSpec, running=None):
        with jax.named_scope(f"cptransform/kernel/{self.kernel.name}/forward"):
            return self.kernel.forward(block, spec, running)

    def backward(self, block: Block, o, lse, do, spec: AttentionSpec, dlse=None, delta=None,
                 dq=None, dk=None, dv=None):
        with jax.named_scope(f"cptransform/kernel/{self.kernel.name}/backward"):
            return self.kernel.backward(block, o, lse, do, spec, dlse, delta, dq, dk, dv)


def row_delta(o, do, dlse=None):
    """Float32 ``[B, H, Tq]``: ``rowsum(dO ∘ O) - dlse``, the backward's per-row term."""
    acc = accumulator_dtype(o.dtype, do.dtype)
    delta = jnp.swapaxes(jnp.sum(do.astype(acc) * o.astype(acc), axis=-1), 1, 2)
    return delta if dlse is None else delta - dlse.astype(acc)


def added_to(running, g):
    """``g`` added to one of a kernel's gradient running sums (``None``: no sum yet)."""
    return g if running is None else running + g


def merged_into(running, o, lse):
    """A block's ``(o, lse)`` merged into a kernel's running partial (``None``: none yet)."""
    return (o, lse) if running is None else merge(*running, o, lse)


def zero_times(x):
    """``0·x`` in float32: 0, or NaN where ``x`` is NaN or ±Inf (what a skipped block adds:
    a dense softmax multiplies exact-zero probabilities with V, see the module doc)."""
    return x.astype(accumulator_dtype(x.dtype)) * 0.0


def pad_axis(x, axis: int, to: int, value=None):
    """``x`` padded along ``axis`` to length ``to``: repeating its last entry (``value``
    ``None``, which keeps min/max ranges unchanged) or with ``value``; ``None`` stays
    ``None``."""
    if x is None or x.shape[axis] == to:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, to - x.shape[axis])
    if value is None:
        return jnp.pad(x, widths, mode="edge")
    return jnp.pad(x, widths, constant_values=value)


def sum_to(x, shape):
    """Sum the dims of ``x`` that ``shape`` broadcasts (size 1) back down to ``shape``."""
    axes = tuple(i for i, (xs, s) in enumerate(zip(x.shape, shape)) if s == 1 and xs != 1)
    return jnp.sum(x, axis=axes, keepdims=True) if axes else x


#: Local-step kernels by name (filled by the modules of this package; see :func:`kernels`).
KERNELS: dict[str, Kernel] = {}


def register_kernel(kernel: Kernel) -> Kernel:
    """Register ``kernel`` under ``kernel.name``; returns it."""
    KERNELS[kernel.name] = kernel
    return kernel


def kernels() -> dict[str, Kernel]:
    """Every registered kernel by name, after importing this package's modules (they
    register themselves)."""
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")
    return KERNELS


def kernel_choices() -> tuple[str, ...]:
    """The values of the ``kernel`` option: ``auto`` (per attention the fastest kernel that
    runs it) and every registered kernel by name (sorted: the registration order is the
    order the kernel modules happened to be imported in)."""
    return ("auto", *sorted(kernels()))


def get_kernel(name: str) -> Kernel:
    """The kernel called ``name``; ``"auto"`` is the one
    :func:`~cptransform.lowering.kernels.capabilities.choose_kernel` picks for a plain causal
    float32 attention on ``jax.default_backend()`` (schedules choose per attention)."""
    known = kernels()
    if name == "auto":
        from cptransform.lowering.kernels.capabilities import plain_choice
        return plain_choice(known)
    if name in known:
        return known[name]
    raise ContextParallelOptionError(unknown_name("kernel", name, kernel_choices()))
