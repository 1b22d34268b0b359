"""Slices along the sequence held unsliced: next-token losses slice logits and labels by
one; token-wise ops and reductions run on the full array in layout order (:class:`~cptransform.
passes.reorder_sequence.states.Shift`) instead of un-permuting the logits."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from cptransform.ir import compat
from cptransform.analysis.dim_rules import reshape_dim_map
from cptransform.analysis.primitives import acting_dims, facts
from cptransform.ir.errors import ReorderError
from cptransform.passes.reorder_sequence.states import PERM, NAT, INV, SHIFTABLE, Shift


class ShiftedSlices:
    """The part of the reorderer that tracks :class:`Shift` values."""

    def slice_positions(self, eqn, invals):
        """A slice along the one full sequence dim of a layout-order value, taken by
        gathering exactly its tokens (their bytes, not the whole value's); the result is in
        natural order."""
        x, atom = invals[0], eqn.invars[0]
        full = self.axes.full_dims(atom)
        acting = acting_dims(eqn)[0]
        if self.get(x) != PERM or len(full) != 1 or full[0] not in acting:
            return None
        (d,) = full
        strides = eqn.params.get("strides") or (1,) * atom.aval.ndim
        start, limit = list(eqn.params["start_indices"]), list(eqn.params["limit_indices"])
        positions = jnp.arange(start[d], limit[d], strides[d], dtype=jnp.int32)
        start[d], limit[d] = 0, atom.aval.shape[d]
        params = {**eqn.params, "start_indices": tuple(start), "limit_indices": tuple(limit),
                  "strides": tuple(1 if i == d else n for i, n in enumerate(strides))}
        (rest,) = compat.bind_eqn(eqn, [x], params)
        out = jnp.take(rest, self.layout.slot_of_position(positions), axis=d)
        moved = int(np.prod(out.shape)) * out.dtype.itemsize
        self.log.append(f"slice at {compat.source_line(eqn)} takes {len(positions)} tokens "
                        f"by position ({moved} bytes gathered)")
        self.priced(eqn, "gather", moved)
        return [self.put(out, NAT)]

    # -- shifted slices along the sequence --
    def start_shift(self, eqn, invals):
        """A stride-1 slice along one sequence dim of a layout-order value: keep it whole."""
        x, atom = invals[0], eqn.invars[0]
        full = self.axes.full_dims(atom)
        acting = acting_dims(eqn)[0]
        strides = eqn.params.get("strides") or (1,) * atom.aval.ndim
        if self.get(x) != PERM or len(acting & set(full)) != 1 or len(full) != 1:
            return None
        (d,) = acting & set(full)
        if strides[d] != 1:
            return None
        start, limit = list(eqn.params["start_indices"]), list(eqn.params["limit_indices"])
        offset, length = start[d], limit[d] - start[d]
        if 2 * length <= atom.aval.shape[d]:
            return None  # gathering the slice's tokens moves less than holding it unsliced
        start[d], limit[d] = 0, atom.aval.shape[d]
        params = {**eqn.params, "start_indices": tuple(start), "limit_indices": tuple(limit)}
        (out,) = compat.bind_eqn(eqn, [x], params)
        st = Shift(offset, length, d)
        return [self.put(self.clean(out, st), st)]

    def clean(self, value, st: Shift):
        """``value`` held unsliced with the tokens outside the slice replaced by a copy of
        its first token, gradient stopped: the excluded tokens then compute what a token of
        the slice computes, so their (masked) values cannot turn into NaN or Inf in the
        gradients (a huge logit excluded from a ``logsumexp``, a zero excluded from a
        ``sqrt``), and nothing flows back to them."""
        valid = self._in_slice(value.shape, st)
        first = self.layout.slot_of_position(jnp.full((1,), st.offset, jnp.int32))
        fill = jax.lax.stop_gradient(jnp.take(value, first, axis=st.dim))
        return jnp.where(valid, value, fill)

    def _in_slice(self, shape, st: Shift):
        """Boolean, broadcastable to ``shape``: which tokens along ``st.dim`` lie in the
        slice (the positions computed once per token, not once per element of a value as
        large as the logits)."""
        pos = self.layout.position_of_slot(jax.lax.iota(jnp.int32, shape[st.dim]))
        valid = (pos >= st.offset) & (pos < st.offset + st.length)
        return valid.reshape([n if d == st.dim else 1 for d, n in enumerate(shape)])

    def settle(self, value, where: str):
        """``value`` itself, or for a shifted value its real slice in natural order (which
        costs a permutation; ``where`` names the consumer in the log)."""
        st = self.get(value)
        if not isinstance(st, Shift):
            return value
        positions = jnp.arange(st.offset, st.offset + st.length, dtype=jnp.int32)
        out = jnp.take(value, self.layout.slot_of_position(positions), axis=st.dim)
        moved = int(np.prod(out.shape)) * out.dtype.itemsize
        self.log.append(f"{where} needs a sliced sequence in natural order: gather its "
                        f"tokens ({moved} bytes permuted)")
        if self.strict:
            raise ReorderError(self.log[-1] + "; strict=True refuses this")
        self.priced(where, "gather", moved, where="")
        return self.put(out, NAT)

    def realign(self, value, st: Shift, offset: int):
        """Move a shifted value so that its slice starts at ``offset`` (a gather)."""
        slots = jnp.arange(self.layout.seq_len, dtype=jnp.int32)
        source = (self.layout.position_of_slot(slots) + st.offset - offset) % self.layout.seq_len
        moved = jnp.take(value, self.layout.slot_of_position(source), axis=st.dim)
        shifted = Shift(offset, st.length, st.dim)
        return self.put(self.clean(moved, shifted), shifted)

    def shifted(self, eqn, invals, shifted):
        """Run ``eqn`` on shifted operands, or ``None`` when it needs them materialized."""
        name = eqn.primitive.name
        if name not in SHIFTABLE:
            return None
        states = {i: self.get(invals[i]) for i in shifted}
        length = {st.length for st in states.values()}
        if len(length) != 1:
            return None
        (length,) = length
        for i, atom in enumerate(eqn.invars):
            if i not in states and any(atom.aval.shape[d] == length
                                       for d in self.axes.dims(atom)):
                return None  # a natural-order slice meets a shifted one
        if name == "gather" and not self._gather_keeps_order(eqn):
            return None
        big = max(shifted, key=lambda i: np.prod(invals[i].shape))
        offset = states[big].offset
        invals = list(invals)
        for i, st in states.items():
            if st.offset != offset:
                nbytes = int(np.prod(invals[i].shape)) * invals[i].dtype.itemsize
                self.log.append(f"{name} at {compat.source_line(eqn)}: re-align a sequence "
                                f"shifted by {st.offset - offset} ({nbytes} bytes gathered)")
                self.priced(eqn, "re-align", nbytes)
                invals[i] = self.realign(invals[i], st, offset)
        st = states[big]
        params = dict(eqn.params)
        seq = self.layout.seq_len
        atom = eqn.invars[big]
        if name == "broadcast_in_dim":
            shape = list(params["shape"])
            shape[params["broadcast_dimensions"][st.dim]] = seq
            params["shape"] = tuple(shape)
        elif name == "reshape":
            out_dim = reshape_dim_map(atom.aval.shape, eqn.outvars[0].aval.shape).get(st.dim)
            if out_dim is None:
                return None
            sizes = list(params["new_sizes"])
            sizes[out_dim] = seq
            params["new_sizes"] = tuple(sizes)
        elif facts(name).identity is not None and st.dim in params["axes"]:
            x = invals[big]
            invals[big] = jnp.where(self._in_slice(x.shape, st), x,
                                    jnp.asarray(facts(name).identity, x.dtype))
        outs = compat.bind_eqn(eqn, invals, params)
        result = []
        for out, var in zip(outs, eqn.outvars):
            dims = [d for d in self.axes.dims(var) if var.aval.shape[d] == length]
            if len(dims) > 1:
                return None
            result.append(self.put(out, Shift(offset, length, dims[0]) if dims else INV))
        return result
