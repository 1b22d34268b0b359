"""Which JAX this is, and whether cptransform supports it (checked on import)."""
from __future__ import annotations

import jax


#: The JAX releases cptransform is tested on: at least the first, below the second (the first
#: untested minor release). ``pyproject.toml`` states the same bound for pip.
SUPPORTED_JAX = ((0, 10, 2), (0, 13))
#: Set to ``1`` to run on a JAX outside :data:`SUPPORTED_JAX` anyway (a warning, not an error).
ALLOW_UNTESTED_JAX = "CPTRANSFORM_ALLOW_UNTESTED_JAX"


class UnsupportedJaxError(ImportError):
    """The installed JAX is outside the tested range, or spells an internal differently
    from every tested release."""


def _jax_version() -> str:
    return jax.__version__


def _release(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split(".")[:3]:
        digits = "".join(c for c in piece if c.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def jax_release() -> tuple[int, ...]:
    """The installed JAX's release as numbers, ``(0, 12, 0)`` for ``0.12.0.1``."""
    return _release(_jax_version())


def compiler_crash(schedule: str) -> str | None:
    """Why this JAX's XLA crashes the process (not an error: a segfault) compiling a program
    that runs ``schedule``, or ``None``. The planner leaves such a schedule out under
    ``auto`` and refuses it when asked for, with this text.

    JAX 0.11.x: XLA segfaults in the SPMD partitioner's conditional-canonicalizer pass when
    compiling the gradient with respect to K/V of a ``context_parallel`` program whose
    attention runs the halo schedule (``examples/gemma.py``, ``examples/gpt_oss.py``;
    measured on the CPU backend of 0.11.2; the forward compiles; 0.10.2 and 0.12.0.1
    compile and match one device)."""
    if schedule == "halo" and jax_release()[:2] == (0, 11):
        return (f"JAX {_jax_version()}'s XLA crashes (a segfault in the SPMD partitioner) "
                "compiling the halo schedule's K/V gradient; use schedule='ring' (auto "
                "does), or JAX 0.10.2 or 0.12")
    return None


def scan_compiler_crash(arrays: int) -> str | None:
    """Why this JAX's XLA crashes the process compiling the gradient of a
    ``lax.associative_scan`` over ``arrays`` arrays whose state is passed between devices
    (prefix of totals), or ``None``. The planner gathers such a recurrence instead (warning
    that it does), and refuses ``recurrences='pass'`` with this text.

    JAX 0.11.x: XLA segfaults compiling the gradient of a CP program running an
    ``associative_scan`` of an affine pair ``(a, b)`` (RG-LRU's ``h = a·h + x``) by prefix of
    totals; measured on the CPU backend of 0.11.2: a one-array scan (a sum) and ``cumsum``
    compile, the forward compiles, the gathered scan compiles; 0.10.2 and 0.12 compile the
    pair and match one device."""
    if arrays > 1 and jax_release()[:2] == (0, 11):
        return (f"JAX {_jax_version()}'s XLA crashes (a segfault) compiling the gradient of "
                f"an associative_scan over {arrays} arrays whose state is passed between "
                "devices; it is gathered instead (recurrences='gather'): use JAX 0.10.2 or "
                "0.12 to shard it")
    return None


def check_jax_version(version: str | None = None) -> None:
    """Refuse a JAX outside :data:`SUPPORTED_JAX` with one error naming the range and the fix
    (a warning instead where ``CPTRANSFORM_ALLOW_UNTESTED_JAX=1``)."""
    import os
    import warnings

    version = version or _jax_version()
    low, high = SUPPORTED_JAX
    if low <= _release(version) < high:
        return
    text = (f"cptransform supports JAX >= {'.'.join(map(str, low))}, < "
            f"{'.'.join(map(str, high))}; this is JAX {version}. Install a supported one "
            f"(pip install 'jax>={'.'.join(map(str, low))},<{'.'.join(map(str, high))}'), or "
            f"set {ALLOW_UNTESTED_JAX}=1 to try this one untested.")
    if os.environ.get(ALLOW_UNTESTED_JAX) == "1":
        warnings.warn(text, stacklevel=2)
        return
    raise UnsupportedJaxError(text)


check_jax_version()
