"""``canonicalize``: inline calls, fold scalar scales, drop no-ops, place static scatters.

Later passes (the attention matcher above all) look for patterns; this pass removes the
spelling differences that would hide them:

* **Inlining.** ``jit``/``pjit`` and ``closed_call``/``core_call`` bodies are evaluated in
  place (options ``inline_jit``, ``inline_calls``), so a ``jnp.where`` or ``jnp.tril``
  wrapped in its own ``jit`` sits in the same jaxpr as its neighbours. A ``cond`` whose
  branch index is a constant is the branch it takes (option ``fold_conds``: gemma picks
  its key positions with ``lax.cond`` on static lengths). ``remat``, ``scan``, ``while``,
  other conds and ``custom_jvp``/``custom_vjp`` stay (they carry meaning: memory
  policy, loops, control flow, custom derivatives); their bodies are canonicalized inside.
* **JAX's own derivative helpers.** ``jax.nn.softmax`` and ``jax.nn.logsumexp`` are
  ``custom_jvp`` functions on some releases (0.12.1; 0.10.2 with ``jax_softmax_custom_jvp``)
  and plain operations on others. Their rules (:data:`JAX_DERIVATIVE_HELPERS`) state the
  derivative of the body with its stabilising maximum held constant, so each is inlined
  with that maximum under ``stop_gradient``: the program is the one 0.10.2 traces, the
  derivative the rule's (up to rounding), and the softmax is visible to the matcher. Other
  ``custom_jvp``/``custom_vjp`` rules (``jax.nn.relu``'s, the user's) stay.
* **Array iteration** (option ``drop_noops``). ``a, b = x`` is an ``unstack`` on JAX 0.11
  and later and a ``slice`` + ``squeeze`` per item on 0.10.2; ``unstack`` is written as the
  latter (so is ``jnp.unstack``), the same program on every release.
* **Scale folding** (option ``fold_scales``). A chain of multiplications and divisions of
  one floating value by scalar constants (literals or 0-d constants, including constant
  expressions such as ``sqrt(64.0)``) becomes a single multiply by the combined factor;
  a lone division by a constant becomes a multiply by its reciprocal. With ``p`` the
  number of constants that are powers of two and ``n`` the others:

  - ``"exact"``: fold only when no rounding changes: every divisor is a power of two and
    at most one multiplier is not (multiplying by ``2**k`` is exact), so the result is
    bit-identical barring overflow/underflow of an intermediate;
  - ``"ulp"`` (default): also fold when exactly one *divisor* is not a power of two and no
    multiplier is: ``x / c`` becomes ``x * (1/c)``, which is within 1 ulp of ``x / c``;
  - ``"off"``: leave multiplies and divides alone.

  Chains with more non-power-of-two constants are left as they are.
* **No-ops.** ``convert_element_type`` to the same dtype and weak type, ``reshape`` and
  ``broadcast_in_dim`` to the same shape, identity ``transpose``, ``squeeze`` of nothing,
  ``copy``/``copy_p``, a transpose of a transpose (composed into one, dropped when it
  is the identity), multiplication by 1 and addition/subtraction of 0 (``x + 0.0`` turns
  ``-0.0`` into ``+0.0``; dropping it keeps ``-0.0``, the only observable difference).
  Option ``drop_noops``.
* **Static scatters** (option ``static_scatters``). A ``scatter`` that sets one window at
  constant indices (``x.at[:, 0].set(t)``, ``x.at[:, 1:].set(y[:, :-1])``: the decoder-input
  shifts of encoder-decoders) and a ``dynamic_update_slice`` at constant starts become
  ``select(window, pad(update), operand)``, the window a predicate of iotas. Pads and
  selects are ops every later pass knows along the sequence (reorder-sequence moves pads,
  and rewrites the iotas), and XLA's SPMD partitioner partitions them correctly, where it
  partitions chained sequence-sharded scatters wrongly (docs/spmd_partitioner_bugs.md).
  A window that is not wholly inside the operand (a scatter would drop or clamp it) and a
  scatter at data-dependent indices are left as they are.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from cptransform.analysis.primitives import INLINABLE, CallKind, calls
from cptransform.ir import compat
from cptransform.ir.module import Module, iter_eqns
from cptransform.ir.pipeline import Pass, PassResult, PipelineError
from cptransform.ir.rewrite import Rewriter, interpret

FOLD_MODES = ("off", "exact", "ulp")
#: JAX's own ``custom_jvp`` functions (by the name :func:`compat.jax_function` reads) whose
#: rule is the derivative of their body with the maximum subtracted for stability held
#: constant: inlined, the maximum under ``stop_gradient`` where the body does not already
#: stop it (logsumexp's does, softmax's does not).
JAX_DERIVATIVE_HELPERS = frozenset({"_softmax", "_logsumexp_impl"})
JIT_PRIMITIVES = calls(CallKind.JIT)
CALL_PRIMITIVES = calls(CallKind.CALL)
# (kept operand, constant operand) pairs for binary ops
EITHER_SIDE = ((0, 1), (1, 0))
RIGHT_SIDE = ((0, 1),)
# Concatenates of known values up to this size are remembered (scatter index vectors).
MAX_INDEX_SIZE = 64


def _is_concrete(value: Any) -> bool:
    """A value known while tracing (a literal or a constant), not a traced variable."""
    return not isinstance(value, jax.core.Tracer)


def _concrete_scalar(value: Any) -> np.ndarray | None:
    """``value`` as a 0-d NumPy array when it is a concrete scalar, else ``None``."""
    if not _is_concrete(value):
        return None
    array = np.asarray(value)
    return array if array.shape == () else None


def _same_type(value: Any, outvar: Any) -> bool:
    """Whether ``value`` can stand for ``outvar``: same shape, dtype and weak type."""
    have, want = jax.typeof(value), compat.aval_of(outvar)
    return (have.shape == want.shape and have.dtype == want.dtype
            and bool(getattr(have, "weak_type", False)) == bool(getattr(want, "weak_type", False)))


def _is_power_of_two(c: np.ndarray) -> bool:
    if not np.isfinite(c) or c == 0:
        return False
    mantissa, _ = np.frexp(np.float64(c))
    return abs(mantissa) == 0.5


@dataclass
class _Chain:
    """``value == base * prod(mults) / prod(divs)``, every factor a scalar of base's dtype."""

    value: Any
    base: Any
    mults: tuple
    divs: tuple


class _Canonicalizer:
    """The equation rules of one canonicalize run (it remembers scale chains by value)."""

    def __init__(self, p: "Canonicalize"):
        self.p = p
        #: The walk the rules run in (set once it exists): a folded cond's branch is
        #: evaluated by it, so its equations are canonicalized too.
        self.rewriter: Rewriter | None = None
        self.chains: dict[int, _Chain] = {}
        # id(value) -> (value, base, perm) for values that are a transpose of ``base``
        self.transposes: dict[int, tuple] = {}
        # id(value) -> (value, contents thunk) for traced values whose contents are known
        # (the index operands of ``x.at[:, 0]`` are broadcasts of constant scalars)
        self.known: dict[int, tuple] = {}

    def rules(self) -> dict:
        rules: dict = {}
        if self.p.drop_noops:
            rules.update({
                "convert_element_type": self.convert_element_type,
                "reshape": self.same_shape,
                "broadcast_in_dim": self.same_shape,
                "transpose": self.transpose,
                "squeeze": self.squeeze,
                "copy": self.copy,
                "copy_p": self.copy,
                "add": self.add,
                "sub": self.sub,
                "sqrt": self.constant_unary(np.sqrt),
                "neg": self.constant_unary(np.negative),
                "unstack": self.unstack,
            })
        rules["custom_jvp_call"] = self.jax_derivative_helper
        rules["mul"] = self.mul
        rules["div"] = self.div
        if self.p.fold_conds:
            rules["cond"] = self.cond
        if self.p.static_scatters:
            rules["broadcast_in_dim"] = self.broadcast_in_dim
            rules["concatenate"] = self.concatenate
            rules["scatter"] = self.scatter
            rules["dynamic_update_slice"] = self.dynamic_update_slice
        return rules

    # -- no-ops and constant scalars -------------------------------------------------------

    def cond(self, eqn, invals):
        """The branch a constant index takes, evaluated in place (XLA runs the last
        branch for an index out of range)."""
        index = _concrete_scalar(invals[0])
        if index is None:
            return None
        branches = compat.cond_branches(eqn)
        taken = branches[int(index) if 0 <= int(index) < len(branches) else -1]
        with compat.inlining(eqn):
            return self.rewriter.eval(compat.open_jaxpr(taken), compat.consts_of(taken),
                                      invals[1:])

    def jax_derivative_helper(self, eqn, invals):
        """JAX's softmax or logsumexp, inlined with its stabilising maximum held constant
        (see :data:`JAX_DERIVATIVE_HELPERS`); any other ``custom_jvp_call`` stays."""
        if compat.jax_function(eqn) not in JAX_DERIVATIVE_HELPERS:
            return None
        body = compat.call_body(eqn)
        jaxpr = compat.open_jaxpr(body)
        shifts = _stability_shifts(jaxpr)
        subtracted = {e.invars[1] for e in jaxpr.eqns if e.primitive.name == "sub"
                      and not compat.is_literal(e.invars[1]) and e.invars[1] in shifts}
        stopped: dict = {}  # a subtracted maximum -> its value under stop_gradient

        def step(inner, read):
            values = [read(a) for a in inner.invars]
            if inner.primitive.name == "sub" and inner.invars[1] in stopped:
                values[1] = stopped[inner.invars[1]]
            outs = self.rewriter.eval_eqn(inner, values)
            # Stopped where it is defined, as JAX 0.10.2's softmax traces it.
            for var, out in zip(inner.outvars, outs):
                if var in subtracted:
                    stopped[var] = lax.stop_gradient(out)
            return outs

        with compat.inlining(eqn):
            return interpret(jaxpr, compat.consts_of(body), invals, step)

    def constant_unary(self, fn):
        def rule(eqn, invals):
            c = _concrete_scalar(invals[0])
            if c is None:
                return None
            dtype = compat.aval_of(eqn.outvars[0]).dtype
            return [np.asarray(fn(c.astype(dtype)), dtype=dtype)]
        return rule

    def convert_element_type(self, eqn, invals):
        c = _concrete_scalar(invals[0])
        if c is not None and eqn.params.get("sharding") is None:
            return [np.asarray(c, dtype=eqn.params["new_dtype"])]
        if eqn.params.get("sharding") is None and _same_type(invals[0], eqn.outvars[0]):
            return [invals[0]]
        return None

    def same_shape(self, eqn, invals):
        if eqn.params.get("sharding") is not None or eqn.params.get("dimensions") is not None:
            return None
        if len(invals) == 1 and _same_type(invals[0], eqn.outvars[0]):
            return [invals[0]]
        return None

    def broadcast_in_dim(self, eqn, invals):
        same = self.same_shape(eqn, invals) if self.p.drop_noops else None
        if same is not None:
            return same
        c = _concrete_scalar(invals[0])
        if c is None or len(invals) != 1:
            return None
        out = compat.bind_eqn(eqn, invals)[0]
        self.known[id(out)] = (out, lambda: np.full(jax.typeof(out).shape, c))
        return [out]

    def concatenate(self, eqn, invals):
        parts = [self._static(v) for v in invals]
        if any(p is None for p in parts) or sum(p.size for p in parts) > MAX_INDEX_SIZE:
            return None
        out = compat.bind_eqn(eqn, invals)[0]
        whole = np.concatenate(parts, axis=eqn.params["dimension"])
        self.known[id(out)] = (out, lambda: whole)
        return [out]

    def _static(self, value: Any) -> np.ndarray | None:
        """The contents of ``value`` when known while tracing (a constant, a broadcast of
        a constant scalar, a concatenate of those), else ``None``."""
        if _is_concrete(value):
            return np.asarray(value)
        known = self.known.get(id(value))
        if known is None or known[0] is not value:
            return None
        return known[1]()

    def scatter(self, eqn, invals):
        operand, indices, update = invals
        dnums = eqn.params["dimension_numbers"]
        index = self._static(indices)
        if (index is None or dnums.operand_batching_dims or dnums.scatter_indices_batching_dims
                or index.size != len(dnums.scatter_dims_to_operand_dims)
                or tuple(dnums.update_window_dims) != tuple(range(jnp.ndim(update)))):
            return None
        # One window: the update's dims are the operand's, less the inserted ones.
        update = lax.expand_dims(update, tuple(dnums.inserted_window_dims))
        starts = [0] * jnp.ndim(operand)
        for d, i in zip(dnums.scatter_dims_to_operand_dims, index.reshape(-1)):
            starts[d] = int(i)
        return _placed(operand, update, starts)

    def dynamic_update_slice(self, eqn, invals):
        operand, update, *start_values = invals
        starts = [self._static(v) for v in start_values]
        if any(s is None for s in starts):
            return None
        # XLA clamps the starts so that the update fits.
        return _placed(operand, update, [min(max(int(s), 0), n - u) for s, n, u in
                                         zip(starts, jnp.shape(operand), jnp.shape(update))])

    def transpose(self, eqn, invals):
        x = invals[0]
        perm = tuple(int(d) for d in eqn.params["permutation"])
        prev = self.transposes.get(id(x))
        if prev is not None and prev[0] is x:
            x, first = prev[1], prev[2]
            perm = tuple(first[d] for d in perm)
        if perm == tuple(range(len(perm))):
            return [x]
        out = lax.transpose(x, perm) if x is not invals[0] else compat.bind_eqn(eqn, invals)[0]
        self.transposes[id(out)] = (out, x, perm)
        return [out]

    def unstack(self, eqn, invals):
        """Each item as JAX 0.10.2 iterates an array: a unit slice, then a squeeze."""
        x, axis = invals[0], int(eqn.params["axis"])
        shape = jnp.shape(x)
        ones = (1,) * len(shape)
        return [lax.squeeze(lax.slice(x, tuple(i if d == axis else 0 for d in range(len(shape))),
                                      tuple(i + 1 if d == axis else n
                                            for d, n in enumerate(shape)), ones), (axis,))
                for i in range(shape[axis])]

    def squeeze(self, eqn, invals):
        return [invals[0]] if not tuple(eqn.params["dimensions"]) else None

    def copy(self, eqn, invals):
        return [invals[0]] if _same_type(invals[0], eqn.outvars[0]) else None

    def _simplify(self, eqn, invals, fn, unit, sides):
        """Fold an op on two constant scalars, or drop ``x op unit`` (unit on ``sides``)."""
        if not self.p.drop_noops:
            return None
        a, b = (_concrete_scalar(v) for v in invals)
        if a is not None and b is not None:
            dtype = compat.aval_of(eqn.outvars[0]).dtype
            with np.errstate(all="ignore"):
                return [np.asarray(fn(a.astype(dtype), b.astype(dtype)), dtype=dtype)]
        for keep, const in sides:
            c = _concrete_scalar(invals[const])
            if c is not None and c == unit and _same_type(invals[keep], eqn.outvars[0]):
                return [invals[keep]]
        return None

    def add(self, eqn, invals):
        return self._simplify(eqn, invals, np.add, 0, EITHER_SIDE)

    def sub(self, eqn, invals):
        return self._simplify(eqn, invals, np.subtract, 0, RIGHT_SIDE)

    # -- scale chains ----------------------------------------------------------------------

    def mul(self, eqn, invals):
        simpler = self._simplify(eqn, invals, np.multiply, 1, EITHER_SIDE)
        if simpler is not None:
            return simpler
        for keep, const in EITHER_SIDE:
            c = _concrete_scalar(invals[const])
            if c is not None and not _is_concrete(invals[keep]):
                return self._scale(eqn, invals, invals[keep], c, divide=False)
        return None

    def div(self, eqn, invals):
        simpler = self._simplify(eqn, invals, np.divide, 1, RIGHT_SIDE)
        if simpler is not None:
            return simpler
        c = _concrete_scalar(invals[1])
        if c is None or _is_concrete(invals[0]):
            return None
        return self._scale(eqn, invals, invals[0], c, divide=True)

    def _scale(self, eqn, invals, x, c, *, divide: bool):
        """Emit ``x * c`` or ``x / c``, folded into the chain that produced ``x`` if allowed."""
        out_aval = compat.aval_of(eqn.outvars[0])
        dtype = out_aval.dtype
        if (self.p.fold_scales == "off" or not np.issubdtype(dtype, np.inexact)
                or jax.typeof(x).shape != out_aval.shape or jax.typeof(x).dtype != dtype):
            return None
        c = c.astype(dtype)
        if not np.isfinite(c) or c == 0:
            return None
        prev = self.chains.get(id(x))
        if prev is not None and prev.value is not x:
            prev = None
        base, mults, divs = (prev.base, prev.mults, prev.divs) if prev else (x, (), ())
        mults, divs = (mults, divs + (c,)) if divide else (mults + (c,), divs)
        factor = self._factor(mults, divs, dtype)
        if factor is None:
            out = compat.bind_eqn(eqn, invals)[0]
            self.chains[id(out)] = _Chain(out, x, () if divide else (c,), (c,) if divide else ())
            return [out]
        if factor == 1 and _same_type(base, eqn.outvars[0]):
            return [base]
        if len(mults) == 1 and not divs and prev is None:
            out = compat.bind_eqn(eqn, invals)[0]
        else:
            out = lax.mul(base, factor)
        self.chains[id(out)] = _Chain(out, base, mults, divs)
        return [out]

    def _factor(self, mults: tuple, divs: tuple, dtype) -> np.ndarray | None:
        """The single factor for ``prod(mults) / prod(divs)`` allowed by ``fold_scales``."""
        odd_mults = [m for m in mults if not _is_power_of_two(m)]
        odd_divs = [d for d in divs if not _is_power_of_two(d)]
        if odd_divs and (self.p.fold_scales != "ulp" or len(odd_divs) > 1 or odd_mults):
            return None
        if len(odd_mults) > 1:
            return None
        with np.errstate(all="ignore"):
            if odd_divs:
                factor = np.divide(np.ones((), dtype), odd_divs[0]).astype(dtype)
            else:
                factor = odd_mults[0] if odd_mults else np.ones((), dtype)
            for m in mults:
                if _is_power_of_two(m):
                    factor = np.multiply(factor, m).astype(dtype)
            for d in divs:
                if _is_power_of_two(d):
                    factor = np.divide(factor, d).astype(dtype)
        if not np.isfinite(factor) or abs(factor) < np.finfo(dtype).tiny:
            return None
        return np.asarray(factor, dtype=dtype)


def _stability_shifts(jaxpr: Any) -> set:
    """The variables of ``jaxpr`` that are its maximum along an axis, as subtracted for a
    stable ``exp``, and not yet under ``stop_gradient``: a ``reduce_max``'s result and what
    ``max`` with a constant, a ``select_n`` (logsumexp's finite-or-zero), a broadcast, a
    reshape, a transpose or a cast makes of it."""
    passing = {"max", "select_n", "broadcast_in_dim", "reshape", "transpose",
               "convert_element_type"}
    shifts: set = set()
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "reduce_max" or (name in passing and any(
                not compat.is_literal(a) and a in shifts for a in eqn.invars)):
            shifts.update(eqn.outvars)
    return shifts


def _placed(operand: Any, update: Any, starts: list[int]) -> list | None:
    """``operand`` with ``update`` written at ``starts`` as ``select(window, pad(update),
    operand)``; ``None`` when the window is not wholly inside ``operand``."""
    shape, sizes = jnp.shape(operand), jnp.shape(update)
    if (jax.typeof(update).dtype != jax.typeof(operand).dtype
            or any(s < 0 or s + u > n for s, u, n in zip(starts, sizes, shape))):
        return None
    partial = [d for d, (u, n) in enumerate(zip(sizes, shape)) if u != n]
    if not partial:
        return [update]
    config = [(s, n - s - u, 0) for s, u, n in zip(starts, sizes, shape)]
    padded = lax.pad(update, np.zeros((), jax.typeof(update).dtype), config)
    inside = None
    for d in partial:
        at = lax.broadcasted_iota(np.int32, shape, d)
        here = (at >= starts[d]) & (at < starts[d] + sizes[d])
        inside = here if inside is None else inside & here
    return [lax.select(inside, padded, operand)]


@dataclass(frozen=True)
class Canonicalize(Pass):
    """Inline calls, fold scalar scale chains into one multiply, drop no-ops, write
    static-index scatters and dynamic-update-slices as pad + select."""

    name = "canonicalize"
    summary = ("inline jit/closed_call bodies, fold scalar multiplies/divides, drop no-ops, "
               "write static scatters as pad + select, take the branch of a constant cond")

    inline_jit: bool = True
    inline_calls: bool = True
    fold_scales: str = "ulp"
    drop_noops: bool = True
    static_scatters: bool = True
    fold_conds: bool = True

    def __post_init__(self):
        if self.fold_scales not in FOLD_MODES:
            raise PipelineError(f"pass canonicalize: option fold_scales must be one of "
                                f"{', '.join(FOLD_MODES)}, got {self.fold_scales!r}")

    def _inlines(self, eqn: Any) -> bool:
        name = eqn.primitive.name
        return (self.inline_jit and name in JIT_PRIMITIVES) or \
            (self.inline_calls and name in CALL_PRIMITIVES)

    def run(self, module: Module) -> PassResult:
        canonicalizer = _Canonicalizer(self)
        rewriter = Rewriter(rules=canonicalizer.rules(), inline=self._inlines,
                            inlinable=INLINABLE)
        canonicalizer.rewriter = rewriter
        new = rewriter.run(module.jaxpr)
        before = sum(1 for _ in iter_eqns(module.jaxpr))
        after = sum(1 for _ in iter_eqns(new))
        if after == before and str(new) == str(module.jaxpr):
            return PassResult(module, False)
        return PassResult(module.with_jaxpr(new), True,
                          (f"canonicalize: {before} -> {after} equations",))

    def verify(self, module: Module) -> None:
        banned = (JIT_PRIMITIVES if self.inline_jit else frozenset()) | \
            (CALL_PRIMITIVES if self.inline_calls else frozenset())
        left = sorted({e.primitive.name for e in iter_eqns(module.jaxpr)
                       if e.primitive.name in banned})
        assert not left, f"call-like equations remain after inlining: {', '.join(left)}"
