"""What each local-step kernel can run, and the choice ``kernel="auto"`` makes from it.

Modelled on tokamax's attention API, where each implementation refuses what it cannot do:
a kernel carries :class:`Capabilities` (mask terms, dtypes, head dims, backends, and the
backends where it must first pass an on-device self-check), checked before lowering, so a
refusal names the cause instead of surfacing deep inside a kernel. :func:`choose_kernel`
resolves a kernel name for one attention: a named kernel that cannot run the attention is a
:class:`~cptransform.ir.errors.KernelError`; ``"auto"`` takes the fastest capable kernel of
:data:`PREFERENCE` for the backend, and a kernel that needs a self-check only after
:func:`self_check` passed on that device kind (once per process), else the next one with
one warning line.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from cptransform.ir.errors import KernelError, unknown_name
from cptransform.lowering.block import Block
from cptransform.op import mask_terms
from cptransform.op.attention_reference import attend
from cptransform.op.attention_spec import AttentionSpec, Layout, MaskSpec

#: Every mask term class.
ALL_TERMS = frozenset(mask_terms.TERMS)
#: Float dtypes of q/k/v the kernels compute in float32 from.
FLOATS = frozenset({"float16", "bfloat16", "float32", "float64"})
#: ``"auto"``'s order per backend, fastest first (Pallas interpreted on CPU is slow; on an
#: H200 cuDNN runs causal bf16 attention at 5-8x our Pallas-Triton kernel's FLOP/s,
#: ``bench/kernels.py``).
PREFERENCE = {"cpu": ("xla",), "gpu": ("cudnn", "pallas", "xla"),
              "cuda": ("cudnn", "pallas", "xla"), "rocm": ("pallas", "xla"),
              "tpu": ("pallas", "xla")}


@dataclass(frozen=True)
class Capabilities:
    """What a kernel runs: ``mask_terms`` (term classes), ``dtypes`` (q/k/v dtype names),
    ``head_dims`` (a predicate on a head dim of q/k or v and the backend), ``backends``,
    ``needs_check``: the backends where ``"auto"`` takes it only after a passed
    :func:`self_check` on the device kind, ``dropout``: whether it draws the dropout bits
    of a tile (:mod:`~cptransform.op.dropout`), ``finite_fill``: whether it gives masked
    pairs a finite logit (``MaskSpec.fill``) instead of hiding them and then skips no
    block, and ``refuses``: the kernel's own further
    refusal ``(spec, head_dims) -> why | None`` (what the other fields cannot state: a
    soft-cap, a bias, a band shape, a missing library)."""

    mask_terms: frozenset = ALL_TERMS
    dtypes: frozenset = FLOATS
    head_dims: Callable[[int, str], bool] = field(default=lambda d, backend: d > 0)
    backends: frozenset = frozenset(PREFERENCE)
    needs_check: frozenset = frozenset()
    dropout: bool = True
    finite_fill: bool = True
    refuses: Callable[[AttentionSpec, tuple], str | None] | None = None

    def refusal(self, spec: AttentionSpec, dtype, head_dims: tuple[int, ...],
                backend: str) -> str | None:
        """Why this kernel cannot run ``spec`` on ``backend`` (``None``: it can)."""
        terms = [t.describe() for t in spec.mask.terms() if type(t) not in self.mask_terms]
        if terms:
            return f"it does not read the mask term(s) {', '.join(terms)}"
        if np.dtype(dtype).name not in self.dtypes:
            return f"it does not compute in {np.dtype(dtype).name}"
        bad = [d for d in head_dims if not self.head_dims(d, backend)]
        if bad:
            return f"it does not support head dim {bad[0]} on the {backend} backend"
        if backend not in self.backends:
            return f"it does not run on the {backend} backend"
        if spec.dropout is not None and not self.dropout:
            return "it does not draw dropout bits (the chunked XLA kernel does)"
        if spec.mask.fill is not None and not self.finite_fill:
            return (f"it does not give masked pairs the finite logit {spec.mask.fill:g} "
                    "(the chunked XLA kernel does)")
        return None if self.refuses is None else self.refuses(spec, tuple(head_dims))


#: Results of :func:`self_check` by ``(kernel name, device kind)``.
_CHECKED: dict[tuple[str, str], str | None] = {}


def self_check(kernel) -> str | None:
    """Run a tiny causal forward of ``kernel`` and its backward from that ``(o, lse)`` (what
    a schedule runs) on the default device, in float32 or, for a kernel without it,
    bfloat16, against :func:`~cptransform.op.attention_reference.attend` and its VJP;
    ``None`` when they agree, else why not. Cached per device kind."""
    kind = jax.devices()[0].device_kind
    key = (kernel.name, kind)
    if key not in _CHECKED:
        _CHECKED[key] = _compare(kernel)
    return _CHECKED[key]


def _compare(kernel) -> str | None:
    dtype = jnp.float32 if "float32" in kernel.capabilities.dtypes else jnp.bfloat16
    rng = np.random.default_rng(0)
    q, k, v, do = (jnp.asarray(rng.normal(size=(1, 64, 2, 64)), dtype) for _ in range(4))
    pos = jnp.arange(64, dtype=jnp.int32)[None]
    bthd = Layout.parse("BTHD")
    spec = AttentionSpec(q=bthd, k=bthd, v=bthd, scale=0.125, mask=MaskSpec(causal=True))

    def local(q, k, v, do):
        block = Block(q, k, v, pos, pos)
        o, lse = kernel.forward(block, spec)
        return (o, *kernel.backward(block, o, lse, do, spec)[:3])

    def reference(q, k, v, do):
        o, vjp = jax.vjp(lambda *x: attend(spec, *x, pos, pos)[0], q, k, v)
        return (o, *vjp(do))

    try:
        with jax.ensure_compile_time_eval():  # eager, even when asked while tracing
            got = jax.jit(local)(q, k, v, do)
            want = jax.jit(reference)(*(x.astype(jnp.float32) for x in (q, k, v, do)))
    except Exception as err:  # noqa: BLE001 - any failure to compile or run is the answer
        return f"it failed to run: {type(err).__name__}: {str(err).splitlines()[0][:200]}"
    for name, a, b in zip(("o", "dq", "dk", "dv"), got, want):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        # bfloat16 operands round o and the gradients to 8 bits of their magnitude.
        atol = 2e-3 if dtype == jnp.float32 else 2e-2 * max(1.0, float(np.max(np.abs(b))))
        if not np.allclose(a, b, rtol=2e-3 if dtype == jnp.float32 else 2e-2, atol=atol):
            return f"its {name} differs from the reference"
    return None


def _refusal_here(kernel, spec: AttentionSpec, dtype, head_dims: tuple[int, ...],
                  backend: str) -> str | None:
    """Why ``kernel`` cannot run this attention here: its capabilities' refusal, or, on a
    backend where it needs one, its failed :func:`self_check` on this device kind."""
    why = kernel.capabilities.refusal(spec, dtype, head_dims, backend)
    if why is None and backend in kernel.capabilities.needs_check:
        failed = self_check(kernel)
        if failed is not None:
            why = f"on this {jax.devices()[0].device_kind} its self-check failed: {failed}"
    return why


def choose_kernel(name: str, spec: AttentionSpec, dtype, head_dims: tuple[int, ...],
                  known: dict, backend: str | None = None):
    """``(kernel, reason)`` for one attention: the kernel called ``name`` in ``known``, or
    for ``"auto"`` the first of :data:`PREFERENCE` that can run it (and passed its self-check
    where it needs one). ``reason`` is one line for ``explain()``."""
    backend = backend or jax.default_backend()
    if name != "auto":
        if name not in known:
            raise KernelError(unknown_name("kernel", name, ("auto", *sorted(known))))
        kernel = known[name]
        why = _refusal_here(kernel, spec, dtype, head_dims, backend)
        if why is not None:
            raise KernelError(
                f"kernel={name!r} cannot run this attention ({spec.mask.describe()}): {why}; "
                "use kernel='xla' (the chunked XLA kernel runs every mask) or kernel='auto'")
        return kernel, f"{name}: requested"
    passed_over = []
    for candidate in PREFERENCE.get(backend, ("xla",)):
        kernel = known[candidate]
        why = _refusal_here(kernel, spec, dtype, head_dims, backend)
        if why is None:
            skipped = "".join(f"; not {n}: {w}" for n, w in passed_over)
            return kernel, f"{candidate}: fastest capable kernel on {backend}{skipped}"
        passed_over.append((candidate, why))
    raise KernelError(f"no kernel can run this attention on {backend}: "
                      + "; ".join(f"{n}: {w}" for n, w in passed_over))


def plain_choice(known: dict):
    """The kernel ``"auto"`` picks for a plain causal float32 attention of head dim 64."""
    bthd = Layout.parse("BTHD")
    spec = AttentionSpec(q=bthd, k=bthd, v=bthd, scale=0.125, mask=MaskSpec(causal=True))
    return choose_kernel("auto", spec, jnp.float32, (64, 64), known)[0]


def warn_passed_over(reason: str) -> None:
    """One warning line when ``"auto"`` passed over a faster kernel (``reason`` from
    :func:`choose_kernel`)."""
    if "; not " in reason:
        warnings.warn(f"cptransform: kernel='auto' uses {reason}", stacklevel=3)
