"""``recurrence_p``: one recurrence along a dim, as one equation.

A recurrence runs along one dim of its operands (its *axis*): step ``t`` depends on step
``t - 1``. Three kinds are recognised by ``match-recurrences`` (:class:`Kind`):

* ``prefix``: a scan with an associative combine, ``y[t] = y[t-1] ⊕ x[t]`` (``cumsum``,
  ``cumprod``, ``cummax``, ``cummin``, ``cumlogsumexp``, ``lax.associative_scan``);
* ``affine``: a ``lax.scan`` whose carry is affine in itself, ``h' = A(x_t)·h + b(x_t)``
  (Mamba, gated linear attention, RG-LRU, DeltaNet written as scans), whatever its
  per-step outputs;
* ``carried``: any other ``lax.scan`` with a carry (a GRU, an LSTM).

:class:`Recurrence` records the wrapped op (re-bound as it was on one device), which
operands and results run along the axis, and what the CP passes decide: the token order
its operands hold (``layout``, written by ``reorder-sequence``) and how it runs across
devices (``method``, written by ``plan-context-parallel``; :class:`Method`). Evaluated on
one device it is the wrapped op, exactly (in natural order: a layout-order operand is
un-permuted first and the results permuted back).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from cptransform.ir import compat
from cptransform.ir.rewrite import interpret
from cptransform.ir.spelled_enum import SpelledEnum
from cptransform.op.layouts import SequenceLayout


class Kind(SpelledEnum):
    """What a recurrence's step is (see the module doc)."""

    PREFIX = "prefix"
    AFFINE = "affine"
    CARRIED = "carried"


class Method(SpelledEnum):
    """How a recurrence along the sharded sequence runs across devices.

    * ``prefix of totals``: each device scans its chunks, the chunk totals are exchanged,
      an exclusive prefix over the chunks in natural order is combined into each chunk;
    * ``state passing``: each chunk's summary (its composed affine map) is exchanged and
      composed in chunk order; each chunk re-runs its scan from its true incoming state;
    * ``pipeline``: device ``i`` waits for device ``i-1``'s final carry (no speed-up,
      memory ∝ S/cp);
    * ``gather``: the whole sequence on every device (XLA's partitioning of the op).
    """

    PREFIX_OF_TOTALS = "prefix of totals"
    STATE_PASSING = "state passing"
    PIPELINE = "pipeline"
    GATHER = "gather"


@dataclass(frozen=True, eq=False)
class Combine:
    """An associative combine of ``leaves`` arrays, position by position along ``axis``.

    ``jaxpr`` (closed; inputs ``a`` leaves then ``b`` leaves, ``leaves`` results) is the
    combine as ``lax.associative_scan`` traced it once; ``resize`` lists where its
    equations' params hold the length along the axis, ``(equation index, param name,
    positions in that param)``, so it runs on operands of any length (each level of the
    scan, a device's chunk, one offset row). Compared by identity."""

    jaxpr: Any
    leaves: int
    axis: int
    resize: tuple = ()

    def __call__(self, a, b):
        n = a[0].shape[self.axis]
        jaxpr = compat.open_jaxpr(self.jaxpr)
        fixes: dict[int, list] = {}
        for index, name, positions in self.resize:
            fixes.setdefault(index, []).append((name, positions))
        index_of = {id(e): i for i, e in enumerate(jaxpr.eqns)}

        def step(eqn, read):
            params = dict(eqn.params)
            for name, positions in fixes.get(index_of[id(eqn)], ()):
                params[name] = tuple(n if i in positions else size
                                     for i, size in enumerate(params[name]))
            return compat.bind_eqn(eqn, [read(x) for x in eqn.invars], params)

        return interpret(jaxpr, compat.consts_of(self.jaxpr), list(a) + list(b), step)


#: The cumulative primitives: their combine and the identity element of each.
CUMULATIVE = {"cumsum": (lax.add, lambda dt: 0),
              "cumprod": (lax.mul, lambda dt: 1),
              "cummax": (lax.max, lambda dt: -jnp.inf if jnp.issubdtype(dt, jnp.inexact)
                         else jnp.iinfo(dt).min),
              "cummin": (lax.min, lambda dt: jnp.inf if jnp.issubdtype(dt, jnp.inexact)
                         else jnp.iinfo(dt).max),
              "cumlogsumexp": (jnp.logaddexp, lambda dt: -jnp.inf)}


@dataclass(frozen=True)
class CarryMap:
    """The linear part of an affine carry leaf's step, ``h ↦ A(x_t)·h``, by dims.

    ``depends``: the step reads the carry at all (False: ``h' = b(x_t)``); ``mixed``: the
    dims along which ``A`` mixes entries (a matrix state's, as DeltaNet's ``S(I - β k kᵀ)``
    mixes its key dim); ``free``: the dims along which ``A`` is one map for every index (no
    coefficient varies along them: DeltaNet's value dim); the others are *batch* dims, along
    which ``A`` is diagonal and varies. A chunk's composed map is then an array over the
    carry's non-free dims and a second copy of its mixed dims."""

    depends: bool = True
    mixed: tuple[int, ...] = ()
    free: tuple[int, ...] = ()

    def describe(self) -> str:
        if not self.depends:
            return "no carry read"
        if not self.mixed:
            return "diagonal"
        return f"matrix over dims {list(self.mixed)}"


@dataclass(frozen=True)
class Loop:
    """A ``lax.scan``'s structure: its body (closed jaxpr over consts, carry and one
    step's slices), how many consts and carries, and how it iterates."""

    body: Any
    consts: int
    carries: int
    reverse: bool
    unroll: Any = 1

    def step(self, consts, carry, xs):
        """One iteration: ``(carry', ys)``."""
        outs = compat.eval_jaxpr(self.body, *consts, *carry, *xs)
        return outs[:self.carries], outs[self.carries:]

    def run(self, consts, init, xs, length: int | None = None):
        """The scan over ``xs`` (their leading dims) from ``init``: ``(carry, ys)``."""
        carry, ys = lax.scan(lambda c, x: tuple(map(tuple, self.step(consts, c, x))),
                             tuple(init), tuple(xs), length=length, reverse=self.reverse,
                             unroll=self.unroll)
        return list(carry), list(ys)


@dataclass(frozen=True)
class Recurrence:
    """One recurrence (see the module doc).

    ``primitive``/``params``: the wrapped op re-bound on one device (``None`` for an
    associative scan, which is ``lax.associative_scan(combine, ...)``); ``axis``: the dim
    of every iterated operand and result the steps run along; ``iterated`` /
    ``iterated_out``: which operands and results run along it (a scan's ``xs`` and ``ys``;
    not its consts, initial carry or final carry); ``combine``: a prefix recurrence's
    combine; ``loop``/``carries``: a scan's structure and, when affine, each carry leaf's
    :class:`CarryMap`; ``why``: for a carried scan, why its carry is not affine;
    ``layout``/``method``: written by the CP passes.
    """

    kind: Kind
    primitive: Any
    params: tuple
    axis: int
    iterated: tuple[bool, ...]
    iterated_out: tuple[bool, ...]
    reverse: bool = False
    combine: Any = None
    loop: Loop | None = None
    carries: tuple[CarryMap, ...] = ()
    why: str = ""
    layout: SequenceLayout | None = None
    method: Method | None = None
    name: str = field(default="", compare=False)

    def apply(self, *operands) -> list:
        """The wrapped op on natural-order operands."""
        if self.primitive is None:
            return list(lax.associative_scan(self.combine, tuple(operands),
                                             reverse=self.reverse, axis=self.axis))
        out = self.primitive.bind(*operands, **dict(self.params))
        return list(out) if self.primitive.multiple_results else [out]

    def in_layout(self, layout: SequenceLayout | None) -> "Recurrence":
        """This recurrence on operands held in ``layout``'s order (``None``: natural)."""
        return replace(self, layout=layout)

    def with_method(self, method: Method | None) -> "Recurrence":
        return replace(self, method=method)

    def describe(self) -> str:
        what = self.name or (self.primitive.name if self.primitive is not None
                             else "associative_scan")
        text = f"{what} {self.kind} axis={self.axis}"
        if self.reverse:
            text += " reverse"
        if self.carries:
            text += " carry " + ", ".join(c.describe() for c in self.carries)
        if self.layout is not None and self.layout.name != "contiguous":
            text += f" {self.layout.name}"
        if self.method is not None:
            text += f" method={self.method}"
        return text


def _impl(*operands, recurrence: Recurrence):
    layout = recurrence.layout
    if layout is None:
        return recurrence.apply(*operands)
    natural = [layout.unpermute(x, recurrence.axis) if it else x
               for x, it in zip(operands, recurrence.iterated)]
    outs = recurrence.apply(*natural)
    return [layout.permute(y, recurrence.axis) if it else y
            for y, it in zip(outs, recurrence.iterated_out)]


def _abstract_eval(*avals, recurrence: Recurrence):
    outs = jax.eval_shape(lambda *xs: recurrence.apply(*xs), *avals)
    return [compat.ShapedArray(o.shape, o.dtype) for o in outs]


recurrence_p = compat.define_wrapper("recurrence", multiple_results=True, impl=_impl,
                                    abstract_eval=_abstract_eval)
compat.register_pp_rule(recurrence_p,
                        lambda params: f"recurrence[{params['recurrence'].describe()}]")
