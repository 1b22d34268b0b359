"""Compiler passes; each module defines one pass, named after its file in kebab-case.

Importing this package registers every built-in pass.
"""
from cptransform.passes import canonicalize  # noqa: F401
from cptransform.passes import match_attention  # noqa: F401
from cptransform.passes import infer_seq_axes  # noqa: F401
from cptransform.passes import plan_context_parallel  # noqa: F401
from cptransform.passes import reorder_sequence  # noqa: F401
from cptransform.passes import lower_context_parallel  # noqa: F401
