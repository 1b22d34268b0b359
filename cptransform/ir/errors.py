"""Every error cptransform raises for user input, under one base class.

Each says what is wrong and how to fix it. ``CPTransformError`` subclasses ``ValueError`` so
callers that caught ``ValueError`` keep working; the CLI catches it and prints one line.
"""
from __future__ import annotations


class CPTransformError(ValueError):
    """Base class: input, options or a program that cptransform refuses, with the fix."""


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
