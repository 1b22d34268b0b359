"""Every use of JAX internals lives here.

JAX 0.10 returns ``ClosedJaxpr`` from ``make_jaxpr``; JAX 0.11 merged ``Jaxpr`` and
``ClosedJaxpr`` (the latter is an alias, and ``.jaxpr`` / ``.consts`` still answer); 0.12
dropped ``scan``'s ``num_consts`` and 0.12.1 puts NumPy integers in params. The rest of
cptransform talks to JAX's internals only through the names below, so a JAX upgrade touches
this package. See ``docs/jax_versions.md`` for the measured differences.

The package is split by subject: :mod:`.versions` (which JAX, checked on import),
:mod:`.jaxprs` (jaxpr classes, bodies of higher-order primitives, canonical params),
:mod:`.source_info` (the user's lines), :mod:`.primitives` (defining our own),
:mod:`.tracers` (what the caller's trace is), :mod:`.collectives` (collectives and
kernels spelled differently per release) and :mod:`.meshes` (a model's own sharding
constraints and ``shard_map`` regions).
"""
from cptransform.ir.compat.versions import (  # checks the JAX version first
    ALLOW_UNTESTED_JAX, SUPPORTED_JAX, UnsupportedJaxError, check_jax_version,
    compiler_crash, jax_release, scan_compiler_crash)
from cptransform.ir.compat.jaxprs import (
    JAXPR_CLASSES_MERGED, Body, ClosedJaxpr, Jaxpr, JaxprTypeError, Literal, ShapedArray,
    aval_of, bind_eqn, bodies, call_body, check_jaxpr, close_jaxpr, cond_branches, consts_of,
    custom_jvp_rule,
    dce, eqn_subjaxprs, eval_jaxpr, is_jaxpr_like, is_literal, literal_value, name_stack,
    canonical_params, jax_function, open_jaxpr, scan_counts, stable_params, while_counts)
from cptransform.ir.compat.source_info import (
    eqn_context, inlining, source_line, source_lines)
from cptransform.ir.compat.primitives import (
    Primitive, define_primitive, define_transpose, define_wrapper, instantiate_zeros,
    register_pp_rule)
from cptransform.ir.compat.tracers import (
    concrete_primal, context_mesh, context_mesh_explicit_axes, context_mesh_is,
    differentiated, forward_differentiated, forward_over_reverse, mesh_context,
    no_mesh_context, typed_cotangent)
from cptransform.ir.compat.collectives import (
    cudnn_attention, cudnn_missing, ppermute)
from cptransform.ir.compat.meshes import (
    DEVICE_PUT, SHARD_MAP, SHARDING_CONSTRAINT, MeshAnnotation, constraint_annotation,
    device_put_annotations, runs_on_own_mesh,
    shard_map_annotation, shard_map_on)

__all__ = ['ALLOW_UNTESTED_JAX', 'Body', 'canonical_params', 'jax_function', 'stable_params', 'ClosedJaxpr', 'JAXPR_CLASSES_MERGED', 'Jaxpr', 'JaxprTypeError', 'Literal', 'Primitive', 'SUPPORTED_JAX', 'ShapedArray', 'UnsupportedJaxError', 'aval_of', 'bind_eqn', 'bodies', 'call_body', 'check_jax_version', 'check_jaxpr', 'close_jaxpr', 'compiler_crash', 'scan_compiler_crash', 'concrete_primal', 'cond_branches', 'consts_of', 'context_mesh', 'custom_jvp_rule', 'context_mesh_explicit_axes', 'context_mesh_is', 'cudnn_attention', 'cudnn_missing', 'dce', 'define_primitive', 'define_transpose', 'define_wrapper', 'differentiated', 'eqn_context', 'eqn_subjaxprs', 'eval_jaxpr', 'forward_differentiated', 'forward_over_reverse', 'inlining', 'instantiate_zeros', 'is_jaxpr_like', 'is_literal', 'jax_release', 'literal_value', 'name_stack', 'mesh_context', 'no_mesh_context', 'open_jaxpr', 'ppermute', 'register_pp_rule', 'scan_counts', 'source_line', 'source_lines', 'typed_cotangent', 'while_counts', 'SHARD_MAP', 'SHARDING_CONSTRAINT', 'MeshAnnotation', 'constraint_annotation', 'runs_on_own_mesh', 'shard_map_annotation', 'shard_map_on', 'DEVICE_PUT', 'device_put_annotations']
