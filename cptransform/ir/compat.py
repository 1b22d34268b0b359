"""Every use of JAX internals lives here.

JAX 0.10 returns ``ClosedJaxpr`` from ``make_jaxpr``; JAX 0.11 merged ``Jaxpr`` and
``ClosedJaxpr`` (the latter is an alias, and ``.jaxpr`` / ``.consts`` still answer). The rest
of cptransform talks to jaxprs only through the helpers below, so a JAX upgrade touches one
file. See ``docs/jax_versions.md`` for the measured differences.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

from jax.extend import core as jex_core
from jax.interpreters import ad, batching, mlir
from jax._src import core as _core
from jax._src import source_info_util as _source_info

Primitive = jex_core.Primitive
Literal = jex_core.Literal
Jaxpr = jex_core.Jaxpr
ClosedJaxpr = jex_core.ClosedJaxpr
ShapedArray = _core.ShapedArray
JaxprTypeError = jex_core.JaxprTypeError

#: True on JAX versions where ``ClosedJaxpr`` is an alias of ``Jaxpr``.
JAXPR_CLASSES_MERGED = ClosedJaxpr is Jaxpr


def open_jaxpr(closed: Any) -> Any:
    """The open jaxpr (the one holding ``eqns``) of a closed or open jaxpr."""
    inner = getattr(closed, "jaxpr", None)
    if inner is not None and inner is not closed and hasattr(inner, "eqns"):
        return inner
    return closed


def consts_of(closed: Any) -> list:
    """The constant values bound to a closed jaxpr's constvars (empty for an open one)."""
    return list(getattr(closed, "consts", ()) or ())


def close_jaxpr(jaxpr: Any, consts: list) -> Any:
    """A closed jaxpr from an open jaxpr and its constants, on either JAX version."""
    return ClosedJaxpr(jaxpr, list(consts))


def is_jaxpr_like(x: Any) -> bool:
    """Whether ``x`` is a jaxpr object (open or closed) found in equation params."""
    return isinstance(x, (Jaxpr, ClosedJaxpr))


def eqn_subjaxprs(eqn: Any) -> Iterator[tuple[str, Any]]:
    """Yield ``(param_name, jaxpr)`` for each jaxpr-valued param of ``eqn``.

    Reaches the bodies of pjit, closed_call, custom_jvp/custom_vjp, remat, scan, while and
    cond (whose ``branches`` param is a tuple of jaxprs). The yielded object is whatever the
    param holds (open or closed); use :func:`open_jaxpr` to get at its equations.
    """
    for name, value in eqn.params.items():
        if is_jaxpr_like(value):
            yield name, value
        elif isinstance(value, (tuple, list)):
            for item in value:
                if is_jaxpr_like(item):
                    yield name, item


def check_jaxpr(closed: Any) -> None:
    """Type-check a jaxpr; raises :class:`JaxprTypeError` when it is malformed."""
    _core.check_jaxpr(open_jaxpr(closed))


def eval_jaxpr(closed: Any, *args: Any) -> list:
    """Evaluate a closed jaxpr on ``args`` under the current trace.

    Goes through the public ``jaxpr_as_fun``, which binds the constants on both JAX 0.10
    (separate ``ClosedJaxpr``) and 0.11 (constants inside the merged ``Jaxpr``)."""
    return list(jex_core.jaxpr_as_fun(closed)(*args))


def is_literal(atom: Any) -> bool:
    """Whether an equation input is a literal constant rather than a variable."""
    return isinstance(atom, Literal)


def literal_value(atom: Any) -> Any:
    """The Python/NumPy value of a literal."""
    return atom.val


def aval_of(atom: Any) -> Any:
    """The abstract value (shape, dtype) of a variable or literal."""
    return atom.aval


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


def register_pp_rule(primitive: Primitive, rule: Callable[[dict], str]) -> None:
    """Print equations of ``primitive`` as ``outs = rule(params)[ins]``.

    ``rule`` receives the equation's params and returns the short head text, e.g.
    ``attention[causal gqa=4]``; operands are printed after it as usual.
    """

    def pp(eqn, context, settings):
        lhs = _core.pp_vars(eqn.outvars, context, print_shapes=settings.print_shapes)
        rhs = [_core.pp.text(rule(eqn.params)), _core.pp.text(" "),
               _core.pp_vars(eqn.invars, context)]
        return _core.pp.concat([lhs, _core.pp.text(" = "), _core.pp.concat(rhs)])

    _core.pp_eqn_rules[primitive] = pp


def define_primitive(
    name: str,
    *,
    multiple_results: bool,
    impl: Callable,
    abstract_eval: Callable,
    jvp: Callable,
    batch: Callable,
) -> Primitive:
    """Create a primitive whose evaluation and lowering are ``impl`` (plain JAX code).

    ``jvp(primals, tangents, **params)`` and ``batch(args, dims, **params)`` follow the
    signatures of ``jax.interpreters.ad.primitive_jvps`` and ``batching.primitive_batchers``.
    """
    prim = Primitive(name)
    prim.multiple_results = multiple_results
    prim.def_impl(impl)
    prim.def_abstract_eval(abstract_eval)
    ad.primitive_jvps[prim] = jvp
    batching.primitive_batchers[prim] = batch
    mlir.register_lowering(prim, mlir.lower_fun(impl, multiple_results=multiple_results))
    return prim


def define_transpose(prim: Primitive, rule: Callable) -> None:
    """Mark ``prim`` linear in its operands with transpose ``rule(cotangent, *operands,
    **params)`` returning one cotangent per operand (``ad.primitive_transposes``)."""
    ad.primitive_transposes[prim] = rule


instantiate_zeros = ad.instantiate_zeros


def bind_eqn(eqn: Any, invals: list, params: dict | None = None) -> list:
    """Re-emit ``eqn`` (optionally with new params) on ``invals`` under the current trace.

    Keeps the equation's user source location and context, so rewritten programs still
    point at the user's lines. Returns a list of outputs.
    """
    params = dict(eqn.params) if params is None else params
    bind_params = eqn.primitive.get_bind_params(params)
    subfuns: list = []
    if isinstance(bind_params, tuple):  # older JAX: (subfuns, params)
        subfuns, bind_params = bind_params
    with eqn_context(eqn):
        out = eqn.primitive.bind(*subfuns, *invals, **bind_params)
    return list(out) if eqn.primitive.multiple_results else [out]


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


def dce(closed: Any) -> Any:
    """Drop equations whose results are unused (effectful ones stay)."""
    from jax._src.interpreters import partial_eval as pe

    jaxpr = open_jaxpr(closed)
    new, used_inputs = pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars), instantiate=True)
    del used_inputs
    return close_jaxpr(new, consts_of(closed)) if closed is not jaxpr else new


def name_stack(eqn: Any) -> str:
    """The transformation/name stack an equation was traced under, e.g. ``transpose(jvp(f))``."""
    return str(getattr(eqn.source_info, "name_stack", "") or "")


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


def context_mesh_axes() -> tuple[str, ...]:
    """The axis names of the mesh a ``jax.set_mesh`` context holds (empty without one)."""
    from jax._src import mesh as _mesh
    return tuple(_mesh.get_abstract_mesh().axis_names)


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
