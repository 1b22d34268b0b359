"""cptransform: automatic context parallelism for JAX programs."""
from cptransform.attention import AttentionShapeError, attention, attention_p
from cptransform.attention_spec import AttentionSpec, Layout, MaskSpec
from cptransform.graph import Graph
from cptransform.module import Module, trace

__all__ = ["attention", "attention_p", "AttentionShapeError", "AttentionSpec", "Layout",
           "MaskSpec", "Graph", "Module", "trace"]
