"""Pass ``plan-context-parallel``: choose a schedule for each attention, and the layout.

Reads each ``attention_p`` (heads, KV heads, head dims, sequence length, mask) and picks
ring, Ulysses, all-gather or hybrid — the one asked for, or under ``auto`` the feasible one
moving the fewest bytes per device (ties and near-ties go to the ring, which overlaps its
transfers with compute). It also picks the sequence layout for the whole program
(``load_balance``; ``auto``: zigzag when an attention is causal). Both decisions are
written onto each ``attention_p`` equation (``spec.schedule``, ``spec.layout``), where
``lower-context-parallel`` reads them; the readable account, one :class:`AttentionPlan` per
attention, goes to ``module.facts.plan`` for ``explain()``, and the layout to
``module.facts.layout`` for ``reorder-sequence``. The CP size comes from the mesh only.
"""
from __future__ import annotations

from dataclasses import dataclass

from cptransform.analysis.cost_model import schedule_volume
from cptransform.ir import compat
from cptransform.ir.errors import PlanError
from cptransform.ir.facts import Fact
from cptransform.ir.module import Module, iter_eqns
from cptransform.ir.pipeline import Pass, PassResult
from cptransform.ir.rewrite import Rewriter
from cptransform.op.attention import attention_p
from cptransform.op.attention_spec import MaskSpec
from cptransform.op.layouts import SequenceLayout

SCHEDULE_NAMES = ("auto", "ring", "ulysses", "allgather", "hybrid")

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

    def describe(self) -> str:
        mib = {k: f"{v / 2**20:.2f} MiB" for k, v in self.bytes_per_device.items()}
        return (f"attention #{self.index} at {self.source}: {self.schedule} ({self.reason}); "
                f"mask {self.mask.describe()}; forward bytes/device {mib}")


@dataclass(frozen=True)
class AttentionShape:
    """The sizes that decide an attention's schedule."""

    seq_len: int
    heads: int
    kv_heads: int
    head_dim: int
    v_head_dim: int
    batch: int
    dtype_bytes: int
    cp: int
    ulysses: int = 1


def schedule_bytes(schedule: str, shape: AttentionShape) -> int:
    """Forward bytes per device of ``schedule`` (the cost model, positions included)."""
    return schedule_volume(
        schedule, seq=shape.seq_len, heads=shape.heads, kv_heads=shape.kv_heads,
        head_dim=shape.head_dim, v_head_dim=shape.v_head_dim, batch=shape.batch,
        dtype_bytes=shape.dtype_bytes, cp=shape.cp,
        ulysses=shape.ulysses if schedule == "hybrid" else None).forward_total


def attention_shape(eqn, cp: int, ulysses: int = 1) -> AttentionShape:
    """The cost-model view of one attention equation."""
    spec = eqn.params["spec"]
    q, k, v = (a.aval for a in eqn.invars[:3])
    dim = lambda x, layout, d: x.shape[d] if d is not None else 1  # noqa: E731
    batch = 1
    for d in spec.q.batch:
        batch *= q.shape[d]
    return AttentionShape(
        seq_len=q.shape[spec.q.seq], heads=dim(q, spec.q, spec.q.heads),
        kv_heads=dim(k, spec.k, spec.k.heads), head_dim=q.shape[spec.q.feature],
        v_head_dim=v.shape[spec.v.feature], batch=batch, dtype_bytes=q.dtype.itemsize,
        cp=cp, ulysses=ulysses)


def feasibility(schedule: str, shape: AttentionShape) -> str | None:
    """Why ``schedule`` cannot run ``shape`` (``None`` when it can)."""
    if shape.seq_len % shape.cp:
        return (f"sequence length {shape.seq_len} is not divisible by cp={shape.cp}; pad it "
                "to a multiple of cp")
    if schedule == "ulysses" and shape.heads % shape.cp:
        return (f"Ulysses splits the {shape.heads} query heads over cp={shape.cp} devices, "
                "which needs heads % cp == 0; use schedule='hybrid' with a Ulysses degree "
                "that divides the heads, or schedule='ring'")
    if schedule == "hybrid":
        if shape.ulysses <= 1:
            return "hybrid needs two mesh axes (axis=('uly', 'ring')) with a Ulysses degree > 1"
        if shape.heads % shape.ulysses:
            return (f"hybrid's Ulysses degree {shape.ulysses} does not divide the "
                    f"{shape.heads} query heads")
    return None


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
        if self.schedule not in SCHEDULE_NAMES:
            raise PlanError(f"unknown schedule {self.schedule!r}; use one of "
                            f"{', '.join(SCHEDULE_NAMES)}")
        if self.load_balance not in LOAD_BALANCES:
            raise PlanError(f"unknown load_balance {self.load_balance!r}; use one of "
                            f"{', '.join(LOAD_BALANCES)}")
        facts = module.facts
        cp = facts.cp
        ulysses = facts.mesh.shape[facts.cp_axes[0]] if len(facts.cp_axes) == 2 else 1
        eqns = [e for e in iter_eqns(module.jaxpr) if e.primitive is attention_p]
        plans = tuple(self.plan_one(i, e, cp, ulysses) for i, e in enumerate(eqns))
        layout = self.choose_layout(eqns, facts.seq_axes.seq_len, cp)

        def decide(eqn, invals):
            spec = eqn.params["spec"]
            schedule = self.plan_one(0, eqn, cp, ulysses).schedule
            return [attention_p.bind(*invals, spec=spec.replace(schedule=schedule,
                                                                  layout=layout))]

        new = Rewriter(rules={attention_p.name: decide}).run(module.jaxpr) if eqns \
            else module.jaxpr
        sequence = None if layout == "contiguous" or facts.seq_axes.seq_len is None else \
            SequenceLayout(layout, facts.seq_axes.seq_len, cp)
        log = tuple(p.describe() for p in plans) + (f"layout: {layout}",)
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

    def plan_one(self, index: int, eqn, cp: int, ulysses: int) -> AttentionPlan:
        """The plan of one attention equation (a function of the equation and the mesh)."""
        spec = eqn.params["spec"]
        shape = attention_shape(eqn, cp, ulysses)
        candidates = ("hybrid",) if self.schedule == "hybrid" or ulysses > 1 else \
            ("ring", "ulysses", "allgather")
        costs = {s: schedule_bytes(s, shape) for s in candidates}
        where = compat.source_line(eqn)
        if self.schedule != "auto":
            problem = feasibility(self.schedule, shape)
            if problem:
                raise PlanError(f"attention at {where}: {problem}")
            return AttentionPlan(index, where, spec.mask, self.schedule,
                                 "requested", shape, costs)
        ok = {s: c for s, c in costs.items() if feasibility(s, shape) is None}
        if not ok:
            raise PlanError(f"attention at {where}: "
                            f"{feasibility(candidates[0], shape)}")
        best = min(ok, key=ok.get)
        if "ring" in ok and ok["ring"] <= 1.1 * ok[best]:
            best, reason = "ring", "fewest bytes within 10%, and the ring overlaps transfers"
        else:
            others = ", ".join(f"{s} {c / ok[best]:.2f}x" for s, c in ok.items() if s != best)
            reason = f"fewest bytes per device ({others or 'only feasible schedule'})"
        skipped = [f"{s}: {feasibility(s, shape)}" for s in costs if s not in ok]
        if skipped:
            reason += "; not feasible: " + "; ".join(skipped)
        return AttentionPlan(index, where, spec.mask, best, reason, shape, costs)
