"""Merged sequence dims: tokens flattened with the batch, folded into features or cut into
chunks keep layout order through reshapes (:class:`~cptransform.passes.reorder_sequence.
states.Merged`); an op acting along such a dim gets natural order first."""
from __future__ import annotations

import numpy as np

from cptransform.ir import compat
from cptransform.analysis.dim_rules import digit_after_reshape, digit_stride, reshape_dim_map
from cptransform.analysis.primitives import Family, acting_dims, facts, seq_links
from cptransform.passes.reorder_sequence.states import (PERM, NAT, INV, Shift, Merged,
                                                        LINKED_FAMILIES, LINKED_INDEXING)


class MergedOrders:
    """The part of the reorderer that tracks :class:`Merged` values."""

    # -- merged sequence dims (tokens flattened, folded into features, cut into chunks) --
    def merged_state(self, var, st: Merged):
        """``st``, or ``PERM`` when it is the program's layout on a full sequence dim that
        the sequence analysis knows (so the usual rules apply): the layout itself, or the
        layout of its chunks of ``inner`` tokens with each chunk's tokens below (chunks
        put back together: the same order when the layout moves whole chunks)."""
        whole = st.layout == self.layout and st.inner == 1
        chunks = st.inner > 1 and self.layout.coarsen(st.inner) == st.layout \
            and st.layout.seq_len * st.inner == self.layout.seq_len
        if ((whole or chunks) and var.aval.shape[st.dim] == self.layout.seq_len
                and self.axes.full_dims(var) == (st.dim,)):
            return PERM
        return st

    def unmerge(self, value):
        """A merged value in natural order (memoized: several consumers share one
        conversion)."""
        st = self.get(value)
        key = ("natural", id(value))
        cached = self.state.get(key)
        if cached is not None and cached[0] is value:
            return cached[1]
        out = self.put(st.layout.unpermute(value, st.dim, st.inner), NAT)
        self.state[key] = (value, out)
        return out

    def align(self, value, dim: int, st: Merged):
        """``value`` (an operand linked to a merged dim through its ``dim``) in the order
        ``st`` describes: a natural operand (a weight over ``[S*D]``, an iota over
        ``[B*S]``) is permuted the same way."""
        have = self.get(value)
        if have == Merged(dim, st.inner, st.layout):
            return value
        if isinstance(have, Merged):
            value = self.unmerge(value)
        return self.put(st.layout.permute(value, dim, st.inner), Merged(dim, st.inner,
                                                                        st.layout))

    def reshape_permuted(self, eqn, invals):
        """A reshape of a layout-order value with one full sequence dim: the sequence digit
        keeps its flat stride, so it lands merged (rows, features) or chunked; ``None``
        when it does not sit in one dim or the layout does not move whole chunks."""
        atom, out = eqn.invars[0], eqn.outvars[0]
        full = self.axes.full_dims(atom)
        if len(full) != 1:
            kept = reshape_dim_map(atom.aval.shape, out.aval.shape)
            if all(kept.get(d) in self.axes.full_dims(out) for d in full):
                return self.equivariant(eqn, invals, [0], {PERM})
            return None
        return self.reshape_merged(eqn, invals, Merged(full[0], 1, self.layout))

    def reshape_merged(self, eqn, invals, st: Merged):
        atom, out = eqn.invars[0], eqn.outvars[0]
        stride = digit_stride(atom.aval.shape, st.dim, st.inner)
        place = digit_after_reshape(out.aval.shape, stride, st.layout.seq_len)
        if place is None:
            return None
        dim, inner, chunk = place
        layout = st.layout.coarsen(chunk)
        if layout is None:
            return None
        (y,) = compat.bind_eqn(eqn, invals)
        return [self.put(y, self.merged_state(out, Merged(dim, inner, layout)))]

    def merged(self, eqn, invals, merged):
        """Run ``eqn`` keeping merged operands merged, or ``None`` when it needs them in
        natural order. The dims linked to a merged dim (the primitives table's links) are
        its partners: operands there are aligned to it, results there are merged like it;
        acting along it is exact only for order-free reductions and for contractions
        (whose partner is aligned)."""
        name = eqn.primitive.name
        row = facts(name)
        states = [self.get(x) for x in invals]
        if any(st == PERM or isinstance(st, Shift) for st in states) or row is None:
            return None
        if name == "reshape":
            return self.reshape_merged(eqn, invals, states[0])
        if row.family not in LINKED_FAMILIES and name not in LINKED_INDEXING:
            return None
        acting = acting_dims(eqn)
        if acting is None:
            return None
        big = max(merged, key=lambda i: np.prod(invals[i].shape))
        st = states[big]
        size = eqn.invars[big].aval.shape[st.dim]
        component = self._linked(eqn, (eqn.invars[big], st.dim))
        if any((eqn.invars[i], states[i].dim) not in component for i in merged):
            return None
        order_free = row.family is Family.CONTRACTION or (
            row.family is Family.REDUCTION and row.order_safe)
        invals = list(invals)
        for i, atom in enumerate(eqn.invars):
            dims = [d for a, d in component if a is atom]
            if not dims:
                continue
            if len(dims) > 1 or atom.aval.shape[dims[0]] != size:
                return None
            if dims[0] in acting[i] and not order_free:
                return None
            invals[i] = self.align(invals[i], dims[0], st)
        outs = compat.bind_eqn(eqn, invals)
        result = []
        for out, var in zip(outs, eqn.outvars):
            dims = [d for a, d in component if a is var]
            if len(dims) > 1:
                return None
            result.append(self.put(out, self.merged_state(var, Merged(dims[0], st.inner,
                                                                      st.layout))
                                   if dims else INV))
        return result

    @staticmethod
    def _linked(eqn, start) -> set:
        """The ``(atom, dim)`` pairs of ``eqn`` linked to ``start`` through its links."""
        edges: dict = {}
        for a, da, b, db in seq_links(eqn):
            edges.setdefault((a, da), []).append((b, db))
            edges.setdefault((b, db), []).append((a, da))
        seen, todo = {start}, [start]
        while todo:
            for nxt in edges.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen
