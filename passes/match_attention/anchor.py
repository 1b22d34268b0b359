"""The softmax core every attention spelling shares: ``exp(x - c)``, its row sum, and the
check that a divisor is that row sum."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np

from cptransform.analysis.primitives import Moves, moving
from cptransform.ir import compat
from cptransform.ir.graph import Graph
from cptransform.ir.patterns import Pat, look_through, one_of
from cptransform.passes.match_attention.stats import NotAttention
from cptransform.passes.match_attention.walk import WRAPPERS, follow_back

_PERMUTES = moving(Moves.PERMUTE)
_ROW_MAX = one_of(
    Pat("max", (Pat.scalar(where=lambda v: v == -np.inf), Pat("reduce_max", name="row_max")),
        commutative=True),
    Pat("reduce_max", name="row_max"))
#: ``where(isfinite(m), m, 0)``: logsumexp's row max, with all-``-inf`` rows shifted by 0.
_GUARDED_MAX = Pat(
    "select_n", (Pat("is_finite", (Pat.any("guarded"),)),
                 Pat.scalar(where=lambda v: v == 0).through(WRAPPERS),
                 _ROW_MAX.through(WRAPPERS | _PERMUTES)),
    name="guard", where=lambda g, a, caps: g.producer(a).invars[2] is caps["guarded"])
#: ``exp(x - c)`` with ``c`` a (stop-gradient, broadcast, guarded) row max, or ``exp(x)``.
SOFTMAX_EXP = one_of(
    Pat("exp", (Pat("sub", (Pat.any("logits"), one_of(_ROW_MAX, _GUARDED_MAX)
                            .through(WRAPPERS | _PERMUTES))),), name="exp"),
    Pat("exp", (Pat.any("logits"),), name="exp"))


@dataclass(frozen=True)
class Split:
    """Part ``index`` of softmax-input dim ``dim`` split into dims of ``sizes`` (some may
    be size-1 dims added next to it)."""

    dim: int
    index: int
    sizes: tuple


@dataclass(frozen=True)
class Softmax:
    """A matched softmax core: ``e = exp(logits - c)`` summed over ``axis`` into ``sum``.

    ``e`` is the value summed (the exponentials, possibly cast).
    """

    exp_eqn: Any
    logits: Any
    e: Any
    axis: int
    sum: Any
    sum_eqn: Any


def softmaxes(graph: Graph) -> Iterator[Softmax]:
    """Every softmax core of ``graph`` (its equations, not its sub-jaxprs'), in program
    order; a row sum that is no softmax core is skipped (:class:`Matcher` reports those)."""
    for eqn in graph.jaxpr.eqns:
        if eqn.primitive.name != "reduce_sum":
            continue
        try:
            yield find_softmax(graph, eqn)
        except NotAttention:
            continue


def find_softmax(graph: Graph, sum_eqn: Any) -> Softmax:
    """The softmax core whose row sum is ``sum_eqn`` (a ``reduce_sum``), or NotAttention."""
    axes = tuple(int(a) for a in sum_eqn.params["axes"])
    if len(axes) != 1:
        raise NotAttention("sum over several axes")
    e = look_through(graph, sum_eqn.invars[0], moving(Moves.CAST))
    caps = SOFTMAX_EXP.match(graph, e)
    if caps is None:
        raise NotAttention("not a sum of exponentials")
    x = caps["logits"]
    if "row_max" in caps and not _row_constant(graph, graph.producer(caps["exp.eqn"].invars[0]),
                                               caps, axes[0]):
        raise NotAttention("the subtracted row maximum is not constant along the softmax "
                           "axis")
    while (shifted := _SHIFTED.match(graph, x)) is not None and \
            _row_constant(graph, graph.producer(x), shifted, axes[0]):
        # Logits already shifted by their row maximum (ejkernel's sinks path subtracts it
        # before jax.nn.softmax): a row constant, so the softmax of the unshifted logits.
        x = shifted["logits"]
    return Softmax(caps["exp.eqn"], x, e, axes[0], sum_eqn.outvars[0], sum_eqn)


#: ``x - c`` with ``c`` a (stop-gradient, broadcast, guarded) row max.
_SHIFTED = Pat("sub", (Pat.any("logits"), one_of(_ROW_MAX, _GUARDED_MAX)
                       .through(WRAPPERS | _PERMUTES)))


def _row_constant(graph: Graph, sub: Any, caps: dict, axis: int) -> bool:
    """Whether the row maximum ``sub`` subtracts (captured in ``caps``) is constant along
    the softmax ``axis``: any such stabiliser leaves the softmax unchanged."""
    nd = len(compat.aval_of(sub.outvars[0]).shape)
    through = WRAPPERS | _PERMUTES | {"max"}
    dims = tuple(range(nd))
    if "guard" in caps:
        # The guard is elementwise: its operand has the dims of its result.
        dims = follow_back(graph, sub.invars[1], dims, caps["guard"], through)
        src = caps["guarded"]
    else:
        src = sub.invars[1]
    if dims is not None:
        dims = follow_back(graph, src, dims, caps["row_max"], through)
    return dims is not None and axis not in dims


def exponentials(graph: Graph, sum_eqn: Any) -> Any | None:
    """The ``exp`` equation whose result ``sum_eqn`` sums (through casts), or None."""
    eqn = graph.producer(look_through(graph, sum_eqn.invars[0], moving(Moves.CAST)))
    return eqn if eqn is not None and eqn.primitive.name == "exp" else None


def is_normalizer(graph: Graph, atom: Any, softmax: Softmax, dims: tuple) -> bool:
    """Whether ``atom`` is the row sum broadcast back onto values labelled ``dims``."""
    nd = len(compat.aval_of(softmax.e).shape)
    want = tuple(d for d in range(nd) if d != softmax.axis)
    got = follow_back(graph, atom, dims, softmax.sum)
    if got is None or len(got) != len(want):
        return False
    sum_shape = compat.aval_of(softmax.sum).shape
    return all(a == b or (a is None and n == 1) for a, b, n in zip(got, want, sum_shape))
