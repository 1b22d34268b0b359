"""What each way of running a recurrence across devices costs, and the planner's record.

Per device, for a recurrence of ``N`` steps along a sequence sharded over ``cp`` devices
(``n`` chunks per device: 1 contiguous, 2 zigzag), forward (the backward moves as much
again, the transposed collectives):

* ``prefix of totals``: an all-gather of each chunk's total, ``n·(cp-1)`` rows of the
  operands; ``N/cp`` local steps;
* ``state passing``: an all-gather of each chunk's summary (its composed affine map and
  offset, :func:`summary_bytes`), ``n·(cp-1)`` summaries; each chunk runs twice (the
  summary, with one extra linear pass per basis column of a matrix state, then the re-run
  from the true incoming state): ``(2 + columns)·N/cp`` steps;
* ``pipeline``: each device sends its final carry to the next, ``n`` carries; the devices
  run one after the other, ``N + N/cp`` steps of latency, memory ``∝ N/cp``;
* ``gather``: the iterated operands all-gathered, ``(cp-1)/cp`` of them; ``N`` steps on
  every device, memory ``∝ N``.

A step costs its FLOPs (dot products ``2·m·n·k``, other ops one per result element) at
the hardware row's rate, at least :attr:`~cptransform.analysis.hardware.Hardware.loop_step_s`
(a sequential loop's per-iteration overhead); the backward about twice the forward.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import numpy as np

from cptransform.analysis.hardware import Hardware
from cptransform.analysis.recurrence_axes import along_sequence, sequence_elsewhere
from cptransform.analysis.seq_axes import SeqAxes
from cptransform.ir import compat
from cptransform.ir.errors import PlanError
from cptransform.ir.module import iter_eqns
from cptransform.op.layouts import SequenceLayout
from cptransform.op.recurrence import Kind, Method, Recurrence

MiB = 2 ** 20

#: The methods each kind can run by (first: its own; gather always works).
METHODS = {Kind.PREFIX: (Method.PREFIX_OF_TOTALS,),
           Kind.AFFINE: (Method.STATE_PASSING, Method.GATHER),
           Kind.CARRIED: (Method.PIPELINE, Method.GATHER)}


@dataclass(frozen=True)
class MethodCost:
    """One method's predicted cost per device: forward ``bytes``, fwd+bwd ``time_s``
    (``None`` without a hardware row), and ``memory_bytes`` (the iterated values and the
    states the backward keeps)."""

    method: Method
    bytes: int
    time_s: float | None
    memory_bytes: int

    def describe(self) -> str:
        time = "" if self.time_s is None else f", predicted {self.time_s * 1e3:.3g} ms fwd+bwd"
        return (f"{self.method}: {self.bytes / MiB:.3f} MiB forward{time}, memory "
                f"{self.memory_bytes / MiB:.2f} MiB")


@dataclass(frozen=True)
class RecurrencePlan:
    """The decision for one recurrence (``index`` = order in the program): its ``method``
    (``None``: not along the sequence, run as the op it was), why, each candidate's
    :class:`MethodCost`, and its ``steps`` of ``chunk`` tokens each; ``crash``: why it
    is gathered although passing state fits it (this JAX's compiler crashes on it), which
    the transform warns of."""

    index: int
    source: str
    what: str
    kind: Kind
    method: Method | None
    reason: str
    costs: tuple[MethodCost, ...] = ()
    steps: int = 0
    chunk: int = 1
    crash: str = ""

    @property
    def chosen(self) -> MethodCost | None:
        return next((c for c in self.costs if c.method == self.method), None)

    def describe(self) -> str:
        what = f"recurrence #{self.index} at {self.source}: {self.what}"
        if self.method is None:
            return f"{what}: {self.reason}"
        grain = "" if self.chunk == 1 else f" of {self.chunk} tokens"
        return f"{what}: {self.method} ({self.reason}); {self.steps} steps{grain}"


def _nbytes(aval) -> int:
    return int(np.prod(aval.shape)) * np.dtype(aval.dtype).itemsize


def step_flops(rec: Recurrence, avals: list) -> int:
    """FLOPs of one step: a scan body's (dot products ``2·m·n·k``, other ops one per
    result element), or one combine per element of a step's slice."""
    if rec.loop is None:
        per_step = sum(int(np.prod(a.shape)) // a.shape[rec.axis]
                       for a, it in zip(avals, rec.iterated) if it)
        return per_step
    flops = 0
    for eqn in iter_eqns(rec.loop.body):
        size = sum(int(np.prod(v.aval.shape)) for v in eqn.outvars
                   if hasattr(v.aval, "shape"))
        if eqn.primitive.name == "dot_general":
            (lc, _), _ = eqn.params["dimension_numbers"]
            size *= 2 * math.prod(eqn.invars[0].aval.shape[d] for d in lc)
        flops += size
    return flops


def summary_bytes(rec: Recurrence, avals: list) -> tuple[int, int]:
    """``(bytes, basis columns)`` of one chunk's summary under state passing: per carry
    leaf its offset ``b`` (the carry) and its map ``A`` over the non-free dims and a copy
    of the mixed ones; the columns are the extra linear passes its map takes."""
    consts = rec.loop.consts
    total, columns = 0, 0
    for leaf, aval in zip(rec.carries, avals[consts:consts + rec.loop.carries]):
        itemsize = np.dtype(aval.dtype).itemsize
        total += _nbytes(aval)
        if not leaf.depends:
            continue
        shape = aval.shape
        inputs = math.prod(shape[d] for d in leaf.mixed)
        kept = math.prod(n for d, n in enumerate(shape) if d not in leaf.free)
        total += kept * inputs * itemsize
        pack = max((shape[d] for d in leaf.free), default=1) if leaf.mixed else 1
        columns = max(columns, -(-inputs // pack))
    return total, columns


def method_costs(rec: Recurrence, avals: list, out_avals: list, cp: int, chunks: int,
                 hardware: Hardware | None, span: int) -> tuple[MethodCost, ...]:
    """Each method of :data:`METHODS` for ``rec`` priced (see the module doc): ``avals``
    its operands', ``out_avals`` its results' ``ShapedArray``s; ``chunks`` per device,
    ``span`` the devices the CP group spans (its link class)."""
    iterated = [a for a, it in zip(avals, rec.iterated) if it]
    steps = iterated[0].shape[rec.axis]
    per_step = sum(_nbytes(a) for a in iterated) // steps
    outs_per_step = sum(_nbytes(a) for a, it in zip(out_avals, rec.iterated_out)
                        if it) // steps
    flops = step_flops(rec, avals)
    itemsize = max(np.dtype(a.dtype).itemsize for a in iterated)
    carry = sum(_nbytes(a) for a in avals[rec.loop.consts:rec.loop.consts + rec.loop.carries]
                ) if rec.loop is not None else per_step
    costs = []
    for method in METHODS[rec.kind]:
        if method is Method.PREFIX_OF_TOTALS:
            sent, runs, serial = chunks * (cp - 1) * per_step, steps / cp, 0
        elif method is Method.STATE_PASSING:
            summary, columns = summary_bytes(rec, avals)
            sent, runs, serial = chunks * (cp - 1) * summary, (2 + columns) * steps / cp, 0
        elif method is Method.PIPELINE:
            sent, runs, serial = chunks * carry, steps / cp, steps
        else:
            sent, runs, serial = (cp - 1) * per_step * steps // cp, steps, 0
        local = steps if method is Method.GATHER else -(-steps // cp)
        memory = local * (per_step + outs_per_step + carry)
        time = None
        if hardware is not None:
            link = hardware.link(span)
            step_s = max(flops / hardware.flops_per_s(itemsize), hardware.loop_step_s)
            time = 3 * (runs + serial) * step_s + 2 * (sent / link.bytes_per_s
                                                       + link.latency_s * (cp - 1))
        costs.append(MethodCost(method, int(sent), time, int(memory)))
    return tuple(costs)


def choose_method(costs: tuple[MethodCost, ...], limit: int | None) -> tuple[MethodCost, str]:
    """The method with the least predicted time among those fitting ``limit`` (ties and
    unpriced rows: the least memory), and why."""
    fits = [c for c in costs if limit is None or c.memory_bytes <= limit]
    over = [c for c in costs if c not in fits]
    fits = fits or list(costs)
    if len(costs) == 1:
        best, reason = costs[0], "the only method of its kind"
    elif all(c.time_s is not None for c in fits):
        best = min(fits, key=lambda c: (c.time_s, c.memory_bytes))
        reason = f"least predicted time: {best.time_s * 1e3:.3g} ms fwd+bwd"
        others = [c for c in fits if c is not best]
        if others:
            reason += "; runner-up " + ", ".join(
                f"{c.method} {c.time_s * 1e3:.3g} ms" for c in others)
    else:
        best = min(fits, key=lambda c: c.memory_bytes)
        reason = "least memory (no hardware row to price it)"
    if over and limit is not None:
        reason += "; excluded: " + ", ".join(
            f"{c.method} needs {c.memory_bytes / MiB:.2f} MiB, over the memory limit of "
            f"{limit / MiB:.2f} MiB" for c in over if c is not best)
    return best, reason


def plan_recurrence(index: int, eqn, axes: SeqAxes, producers: dict, cp: int,
                    layout: SequenceLayout | None, hardware: Hardware | None,
                    limit: int | None, span: int, choice: str = "auto") -> RecurrencePlan:
    """The :class:`RecurrencePlan` of one ``recurrence_p`` equation: ``None`` when its axis
    is not a sequence; ``gather`` when passing state cannot be exact (a const or carry
    holding the sequence, a second sequence dim, a length the chunks do not divide);
    otherwise its kind's methods priced and the cheapest chosen (``choice``, the
    ``recurrences`` option: ``gather`` gathers, ``pass`` takes the kind's own method,
    whatever they cost). ``layout``: the program's (``None``: contiguous); under zigzag a
    device holds two chunks of the steps when the steps' chunks of tokens fit its pieces."""
    rec = eqn.params["recurrence"]
    source = compat.source_line(eqn)
    plan = partial(RecurrencePlan, index, source, rec.describe(), rec.kind)
    iterated = [x for x, it in zip(eqn.invars, rec.iterated) if it]
    found = [along_sequence(axes, producers, x, rec.axis) for x in iterated]
    along = next((a for a in found if a is not None), None)
    if along is None:
        return plan(None, "its axis is not the sequence: left as it was")
    steps = iterated[0].aval.shape[rec.axis]
    chunks = 2 if layout is not None and layout.name == "zigzag" \
        and layout.coarsen(along.chunk) is not None else 1
    held = [x for x, it in zip(eqn.invars, rec.iterated) if not it and axes.dims(x)] + \
        [y for y, it in zip(eqn.outvars, rec.iterated_out) if not it and axes.dims(y)]
    problem = None
    if held:
        problem = "a value it holds whole (a const or carry) carries the sequence"
    elif any(sequence_elsewhere(axes, x, rec.axis) for x in iterated):
        problem = "an operand carries the sequence on a second dim"
    if steps % (cp * chunks):
        problem = f"its {steps} steps do not split into {cp * chunks} chunks"
    crash = compat.scan_compiler_crash(sum(rec.iterated)) \
        if rec.kind is Kind.PREFIX and rec.primitive is None else None
    if crash is not None and problem is None and choice == "pass":
        raise PlanError(f"recurrence #{index} at {source}: {crash}")
    if choice == Method.GATHER:
        problem = "recurrences='gather'"
    elif crash is not None and problem is None:
        return plan(Method.GATHER, f"gathered: {crash}", steps=steps, chunk=along.chunk,
                    crash=crash)
    avals = [compat.aval_of(x) for x in eqn.invars]
    out_avals = [compat.aval_of(y) for y in eqn.outvars]
    if problem is not None:
        return plan(Method.GATHER, f"gathered: {problem}", steps=steps, chunk=along.chunk)
    costs = method_costs(rec, avals, out_avals, cp, chunks, hardware, span)
    best, reason = choose_method(costs, limit)
    if choice == "pass":
        best, reason = costs[0], "recurrences='pass'"
    if rec.kind is Kind.CARRIED:
        reason += f"; not affine: {rec.why}"
    return plan(best.method, reason, costs, steps, along.chunk)
