"""Jaxprs as every supported JAX spells them: classes, bodies of higher-order primitives,
evaluation, re-binding, and the canonical form of equation params."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
from jax.extend import core as jex_core
from jax._src import core as _core

from cptransform.ir.compat.source_info import eqn_context
from cptransform.ir.compat.versions import UnsupportedJaxError, _jax_version

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


def custom_jvp_rule(eqn: Any) -> Any | None:
    """The jaxpr of a ``custom_jvp_call``'s derivative rule with every tangent nonzero
    (its inputs: the primals, then their tangents), or ``None`` when this release spells
    the rule otherwise. JAX 0.10 to 0.12 keep it as ``jvp_jaxpr_fun``, a function of one
    "tangent is zero" flag per non-constant operand returning ``(jaxpr, consts,
    out_zeros)``."""
    fun = eqn.params.get("jvp_jaxpr_fun")
    call = getattr(fun, "call_wrapped", None)
    if call is None:
        return None
    flags = [False] * (len(eqn.invars) - int(eqn.params.get("num_consts", 0)))
    try:
        jaxpr, consts, _ = call(*flags)
    except Exception:  # noqa: BLE001 - a release that calls it otherwise: no rule to read
        return None
    return jaxpr if not consts else close_jaxpr(open_jaxpr(jaxpr), list(consts))


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



def _canonical_value(value: Any) -> Any:
    """A param value with NumPy integer and bool scalars as Python ``int`` and ``bool``, in
    tuples (named tuples too, as a gather's dimension numbers) and lists at any depth; any
    other value as it is (the same object when nothing changes)."""
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, (tuple, list)) and not is_jaxpr_like(value):
        items = [_canonical_value(v) for v in value]
        if all(a is b for a, b in zip(items, value)):
            return value
        if hasattr(value, "_fields"):
            return type(value)(*items)
        return type(value)(items)
    return value


def canonical_params(closed: Any, _done: dict | None = None) -> Any:
    """``closed`` (an open or closed jaxpr) with every equation's params in one spelling
    whatever JAX traced it, in every body: NumPy integers (JAX 0.12.1 writes
    ``axes=(np.int64(4),)``) as Python ints. The same object when nothing changes, and a
    body shared by several equations stays shared."""
    done = {} if _done is None else _done
    if id(closed) in done:
        return done[id(closed)][1]
    jaxpr = open_jaxpr(closed)
    eqns, changed = [], False
    for eqn in jaxpr.eqns:
        params = {}
        for name, value in eqn.params.items():
            if is_jaxpr_like(value):
                params[name] = canonical_params(value, done)
            elif isinstance(value, tuple) and value and all(map(is_jaxpr_like, value)):
                params[name] = tuple(canonical_params(v, done) for v in value)
            else:
                params[name] = _canonical_value(value)
        if any(params[k] is not v for k, v in eqn.params.items()):
            eqn, changed = eqn.replace(params=params), True
        eqns.append(eqn)
    if not changed:
        out = closed
    elif closed is jaxpr:
        out = jaxpr.replace(eqns=eqns)
    else:
        out = close_jaxpr(jaxpr.replace(eqns=eqns), consts_of(closed))
    done[id(closed)] = (closed, out)
    return out


def jax_function(eqn: Any) -> str | None:
    """The name of the function of JAX's own library whose body a call-like equation holds
    (``_where``, ``tril``, ``_softmax``), read off the body's debug info; ``None`` for a
    body that is not JAX's (the user's ``jax.jit``, a Flax function) or has no such info."""
    import os

    import jax

    body = call_body(eqn)
    info = getattr(open_jaxpr(body), "debug_info", None) if body is not None else None
    where = getattr(info, "func_src_info", None) or ""
    name, _, path = where.partition(" at ")
    root = os.path.dirname(jax.__file__) + os.sep
    return name if path.startswith(root) else None


#: Params a release added to a primitive, with the value that means what earlier releases
#: did without them (0.10.2's ``top_k`` is stable, its ``random_bits`` draws one stream).
_ADDED_PARAMS = {("top_k", "is_stable"): True, ("random_bits", "num_streams"): 1}
#: Params that hold how a release stores a higher-order primitive's structure (a scan's
#: split of operands into consts, carry and scanned values) rather than what it computes.
_STRUCTURE_PARAMS = {"scan": ("ft_in", "ft_out", "num_consts", "num_carry", "linear",
                              "_split_transpose")}


def stable_params(eqn: Any) -> dict:
    """``eqn``'s params as every supported release would hold them, for printing and
    comparing programs: a param a later release added is absent where it has the value that
    means the earlier behaviour (:data:`_ADDED_PARAMS`); a scan's structure is
    ``num_consts`` and ``num_carry`` whatever the release stores; a PRNG implementation is
    its name (0.12 added fields to its record)."""
    name = eqn.primitive.name
    params = {k: v for k, v in eqn.params.items()
              if k not in _STRUCTURE_PARAMS.get(name, ())
              and not ((name, k) in _ADDED_PARAMS and v == _ADDED_PARAMS[(name, k)])}
    if name == "scan":
        params["num_consts"], params["num_carry"] = scan_counts(eqn)
    for key, value in params.items():
        if type(value).__name__ == "PRNGImpl":
            params[key] = f"PRNGImpl({value.name})"
    return params
