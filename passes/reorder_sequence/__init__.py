"""Pass ``reorder-sequence``: run the program in a load-balanced token order.

Zigzag and striped layouts are permutations of positions. The pass permutes
sequence-carrying inputs into layout order, replaces ``iota`` along the sequence with the
permuted positions (RoPE and position tables keep working), gives every attention explicit
position operands, and un-permutes the outputs. Values are tracked in one of three states:
``perm`` (layout order), ``nat`` (natural order) and ``inv`` (no sequence dim, or constant
along it). Order-independent ops keep the state, and so do ops acting only on other dims
(a split of a fused qkv projection on the features) and contractions over the sequence
whose operands both carry it (an ``[S]`` pooling weight, an ``[S, S]`` token-mixing
matrix: inputs and constants linked to the sequence are permuted like activations);
positional ops along the sequence (pads, concatenates, cumsums, gathers by position) get
their operands un-permuted first, which costs a permutation of those operands; each such
place is logged and priced (a :class:`~cptransform.op.layouts.Conversion`, listed by
``explain``), and ``strict`` makes it an error. A reshape keeps the sequence's flat stride,
so tokens flattened with the batch or folded into features stay in layout order as a
:class:`Merged` dim, and chunks the layout moves whole stay permuted in the layout of the
chunks; slices keeping few tokens (``h[:, 0]``) gather just those. ``docs/layouts.md``
lists what keeps the order and what converts.
"""
from __future__ import annotations

from dataclasses import dataclass, field
import jax.numpy as jnp
import numpy as np

from cptransform.ir import compat
from cptransform.op.attention import attention_p
from cptransform.ir.module import Module
from cptransform.ir.pipeline import Pass, PassResult
from cptransform.ir.rewrite import fit_body, interpret, map_bodies, trace_like
from cptransform.analysis.primitives import CallKind, Family, acting_dims, calls, names_of
from cptransform.analysis.seq_axes import SeqAxes
from cptransform.op.layouts import Conversion, SequenceLayout
from cptransform.op.recurrence import Method, recurrence_p
from cptransform.op.seq_window import seq_window_p
from cptransform.lowering.halo import CHUNKS_PER_RANK
from cptransform.ir.errors import ReorderError
from cptransform.ir.facts import Fact
from cptransform.analysis.seq_axes_summary import analyse
from cptransform.passes.reorder_sequence.states import (PERM, NAT, INV, EQUIVARIANT,
                                                        CONTRACTIONS, Shift, Merged, CALLS,
                                                        REBUILT, LOOPS, CUSTOM_RULES)
from cptransform.passes.reorder_sequence.merged import MergedOrders
from cptransform.passes.reorder_sequence.shifted import ShiftedSlices

#: Elementwise primitives, and the jit calls a custom rule's body may hold.
ELEMENTWISE = names_of(Family.ELEMENTWISE)
JITS = calls(CallKind.JIT)


@dataclass
class _Reorderer(MergedOrders, ShiftedSlices):
    axes: SeqAxes
    layout: SequenceLayout
    strict: bool
    log: list = field(default_factory=list)
    conversions: list = field(default_factory=list)
    state: dict = field(default_factory=dict)

    # -- state bookkeeping (by traced value identity; values are kept alive in `state`) --
    def get(self, value) -> str:
        entry = self.state.get(id(value))
        return entry[1] if entry is not None and entry[0] is value else INV

    def put(self, value, st: str):
        self.state[id(value)] = (value, st)
        return value

    def to(self, value, atom, want: str):
        """``value`` (of jaxpr atom ``atom``) in state ``want`` along its full seq dims."""
        have = self.get(value)
        if isinstance(have, Shift):
            raise AssertionError("shifted values are materialized before conversions")
        if isinstance(have, Merged):
            value, have = self.unmerge(value), NAT
        if have == want or have == INV:
            return value
        for d in self.axes.full_dims(atom):
            value = (self.layout.permute if want == PERM else self.layout.unpermute)(value, d)
        return self.put(value, want)

    # -- the interpreter --
    def eval(self, jaxpr, consts, args):
        consts = [self.put(val, NAT if self.axes.full_dims(var) else INV)
                  for var, val in zip(jaxpr.constvars, consts)]
        return interpret(jaxpr, consts, args,
                         lambda eqn, read: self.eval_eqn(eqn, [read(a) for a in eqn.invars]))

    def eval_eqn(self, eqn, invals):
        name = eqn.primitive.name
        shifted = [i for i, x in enumerate(invals) if isinstance(self.get(x), Shift)]
        if shifted:
            outs = self.shifted(eqn, invals, shifted)
            if outs is not None:
                return outs
            where = f"{name} at {compat.source_line(eqn)}"
            invals = [self.settle(x, where) for x in invals]
        if eqn.primitive is recurrence_p:
            return self.recurrence(eqn, invals)
        merged = [i for i, x in enumerate(invals) if isinstance(self.get(x), Merged)]
        if merged and not (name in CALLS and name not in REBUILT | CUSTOM_RULES):
            outs = self.merged(eqn, invals, merged)
            if outs is not None:
                return outs
            invals = [self.natural(x, eqn) if i in merged else x for i, x in enumerate(invals)]
        if name == "reshape" and self.get(invals[0]) == PERM:
            outs = self.reshape_permuted(eqn, invals)
            if outs is not None:
                return outs
            return self.positional(eqn, invals, [0], {PERM},
                                   "cuts the sequence into pieces its layout does not keep "
                                   "whole")
        if name == "slice":
            outs = self.start_shift(eqn, invals)
            if outs is not None:
                return outs
            outs = self.slice_positions(eqn, invals)
            if outs is not None:
                return outs
        carrying = [i for i, a in enumerate(eqn.invars) if self.axes.full_dims(a)
                    and self.get(invals[i]) != INV]
        out_full = any(self.axes.full_dims(v) for v in eqn.outvars)
        if eqn.primitive is attention_p:
            return self.attention(eqn, invals)
        if name == "iota" and out_full:
            return self.iota(eqn)
        if name in CALLS:
            return self.call(eqn, invals)
        if not carrying:
            outs = compat.bind_eqn(eqn, invals)
            return [self.put(o, NAT if self.axes.full_dims(v) else INV)
                    for o, v in zip(outs, eqn.outvars)]
        states = {self.get(invals[i]) for i in carrying}
        if eqn.primitive is seq_window_p and self._window_in_layout(eqn, invals, carrying):
            return self.window(eqn, invals)
        if name in EQUIVARIANT or self._acts_off_sequence(eqn, carrying) \
                or (name in CONTRACTIONS and self._contracts_in_step(eqn, carrying)):
            return self.equivariant(eqn, invals, carrying, states)
        return self.positional(eqn, invals, carrying, states)

    def equivariant(self, eqn, invals, carrying, states):
        """Run ``eqn`` with every sequence-carrying operand in one order (layout order when
        any of them is in it); its sequence-carrying outputs are in that order."""
        want = PERM if PERM in states else NAT
        invals = [self.to(x, a, want) if i in carrying else x
                  for i, (x, a) in enumerate(zip(invals, eqn.invars))]
        outs = compat.bind_eqn(eqn, invals)
        return [self.put(o, want if self.axes.full_dims(v) else INV)
                for o, v in zip(outs, eqn.outvars)]

    def _contracts_in_step(self, eqn, carrying) -> bool:
        """A ``dot_general`` whose contracted dims are sequence dims on both operands or on
        neither. ``sum_s a[s] b[s]`` equals ``sum_s a[p(s)] b[p(s)]`` for any permutation
        ``p``, so once both operands are in one order (as :meth:`equivariant` puts them)
        the contraction is exact. Contracting links put both dims of a pair in one
        component, so a pair marked on one side only is an operand the analysis cannot
        see (a literal): its order is unknown, and the op runs positionally."""
        (lc, rc), _ = eqn.params["dimension_numbers"]
        held = [[i in carrying and d in self.axes.full_dims(eqn.invars[i]) for d in dims]
                for i, dims in enumerate((lc, rc))]
        return held[0] == held[1]

    def _window_in_layout(self, eqn, invals, carrying) -> bool:
        """A windowed op along the sequence of a layout-order operand, in a layout whose
        chunks the halo exchange serves (zigzag: each chunk gets its own neighbours)."""
        window = eqn.params["window"]
        return (carrying == [0] and self.get(invals[0]) == PERM
                and self.layout.name in CHUNKS_PER_RANK
                and self.axes.full_dims(eqn.invars[0]) == (window.dim,))

    def window(self, eqn, invals):
        """Keep a windowed op in layout order: it records the layout on its equation."""
        params = {**eqn.params, "window": eqn.params["window"].in_layout(self.layout)}
        (out,) = compat.bind_eqn(eqn, invals, params)
        return [self.put(out, PERM)]

    def recurrence(self, eqn, invals):
        """Keep a recurrence planned to pass state (or totals) in layout order: it
        records the layout of its steps, the program's on a full sequence dim or the
        layout of the chunks on a chunked one (zigzag: each device's two chunks take their
        incoming state from the chunks before them in natural order). Gathered ones, and
        any under a layout that does not keep chunks whole (striped), run in natural
        order, converted around them."""
        rec = eqn.params["recurrence"]
        steps = [i for i, it in enumerate(rec.iterated) if it]
        invals = list(invals)
        layout = self._steps_layout(eqn, invals, steps)
        if layout is None:
            invals = [self.natural(x, eqn) if isinstance(self.get(x), Merged) else x
                      for x in invals]
            carrying = [i for i, a in enumerate(eqn.invars) if self.axes.full_dims(a)
                        and self.get(invals[i]) != INV]
            return self.positional(eqn, invals, carrying,
                                   {self.get(invals[i]) for i in carrying})
        state = Merged(rec.axis, 1, layout)
        with compat.eqn_context(eqn):
            outs = recurrence_p.bind(*invals, recurrence=rec.in_layout(layout))
        return [self.put(o, self.merged_state(v, state) if it else INV)
                for o, v, it in zip(outs, eqn.outvars, rec.iterated_out)]

    def _steps_layout(self, eqn, invals, steps) -> SequenceLayout | None:
        """The layout a recurrence's steps are held in when it can keep it: the program's
        (a layout-order full sequence dim) or a merged dim's chunk layout, the same for
        every step operand; ``None``: it runs in natural order. Step operands are put in
        it as an order-free op's would be: a natural-order one beside a layout-order one
        is permuted, and one that is not a sequence dim of its own (``inv``: chunks cut
        from natural-order tokens, or steps made apart from the tokens) is aligned with
        merged ones."""
        rec = eqn.params["recurrence"]
        if rec.method in (None, Method.GATHER) or self.layout.name not in CHUNKS_PER_RANK:
            return None
        found, natural, loose = set(), [], []
        for i in steps:
            st, full = self.get(invals[i]), rec.axis in self.axes.full_dims(eqn.invars[i])
            if st == PERM and full:
                found.add(self.layout)
            elif st == NAT and full:
                natural.append(i)
            elif isinstance(st, Merged) and st.dim == rec.axis and st.inner == 1:
                found.add(st.layout)
            elif st == INV and not full:
                loose.append(i)
            elif st != INV:
                return None
        if len(found) != 1 or (natural and found != {self.layout}):
            return None
        layout = found.pop()
        for i in natural:
            invals[i] = self.to(invals[i], eqn.invars[i], PERM)
        for i in loose:
            invals[i] = self.align(invals[i], rec.axis, Merged(rec.axis, 1, layout))
        return layout

    def priced(self, eqn_or_name, kind: str, nbytes: int, where: str | None = None):
        """Record one conversion (what :func:`explain` lists with its bytes)."""
        op = eqn_or_name if isinstance(eqn_or_name, str) else eqn_or_name.primitive.name
        if where is None:
            where = compat.source_line(eqn_or_name)
        self.conversions.append(Conversion(op, where, kind, int(nbytes)))

    def natural(self, value, eqn):
        """A merged operand of ``eqn`` in natural order, logged with its bytes (refused
        under ``strict``): ``eqn`` acts along the merged sequence dim, or mixes it with
        another order."""
        moved = int(np.prod(value.shape)) * value.dtype.itemsize
        self.unpermuting(eqn, f"{eqn.primitive.name} at {compat.source_line(eqn)} needs the "
                         f"tokens of a merged sequence dim in natural order: un-permute "
                         f"({moved} bytes permuted)", moved,
                         "Keep the op off the flattened tokens, or use load_balance='none'")
        return self.unmerge(value)

    def unpermuting(self, eqn, message: str, moved: int, fix: str):
        """Record the un-permute of ``moved`` bytes that ``eqn`` needs (``message`` says
        where and why; logged and priced), or refuse it under ``strict``, naming ``fix``."""
        if self.strict:
            raise ReorderError(f"{message}; strict=True refuses this. {fix}")
        self.log.append(message)
        self.priced(eqn, "un-permute", moved)

    @staticmethod
    def operand_bytes(eqn, indices) -> int:
        """The bytes of ``eqn``'s operands ``indices``."""
        return sum(int(np.prod(eqn.invars[i].aval.shape)) * eqn.invars[i].aval.dtype.itemsize
                   for i in indices)

    def _acts_off_sequence(self, eqn, carrying) -> bool:
        """An op (slice, split, concatenate, pad, gather, contraction, ...) acting only on
        non-sequence dims of its sequence-carrying operands."""
        acting = acting_dims(eqn)
        if acting is None:
            return False
        return all(not acting[i] & set(self.axes.dims(eqn.invars[i])) for i in carrying)

    def _gather_keeps_order(self, eqn) -> bool:
        """A gather whose operand's sequence dims are all batching dims (``take_along_axis``
        per token) or that has none (an embedding lookup by sequence-carrying indices): it
        runs unchanged on a shifted operand held unsliced, unlike one taking a sequence dim
        whole, whose slice size is the sliced length."""
        dn = eqn.params["dimension_numbers"]
        return set(self.axes.dims(eqn.invars[0])) <= set(dn.operand_batching_dims)

    def positional(self, eqn, invals, carrying, states,
                   why: str = "is not permutation-equivariant along the sequence"):
        """Run ``eqn`` on natural-order operands (un-permuted first, logged with the bytes
        it costs; refused under ``strict``); its outputs are in natural order."""
        if PERM in states:
            moved = self.operand_bytes(eqn, [i for i in carrying
                                             if self.get(invals[i]) == PERM])
            self.unpermuting(eqn, f"{eqn.primitive.name} at {compat.source_line(eqn)} {why}: "
                             f"un-permute its operands first ({moved} bytes permuted)", moved,
                             "Rewrite the op to work on positions, or use "
                             "load_balance='none'")
        invals = [self.to(x, a, NAT) if i in carrying else x
                  for i, (x, a) in enumerate(zip(invals, eqn.invars))]
        outs = compat.bind_eqn(eqn, invals)
        return [self.put(o, NAT if self.axes.dims(v) else INV)
                for o, v in zip(outs, eqn.outvars)]

    def iota(self, eqn):
        """An iota along the sequence becomes the layout's positions (already permuted)."""
        outs = compat.bind_eqn(eqn, [])
        out = outs[0]
        dim = eqn.params["dimension"]
        if dim in self.axes.full_dims(eqn.outvars[0]):
            out = self.layout.position_of_slot(out).astype(out.dtype)
        others = [d for d in self.axes.full_dims(eqn.outvars[0]) if d != dim]
        for d in others:
            out = self.layout.permute(out, d)
        return [self.put(out, PERM)]

    def attention(self, eqn, invals):
        spec = eqn.params["spec"]
        invals = [self.to(x, a, PERM) for x, a in zip(invals, eqn.invars)]
        if not spec.positions:
            nb = len(spec.q.batch)
            slots = jnp.arange(self.layout.seq_len, dtype=jnp.int32)
            pos = self.layout.position_of_slot(slots).reshape((1,) * nb + (-1,))
            invals = invals[:3] + [pos, pos] + invals[3:]
            spec = spec.replace(positions=True)
        with compat.eqn_context(eqn):
            out = attention_p.bind(*invals, spec=spec)
        return [self.put(out, PERM)]

    def call(self, eqn, invals):
        """Sub-jaxprs: every full sequence-carrying value crosses the boundary permuted;
        custom derivative rules run as written, in natural order."""
        name = eqn.primitive.name
        if name in CUSTOM_RULES:
            carrying = [i for i, a in enumerate(eqn.invars)
                        if self.axes.full_dims(a) and self.get(invals[i]) != INV]
            if elementwise_rule(eqn):
                return self.equivariant(eqn, invals, carrying,
                                        {self.get(invals[i]) for i in carrying})
            return self.positional(eqn, invals, carrying,
                                   {self.get(invals[i]) for i in carrying},
                                   "has a custom derivative rule, which must see the tokens "
                                   "in their order")
        if name in LOOPS:
            return self.loop(eqn, invals)
        if name in REBUILT:
            outs = self.rebound(eqn, invals, PERM)
            if outs is not None:
                return outs
        invals = [x if isinstance(self.get(x), Merged) else self.to(x, a, PERM)
                  for x, a in zip(invals, eqn.invars)]
        body = next(sub for _, sub in compat.eqn_subjaxprs(eqn))
        with compat.inlining(eqn):
            outs = self.eval(compat.open_jaxpr(body), compat.consts_of(body),
                             [self.put(x, self.get(x)) for x in invals])
        outs = [self.settle(o, f"the result of {name}") for o in outs]
        return [o if isinstance(self.get(o), Merged) else self.to(o, v, PERM)
                for o, v in zip(outs, eqn.outvars)]

    def rebound(self, eqn, invals, order: str):
        """``eqn`` re-bound with its bodies re-traced, every full sequence-carrying value
        crossing the boundary in ``order`` (``PERM`` keeps merged operands merged); ``None``
        when a body cannot be re-bound (it is inlined instead)."""
        invals = [x if order == PERM and isinstance(self.get(x), Merged)
                  else self.to(x, a, order) for x, a in zip(invals, eqn.invars)]
        params = map_bodies(eqn, lambda closed: self.body(closed, order))
        if params is None:
            return None
        outs = compat.bind_eqn(eqn, invals, params)
        return [self.put(o, order if self.axes.full_dims(v) else INV)
                for o, v in zip(outs, eqn.outvars)]

    def loop(self, eqn, invals):
        """A ``scan`` or ``while``: in layout order, unless its iterations follow the
        tokens. A carry through a scan whose iteration axis is a sequence dim is a
        recurrence over time, whose steps must come in token order; a body that would
        convert on every iteration (a ``fori_loop`` indexing the tokens by its counter)
        converts once instead. Such a loop runs in natural order, its operands converted
        around it (logged and priced; refused under ``strict``)."""
        why = self._recurrence(eqn)
        if why is None:
            outs, taken, error = self._attempt(eqn, invals, PERM)
            if error is None and not taken[1]:
                self._keep(taken)
                return outs
            natural = self._attempt(eqn, invals, NAT)
            if natural[2] is not None or natural[1][1]:
                if error is not None:
                    raise error
                self._keep(taken)
                return outs
            inside = (f"{len(taken[1])} conversion(s), "
                      f"{sum(c.bytes for c in taken[1])} bytes" if error is None
                      else "a conversion strict=True refuses")
            why = f"its body would convert on every iteration in layout order ({inside})"
            outs, taken, _ = natural
        else:
            outs, taken, error = self._attempt(eqn, invals, NAT)
            if error is not None:
                raise error
        moved = self.operand_bytes(eqn, [i for i, a in enumerate(eqn.invars)
                                         if self.axes.full_dims(a)
                                         and self.get(invals[i]) not in (NAT, INV)])
        if moved:
            self.unpermuting(eqn, f"{eqn.primitive.name} at {compat.source_line(eqn)} runs in "
                             f"token order: {why}: un-permute its operands first ({moved} "
                             "bytes permuted)", moved, "Write the recurrence with "
                             "lax.associative_scan, or use load_balance='none'")
        self._keep(taken)
        return outs

    def _recurrence(self, eqn) -> str | None:
        """Why ``eqn`` is a recurrence over the sequence (a carry through iterations along a
        sequence dim of its scanned operands or results), or ``None``."""
        for body in compat.bodies(eqn):
            along = [outer for outer, _ in body.scanned_in + body.scanned_out
                     if 0 in self.axes.full_dims(outer)]
            if along and body.carry_in:
                return "it carries state across iterations along the sequence"
        return None

    def _attempt(self, eqn, invals, order: str):
        """``(outputs, (log, conversions), error)`` of :meth:`rebound` in ``order``, with
        what its bodies logged taken back out (:meth:`_keep` puts it back)."""
        log, conversions = len(self.log), len(self.conversions)
        try:
            outs, error = self.rebound(eqn, invals, order), None
        except ReorderError as exc:
            outs, error = None, exc
        taken = (self.log[log:], self.conversions[conversions:])
        del self.log[log:], self.conversions[conversions:]
        return outs, taken, error

    def _keep(self, taken):
        self.log.extend(taken[0])
        self.conversions.extend(taken[1])

    def body(self, closed, order: str = PERM):
        """``closed`` re-traced with its full sequence-carrying inputs and results in
        ``order``."""
        jaxpr = compat.open_jaxpr(closed)
        consts = compat.consts_of(closed)

        def fn(*xs):
            xs = [self.put(x, order if self.axes.full_dims(v) else INV)
                  for x, v in zip(xs, jaxpr.invars)]
            outs = [self.settle(o, "a loop or branch result") for o in
                    self.eval(jaxpr, consts, xs)]
            return [self.to(o, v, order) for o, v in zip(outs, jaxpr.outvars)]

        return fit_body(closed, trace_like(jaxpr, fn))


def _elementwise(jaxpr) -> bool:
    """Every equation of ``jaxpr`` is elementwise, a fill (a scalar broadcast), or a call
    of a body that is (a jit, the function itself re-bound inside its rule)."""
    for eqn in compat.open_jaxpr(jaxpr).eqns:
        name = eqn.primitive.name
        if name in ELEMENTWISE or (name == "broadcast_in_dim"
                                   and compat.aval_of(eqn.invars[0]).ndim == 0):
            continue
        body = compat.call_body(eqn) if name in JITS | CUSTOM_RULES else None
        if body is None or not _elementwise(body):
            return False
    return True


def elementwise_rule(eqn) -> bool:
    """A ``custom_jvp`` function whose primal and derivative rule are both elementwise
    (``jax.nn.relu``, ``softplus``, ``log_sigmoid``): each output entry reads only the same
    entry of each operand, so the function and its rule commute with any order of the
    tokens and run in layout order, unchanged. Any other custom rule may read the tokens
    in their order."""
    if eqn.primitive.name != "custom_jvp_call":
        return False
    body, rule = compat.call_body(eqn), compat.custom_jvp_rule(eqn)
    return body is not None and rule is not None and _elementwise(body) \
        and _elementwise(rule)


@dataclass(frozen=True)
class ReorderSequence(Pass):
    """Permute the program into a load-balanced sequence layout (zigzag or striped)."""

    name = "reorder-sequence"
    summary = "zigzag/striped: permute inputs, rewrite sequence iotas, un-permute outputs"
    requires = (Fact.PLAN,)
    keep_permuted: bool = False
    strict: bool = False

    def run(self, module: Module) -> PassResult:
        layout = module.facts.layout
        inside = sorted({p.layout for p in module.facts.plan or ()} - {"contiguous"})
        if layout is None and inside and self.keep_permuted:
            raise ReorderError(
                f"keep_permuted=True asks for outputs in {inside[0]} order, but the program "
                f"is not reordered: {inside[0]} runs inside the attentions only (a sequence "
                "length the layout does not divide, or several sequences), so outputs come "
                "back in natural order; drop keep_permuted, or pad the sequence to a "
                "multiple of the layout's")
        if layout is None:
            return PassResult(module, False, ("reorder-sequence: contiguous layout, nothing "
                                              "to do",))
        axes = analyse(module)
        jaxpr = compat.open_jaxpr(module.jaxpr)
        consts = compat.consts_of(module.jaxpr)
        worker = _Reorderer(axes, layout, self.strict)

        def fn(*xs):
            xs = [worker.put(x, NAT if axes.full_dims(v) else INV)
                  for x, v in zip(xs, jaxpr.invars)]
            xs = [worker.to(x, v, PERM) for x, v in zip(xs, jaxpr.invars)]
            outs = worker.eval(jaxpr, consts, xs)
            outs = [worker.settle(o, "a program output") for o in outs]
            want = PERM if self.keep_permuted else NAT
            return [worker.to(o, v, want) for o, v in zip(outs, jaxpr.outvars)]

        new = compat.dce(trace_like(jaxpr, fn))
        log = tuple(f"reorder-sequence: {m}" for m in worker.log)
        return PassResult(module.with_jaxpr(new, reorder_log=log,
                                            conversions=tuple(worker.conversions)), True, log)

