"""Count the communication of a lowered program from its StableHLO text.

Communication is read from ``jax.jit(f).lower(...).as_text()``, not from the compiled HLO:
the CPU backend widens bf16 collectives to f32 and would double the bytes.

Per-device bytes follow one convention, the data one device puts on the wire for an
operand of ``b`` bytes in a group of ``n`` devices:

* ``all_to_all``: ``b·(n-1)/n`` (it keeps its own slice);
* ``all_gather``: ``b·(n-1)`` (what it receives, equal to what it forwards in a ring);
* ``reduce_scatter``: ``b·(n-1)/n``;
* ``all_reduce``: ``2·b·(n-1)/n`` (reduce-scatter then all-gather);
* ``collective_permute``: ``b`` (one send per pair).

Collectives inside ``stablehlo.while`` loops count once per iteration when the trip count
can be read off the loop (an ``LT`` compare of the counter with a constant, a constant
start and step, as ``fori_loop`` and ``scan`` emit); collectives in functions reached by
``func.call`` count once per call. A loop whose trip count cannot be read raises
:class:`CollectiveParseError` rather than report a wrong total.
"""
from __future__ import annotations

import json
import math
import re
from collections import Counter
from dataclasses import dataclass, field

COLLECTIVE_KINDS = ("all_to_all", "all_gather", "collective_permute", "reduce_scatter",
                    "all_reduce")

_ELEMENT_BYTES = {
    "i1": 1, "i8": 1, "ui8": 1, "i16": 2, "ui16": 2, "i32": 4, "ui32": 4, "i64": 8, "ui64": 8,
    "bf16": 2, "f16": 2, "f32": 4, "f64": 8, "f8E4M3FN": 1, "f8E5M2": 1,
}

_OP = re.compile(r'"?stablehlo\.(' + "|".join(COLLECTIVE_KINDS) + r')"?\(')
_FUNC = re.compile(r"func\.func\s+(?:public\s+|private\s+)?@([\w.$-]+)\(")
_CALL = re.compile(r"(?:func\.)?call\s+@([\w.$-]+)\(")
_TENSOR = re.compile(r"tensor<([^<>]*)>")
_SIGNATURE = re.compile(r":\s*\(([^()]*)\)\s*->\s*([^()]+|\([^()]*\))\s*$")
_GROUPS = re.compile(r"(replica_groups|source_target_pairs)\s*=\s*dense<([^>]*)>\s*:\s*"
                     r"tensor<([\dx]*)xi64>")
_CONST = re.compile(r"(%[\w#]+)\s*=\s*stablehlo\.constant\s+dense<(-?\d+)>\s*:\s*tensor<i\d+>")
_WHILE = re.compile(r"stablehlo\.while\((.*?)\)\s*:")
_COMPARE = re.compile(r"stablehlo\.compare\s+(LT|LE),\s*(%[\w#]+),\s*(%[\w#]+)")
_ADD = re.compile(r"stablehlo\.add\s+(%[\w#]+),\s*(%[\w#]+)")
_PARTITIONS = re.compile(r"mhlo\.num_partitions\s*=\s*(\d+)")


class CollectiveParseError(ValueError):
    """The StableHLO text holds something the counter cannot account for exactly."""


@dataclass(frozen=True)
class TensorType:
    """A ranked tensor type: shape and element type, e.g. ``tensor<1x8x4xbf16>``."""

    shape: tuple[int, ...]
    dtype: str

    @classmethod
    def parse(cls, text: str) -> "TensorType":
        *dims, dtype = text.split("x") if "x" in text else (text,)
        if dtype not in _ELEMENT_BYTES:
            raise CollectiveParseError(f"unknown element type {dtype!r} in tensor<{text}>")
        return cls(tuple(int(d) for d in dims), dtype)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _ELEMENT_BYTES[self.dtype]

    def __str__(self) -> str:
        return "x".join([*map(str, self.shape), self.dtype])


@dataclass(frozen=True)
class Collective:
    """One collective op of the program and the bytes one device sends for it.

    ``groups`` holds the replica groups (device ids per group) or, for
    ``collective_permute``, the ``(source, target)`` pairs. ``count`` is how many times it
    runs per program execution (loop trip counts times call sites); ``bytes_per_device`` is
    for one execution, ``total_bytes`` for all of them.
    """

    kind: str
    operands: tuple[TensorType, ...]
    results: tuple[TensorType, ...]
    groups: tuple[tuple[int, ...], ...]
    group_size: int
    function: str
    count: int = 1

    @property
    def dtype(self) -> str:
        return self.operands[0].dtype

    @property
    def operand_bytes(self) -> int:
        return sum(t.nbytes for t in self.operands)

    @property
    def bytes_per_device(self) -> int:
        b, n = self.operand_bytes, self.group_size
        if self.kind == "collective_permute":
            return b
        if self.kind == "all_gather":
            return b * (n - 1)
        if self.kind == "all_reduce":
            return 2 * b * (n - 1) // n
        return b * (n - 1) // n

    @property
    def total_bytes(self) -> int:
        return self.count * self.bytes_per_device

    def describe(self) -> str:
        shapes = ", ".join(map(str, self.operands))
        times = f" ×{self.count}" if self.count != 1 else ""
        return (f"{self.kind}({shapes}) group={self.group_size}{times}: "
                f"{self.bytes_per_device} B/device")


@dataclass
class CommunicationReport:
    """Every collective of a lowered program, with per-device byte totals."""

    collectives: list[Collective] = field(default_factory=list)

    @property
    def per_device_bytes(self) -> int:
        return sum(c.total_bytes for c in self.collectives)

    def bytes_by_kind(self) -> dict[str, int]:
        out: Counter = Counter()
        for c in self.collectives:
            out[c.kind] += c.total_bytes
        return dict(out)

    def counts(self) -> dict[str, int]:
        """How many times each kind of collective runs."""
        out: Counter = Counter()
        for c in self.collectives:
            out[c.kind] += c.count
        return dict(out)

    def of_kind(self, kind: str) -> list[Collective]:
        return [c for c in self.collectives if c.kind == kind]

    def describe(self) -> str:
        lines = [c.describe() for c in self.collectives]
        lines.append(f"total: {self.per_device_bytes} B/device")
        return "\n".join(lines)


def _strip_strings(line: str) -> str:
    """The line with string literals emptied (they may hold braces), op names kept."""
    return re.sub(r'"(?!stablehlo\.)(?:[^"\\]|\\.)*"', '""', line)


def _tensor_types(text: str) -> tuple[TensorType, ...]:
    return tuple(TensorType.parse(t) for t in _TENSOR.findall(text))


def _groups(attrs: str, partitions: int) -> tuple[tuple[tuple[int, ...], ...], str]:
    m = _GROUPS.search(attrs)
    if m is None:
        return (tuple(range(partitions)),), "replica_groups"
    name, body, shape = m.groups()
    dims = [int(d) for d in shape.split("x") if d]
    if not body or 0 in dims:
        return (tuple(range(partitions)),), name
    if body.lstrip().startswith("["):
        rows = json.loads(body)
    else:
        rows = [[int(body)] * dims[1] for _ in range(dims[0])]
    return tuple(tuple(r) for r in rows), name


@dataclass
class _Pending:
    kind: str
    attrs: str
    depth: int


@dataclass
class _Loop:
    init: dict[int, str]
    depth: int
    cond: tuple[str, str, str] | None = None
    step: int = 1
    trips: int | None = None
    in_body: bool = False


@dataclass
class _Function:
    collectives: list[tuple[str, tuple, tuple, str, int]] = field(default_factory=list)
    calls: list[tuple[str, int]] = field(default_factory=list)


def _trip_count(loop: _Loop, consts: dict[str, int]) -> int:
    if loop.cond is None:
        raise CollectiveParseError("a stablehlo.while loop has no counter compare in its "
                                   "condition; cannot count the collectives in its body")
    op, lhs, rhs = loop.cond
    start_name = loop.init.get(lhs)
    if start_name not in consts or rhs not in consts:
        raise CollectiveParseError(
            f"cannot read the trip count of a stablehlo.while loop ({lhs} {op} {rhs}); "
            "the counter's start and limit must be constants")
    start, limit = consts[start_name], consts[rhs] + (op == "LE")
    return max(0, -(-(limit - start) // loop.step))


def count_collectives(text: str) -> CommunicationReport:
    """Every collective in a StableHLO module, with how often it runs per execution."""
    m = _PARTITIONS.search(text)
    partitions = int(m.group(1)) if m else 1
    functions: dict[str, _Function] = {}
    current: _Function | None = None
    name = ""
    depth = 0
    consts: dict[str, int] = {}
    loops: list[_Loop] = []
    pending: list[_Pending] = []

    def multiplier() -> int:
        return math.prod(loop.trips for loop in loops if loop.in_body)

    def record(kind: str, attrs: str, signature: str) -> None:
        sig = _SIGNATURE.search(signature)
        if sig is None:
            raise CollectiveParseError(f"no type signature found for stablehlo.{kind}")
        operands, results = _tensor_types(sig.group(1)), _tensor_types(sig.group(2))
        current.collectives.append((kind, operands, results, attrs, multiplier()))

    for raw in text.splitlines():
        line = _strip_strings(raw)
        fm = _FUNC.search(line)
        if fm:
            name = fm.group(1)
            current = functions.setdefault(name, _Function())
            consts = {}
        if current is None:
            depth += line.count("{") - line.count("}")
            continue
        cm = _CONST.search(line)
        if cm:
            consts[cm.group(1)] = int(cm.group(2))
        stripped = line.strip()
        if stripped.startswith("}") and loops and depth == loops[-1].depth + 1:
            loop = loops[-1]
            if stripped.startswith("} do {"):
                loop.trips = _trip_count(loop, consts)
                loop.in_body = True
            else:
                loops.pop()
        if stripped.startswith("})") and pending and depth == pending[-1].depth + 1:
            p = pending.pop()
            record(p.kind, p.attrs, line)
        om = _OP.search(line)
        if om:
            kind = om.group(1)
            if line.rstrip().endswith("{"):
                pending.append(_Pending(kind, line, depth))
            else:
                record(kind, line, line)
        for callee in _CALL.findall(line):
            if not fm:
                current.calls.append((callee, multiplier()))
        wm = _WHILE.search(line)
        if wm:
            init = {}
            for pair in wm.group(1).split(","):
                if "=" in pair:
                    lhs, rhs = (s.strip() for s in pair.split("=", 1))
                    init[lhs] = rhs
            loops.append(_Loop(init, depth))
        if loops and not loops[-1].in_body:
            cmp = _COMPARE.search(line)
            if cmp and cmp.group(2) in loops[-1].init:
                loops[-1].cond = cmp.groups()
        elif loops:
            am = _ADD.search(line)
            if am and am.group(1) in loops[-1].init and am.group(2) in consts:
                loops[-1].step = consts[am.group(2)]
        depth += line.count("{") - line.count("}")

    report = CommunicationReport()

    def walk(fn_name: str, times: int, stack: tuple[str, ...]) -> None:
        if fn_name in stack:
            raise CollectiveParseError(f"recursive call to @{fn_name}")
        fn = functions.get(fn_name)
        if fn is None:
            return
        for kind, operands, results, attrs, mult in fn.collectives:
            groups, _ = _groups(attrs, partitions)
            size = len(groups[0]) if kind != "collective_permute" else 2
            report.collectives.append(Collective(kind, operands, results, groups, size,
                                                 fn_name, times * mult))
        for callee, mult in fn.calls:
            walk(callee, times * mult, stack + (fn_name,))

    entry = "main" if "main" in functions else next(iter(functions), None)
    if entry is not None:
        walk(entry, 1, ())
    return report


def lower_and_count(fn, *args, **kwargs) -> CommunicationReport:
    """Lower ``jax.jit(fn)`` on ``args`` (arrays or ``jax.ShapeDtypeStruct``) and count."""
    import jax

    return count_collectives(jax.jit(fn).lower(*args, **kwargs).as_text())
