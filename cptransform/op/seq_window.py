"""``seq_window_p``: an op that reads a bounded window of neighbours along one dim.

A max/min/sum ``reduce_window`` or a ``conv_general_dilated`` whose window runs along one
dim of its first operand, with stride 1 there and an output as long as the input, computes
result ``t`` from the operand's entries ``t - left … t + right`` (``left``/``right`` its
low/high padding) and pads with ``fill`` past the ends. :class:`Window` records that op;
``seq_window_p`` binds it as one equation, so the sequence analyses see one row (the
windowed dim keeps its position) and the CP lowering can give it a halo exchange of
``left`` and ``right`` tokens instead of leaving it to XLA's SPMD partitioner.

``layout`` is the token order its first operand and result hold: ``None`` for natural
order, or a :class:`~cptransform.op.layouts.SequenceLayout` that ``reorder-sequence``
writes when the program runs in a load-balanced order (evaluated on one device, the op then
un-permutes, runs, and permutes back; the CP lowering exchanges each chunk's own
neighbours instead).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import jax

from cptransform.ir import compat
from cptransform.op.layouts import SequenceLayout


@dataclass(frozen=True)
class Window:
    """One windowed op along dim ``dim`` of its first operand (and of its result).

    ``primitive`` and ``params`` are the wrapped equation's (params as sorted pairs, so the
    record is hashable); re-binding them on a longer operand runs the same window there.
    ``kept`` are the dims of the first operand that are the same dims of the result (the
    windowed one included). ``fill`` is what the op pads with past the ends.
    """

    primitive: Any
    params: tuple
    dim: int
    left: int
    right: int
    fill: float
    kept: tuple[int, ...]
    layout: SequenceLayout | None = None

    def apply(self, x, *rest):
        """The wrapped op on ``x`` (natural order along ``dim``) and its other operands."""
        return self.primitive.bind(x, *rest, **dict(self.params))

    def in_layout(self, layout: SequenceLayout | None) -> "Window":
        """This window on operands held in ``layout``'s order (``None``: natural)."""
        return replace(self, layout=layout)

    def describe(self) -> str:
        order = "" if self.layout is None else f" {self.layout.name}"
        return (f"{self.primitive.name} dim={self.dim} halo=({self.left}, {self.right})"
                f"{order}")


def _impl(x, *rest, window: Window):
    if window.layout is None:
        return window.apply(x, *rest)
    natural = window.layout.unpermute(x, window.dim)
    return window.layout.permute(window.apply(natural, *rest), window.dim)


def _abstract_eval(*avals, window: Window):
    out = jax.eval_shape(lambda *xs: window.apply(*xs), *avals)
    return compat.ShapedArray(out.shape, out.dtype)


seq_window_p = compat.define_wrapper("seq_window", multiple_results=False, impl=_impl,
                                    abstract_eval=_abstract_eval)
compat.register_pp_rule(seq_window_p, lambda params: f"seq_window[{params['window'].describe()}]")
