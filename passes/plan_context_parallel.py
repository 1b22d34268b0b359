"""Pass ``plan-context-parallel``: choose a schedule for each attention, and the layout.

Reads each ``attention_p`` (heads, KV heads, head dims, sequence length, mask) and picks a
registered schedule for it — the one asked for, or under ``auto`` the feasible one with the
least predicted time (forward + backward) whose local step fits the memory limit. Each
schedule's :class:`~cptransform.lowering.schedule.Schedule` record gives its volume,
work (FLOPs after block skipping, under the layout), memory, steps and feasibility;
:meth:`Schedule.predict` prices them on a row of the hardware table
(:mod:`cptransform.analysis.hardware`), with the link class of each mesh axis read off the
device ids its groups span. Every attention is planned on its own, so one program may mix
schedules. A two-axis schedule (``schedule="hybrid"``) asked for over a single CP axis
gets its inner degree picked (a divisor of cp; for hybrid, the Ulysses degree, dividing
every attention's KV heads) with the least predicted total time, and the mesh replaced by
a two-axis one over its ``InnerAxis.names``, inner groups on consecutive devices.

It also picks the sequence layout for the whole program (``load_balance``): it plans every
attention under each layout of :data:`~cptransform.op.layouts.LAYOUTS` and, under
``auto``, keeps the one with the least predicted time of all attentions together (each on
its slowest device, the work counted from the actual masks after block skipping; ties go
to the least work on the busiest rank: :mod:`cptransform.analysis.load_balance`). Both
decisions are written onto each ``attention_p`` equation (``spec.schedule``,
``spec.layout``), where ``lower-context-parallel`` reads them, and so is the local-step
kernel (``spec.kernel``: :func:`choose_kernel` for the ``kernel`` option, decided here
once; a warning names the faster ones ``auto`` passed over); the readable account, one
:class:`AttentionPlan` per attention, goes to ``module.facts.plan`` and one
:class:`LayoutBalance` per candidate layout to ``module.facts.balance`` for ``explain()``,
and the layout to ``module.facts.layout`` for ``reorder-sequence``. The CP size comes from
the mesh only. Per-document zigzag (``load_balance="documents"``) is refused: see
:data:`REFUSED_LOAD_BALANCES`.

The program is reordered (``facts.layout``) only when it has one sequence whose length the
layout divides. A zigzag or striped layout over a length it does not divide, or over two
sequences (cross-attention), is applied inside each attention instead: the lowering pads
and permutes the attention's operands and un-permutes its output, and the rest of the
program stays in natural order. That costs a permutation of q, k, v and o per attention
(communication the program-level reorder avoids), but it is exact: a permutation of the
real tokens alone cannot be cut into equal zigzag shards, and the pad tokens live only
inside the attention.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import partial

import numpy as np
from jax.sharding import AxisType, Mesh

from cptransform.analysis.attention_shape import AttentionShape, attention_shape
from cptransform.analysis.hardware import HARDWARE, Hardware, hardware_for_device, \
    memory_limit_bytes, memory_limit_problem
from cptransform.analysis.load_balance import LayoutBalance, best_layout, rank_flops
from cptransform.analysis.prediction import Prediction
from cptransform.analysis.primitives import INLINABLE
from cptransform.analysis.recurrence_cost import RecurrencePlan, plan_recurrence
from cptransform.analysis.seq_axes_summary import analyse
from cptransform.analysis.sharded_sequence import LOCAL, ShardedSequence, attention_axes, \
    choose
from cptransform.ir import compat
from cptransform.ir.errors import PlanError, unknown_name
from cptransform.ir.facts import Fact
from cptransform.ir.module import Module, iter_eqns
from cptransform.ir.pipeline import Pass, PassResult
from cptransform.ir.rewrite import Rewriter
from cptransform.lowering.kernels import kernels
from cptransform.lowering.kernels.capabilities import choose_kernel, warn_passed_over
from cptransform.lowering.schedule import Schedule, schedules
from cptransform.op.attention import attention_p
from cptransform.op.recurrence import Method, recurrence_p
from cptransform.op import mask_terms
from cptransform.op.attention_spec import MaskSpec
from cptransform.op.layouts import LAYOUTS, LayoutName, SequenceLayout, layout_multiple

#: ``load_balance`` option → the layout it names (``auto`` is decided per program; ``none``
#: is the contiguous layout); every other layout of :class:`LayoutName` by its own name.
LOAD_BALANCES = {"auto": None,
                 **{name: name for name in LAYOUTS if name != LayoutName.CONTIGUOUS},
                 "none": LayoutName.CONTIGUOUS.value}

def schedule_choices() -> tuple[str, ...]:
    """The values of the ``schedule`` option: ``auto`` (per attention the feasible schedule
    with the least predicted time) and every registered schedule, in listing order."""
    return ("auto", *schedules())


#: ``recurrences`` option values: ``auto`` (each recurrence's cheapest method), ``pass``
#: (state, totals or a pipelined carry passed between devices wherever that is exact) or
#: ``gather`` (every one on the whole sequence, as XLA partitions it).
RECURRENCE_CHOICES = ("auto", "pass", Method.GATHER.value)

#: ``load_balance`` values that name a real scheme this planner cannot plan, and why.
REFUSED_LOAD_BALANCES = {
    "documents": "load_balance='documents' (per-document zigzag of packed sequences) needs "
                 "the document boundaries when planning, but they are data (segment ids), "
                 "known only when the function runs; pad documents to a fixed length and use "
                 "load_balance='zigzag', or 'auto' (which balances the mask's band)"}

#: Predicted times within this factor count as a tie, which goes to an overlapping schedule.
TIE = 1.01

MiB = 2 ** 20


@dataclass(frozen=True)
class AttentionPlan:
    """The decision for one attention (``index`` = order in the program).

    ``bytes_per_device``: forward bytes per device of each candidate schedule;
    ``predictions``: the :class:`Prediction` of each candidate that was priced, fastest
    first (empty when no hardware row applies); ``runner_up``: the next feasible one under
    ``auto``; ``source`` the nearest frame in the user's code, ``library_source`` the
    installed library's frame that emitted the attention when there is one (Flax's);
    ``kernel``: the local-step kernel and why, one line (``choose_kernel``); ``dropout``:
    whether its probabilities go through dropout (drawn per block by the kernel).
    """

    index: int
    source: str
    mask: MaskSpec
    schedule: str
    reason: str
    shape: AttentionShape
    bytes_per_device: dict
    predictions: tuple[Prediction, ...] = ()
    runner_up: str | None = None
    layout: str = "contiguous"
    library_source: str | None = None
    kernel: str = ""
    dropout: bool = False

    @property
    def kernel_name(self) -> str:
        """The registry name of the local-step kernel (``kernel``'s text before the colon)."""
        return self.kernel.split(":", 1)[0]

    def describe(self) -> str:
        mib = {k: f"{v / MiB:.2f} MiB" for k, v in self.bytes_per_device.items()}
        return (f"attention #{self.index} at {self.source}: {self.schedule} ({self.reason}); "
                f"mask {self.mask.describe()}; forward bytes/device {mib}; padding "
                f"{self.shape.describe_padding()}")


def mesh_problem(schedule: Schedule, axes: int) -> str | None:
    """Why ``schedule`` does not fit a plan over ``axes`` CP mesh axes."""
    if schedule.mesh_axes == axes:
        return None
    if schedule.mesh_axes == 2:
        return (f"{schedule.name} needs two mesh axes (axis=("
                f"{', '.join(map(repr, schedule.inner.names))}))")
    return (f"{schedule.name} runs over one mesh axis, but the plan has {axes}; use a "
            "two-axis schedule or one mesh axis")


def axis_spans(mesh, axes: tuple[str, ...]) -> tuple[int, ...]:
    """For each CP axis: how many consecutive device ids one group along it spans (what
    decides its link class)."""
    spans = []
    for axis in axes:
        index = mesh.axis_names.index(axis)
        line = mesh.devices[tuple(slice(None) if i == index else 0
                                  for i in range(mesh.devices.ndim))]
        ids = [d.id for d in line.reshape(-1)]
        spans.append(max(ids) - min(ids) + 1)
    return tuple(spans)


def two_axis_mesh(mesh, inner: int, names: tuple[str, str]) -> Mesh:
    """The devices of ``mesh``'s one CP axis as an ``(inner, cp / inner)`` mesh over
    ``names`` (a schedule's :attr:`InnerAxis.names`), each inner group on consecutive
    devices (the fastest links)."""
    devices = mesh.devices.reshape(-1)
    grid = devices.reshape(len(devices) // inner, inner).T
    return Mesh(grid, names, axis_types=(AxisType.Auto,) * 2)


def candidate_layouts(forced: str | None) -> list[str]:
    """The layouts to plan under: ``forced`` (a ``load_balance`` other than ``auto``) first,
    then every layout of :data:`LAYOUTS`. Each is legal for any length: one the program's
    length does not divide, or a program of several sequences, is applied inside each
    attention (padded there; the permutation it then costs per attention is not priced)."""
    return list(dict.fromkeys(([forced] if forced else []) + list(LAYOUTS)))


@dataclass(frozen=True)
class LayoutPlan:
    """Every attention planned under one layout: the plans, the mesh and CP axes they run
    on (a hybrid built from ``cp`` replaces the mesh), the log lines of that planning, and
    the program's :class:`LayoutBalance` under the layout."""

    balance: LayoutBalance
    plans: tuple[AttentionPlan, ...]
    mesh: object
    axes: tuple[str, ...]
    log: tuple[str, ...]
    sharded: ShardedSequence | None = None


def _mib(n: int) -> str:
    return f"{n / MiB:.1f} MiB"


@dataclass(frozen=True)
class PlanContextParallel(Pass):
    """Choose a schedule per attention (predicted time under a memory limit), the Ulysses
    degree of a hybrid given only ``cp``, and the sequence layout."""

    name = "plan-context-parallel"
    summary = ("choose a schedule per attention (cost model: predicted time under a memory "
               "limit) and the layout; written onto each attention")
    requires = (Fact.MESH, Fact.SEQ_AXES)
    ensures = (Fact.PLAN,)
    schedule: str = "auto"
    load_balance: str = "auto"
    hardware: str | None = None
    memory_limit: int | str | None = None
    kernel: str = "auto"
    recurrences: str = "auto"

    def check(self) -> None:
        """One clear error for an unknown option value."""
        names = schedule_choices()
        if self.schedule not in names:
            raise PlanError(unknown_name("schedule", self.schedule, names))
        if self.load_balance in REFUSED_LOAD_BALANCES:
            raise NotImplementedError(REFUSED_LOAD_BALANCES[self.load_balance])
        if self.load_balance not in LOAD_BALANCES:
            raise PlanError(unknown_name("load_balance", self.load_balance, LOAD_BALANCES))
        if self.recurrences not in RECURRENCE_CHOICES:
            raise PlanError(unknown_name("recurrences", self.recurrences, RECURRENCE_CHOICES))
        if self.hardware is not None and self.hardware not in HARDWARE:
            raise PlanError(unknown_name("hardware", self.hardware, HARDWARE))
        problem = memory_limit_problem(self.memory_limit)
        if problem:
            raise PlanError(problem)

    def machine(self, mesh, required: bool) -> Hardware | None:
        """The hardware row: the one named, else the one of the mesh's devices; ``None``
        when the table has none and nothing needs it (``required``: raise)."""
        if self.hardware is not None:
            return HARDWARE[self.hardware]
        device = mesh.devices.reshape(-1)[0]
        name = hardware_for_device(device.platform, device.device_kind)
        if name is None and required:
            raise PlanError(f"no row of the hardware table for device kind "
                            f"{device.device_kind!r}, so schedules cannot be priced; pass "
                            f"hardware= one of {', '.join(HARDWARE)}, or a schedule by name")
        return None if name is None else HARDWARE[name]

    def run(self, module: Module) -> PassResult:
        self.check()
        facts = module.facts
        cp, mesh, axes = facts.cp, facts.mesh, tuple(facts.cp_axes)
        eqns = [e for e in iter_eqns(module.jaxpr) if e.primitive is attention_p]
        # A two-axis schedule asked for over one CP axis: the planner builds its two axes.
        build = None if self.schedule == "auto" or len(axes) != 1 else \
            schedules()[self.schedule] if schedules()[self.schedule].mesh_axes == 2 else None
        hardware = self.machine(mesh, required=self.schedule == "auto" or build is not None)
        limit = None if hardware is None else memory_limit_bytes(self.memory_limit, hardware)
        forced = LOAD_BALANCES[self.load_balance]
        options, errors = {}, {}
        seq_axes = analyse(module)
        found = [attention_axes(seq_axes, e, cp) for e in eqns]
        for layout in candidate_layouts(forced):
            try:
                options[layout] = self.plan_layout(eqns, layout, cp, mesh, axes, build,
                                                   hardware, limit, (found, seq_axes.lengths))
            except PlanError as err:
                if layout == forced:
                    raise
                errors[layout] = err
        if not options:
            raise next(iter(errors.values()))
        choice = options[forced] if forced is not None else \
            options[best_layout([o.balance for o in options.values()]).layout]
        balances = tuple(replace(o.balance, chosen=o is choice) for o in options.values())
        layout, plans, mesh, axes = choice.balance.layout, choice.plans, choice.mesh, choice.axes

        sharded = choice.sharded
        # The kernel was chosen under every candidate layout alike; warned of once per
        # attention, for the plan kept.
        for p in plans:
            warn_passed_over(p.kernel)
        # Sequences of one common length (an encoder and a decoder of equal lengths) share
        # one permutation: every op between them (cross attention, a sum of encoder and
        # decoder states) then sees both in the same order, as in natural order.
        lengths = set(facts.seq_axes.lengths)
        seq_len = next(iter(lengths)) if len(lengths) == 1 else None
        reordered = layout != "contiguous" and seq_len is not None \
            and seq_len % layout_multiple(layout, cp) == 0
        sequence = SequenceLayout(layout, seq_len, cp) if reordered else None
        recurrences = self.plan_recurrences(module, seq_axes, sequence, mesh, axes, hardware,
                                             limit)
        # The re-trace walks these same equation objects (inside bodies too): the plan is
        # found by the equation's identity, never by the order of visits.
        plan_of = {id(e): p for e, p in zip(eqns, plans)}
        plan_of.update(recurrences)

        def decide(eqn, invals):
            plan = plan_of[id(eqn)]
            spec = eqn.params["spec"].replace(schedule=plan.schedule, layout=layout,
                                              kernel=plan.kernel_name)
            return [attention_p.bind(*invals, spec=spec)]

        def run_by(eqn, invals):
            # A recurrence off the sequence is the op it was; the others carry their method.
            rec, method = eqn.params["recurrence"], plan_of[id(eqn)].method
            if method is None:
                return rec.apply(*invals)
            return recurrence_p.bind(*invals, recurrence=rec.with_method(method))

        rules = {attention_p.name: decide, recurrence_p.name: run_by}
        new = Rewriter(rules=rules, inlinable=INLINABLE).run(module.jaxpr) \
            if eqns or recurrences else module.jaxpr
        where = "" if reordered or layout == "contiguous" else \
            " inside each attention only: " + (
                f"{len(lengths)} sequences of different lengths" if seq_len is None else
                f"length {seq_len} is not a multiple of {layout_multiple(layout, cp)}") + \
            "; the program stays in natural order"
        why = "load_balance=" + self.load_balance if forced is not None else \
            "least predicted time over all attentions"
        log = choice.log + tuple(p.describe() for p in plans) + (
            f"layout: {layout} ({why}{';' if where else ''}{where})",)
        log += tuple(f"  {b.describe()}" for b in balances)
        log += tuple(p.describe() for p in recurrences.values())
        log += (sharded.describe(),) if sharded is not None else ()
        return PassResult(module.with_jaxpr(new, plan=plans, layout=sequence, mesh=mesh,
                                            cp_axes=axes, balance=balances,
                                            recurrences=tuple(recurrences.values()),
                                            sharded_sequence=sharded),
                          bool(eqns or recurrences), log)

    def plan_recurrences(self, module: Module, seq_axes, sequence: SequenceLayout | None, mesh,
                         axes: tuple[str, ...], hardware: Hardware | None,
                         limit: int | None) -> dict[int, RecurrencePlan]:
        """A :class:`RecurrencePlan` per ``recurrence_p`` equation, keyed by the equation's
        identity: each runs by the cheapest method its kind allows (the ``recurrences``
        option), over the program's layout ``sequence`` (``seq_axes``: the program's
        :class:`SeqAxesSummary`)."""
        found = [e for e in iter_eqns(module.jaxpr) if e.primitive is recurrence_p]
        if not found:
            return {}
        producers = {v: e for e in iter_eqns(module.jaxpr) for v in e.outvars}
        cp = module.facts.cp
        span = max(axis_spans(mesh, axes))
        return {id(eqn): plan_recurrence(index, eqn, seq_axes, producers, cp, sequence,
                                         hardware, limit, span, self.recurrences)
                for index, eqn in enumerate(found)}

    @staticmethod
    def shard_sequence(plans, found, lengths, hardware: Hardware | None, spans
                       ) -> tuple[tuple[AttentionPlan, ...], ShardedSequence | None]:
        """Where one value holds several sequences (frames × patches), the one to shard
        (:mod:`cptransform.analysis.sharded_sequence`; ``found``: each attention's
        :class:`AttentionAxes`), and ``plans`` with the attentions it lets run on each
        device's part of their batch planned ``local``."""
        chosen = [next((x for x in p.predictions if x.schedule == p.schedule), None)
                  for p in plans]
        if hardware is None or None in chosen:
            # Unpriced: every attention counts one, a local one half, a moved one two.
            time_s, compute_s, move_s = ([1.0] * len(plans), [0.5] * len(plans),
                                         [1.0] * len(plans))
        else:
            link = hardware.link(max(spans))
            time_s = [c.time_s for c in chosen]
            compute_s = [c.compute_s for c in chosen]
            move_s = [2 * p.shape.operand_bytes * (p.shape.cp - 1) / p.shape.cp ** 2
                      / link.bytes_per_s for p in plans]
        sharded = choose(found, time_s, compute_s, move_s, lengths)
        if sharded is None:
            return plans, None

        def local(i, p):
            s = sharded.sequence
            reason = (f"its batch dim {found[i].batch[s]} holds the sharded sequence {s}: "
                      "each device attends over its own part of the batch, no "
                      f"communication (planned otherwise: {p.schedule})")
            predictions = p.predictions if chosen[i] is None else (replace(
                chosen[i], schedule=LOCAL, time_s=compute_s[i], forward_s=compute_s[i] / 3.5,
                comm_s=0.0, bytes=0),) + p.predictions
            return replace(p, schedule=LOCAL, runner_up=p.schedule, reason=reason,
                           predictions=predictions,
                           bytes_per_device={LOCAL: 0, **p.bytes_per_device})

        return tuple(local(i, p) if i in sharded.local else p
                     for i, p in enumerate(plans)), sharded

    def plan_layout(self, eqns, layout: str, cp: int, mesh, axes: tuple[str, ...],
                    build: Schedule | None, hardware: Hardware | None,
                    limit: int | None, sequences) -> LayoutPlan:
        """Every attention planned under ``layout``, and the program's balance under it;
        ``build``: the two-axis schedule whose mesh is built from the one CP axis;
        ``sequences``: each attention's :class:`AttentionAxes` and the sequences' lengths
        (which of several sequences to shard is decided under each layout)."""
        log: tuple[str, ...] = ()
        degree_note = None
        if build is not None and eqns:
            inner, degree_note = self.choose_degree(build, eqns, cp, layout, hardware, limit)
            mesh, axes = two_axis_mesh(mesh, inner, build.inner.names), build.inner.names
            log += (degree_note,)
        # The first of two CP axes is the inner one (:class:`InnerAxis`).
        inner = mesh.shape[axes[0]] if len(axes) == 2 else 1
        spans = axis_spans(mesh, axes)
        plans = tuple(self.plan_one(i, e, cp, len(axes), inner, layout, hardware, limit,
                                    spans, degree_note) for i, e in enumerate(eqns))
        plans, sharded = self.shard_sequence(plans, *sequences, hardware, spans)
        known = schedules()
        # A local attention does the work of the schedule it was planned otherwise.
        flops = sum((rank_flops(known[p.runner_up if p.schedule == LOCAL else p.schedule]
                                .work(p.shape), cp) for p in plans), np.zeros(cp))
        times = [next((x.time_s for x in p.predictions if x.schedule == p.schedule), None)
                 for p in plans]
        time_s = None if None in times else sum(times)
        data = any(not mask_terms.positional(p.mask.terms()) for p in plans)
        balance = LayoutBalance(layout, tuple(p.schedule for p in plans),
                                tuple(float(f) for f in flops), time_s, data)
        return LayoutPlan(balance, plans, mesh, axes, log, sharded)

    def choose_degree(self, schedule: Schedule, eqns, cp: int, layout: str,
                      hardware: Hardware, limit: int) -> tuple[int, str]:
        """The inner degree of a two-axis ``schedule`` built from one CP axis, and why: the
        divisor ``1 < U < cp`` of cp (dividing every attention's KV heads when its
        :class:`InnerAxis` asks) with the least predicted total time among those that fit
        the memory limit."""
        shapes = [attention_shape(e.params["spec"], *(x.aval for x in e.invars[:3]), cp=cp,
                                  layout=layout) for e in eqns]
        kv = math.gcd(*(s.kv_heads for s in shapes)) if schedule.inner.divides_kv_heads \
            else cp
        what = schedule.inner.degree
        degrees = [u for u in range(2, cp) if cp % u == 0 and kv % u == 0]
        if not degrees:
            heads = (" and the KV heads (" + ", ".join(str(s.kv_heads) for s in shapes) + ")"
                     if schedule.inner.divides_kv_heads else "")
            raise PlanError(
                f"schedule={schedule.name!r} with cp={cp}: no {what} 1 < U < {cp} divides "
                f"{'both ' if heads else ''}cp{heads}; use schedule='ring' or 'auto', or pass "
                "a two-axis mesh")
        totals, fits = {}, {}
        for u in degrees:
            options = [replace(s, ulysses=u) for s in shapes]
            problem = next((p for p in map(schedule.feasible, options) if p), None)
            if problem:
                continue
            predictions = [schedule.predict(s, hardware) for s in options]
            totals[u] = sum(p.time_s for p in predictions)
            fits[u] = max(p.memory_bytes for p in predictions) <= limit
        ranked = sorted((u for u in totals if fits[u]), key=totals.get)
        if not ranked:
            raise PlanError(
                f"schedule={schedule.name!r} with cp={cp}: no {what} in {degrees} fits the "
                f"memory limit of {_mib(limit)} per device; raise memory_limit or cp")
        best = ranked[0]
        note = (f"{schedule.name} {what} {best} ({schedule.inner.outer} {cp // best}) on "
                f"{hardware.name}: "
                f"predicted {totals[best] * 1e3:.3g} ms over all attentions")
        if len(ranked) > 1:
            note += f"; runner-up degree {ranked[1]}: {totals[ranked[1]] * 1e3:.3g} ms"
        return best, note

    def plan_one(self, index: int, eqn, cp: int, mesh_axes: int, ulysses: int, layout: str,
                 hardware: Hardware | None, limit: int | None, spans: tuple[int, ...],
                 degree_note: str | None) -> AttentionPlan:
        """The plan of one attention equation (a function of the equation and the mesh):
        over ``mesh_axes`` CP axes, the first (inner) one of ``ulysses`` devices when
        there are two."""
        spec = eqn.params["spec"]
        shape = attention_shape(spec, *(x.aval for x in eqn.invars[:3]), cp=cp,
                                ulysses=ulysses, layout=layout)
        known = schedules()
        # Candidates run over as many mesh axes as the requested schedule, or under auto
        # as the plan has CP axes.
        axes = known[self.schedule].mesh_axes if self.schedule != "auto" else mesh_axes
        # Under auto only the schedules that take part in it (``Schedule.automatic``).
        candidates = {name: s for name, s in known.items() if s.mesh_axes == axes
                      and (s.automatic or self.schedule != "auto")}
        costs = {name: s.volume(shape).forward_total for name, s in candidates.items()}
        problems = {name: s.feasible(shape) or compat.compiler_crash(name)
                    for name, s in candidates.items()}
        q, _, v = (x.aval for x in eqn.invars[:3])
        local, kernel = choose_kernel(self.kernel, spec, q.dtype, (q.shape[spec.q.feature],
                                                                 v.shape[spec.v.feature]),
                                      kernels())
        # The kernel is chosen first: its measured rates (where the hardware row has them)
        # price every candidate's local steps.
        predictions = {} if hardware is None else {
            name: s.predict(shape, hardware, spans, local.name)
            for name, s in candidates.items() if problems[name] is None}
        ranked = tuple(sorted(predictions.values(), key=lambda p: p.time_s))
        where, library = compat.source_lines(eqn)
        plan = partial(AttentionPlan, index=index, source=where, mask=spec.mask, shape=shape,
                       dropout=spec.dropout is not None,
                       layout=layout, library_source=library, kernel=kernel,
                       bytes_per_device=costs, predictions=ranked)
        if self.schedule != "auto":
            chosen = known[self.schedule]
            problem = mesh_problem(chosen, mesh_axes) or chosen.feasible(shape) \
                or compat.compiler_crash(self.schedule)
            if problem:
                raise PlanError(f"attention at {where}: {problem}")
            reason = degree_note or "requested"
            mine = predictions.get(self.schedule)
            if mine is not None and mine.memory_bytes > limit:
                reason += (f"; note: its local step needs {_mib(mine.memory_bytes)}, over the "
                           f"memory limit of {_mib(limit)}")
            return plan(schedule=self.schedule, reason=reason)
        too_big = {p.schedule: p for p in ranked if p.memory_bytes > limit}
        ok = [p for p in ranked if p.schedule not in too_big]
        skipped = [f"{name}: {problem}" for name, problem in problems.items() if problem]
        skipped += [f"{name}: needs {_mib(p.memory_bytes)} per device, over the memory limit "
                    f"of {_mib(limit)}" for name, p in too_big.items()]
        if not ok:
            raise PlanError(f"attention at {where}: no schedule can run it: "
                            + "; ".join(skipped)
                            + ("; raise memory_limit or cp" if too_big else ""))
        best = ok[0]
        tied = [p for p in ok if p.time_s <= TIE * best.time_s
                and candidates[p.schedule].overlaps(shape)]
        if tied and not candidates[best.schedule].overlaps(shape):
            best = tied[0]
        runner_up = next((p for p in ok if p is not best), None)
        reason = (f"least predicted time on {hardware.name}: {best.time_s * 1e3:.3g} ms "
                  "fwd+bwd")
        if runner_up is not None:
            reason += (f"; runner-up {runner_up.schedule} {runner_up.time_s * 1e3:.3g} ms "
                       f"({runner_up.time_s / best.time_s:.2f}x)")
        else:
            reason += "; the only feasible schedule"
        if skipped:
            reason += "; excluded: " + "; ".join(skipped)
        return plan(schedule=best.schedule, reason=reason,
                    runner_up=runner_up.schedule if runner_up else None)

