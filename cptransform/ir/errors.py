"""Every error cptransform raises for user input, under one base class.

Each says what is wrong and how to fix it. ``CPTransformError`` subclasses ``ValueError`` so
callers that caught ``ValueError`` keep working; the CLI catches it and prints one line.
"""
from __future__ import annotations

import difflib
from typing import Iterable


class CPTransformError(ValueError):
    """Base class: input, options or a program that cptransform refuses, with the fix."""


def did_you_mean(word: object, choices: Iterable[str]) -> str:
    """`` (did you mean 'ring'?)`` for the closest of ``choices`` to ``word``, or ``""``:
    the suffix every "unknown name" error appends to its message."""
    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def unknown_name(what: str, word: object, choices: Iterable[str], sep: str = " ") -> str:
    """``unknown schedule 'rign' (did you mean 'ring'?); use one of auto, ring, ...``
    (``sep="="`` for an option: ``unknown schedule='rign' ...``)."""
    choices = list(choices)
    return (f"unknown {what}{sep}{word!r}{did_you_mean(word, choices)}; use one of "
            f"{', '.join(map(str, choices)) or 'none'}")
class KernelError(CPTransformError, NotImplementedError):
    """The requested local-step kernel cannot run an attention (a mask term, dtype, head dim
    or backend it does not support), or no kernel can."""


class PipelineError(CPTransformError):
    """A pipeline text names an unknown pass or option, a bad option value, or a pass runs
    without the facts it requires."""


class ContextParallelOptionError(CPTransformError):
    """An option of ``context_parallel`` is unknown or inconsistent."""


class ContextParallelError(CPTransformError):
    """The function, its operands or the mesh cannot be transformed as written."""


class UnshardedError(ContextParallelError):
    """The transform would shard less than asked: no attention found (``cp > 1``), or,
    under ``strict=True``, some attention left whole."""


class AttentionShapeError(CPTransformError):
    """Operands of an attention do not fit together."""


class LayoutError(CPTransformError):
    """A sequence layout that cannot split this length over these devices."""


class SeqAxisError(CPTransformError):
    """The sequence axis of a value cannot be decided, or an override contradicts it."""


class MatchAttentionError(CPTransformError):
    """``strict`` matching met a softmax it cannot prove to be attention."""


class PlanError(CPTransformError):
    """A schedule that cannot run an attention on this mesh."""


class ReorderError(CPTransformError):
    """An op that the load-balanced layout cannot run (under ``strict``) or cannot wrap."""


class PlotError(CPTransformError):
    """A picture cannot be drawn (``--png`` without matplotlib installed)."""
