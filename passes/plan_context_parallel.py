"""Pass ``plan-context-parallel``: choose a schedule for each attention, and the layout.

Reads each ``attention_p`` (heads, KV heads, head dims, sequence length, mask) and picks
ring, Ulysses, all-gather or hybrid — the one asked for, or under ``auto`` the feasible one
moving the fewest bytes per device (ties and near-ties go to a schedule that overlaps its
transfers with compute: the ring). Volumes and feasibility come from each schedule's
:class:`~cptransform.lowering.schedule.Schedule` record. It also picks the sequence layout
for the whole program (``load_balance``; ``auto``: zigzag when an attention is causal and
the program's one sequence splits into ``2·cp`` chunks).
Both decisions are written onto each ``attention_p`` equation (``spec.schedule``,
``spec.layout``), where ``lower-context-parallel`` reads them; the readable account, one
:class:`AttentionPlan` per attention, goes to ``module.facts.plan`` for ``explain()``, and
the layout to ``module.facts.layout`` for ``reorder-sequence``. The CP size comes from the
mesh only.

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

from dataclasses import dataclass

from cptransform.analysis.attention_shape import AttentionShape, attention_shape
from cptransform.ir import compat
from cptransform.ir.errors import PlanError
from cptransform.ir.facts import Fact
from cptransform.ir.module import Module, iter_eqns
from cptransform.ir.pipeline import Pass, PassResult
from cptransform.ir.rewrite import Rewriter
from cptransform.lowering.schedule import Schedule, schedules
from cptransform.op.attention import attention_p
from cptransform.op.attention_spec import MaskSpec
from cptransform.op.layouts import SequenceLayout, layout_multiple

#: ``load_balance`` option → the layout it names (``auto`` is decided per program).
LOAD_BALANCES = {"auto": None, "zigzag": "zigzag", "striped": "striped",
                 "none": "contiguous"}


@dataclass(frozen=True)
class AttentionPlan:
    """The decision for one attention (``index`` = order in the program)."""

    index: int
    source: str
    mask: MaskSpec
    schedule: str
    reason: str
    shape: AttentionShape
    bytes_per_device: dict
    layout: str = "contiguous"

    def describe(self) -> str:
        mib = {k: f"{v / 2**20:.2f} MiB" for k, v in self.bytes_per_device.items()}
        return (f"attention #{self.index} at {self.source}: {self.schedule} ({self.reason}); "
                f"mask {self.mask.describe()}; forward bytes/device {mib}; padding "
                f"{self.shape.describe_padding()}")


def mesh_problem(schedule: Schedule, ulysses: int) -> str | None:
    """Why ``schedule`` does not fit the planned mesh: two CP axes (a Ulysses degree
    ``ulysses > 1``) or one."""
    axes = 2 if ulysses > 1 else 1
    if schedule.mesh_axes == axes:
        return None
    if schedule.mesh_axes == 2:
        return (f"{schedule.name} needs two mesh axes (axis=('uly', 'ring')) with a Ulysses "
                "degree > 1")
    return (f"{schedule.name} runs over one mesh axis, but the plan has two (Ulysses degree "
            f"{ulysses}); use a two-axis schedule or one mesh axis")


@dataclass(frozen=True)
class PlanContextParallel(Pass):
    """Choose ring / Ulysses / all-gather / hybrid per attention, and the sequence layout."""

    name = "plan-context-parallel"
    summary = ("choose a schedule per attention (cost model: bytes moved per device) and "
               "the layout; written onto each attention")
    requires = (Fact.MESH, Fact.SEQ_AXES)
    ensures = (Fact.PLAN,)
    schedule: str = "auto"
    load_balance: str = "auto"

    def run(self, module: Module) -> PassResult:
        names = ("auto", *schedules())
        if self.schedule not in names:
            raise PlanError(f"unknown schedule {self.schedule!r}; use one of "
                            f"{', '.join(names)}")
        if self.load_balance not in LOAD_BALANCES:
            raise PlanError(f"unknown load_balance {self.load_balance!r}; use one of "
                            f"{', '.join(LOAD_BALANCES)}")
        facts = module.facts
        cp = facts.cp
        ulysses = facts.mesh.shape[facts.cp_axes[0]] if len(facts.cp_axes) == 2 else 1
        eqns = [e for e in iter_eqns(module.jaxpr) if e.primitive is attention_p]
        seq_len = facts.seq_axes.seq_len
        layout = self.choose_layout(eqns, seq_len, cp)
        plans = tuple(self.plan_one(i, e, cp, ulysses, layout) for i, e in enumerate(eqns))

        # The re-trace walks these same equation objects (inside bodies too): the plan is
        # found by the equation's identity, never by the order of visits.
        schedule_of = {id(e): p.schedule for e, p in zip(eqns, plans)}

        def decide(eqn, invals):
            spec = eqn.params["spec"].replace(schedule=schedule_of[id(eqn)], layout=layout)
            return [attention_p.bind(*invals, spec=spec)]

        new = Rewriter(rules={attention_p.name: decide}).run(module.jaxpr) if eqns \
            else module.jaxpr
        reordered = layout != "contiguous" and seq_len is not None \
            and seq_len % layout_multiple(layout, cp) == 0
        sequence = SequenceLayout(layout, seq_len, cp) if reordered else None
        where = "" if reordered or layout == "contiguous" else \
            " (inside each attention only: " + (
                f"{len(facts.seq_axes.lengths)} sequences" if seq_len is None else
                f"length {seq_len} is not a multiple of {layout_multiple(layout, cp)}") + \
            "; the program stays in natural order)"
        log = tuple(p.describe() for p in plans) + (f"layout: {layout}{where}",)
        return PassResult(module.with_jaxpr(new, plan=plans, layout=sequence), bool(eqns),
                          log)

    def choose_layout(self, eqns, seq_len: int | None, cp: int) -> str:
        """``load_balance`` as a layout name; ``auto``: zigzag when some attention is causal
        and the length splits into 2·cp chunks, else contiguous."""
        chosen = LOAD_BALANCES[self.load_balance]
        if chosen is not None:
            return chosen
        causal = any(e.params["spec"].mask.band()[1] is not None for e in eqns)
        return "zigzag" if causal and seq_len and seq_len % (2 * cp) == 0 else "contiguous"

    def plan_one(self, index: int, eqn, cp: int, ulysses: int, layout: str) -> AttentionPlan:
        """The plan of one attention equation (a function of the equation, the mesh and the
        layout, which sets the lengths the sequences are padded to)."""
        spec = eqn.params["spec"]
        shape = attention_shape(spec, *(x.aval for x in eqn.invars[:3]), cp=cp,
                                ulysses=ulysses, layout=layout)
        known = schedules()
        # Candidates run over as many mesh axes as the requested schedule, or under auto
        # as the mesh has CP axes.
        axes = known[self.schedule].mesh_axes if self.schedule != "auto" else \
            2 if ulysses > 1 else 1
        candidates = {name: s for name, s in known.items() if s.mesh_axes == axes}
        costs = {name: s.volume(shape).forward_total for name, s in candidates.items()}
        where = compat.source_line(eqn)
        if self.schedule != "auto":
            chosen = known[self.schedule]
            problem = mesh_problem(chosen, ulysses) or chosen.feasible(shape)
            if problem:
                raise PlanError(f"attention at {where}: {problem}")
            return AttentionPlan(index, where, spec.mask, self.schedule,
                                 "requested", shape, costs, layout)
        problems = {name: s.feasible(shape) for name, s in candidates.items()}
        ok = {name: c for name, c in costs.items() if problems[name] is None}
        if not ok:
            raise PlanError(f"attention at {where}: {next(iter(problems.values()))}")
        best = min(ok, key=ok.get)
        overlapping = [name for name in ok
                       if candidates[name].overlaps and ok[name] <= 1.1 * ok[best]]
        if overlapping:
            best = overlapping[0]
            reason = f"fewest bytes within 10%, and the {best} overlaps transfers"
        else:
            others = ", ".join(f"{s} {c / ok[best]:.2f}x" for s, c in ok.items() if s != best)
            reason = f"fewest bytes per device ({others or 'only feasible schedule'})"
        skipped = [f"{name}: {problems[name]}" for name in costs if name not in ok]
        if skipped:
            reason += "; not feasible: " + "; ".join(skipped)
        return AttentionPlan(index, where, spec.mask, best, reason, shape, costs, layout)
