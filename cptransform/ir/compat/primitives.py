"""Defining cptransform's own primitives (evaluation, autodiff, batching, printing)."""
from __future__ import annotations

from typing import Callable

import jax
from jax.extend import core as jex_core
from jax.interpreters import ad, batching, mlir
from jax._src import core as _core

Primitive = jex_core.Primitive

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


def define_wrapper(name: str, *, multiple_results: bool, impl: Callable,
                   abstract_eval: Callable) -> Primitive:
    """A primitive that wraps plain JAX code ``impl(*operands, **params)``: evaluated,
    lowered, differentiated and batched as ``impl``. Its JVP keeps the primitive for the
    primal (so the equation stays visible to later passes) and differentiates ``impl`` for
    the tangent; its batching rule vmaps ``impl``."""
    def jvp(primals, tangents, **params):
        out = prim.bind(*primals, **params)
        tans = [instantiate_zeros(t) for t in tangents]
        _, t_out = jax.jvp(lambda *xs: impl(*xs, **params), list(primals), tans)
        return out, t_out

    def batch(args, dims, **params):
        out = jax.vmap(lambda *xs: impl(*xs, **params), in_axes=tuple(dims))(*args)
        return out, ([0] * len(out) if multiple_results else 0)

    prim = define_primitive(name, multiple_results=multiple_results, impl=impl,
                            abstract_eval=abstract_eval, jvp=jvp, batch=batch)
    return prim


def define_transpose(prim: Primitive, rule: Callable) -> None:
    """Mark ``prim`` linear in its operands with transpose ``rule(cotangent, *operands,
    **params)`` returning one cotangent per operand (``ad.primitive_transposes``)."""
    ad.primitive_transposes[prim] = rule


instantiate_zeros = ad.instantiate_zeros

