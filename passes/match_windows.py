"""Pass ``match-windows``: wrap each op that reads a bounded window along one dim as
``seq_window_p``.

A max/min/sum ``reduce_window`` (``lax.reduce_window`` with ``lax.max``/``lax.min``/
``lax.add`` and their identity, max- and average-pooling) or a one-spatial-dim
``conv_general_dilated`` (a depthwise causal conv, ``feature_group_count = D``, as in Mamba,
Hyena and RWKV) becomes one :data:`~cptransform.op.seq_window.seq_window_p` equation
carrying a :class:`~cptransform.op.seq_window.Window` when its window runs along exactly
one dim with stride 1 and no base (lhs) dilation, and its output is as long as its input
there (the padding covers the window: ``low + high = dilation·(width - 1)``), and a token
shift spelled as a pad and a slice that keep the length becomes one of a length-keeping
``pad`` (its window: the shift, on one side). Whether that
dim is the sequence is decided later, by ``infer-seq-axes``; the CP lowering gives a
sequence-sharded window a halo exchange. Other windowed ops stay as they are, and the CP
lowering refuses them when they read a sharded sequence.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np
from jax import lax

from cptransform.analysis.primitives import INLINABLE
from cptransform.ir import compat
from cptransform.ir.module import Module, iter_eqns
from cptransform.ir.pipeline import Pass, PassResult
from cptransform.ir.rewrite import Rewriter
from cptransform.op.seq_window import Window, seq_window_p

#: What each reduce_window pads with: its reduction's identity.
REDUCE_WINDOW_FILLS = {
    "reduce_window_max": lambda dt: -np.inf if np.issubdtype(dt, np.inexact) else np.iinfo(dt).min,
    "reduce_window_min": lambda dt: np.inf if np.issubdtype(dt, np.inexact) else np.iinfo(dt).max,
    "reduce_window_sum": lambda dt: 0,
}


def _one_window(dims: list[int], width: int, stride: int, dilation: int,
                padding: tuple[int, int], base_dilation: int = 1) -> tuple[int, int] | None:
    """``(left, right)`` of a window along one dim that keeps the length, or None."""
    if len(dims) != 1 or stride != 1 or base_dilation != 1:
        return None
    lo, hi = padding
    if lo < 0 or hi < 0 or lo + hi != dilation * (width - 1):
        return None
    return lo, hi


def reduce_window_window(eqn) -> Window | None:
    """The :class:`Window` of a max/min/sum ``reduce_window`` equation, or None."""
    p = eqn.params
    aval = eqn.invars[0].aval
    if not np.issubdtype(aval.dtype, np.number):
        return None
    moved = [d for d in range(aval.ndim)
             if (p["window_dimensions"][d], p["window_strides"][d], tuple(p["padding"][d]),
                 p["base_dilation"][d], p["window_dilation"][d]) != (1, 1, (0, 0), 1, 1)]
    if not moved:
        # A window of one: it reads nothing across, so any dim stands for its window.
        moved = [0]
    if len(moved) != 1:
        return None
    (d,) = moved
    sides = _one_window(moved, p["window_dimensions"][d], p["window_strides"][d],
                        p["window_dilation"][d], tuple(p["padding"][d]), p["base_dilation"][d])
    if sides is None:
        return None
    fill = REDUCE_WINDOW_FILLS[eqn.primitive.name](aval.dtype)
    return Window(eqn.primitive, tuple(sorted(p.items())), d, *sides, fill,
                  tuple(range(aval.ndim)))


def conv_window(eqn) -> Window | None:
    """The :class:`Window` of a one-spatial-dim ``conv_general_dilated``, or None."""
    p = eqn.params
    dn = p["dimension_numbers"]
    lhs, rhs = eqn.invars[0].aval, eqn.invars[1].aval
    if lhs.ndim != 3 or p["batch_group_count"] != 1:
        return None
    d, out_d = dn.lhs_spec[2], dn.out_spec[2]
    if d != out_d or dn.lhs_spec[0] != dn.out_spec[0]:
        return None
    sides = _one_window([d], rhs.shape[dn.rhs_spec[2]], p["window_strides"][0],
                        p["rhs_dilation"][0], tuple(p["padding"][0]), p["lhs_dilation"][0])
    if sides is None:
        return None
    return Window(eqn.primitive, tuple(sorted(p.items())), d, *sides, 0,
                  tuple(sorted((dn.lhs_spec[0], d))))


#: primitive name -> how to read its window.
WINDOW_READERS = {**{name: reduce_window_window for name in REDUCE_WINDOW_FILLS},
                  "conv_general_dilated": conv_window}


def _wrap(read):
    def rule(eqn, invals):
        window = read(eqn)
        if window is None:
            return None
        with compat.eqn_context(eqn):
            return [seq_window_p.bind(*invals, window=window)]
    return rule


def _one_dim(shape, los, his) -> int | None:
    """The one dim where a pad or slice changes anything, or None."""
    moved = [d for d in range(len(shape)) if (los[d], his[d]) != (0, 0)]
    return moved[0] if len(moved) == 1 else None


class _Shifts:
    """Token shifts spelled as a pad and a slice along one dim that keep its length
    (``jnp.pad(x, ((0,0),(k,0),(0,0)))[:, :-k]``, ``jnp.pad(x[:, :-k], …)``): one
    ``seq_window_p`` of a length-keeping ``pad`` (a negative side crops). Pads and slices
    are remembered by value within one walk (the canonicalize habit)."""

    def __init__(self):
        self.pads: dict[int, tuple] = {}    # id(out) -> (out, x, fill, dim, lo, hi)
        self.slices: dict[int, tuple] = {}  # id(out) -> (out, x, dim, cut_lo, cut_hi)

    def rules(self) -> dict:
        return {"pad": self.pad, "slice": self.slice}

    @staticmethod
    def _fill(value):
        if isinstance(value, jax.core.Tracer):
            return None
        array = np.asarray(value)
        return array.item() if array.shape == () else None

    def pad(self, eqn, invals):
        x, value = invals
        config = eqn.params["padding_config"]
        shape = eqn.invars[0].aval.shape
        los, his = [c[0] for c in config], [c[1] for c in config]
        d = _one_dim(shape, los, his)
        fill = self._fill(value)
        if d is None or any(c[2] for c in config) or fill is None or min(los[d], his[d]) < 0:
            return None
        sliced = self.slices.get(id(x))
        if sliced is not None and sliced[0] is x and sliced[2] == d:
            _, source, _, cut_lo, cut_hi = sliced
            # A slice then a pad: only a cut on the side that is not padded comes back as
            # the same tokens.
            if (cut_lo == 0 or los[d] == 0) and (cut_hi == 0 or his[d] == 0):
                out = _shift(source, fill, d, los[d] - cut_lo, his[d] - cut_hi, eqn)
                if out is not None:
                    return [out]
        (out,) = compat.bind_eqn(eqn, invals)
        self.pads[id(out)] = (out, x, fill, d, los[d], his[d])
        return [out]

    def slice(self, eqn, invals):
        (x,) = invals
        shape = eqn.invars[0].aval.shape
        if any(s != 1 for s in (eqn.params.get("strides") or ())):
            return None
        start, limit = eqn.params["start_indices"], eqn.params["limit_indices"]
        cut_lo = list(start)
        cut_hi = [n - b for n, b in zip(shape, limit)]
        d = _one_dim(shape, cut_lo, cut_hi)
        if d is None:
            return None
        padded = self.pads.get(id(x))
        if padded is not None and padded[0] is x and padded[3] == d:
            _, source, fill, _, lo, hi = padded
            out = _shift(source, fill, d, lo - cut_lo[d], hi - cut_hi[d], eqn)
            if out is not None:
                return [out]
        (out,) = compat.bind_eqn(eqn, invals)
        self.slices[id(out)] = (out, x, d, cut_lo[d], cut_hi[d])
        return [out]


def _shift(x, fill, d: int, lo: int, hi: int, eqn):
    """``x`` shifted by ``lo`` along ``d`` (``lo + hi == 0``) as one ``seq_window_p``."""
    if lo + hi != 0 or lo == 0:
        return None
    config = tuple((lo, hi, 0) if i == d else (0, 0, 0) for i in range(x.ndim))
    window = Window(lax.pad_p, (("padding_config", config),), d, max(lo, 0), max(-lo, 0),
                    fill, tuple(range(x.ndim)))
    with compat.eqn_context(eqn):
        return seq_window_p.bind(x, np.asarray(fill, x.dtype), window=window)


@dataclass(frozen=True)
class MatchWindows(Pass):
    """Wrap windowed reductions and convolutions along one dim as ``seq_window_p``."""

    name = "match-windows"
    summary = "reduce_window / 1-D conv along one dim -> seq_window_p (halo-exchanged under CP)"

    def run(self, module: Module) -> PassResult:
        names = set(WINDOW_READERS) | {"pad"}
        if not any(e.primitive.name in names for e in iter_eqns(module.jaxpr)):
            return PassResult(module, False)
        rules = {name: _wrap(read) for name, read in WINDOW_READERS.items()}
        rules.update(_Shifts().rules())
        new = Rewriter(rules=rules, inlinable=INLINABLE).run(module.jaxpr)
        n = sum(1 for e in iter_eqns(new) if e.primitive is seq_window_p)
        return PassResult(module.with_jaxpr(new), n > 0,
                          (f"match-windows: {n} windowed ops wrapped",))
