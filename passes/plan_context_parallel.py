"""Pass ``plan-context-parallel``: choose a schedule for each attention.

Reads each ``attention_p`` (heads, KV heads, head dims, sequence length, mask) and picks
ring, Ulysses, all-gather or hybrid — the one asked for, or under ``auto`` the feasible one
moving the fewest bytes per device (ties and near-ties go to the ring, which overlaps its
transfers with compute). The plan, one :class:`AttentionPlan` per attention in program
order, goes to ``module.meta["plan"]``; ``lower-context-parallel`` follows it and
``explain()`` prints it.
"""
from __future__ import annotations

from dataclasses import dataclass

from cptransform.ir import compat
from cptransform.op.attention import attention_p
from cptransform.op.attention_spec import MaskSpec
from cptransform.analysis.cost_model import schedule_volume
from cptransform.ir.module import Module, iter_eqns
from cptransform.ir.pipeline import Pass, PassResult, register
from cptransform.ir.errors import PlanError

SCHEDULE_NAMES = ("auto", "ring", "ulysses", "allgather", "hybrid")


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


@register
@dataclass(frozen=True)
class PlanContextParallel(Pass):
    """Choose ring / Ulysses / all-gather / hybrid per attention with the cost model."""

    name = "plan-context-parallel"
    summary = "choose a schedule per attention (cost model: bytes moved per device)"
    schedule: str = "auto"
    cp: int = 8
    ulysses: int = 1

    def run(self, module: Module) -> PassResult:
        if self.schedule not in SCHEDULE_NAMES:
            raise PlanError(f"unknown schedule {self.schedule!r}; use one of "
                            f"{', '.join(SCHEDULE_NAMES)}")
        plans = []
        eqns = [e for e in iter_eqns(module.jaxpr) if e.primitive is attention_p]
        for index, eqn in enumerate(eqns):
            plans.append(self.plan_one(index, eqn))
        log = tuple(p.describe() for p in plans)
        return PassResult(module.with_jaxpr(module.jaxpr, plan=tuple(plans)), False, log)

    def plan_one(self, index: int, eqn) -> AttentionPlan:
        spec = eqn.params["spec"]
        shape = attention_shape(eqn, self.cp, self.ulysses)
        candidates = ("hybrid",) if self.schedule == "hybrid" or self.ulysses > 1 else \
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
