"""The plan of a transformed program as typed records, for programs to read.

:class:`Plan` is what ``ContextParallelFunction.plan(*args)`` returns and what
``cptransform plan --json`` prints: the mesh, the layout, one :class:`AttentionGroup` per
distinct attention (identical layers once, with their indices), the work and predicted time
of every candidate layout, the conversions the reorder placed, the softmaxes left alone and
the wall time of each pass. Every record is a frozen dataclass of plain values, so
``Plan.from_json(plan.to_json()) == plan``.
"""
from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass

from cptransform.analysis.attention_shape import AttentionShape
from cptransform.analysis.load_balance import LayoutBalance
from cptransform.analysis.prediction import Prediction
from cptransform.ir.module import Module
from cptransform.ir.pipeline import PassTiming


@dataclass(frozen=True)
class AttentionGroup:
    """Identical attentions (same source line, schedule, layout, kernel, mask, sizes and
    costs), listed once: ``indices`` are their numbers in program order.

    ``source`` is the nearest frame in the user's code, ``library_source`` the installed
    library's frame that emitted the attention (``None`` when the user wrote it); ``reason``
    why the schedule was chosen; ``kernel_reason`` why that local-step kernel; ``bytes_per_device`` the forward bytes per device of every
    candidate schedule; ``predictions`` the priced candidates, fastest first.
    """

    indices: tuple[int, ...]
    source: str
    library_source: str | None
    schedule: str
    reason: str
    layout: str
    kernel: str
    kernel_reason: str
    mask: str
    shape: AttentionShape
    bytes_per_device: dict[str, int]
    predictions: tuple[Prediction, ...]
    runner_up: str | None

    @property
    def label(self) -> str:
        """``attention #3``, or ``attentions #0–15 (16×)``."""
        if len(self.indices) == 1:
            return f"attention #{self.indices[0]}"
        return f"attentions #{index_ranges(self.indices)} ({len(self.indices)}×)"

    @property
    def chosen(self) -> Prediction | None:
        """The prediction of the chosen schedule (``None`` without a hardware row)."""
        return next((p for p in self.predictions if p.schedule == self.schedule), None)


@dataclass(frozen=True)
class Plan:
    """What the transform does to one program for one set of argument shapes.

    ``mesh`` maps axis names to sizes; ``layout`` is the chosen layout and ``reordered``
    whether the whole program runs in it (else each attention applies it inside);
    ``attentions`` one :class:`AttentionGroup` per distinct attention; ``layouts`` the
    :class:`LayoutBalance` of every candidate layout; ``conversions`` what the reorder
    placed around ops that are not order-safe; ``left_alone`` the softmaxes the matcher
    did not rewrite, with why; ``passes`` the wall time of each pass.
    """

    function: str
    mesh: dict[str, int]
    cp_axes: tuple[str, ...]
    cp: int
    layout: str
    reordered: bool
    attentions: tuple[AttentionGroup, ...]
    layouts: tuple[LayoutBalance, ...]
    conversions: tuple[str, ...]
    left_alone: tuple[str, ...]
    passes: tuple[PassTiming, ...] = ()

    @property
    def attention_count(self) -> int:
        """Attentions in the program (the groups' indices together)."""
        return sum(len(g.indices) for g in self.attentions)

    def to_json(self, **dump_args) -> str:
        """The plan as JSON (:meth:`from_json` reads it back)."""
        return json.dumps(dataclasses.asdict(self), **dump_args)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        """The plan :meth:`to_json` wrote."""
        return _load(cls, json.loads(text))


def index_ranges(indices: tuple[int, ...]) -> str:
    """``(0, 1, 2, 3, 8)`` → ``"0–3, 8"``."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ", ".join(f"{r[0]}–{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def build_plan(module: Module, passes: tuple[PassTiming, ...] = ()) -> Plan:
    """The :class:`Plan` of a module planned by ``plan-context-parallel`` (lowered or not)."""
    facts = module.facts
    groups: dict[tuple, list] = {}
    for p in facts.plan or ():
        entry = dict(source=p.source, library_source=p.library_source, schedule=p.schedule,
                     reason=p.reason, layout=p.layout,
                     kernel=p.kernel_name,
                     kernel_reason=p.kernel.split(":", 1)[-1].strip(),
                     mask=p.mask.describe() + (" dropout" if p.dropout else ""),
                     shape=p.shape, bytes_per_device=dict(p.bytes_per_device),
                     predictions=tuple(p.predictions), runner_up=p.runner_up)
        key = tuple((k, tuple(sorted(v.items())) if isinstance(v, dict) else v)
                    for k, v in entry.items())
        groups.setdefault(key, [entry, []])[1].append(p.index)
    chosen = next((b.layout for b in facts.balance if b.chosen), None)
    return Plan(
        function=module.name,
        mesh={k: int(v) for k, v in facts.mesh.shape.items()} if facts.mesh is not None
        else {},
        cp_axes=tuple(facts.cp_axes), cp=facts.cp,
        layout=facts.layout.name if facts.layout is not None else chosen or "contiguous",
        reordered=facts.layout is not None,
        attentions=tuple(AttentionGroup(indices=tuple(ix), **entry)
                         for entry, ix in groups.values()),
        layouts=tuple(facts.balance), conversions=tuple(facts.reorder_log),
        left_alone=tuple(str(m) for m in facts.matches or () if not m.rewritten),
        passes=tuple(passes))


def _load(tp, data):
    """``data`` (parsed JSON) as type ``tp``: dataclasses field by field, tuples, unions
    with ``None``, and plain values."""
    if dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        return tp(**{f.name: _load(hints[f.name], data[f.name])
                     for f in dataclasses.fields(tp) if f.init})
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_load(args[0], x) for x in data)
        return tuple(_load(a, x) for a, x in zip(args, data))
    if origin in (typing.Union, types.UnionType):
        if data is None:
            return None
        return _load(next(a for a in args if a is not type(None)), data)
    if origin is dict:
        return {k: _load(args[1], v) for k, v in data.items()}
    return data
