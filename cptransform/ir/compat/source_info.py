"""Where an equation came from in the user's code, and re-emitting equations under it."""
from __future__ import annotations

import contextlib
from typing import Any

from jax._src import source_info_util as _source_info

#: The folders of cptransform's own packages, once registered with JAX.
_EXCLUDED: list[str] = []


def _exclude_own_frames() -> None:
    """Make JAX skip cptransform's own files when it looks for the user's frame."""
    if _EXCLUDED:
        return
    import importlib.util
    import os

    for package in ("cptransform", "cptransform.passes", "cptransform.lowering"):
        spec = importlib.util.find_spec(package)
        if spec is not None and spec.origin:
            path = os.path.dirname(spec.origin)
            _source_info.register_exclusion(path + os.sep)
            _EXCLUDED.append(path)


def source_line(eqn: Any) -> str:
    """``file:line (function)`` of the user code that produced ``eqn``, or ``"?"``."""
    _exclude_own_frames()
    traceback = getattr(eqn.source_info, "traceback", None)
    if traceback is None:
        return "?"
    frame = _source_info.user_frame(traceback)
    if frame is None:
        return "?"
    return f"{frame.file_name}:{frame.start_line} ({frame.function_name})"


def _in_installed_package(file_name: str) -> bool:
    """Whether ``file_name`` belongs to an installed package (Flax, Equinox, ...), not to the
    user's own code."""
    import sysconfig

    roots = {sysconfig.get_paths()[k] for k in ("purelib", "platlib")}
    return any(file_name.startswith(root) for root in roots) or any(
        part in file_name for part in ("/site-packages/", "/dist-packages/"))


def source_lines(eqn: Any) -> tuple[str, str | None]:
    """``(user, library)``: ``file:line (function)`` of the nearest frame in the user's own
    code that produced ``eqn`` (``"?"`` when none), and of the installed library's frame
    that emitted it when that is not the user's (a Flax module's attention), else ``None``."""
    _exclude_own_frames()
    traceback = getattr(eqn.source_info, "traceback", None)
    frames = list(_source_info.user_frames(traceback)) if traceback is not None else []

    def text(frame):
        return f"{frame.file_name}:{frame.start_line} ({frame.function_name})"

    if not frames:
        return "?", None
    if not _in_installed_package(frames[0].file_name):
        return text(frames[0]), None
    own = next((f for f in frames if not _in_installed_package(f.file_name)), None)
    return (text(own) if own is not None else "?"), text(frames[0])



_INLINING = [0]


@contextlib.contextmanager
def eqn_context(eqn: Any):
    """A context manager that attributes new equations to ``eqn``'s user source line.

    Inside :func:`inlining`, an equation from a library's ``jit`` body (``jnp.cumsum``)
    carries a traceback that stops at that ``jit``; the enclosing context (the call site's
    user line) is kept for it instead.
    """
    name_stack = _source_info.current_name_stack() + eqn.source_info.name_stack
    traceback = eqn.source_info.traceback
    if _INLINING[0] and traceback is not None:
        _exclude_own_frames()
        if _source_info.user_frame(traceback) is None:
            traceback = None
    with _source_info.user_context(traceback, name_stack=name_stack):
        manager = getattr(getattr(eqn, "ctx", None), "manager", None)
        if manager is None:
            yield
        else:
            with manager:
                yield


@contextlib.contextmanager
def inlining(eqn: Any):
    """Evaluate a call equation's body in place under ``eqn``'s context (see
    :func:`eqn_context`)."""
    with eqn_context(eqn):
        _INLINING[0] += 1
        try:
            yield
        finally:
            _INLINING[0] -= 1

