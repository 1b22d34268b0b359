"""cptransform: automatic context parallelism for JAX programs.

``context_parallel`` is the transform; ``attention`` the explicit op for models whose
attention the matcher cannot see; the rest is the compiler toolkit under them.
"""
from cptransform.op.attention import AttentionShapeError, attention, attention_p
from cptransform.op.attention_spec import AttentionSpec, Layout, MaskSpec
from cptransform.api.context_parallel import (ContextParallelError, ContextParallelOptionError,
                                              UnshardedWarning, context_parallel)
from cptransform.ir.graph import Graph
from cptransform.ir.module import Module, trace

__all__ = ["attention", "attention_p", "AttentionShapeError", "AttentionSpec", "Layout",
           "MaskSpec", "context_parallel", "ContextParallelError", "ContextParallelOptionError",
           "UnshardedWarning",
           "Graph", "Module", "trace"]
