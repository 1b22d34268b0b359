"""What the caller's trace is: autodiff tracers, the mesh context."""
from __future__ import annotations

import contextlib
from typing import Iterator

from jax._src import core as _core

@contextlib.contextmanager
def no_mesh_context() -> Iterator[None]:
    """No ``jax.set_mesh`` mesh in context: the transformed program carries its own CP mesh
    (Auto axes), and the sharding constraints it places would be read against a user's
    Explicit mesh, where they act as assertions. Outside ``jit`` both the concrete and the
    abstract mesh are cleared; inside it (``set_mesh`` is refused there) the abstract one."""
    import jax
    from jax._src import mesh as _mesh
    if _core.trace_state_clean():
        with jax.set_mesh(None):
            yield
    else:
        with jax.sharding.use_abstract_mesh(_mesh.empty_abstract_mesh):
            yield


def context_mesh():
    """The abstract mesh of the caller's ``jax.set_mesh`` / ``with mesh:`` context with
    every axis Auto, or ``None`` without one."""
    from jax._src import mesh as _mesh
    from jax.sharding import AxisType
    abstract = _mesh.get_abstract_mesh()
    if abstract.empty:
        return None
    return abstract.update_axis_types({a: AxisType.Auto for a in abstract.axis_names})


@contextlib.contextmanager
def mesh_context(abstract) -> Iterator[None]:
    """``abstract`` (from :func:`context_mesh`; ``None``: no mesh) as the mesh in context
    while a function is traced: a model's annotations written for the caller's ``with
    mesh:`` (Flax's logical constraints, a bare PartitionSpec) resolve against it."""
    import jax
    with contextlib.nullcontext() if abstract is None \
            else jax.sharding.use_abstract_mesh(abstract):
        yield


def context_mesh_explicit_axes() -> tuple[str, ...]:
    """The axes of the ``jax.set_mesh`` context's mesh that are not Auto (Explicit or
    Manual; empty without a context mesh)."""
    from jax._src import mesh as _mesh
    from jax.sharding import AxisType
    abstract = _mesh.get_abstract_mesh()
    types = getattr(abstract, "axis_types", None) or ()
    return tuple(name for name, kind in zip(abstract.axis_names, types)
                 if kind != AxisType.Auto)


def context_mesh_is(mesh) -> bool:
    """Whether the ``jax.set_mesh`` context's mesh has ``mesh``'s axis names and sizes
    (whatever either's axis types)."""
    from jax._src import mesh as _mesh
    abstract = _mesh.get_abstract_mesh()
    return tuple(abstract.axis_names) == tuple(mesh.axis_names) and \
        tuple(abstract.axis_sizes) == tuple(mesh.devices.shape)


def differentiated(values) -> bool:
    """Whether any of ``values`` is traced by JAX's autodiff (``jvp``, ``grad``,
    ``linearize``) rather than only staged (``jit``)."""
    from jax._src.interpreters import ad as _ad
    kinds = tuple(k for k in (getattr(_ad, "JVPTracer", None),
                              getattr(_ad, "LinearizeTracer", None)) if k is not None)
    return any(isinstance(v, kinds) for v in values)


def _tracer_levels(v):
    """The autodiff and batching tracers of ``v``, innermost transformation first (a
    ``grad`` inside a ``jax.jvp`` comes before the ``jvp``'s tracer)."""
    from jax._src.interpreters import batching as _batching
    while isinstance(v, _core.Tracer):
        yield v
        inner = getattr(v, "primal", None)
        if inner is None and isinstance(v, _batching.BatchTracer):
            inner = v.val
        if inner is None:
            return
        v = inner


def concrete_primal(v):
    """The concrete array under ``v``'s autodiff tracers (``grad`` / ``jvp`` of an eager
    call: its ``primal``), ``v`` itself when it is concrete, else ``None`` (staged by
    ``jit`` or batched: no concrete value, or not of ``v``'s shape)."""
    while isinstance(v, _core.Tracer):
        v = getattr(v, "primal", None)
        if v is None:
            return None
    return v


def forward_differentiated(values) -> bool:
    """Whether any of ``values`` carries a forward-mode tangent (``jax.jvp``,
    ``jax.jacfwd``, the outer derivative of ``jax.hessian``) at any level of its tracers;
    reverse mode (``grad``, ``vjp``) traces with ``LinearizeTracer``s instead."""
    from jax._src.interpreters import ad as _ad
    jvp = getattr(_ad, "JVPTracer", None)
    return jvp is not None and any(isinstance(t, jvp) for v in values
                                   for t in _tracer_levels(v))


def forward_over_reverse(values) -> bool:
    """Whether any of ``values`` is differentiated in reverse mode inside a forward-mode
    derivative (``jax.jvp`` of ``jax.grad``, ``jax.hessian``): a ``LinearizeTracer`` above
    a ``JVPTracer``."""
    from jax._src.interpreters import ad as _ad
    jvp, linearize = getattr(_ad, "JVPTracer", None), getattr(_ad, "LinearizeTracer", None)
    if jvp is None or linearize is None:
        return False
    for v in values:
        reverse = False
        for t in _tracer_levels(v):
            reverse = reverse or isinstance(t, linearize)
            if reverse and isinstance(t, jvp):
                return True
    return False



def typed_cotangent(x):
    """``x``, whose cotangent is resharded to ``x``'s own type in the ``jax.set_mesh``
    context (a ``custom_vjp`` identity; not for forward-mode tangents). JAX 0.10 and 0.11
    give the gradient of an input of ``jax.sharding.auto_axes`` under ``jit`` the Auto
    mesh's type, which the Explicit context then refuses to combine with its arrays."""
    import jax
    return _typed_cotangent(x, jax.typeof(x).sharding.spec)


def _typed_cotangent_rule():
    import functools

    import jax

    @functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
    def identity(x, spec):
        return x

    def forward(x, spec):
        return x, None

    def backward(spec, _, cotangent):
        return (jax.sharding.reshard(cotangent, spec),)

    identity.defvjp(forward, backward)
    return identity


_typed_cotangent = _typed_cotangent_rule()
