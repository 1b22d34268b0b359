"""Every use of JAX internals lives here.

JAX 0.10 returns ``ClosedJaxpr`` from ``make_jaxpr``; JAX 0.11 merged ``Jaxpr`` and
``ClosedJaxpr`` (the latter is an alias, and ``.jaxpr`` / ``.consts`` still answer). The rest
of cptransform talks to jaxprs only through the helpers below, so a JAX upgrade touches one
file. See ``docs/jax_versions.md`` for the measured differences.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import jax

from cptransform.ir.errors import KernelError

#: The JAX releases cptransform is tested on: at least the first, below the second (the first
#: untested minor release). ``pyproject.toml`` states the same bound for pip.
SUPPORTED_JAX = ((0, 10, 2), (0, 13))
#: Set to ``1`` to run on a JAX outside :data:`SUPPORTED_JAX` anyway (a warning, not an error).
ALLOW_UNTESTED_JAX = "CPTRANSFORM_ALLOW_UNTESTED_JAX"


class UnsupportedJaxError(ImportError):
    """The installed JAX is outside the tested range, or spells an internal differently
    from every tested release."""


def _jax_version() -> str:
    return jax.__version__


def _release(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split(".")[:3]:
        digits = "".join(c for c in piece if c.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def jax_release() -> tuple[int, ...]:
    """The installed JAX's release as numbers, ``(0, 12, 0)`` for ``0.12.0.1``."""
    return _release(_jax_version())


def compiler_crash(schedule: str) -> str | None:
    """Why this JAX's XLA crashes the process (not an error: a segfault) compiling a program
    that runs ``schedule``, or ``None``. The planner leaves such a schedule out under
    ``auto`` and refuses it when asked for, with this text.

    JAX 0.11.x: XLA segfaults in the SPMD partitioner's conditional-canonicalizer pass when
    compiling the gradient with respect to K/V of a ``context_parallel`` program whose
    attention runs the halo schedule (``examples/gemma.py``, ``examples/gpt_oss.py``;
    measured on the CPU backend of 0.11.2; the forward compiles; 0.10.2 and 0.12.0.1
    compile and match one device)."""
    if schedule == "halo" and jax_release()[:2] == (0, 11):
        return (f"JAX {_jax_version()}'s XLA crashes (a segfault in the SPMD partitioner) "
                "compiling the halo schedule's K/V gradient; use schedule='ring' (auto "
                "does), or JAX 0.10.2 or 0.12")
    return None


def check_jax_version(version: str | None = None) -> None:
    """Refuse a JAX outside :data:`SUPPORTED_JAX` with one error naming the range and the fix
    (a warning instead where ``CPTRANSFORM_ALLOW_UNTESTED_JAX=1``)."""
    import os
    import warnings

    version = version or _jax_version()
    low, high = SUPPORTED_JAX
    if low <= _release(version) < high:
        return
    text = (f"cptransform supports JAX >= {'.'.join(map(str, low))}, < "
            f"{'.'.join(map(str, high))}; this is JAX {version}. Install a supported one "
            f"(pip install 'jax>={'.'.join(map(str, low))},<{'.'.join(map(str, high))}'), or "
            f"set {ALLOW_UNTESTED_JAX}=1 to try this one untested.")
    if os.environ.get(ALLOW_UNTESTED_JAX) == "1":
        warnings.warn(text, stacklevel=2)
        return
    raise UnsupportedJaxError(text)


check_jax_version()

from jax.extend import core as jex_core  # noqa: E402
from jax.interpreters import ad, batching, mlir  # noqa: E402
from jax._src import core as _core  # noqa: E402
from jax._src import source_info_util as _source_info  # noqa: E402

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


@dataclass(frozen=True)
class Body:
    """One body of a control-flow or call equation and how the equation feeds it.

    ``jaxpr`` is the open body; ``inputs[i]`` is the outer operand that body input ``i``
    equals on every iteration or call (``None`` for a loop carry or a scanned slice);
    ``carry_in`` / ``carry_out`` are the body's carried inputs and results, index for index
    (empty for a call); ``scanned_in`` / ``scanned_out`` pair outer operands and results
    with the body's per-iteration slices (a scan's ``xs`` and ``ys``, whose leading dim is
    the iteration); ``outputs`` pairs outer results with body results of the same shape.
    """

    jaxpr: Any
    inputs: tuple
    carry_in: tuple = ()
    carry_out: tuple = ()
    carry_init: tuple = ()
    scanned_in: tuple = ()
    scanned_out: tuple = ()
    outputs: tuple = ()


def call_body(eqn: Any) -> Any:
    """The body a call-like equation runs once on its operands (pjit's ``jaxpr``,
    closed_call's / custom_jvp_call's ``call_jaxpr``, custom_vjp_call's ``fun_jaxpr`` or
    ``call_jaxpr``), or ``None``."""
    for name in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        body = eqn.params.get(name)
        if body is not None and is_jaxpr_like(body):
            return body
    return None


def scan_counts(eqn: Any) -> tuple[int, int]:
    """``(num_consts, num_carry)`` of a ``scan`` equation.

    JAX 0.10 has them as params; 0.12 replaced them with flat-tree params ``ft_in`` /
    ``ft_out`` (``ft_in`` unpacks to the consts, carry and xs trees)."""
    params = eqn.params
    if "num_consts" in params:
        return int(params["num_consts"]), int(params["num_carry"])
    ft_in = params.get("ft_in")
    if ft_in is None or not hasattr(ft_in, "unpack"):
        raise UnsupportedJaxError(
            f"this JAX ({_jax_version()}) spells a scan's params as {sorted(params)}: "
            "neither num_consts/num_carry nor ft_in")
    consts, carry, xs = ft_in.unpack()
    if len(consts) + len(carry) + len(xs) != len(eqn.invars):
        raise UnsupportedJaxError(
            f"this JAX ({_jax_version()}) gives a scan's ft_in {len(consts)}+{len(carry)}+"
            f"{len(xs)} leaves for {len(eqn.invars)} operands")
    return len(consts), len(carry)


def while_counts(eqn: Any) -> tuple[int, int]:
    """``(cond_nconsts, body_nconsts)`` of a ``while`` equation."""
    return int(eqn.params["cond_nconsts"]), int(eqn.params["body_nconsts"])


def cond_branches(eqn: Any) -> tuple:
    """The branches (closed jaxprs) of a ``cond`` equation; operand 0 is the index."""
    return tuple(eqn.params["branches"])


def bodies(eqn: Any) -> list[Body]:
    """Each body of ``eqn`` with how its inputs and outputs relate to the equation's (see
    :class:`Body`): scan, while and cond by their params; any other equation holding a
    jaxpr whose inputs match its operands one for one (jit, calls, remat, custom
    derivatives' primal bodies) as a call. Empty for an equation without a body."""
    name = eqn.primitive.name
    ins, outs = list(eqn.invars), list(eqn.outvars)
    if name == "scan":
        body = open_jaxpr(eqn.params["jaxpr"])
        nc, nk = scan_counts(eqn)
        bin_, bout = list(body.invars), list(body.outvars)
        return [Body(body, tuple(ins[:nc]) + (None,) * (len(bin_) - nc),
                     carry_in=tuple(bin_[nc:nc + nk]), carry_out=tuple(bout[:nk]),
                     carry_init=tuple(ins[nc:nc + nk]),
                     scanned_in=tuple(zip(ins[nc + nk:], bin_[nc + nk:])),
                     scanned_out=tuple(zip(outs[nk:], bout[nk:])),
                     outputs=tuple(zip(outs[:nk], bout[:nk])))]
    if name == "while":
        cn, bn = while_counts(eqn)
        cond = open_jaxpr(eqn.params["cond_jaxpr"])
        body = open_jaxpr(eqn.params["body_jaxpr"])
        carry = tuple(ins[cn + bn:])
        return [Body(cond, tuple(ins[:cn]) + (None,) * (len(cond.invars) - cn),
                     carry_in=tuple(cond.invars[cn:]), carry_init=carry),
                Body(body, tuple(ins[cn:cn + bn]) + (None,) * (len(body.invars) - bn),
                     carry_in=tuple(body.invars[bn:]), carry_out=tuple(body.outvars),
                     carry_init=carry, outputs=tuple(zip(outs, body.outvars)))]
    if name == "cond":
        return [Body(open_jaxpr(b), tuple(ins[1:]),
                     outputs=tuple(zip(outs, open_jaxpr(b).outvars)))
                for b in cond_branches(eqn)]
    found = []
    for _, sub in eqn_subjaxprs(eqn):
        body = open_jaxpr(sub)
        if len(body.invars) == len(ins) and len(body.outvars) >= len(outs):
            found.append(Body(body, tuple(ins), outputs=tuple(zip(outs, body.outvars))))
    return found


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


def context_mesh_explicit_axes() -> tuple[str, ...]:
    """The axes of the ``jax.set_mesh`` context's mesh that are not Auto (Explicit or
    Manual; empty without a context mesh)."""
    from jax._src import mesh as _mesh
    from jax.sharding import AxisType
    abstract = _mesh.get_abstract_mesh()
    types = getattr(abstract, "axis_types", None) or ()
    return tuple(name for name, kind in zip(abstract.axis_names, types)
                 if kind != AxisType.Auto)


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


def ppermute(x: Any, axes: tuple[str, ...], perm: list[tuple[int, int]]) -> Any:
    """``lax.ppermute`` of ``x`` over the mesh axes ``axes`` (major first), with ``perm``'s
    ranks numbered in ``axes``' order, as ``lax.axis_index(axes)`` numbers them.

    JAX 0.10 numbers a multi-axis ``ppermute`` in the mesh's axis order whatever order the
    axes are named in; JAX 0.11 and 0.12 refuse axes named out of mesh order. Both read the
    same program when the axes are passed in mesh order and the ranks renumbered to it."""
    from jax import lax

    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    mesh_order = tuple(a for a in _core_mesh_axis_names() if a in axes)
    if len(axes) <= 1 or mesh_order == axes or len(mesh_order) != len(axes):
        return lax.ppermute(x, axes, perm)
    sizes = {a: lax.axis_size(a) for a in axes}

    def renumbered(rank: int) -> int:
        coords = {}
        for a in reversed(axes):
            coords[a], rank = rank % sizes[a], rank // sizes[a]
        index = 0
        for a in mesh_order:
            index = index * sizes[a] + coords[a]
        return index

    return lax.ppermute(x, mesh_order, [(renumbered(s), renumbered(d)) for s, d in perm])


def _core_mesh_axis_names() -> tuple[str, ...]:
    """The axis names, in mesh order, of the mesh a ``shard_map`` body runs under."""
    from jax._src import mesh as _mesh
    return tuple(_mesh.get_abstract_mesh().axis_names)


def cudnn_missing() -> str | None:
    """Why this JAX cannot serve :func:`cudnn_attention` (and the fix); ``None`` if it can."""
    fa = None
    with contextlib.suppress(ImportError):
        from jax._src.cudnn import fused_attention_stablehlo as fa
    gone = ", ".join(n for n in ("dot_product_attention", "MaskType", "AttentionLayout",
                                 "_dot_product_attention_bwd_p_wrapper") if not hasattr(fa, n))
    return gone and (f"kernel 'cudnn' needs {gone} of jax._src.cudnn.fused_attention_stablehlo"
                     f", absent from JAX {_jax_version()}: use kernel='pallas'/'xla'") or None


def cudnn_attention(*args, backward: bool = False, scale: float, causal: bool, window=None):
    """cuDNN attention (JAX's private module) of ``[B, T, H, D]`` 16-bit operands, unmasked or
    causal top-left (query ``i`` sees keys ``i - window < j <= i``): ``(q, k, v) -> (o, lse f32
    [B, H, T])``, never differentiated; ``backward``: ``(q, k, v, o, lse, do) -> (dq, dk, dv)``
    fed the rows' merged ``o``/``lse`` (``rowsum(dO∘O)`` inside)."""
    if cudnn_missing():
        raise KernelError(cudnn_missing())
    from jax._src.cudnn import fused_attention_stablehlo as fa
    mask = fa.MaskType.CAUSAL if causal else fa.MaskType.NO_MASK
    if not backward:
        return tuple(fa.dot_product_attention(*args, scale=scale, mask_type=mask,
                                              sliding_window_length=window, return_residual=True))
    extra = {"score_mod": None} if jax_release() >= (0, 12) else {}  # 0.12: flex attention
    unused = jax.numpy.zeros((0,), args[0].dtype)  # bias, seqlens, offsets, page tables
    return tuple(fa._dot_product_attention_bwd_p_wrapper.bind(
        *args[:3], *[unused] * 7, args[4], args[3], args[5], scale=scale, seed=42,
        dropout_rate=0.0, variadic_args=(False, False), mask_type=mask,
        layout=fa.AttentionLayout.BTNH.value, sliding_window_length=window, **extra))
