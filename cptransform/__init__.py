"""cptransform: automatic context parallelism for JAX programs.

``context_parallel`` is the transform; ``attention`` the explicit op for models whose
attention the matcher cannot see; the rest is the compiler toolkit under them.

Everything is logged under the ``cptransform`` logger (INFO: each pass with its wall time and
what it changed; DEBUG: the program after each pass); the library adds no handler but
``logging.NullHandler``, so ``logging.basicConfig(level=logging.INFO)`` shows it.
"""
import logging

logging.getLogger("cptransform").addHandler(logging.NullHandler())

from cptransform.op.attention import AttentionShapeError, attention, attention_p
from cptransform.op.attention_spec import AttentionSpec, Layout, MaskSpec
from cptransform.api.context_parallel import (ContextParallelError, ContextParallelOptionError,
                                              IdleDevicesWarning, PartlyShardedWarning,
                                              UnshardedWarning, context_parallel)
from cptransform.ir.errors import UnshardedError
from cptransform.ir.graph import Graph
from cptransform.ir.module import Module, trace

__all__ = ["attention", "attention_p", "AttentionShapeError", "AttentionSpec", "Layout",
           "MaskSpec", "context_parallel", "ContextParallelError", "ContextParallelOptionError",
           "IdleDevicesWarning", "PartlyShardedWarning", "UnshardedError", "UnshardedWarning",
           "Graph", "Module", "trace"]
