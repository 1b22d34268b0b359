"""Local-step kernels: one block of queries against one block of keys, and its backward.

Every schedule is built from this step. A kernel is an object with a ``name`` and two
methods (:class:`Kernel`); each module of this package registers its kernels with
:func:`register_kernel`, and :func:`get_kernel` imports them on first use, so a new kernel
is one new module here.

* ``forward(block, spec) -> (o, lse)``
* ``backward(block, o, lse, do, spec, dlse=None, delta=None) -> (dq, dk, dv, dbias)``

``block`` is a :class:`~cptransform.lowering.block.Block` in the canonical per-device shapes
with the mask and bias holding only this block's key columns. ``o`` is float32 and
normalised within the block, ``lse`` float32 ``[B, H, Tq]`` and ``-inf`` for rows that see
no key in the block. In ``backward``, ``o``/``lse`` are the *merged* results over all key
blocks (so the probabilities of this block are ``exp(logits - lse)``) and ``dlse`` an
optional cotangent of ``lse``; ``delta``, when given, is :func:`row_delta` of those (a schedule
that calls the backward once per key block computes it once), and then ``o`` and ``dlse``
are not read; all gradients are float32, ``dbias`` has the bias's shape
(broadcast dims summed) and is ``None`` without a bias.

Non-finite values (DESIGN §6) follow the dense single-device computation: an empty row is
one with ``lse == -inf`` exactly (:func:`~cptransform.op.attention_reference.empty_rows_of`,
never ``isfinite``), a NaN ``lse`` is a NaN row, a masked probability is an exact 0 (so
``0·NaN`` in V still reaches the output) and a masked logit's gradient is an exact 0. A
schedule that skips a block no query can see uses :func:`skipped_forward` and
:func:`skipped_backward`, which return what a kernel would for that block.
"""
from __future__ import annotations

import importlib
import pkgutil
from typing import Protocol

import jax
import jax.numpy as jnp

from cptransform.op.attention_reference import empty_rows_of
from cptransform.op.attention_spec import AttentionSpec
from cptransform.lowering.block import Block


class Kernel(Protocol):
    """What a schedule calls for one (query block, key block) step; see the module doc."""

    name: str

    def forward(self, block: Block, spec: AttentionSpec):
        ...

    def backward(self, block: Block, o, lse, do, spec: AttentionSpec, dlse=None, delta=None):
        ...


def row_delta(o, do, dlse=None):
    """Float32 ``[B, H, Tq]``: ``rowsum(dO ∘ O) - dlse``, the backward's per-row term."""
    delta = jnp.swapaxes(jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1), 1, 2)
    return delta if dlse is None else delta - dlse.astype(jnp.float32)


def _nan_of(x):
    """``0·x`` in float32: 0, or NaN where ``x`` is NaN or ±Inf."""
    return x.astype(jnp.float32) * 0.0


def _sum_rows(x, groups: int):
    """``x [B, T, H, F]`` summed over the sequence (dim 1) and the query-head groups:
    ``[B, 1, H/groups, F]``."""
    b, t, h, f = x.shape
    return jnp.sum(x.reshape(b, t, h // groups, groups, f), axis=(1, 3))[:, None]


def skipped_forward(block: Block, spec: AttentionSpec):
    """``(o, lse)`` of a block in which no query sees any key, without computing it.

    ``lse = -inf``; ``o = Σ 0·V`` per (batch, head, feature): 0, or NaN where V holds a NaN
    or Inf, as ``P·V`` with exact-zero probabilities gives on one device.
    """
    b, tq, h, _ = block.q.shape
    o = jnp.repeat(_sum_rows(_nan_of(block.v), 1), h // block.v.shape[2], axis=2)
    lse = jnp.full_like(block.q, -jnp.inf, dtype=jnp.float32, shape=(b, h, tq))
    return jnp.broadcast_to(o, (b, tq, h, o.shape[3])), lse


def skipped_backward(block: Block, lse, do, spec: AttentionSpec):
    """``(dq, dk, dv, dbias)`` of a block in which no query sees any key (``lse``, ``do``
    as in :meth:`Kernel.backward`), without computing it: what the kernel gives with zero
    logit gradients and zero probabilities (NaN ones in a NaN row), i.e. ``dq = Σ 0·K``,
    ``dk = Σ 0·Q``, ``dv = Σ (0·lse + 0·dO)`` and ``dbias = 0``, all float32."""
    q, k, v = block.q, block.k, block.v
    b, tq, h, d = q.shape
    _, tkv, hkv, dv_dim = v.shape
    groups = h // hkv
    dq = jnp.repeat(_sum_rows(_nan_of(k), 1), groups, axis=2)
    dk = _sum_rows(_nan_of(q), groups)
    row = jnp.swapaxes(jnp.where(empty_rows_of(lse), 0.0, lse), 1, 2)[..., None]  # [B,Tq,H,1]
    dv = _sum_rows(_nan_of(row) + _nan_of(do), groups)
    dbias = None if block.bias is None else jnp.zeros_like(block.bias, dtype=jnp.float32)
    return (jnp.broadcast_to(dq, (b, tq, h, d)), jnp.broadcast_to(dk, (b, tkv, hkv, d)),
            jnp.broadcast_to(dv, (b, tkv, hkv, dv_dim)), dbias)


#: Local-step kernels by name (filled by the modules of this package; see :func:`kernels`).
KERNELS: dict[str, Kernel] = {}

#: Backends whose ``"auto"`` kernel is Pallas.
_PALLAS_BACKENDS = ("tpu", "gpu", "cuda", "rocm")


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


def get_kernel(name: str) -> Kernel:
    """The kernel called ``name``; ``"auto"`` picks Pallas on TPU and GPU and XLA elsewhere
    (on CPU Pallas only interprets: correct, but far slower than XLA), by
    ``jax.default_backend()`` when the program is lowered."""
    known = kernels()
    if name == "auto":
        return known["pallas" if jax.default_backend() in _PALLAS_BACKENDS else "xla"]
    if name in known:
        return known[name]
    raise ValueError(f"unknown kernel {name!r}; use one of {', '.join(sorted({*known, 'auto'}))}")
