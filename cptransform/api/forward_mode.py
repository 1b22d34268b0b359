"""Forward-mode derivatives (``jax.jvp``, ``jax.linearize``, ``jax.jacfwd``) of a
transformed program.

The schedules define reverse mode only (each is a ``custom_vjp``), and JAX cannot push a
tangent through a ``custom_vjp``. A linear map has one derivative in both directions, so the
tangent of the whole program is the transpose of its VJP: :func:`with_forward_mode` gives
the program a ``custom_jvp`` whose tangent is a ``linear_call`` that computes
``transpose(vjp)(tangents)`` going forward and transposes back to the ``vjp`` itself —
reverse mode still runs each schedule's own backward, unchanged.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero, linear_call


def _differentiable(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _transposable(forward: Callable, vjp, primals) -> bool:
    """Whether ``forward`` (the transpose of the program's VJP) can be traced."""
    avals = [jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)) for x in primals]
    try:
        jax.make_jaxpr(lambda ts: forward(vjp, ts))(avals)
    except Exception:  # linear_transpose refuses a non-linear VJP with assorted errors
        return False
    return True


def with_forward_mode(call: Callable) -> Callable:
    """``call`` (a function of flat arrays returning a list of arrays) with a JVP rule built
    from its VJP; integer inputs and outputs have zero (``float0``) tangents."""

    @jax.custom_jvp
    def program(*flat):
        return call(*flat)

    def jvp(primals, tangents):
        out, vjp = jax.vjp(call, *primals)
        # Only perturbed inputs are linear operands: linear_call transposes all of them,
        # and an input grad does not differentiate (a zero) is known, not linear.
        ins = [i for i, (x, t) in enumerate(zip(primals, tangents))
               if _differentiable(x) and not isinstance(t, SymbolicZero)]
        outs = [j for j, y in enumerate(out) if _differentiable(y)]
        # A ShapeDtypeStruct per output: linear_transpose needs only their avals.
        out_avals = [jax.ShapeDtypeStruct(jnp.shape(out[j]), jnp.result_type(out[j]))
                     for j in outs]

        def backward(vjp, cts):
            full = [jnp.zeros(jnp.shape(y), jax.dtypes.float0) if not _differentiable(y)
                    else None for y in out]
            for j, ct in zip(outs, cts):
                full[j] = ct
            grads = vjp(type(out)(full) if isinstance(out, tuple) else full)
            return [grads[i] for i in ins]

        def forward(vjp, ts):
            transposed = jax.linear_transpose(lambda cts: backward(vjp, cts), out_avals)
            return transposed(ts)[0]

        if ins and not _transposable(forward, vjp, [primals[i] for i in ins]):
            # A VJP that linear_transpose cannot transpose (a user's custom_vjp whose backward
            # is not linear in the cotangent, such as clipping by its norm): differentiate
            # the program itself, as without this rule. Reverse mode is then exact as before;
            # forward mode stops at JAX's own custom_vjp error.
            return jax.jvp(call, primals, tuple(
                jnp.zeros(jnp.shape(x), jax.dtypes.float0) if not _differentiable(x)
                else jnp.zeros_like(x) if isinstance(t, SymbolicZero) else t
                for x, t in zip(primals, tangents)))
        t_out = linear_call(forward, backward, vjp, [tangents[i] for i in ins]) if ins \
            else [jnp.zeros_like(out[j]) for j in outs]
        full = [jnp.zeros(jnp.shape(y), jax.dtypes.float0) for y in out]
        for j, t in zip(outs, t_out):
            full[j] = t
        return out, type(out)(full) if isinstance(out, tuple) else full

    program.defjvp(jvp, symbolic_zeros=True)
    return program
