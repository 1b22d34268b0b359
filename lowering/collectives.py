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

import itertools
import json
import math
import re
from collections import Counter
from dataclasses import dataclass, field

import jax

from cptransform.analysis.cost_model import WIRE

#: The collectives counted: those the cost model prices.
COLLECTIVE_KINDS = tuple(WIRE)

_ELEMENT_BYTES = {
    "i1": 1, "i8": 1, "ui8": 1, "i16": 2, "ui16": 2, "i32": 4, "ui32": 4, "i64": 8, "ui64": 8,
    "bf16": 2, "f16": 2, "f32": 4, "f64": 8, "f8E4M3FN": 1, "f8E5M2": 1,
}

_OP = re.compile(r'"?stablehlo\.(' + "|".join(COLLECTIVE_KINDS) + r')"?\(')
# A symbol is bare (@main) or quoted (JAX 0.12 names a lambda's function @"<lambda>").
_SYMBOL = r'@([\w.$-]+|"(?:[^"\\]|\\.)*")'
_FUNC = re.compile(r"func\.func\s+(?:public\s+|private\s+)?" + _SYMBOL + r"\(")
_CALL = re.compile(r"(?:func\.)?call\s+" + _SYMBOL + r"\(")
_TENSOR = re.compile(r"tensor<([^<>]*)>")
_SIGNATURE = re.compile(r":\s*\(([^()]*)\)\s*->\s*([^()]+|\([^()]*\))\s*$")
_GROUPS = re.compile(r"(replica_groups|source_target_pairs)\s*=\s*dense<([^>]*)>\s*:\s*"
                     r"tensor<([\dx]*)xi64>")
_CONST = re.compile(r"(%[\w#]+)\s*=\s*stablehlo\.constant\s+dense<(-?\d+)>\s*:\s*tensor<i\d+>")
_WHILE = re.compile(r"stablehlo\.while\((.*?)\)\s*:")
_COMPARE = re.compile(r"stablehlo\.compare\s+(LT|LE),\s*(%[\w#]+),\s*(%[\w#]+)")
_ADD = re.compile(r"stablehlo\.add\s+(%[\w#]+),\s*(%[\w#]+)")
_MESH = re.compile(r"sdy\.mesh\s+@([\w.$-]+)\s*=\s*<\[([^\]]*)\]"
                   r"(?:\s*,\s*device_ids\s*=\s*\[([^\]]*)\])?")
_MESH_AXES = re.compile(r"replica_group_mesh_axes<\s*mesh\s*=\s*@([\w.$-]+)\s*,\s*"
                        r"axes\s*=\s*\[([^\]]*)\]\s*>")
_AXIS = re.compile(r'"([^"]+)"\s*=\s*(\d+)')
_AXIS_REF = re.compile(r'axis_ref<\s*name\s*=\s*"([^"]+)"\s*(,[^>]*)?>')
_STRING = re.compile(r'@?"(?:[^"\\]|\\.)*"')
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
    ``collective_permute``, the ``(source, target)`` pairs (``group_size`` is then 2). ``count`` is how many times it
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
        """What one device puts on the wire for one execution (the convention above, the
        cost model's :data:`~cptransform.analysis.cost_model.WIRE`)."""
        return WIRE[self.kind](self.operand_bytes, self.group_size)

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
    """The line with string literals emptied (they may hold braces), op names and quoted
    symbol names kept."""
    return _STRING.sub(lambda m: m.group(0) if m.group(0).startswith(('"stablehlo.', '@'))
                       else '""', line)


def _tensor_types(text: str) -> tuple[TensorType, ...]:
    return tuple(TensorType.parse(t) for t in _TENSOR.findall(text))


@dataclass(frozen=True)
class _Mesh:
    """A Shardy mesh declared in the module (``sdy.mesh @name = <["a"=2, ...]>``)."""

    axes: tuple[tuple[str, int], ...]
    device_ids: tuple[int, ...] | None

    def groups(self, names: list[str]) -> tuple[tuple[int, ...], ...]:
        """The device groups of a collective over the mesh axes ``names`` (major first):
        devices that agree on every other axis, in ``names``' order."""
        sizes = dict(self.axes)
        unknown = [n for n in names if n not in sizes]
        if unknown:
            raise CollectiveParseError(f"collective over axes {unknown} not in the mesh "
                                       f"{list(sizes)}")
        others = [a for a, _ in self.axes if a not in names]
        strides, stride = {}, 1
        for a, size in reversed(self.axes):
            strides[a], stride = stride, stride * size

        def device(coords: dict[str, int]) -> int:
            index = sum(strides[a] * c for a, c in coords.items())
            return self.device_ids[index] if self.device_ids else index

        out = []
        for fixed in _product([sizes[a] for a in others]):
            group = [device({**dict(zip(others, fixed)), **dict(zip(names, moving))})
                     for moving in _product([sizes[a] for a in names])]
            out.append(tuple(group))
        return tuple(out)


def _product(sizes: list[int]):
    """Every coordinate tuple of a grid of ``sizes``, last coordinate fastest."""
    return itertools.product(*(range(n) for n in sizes))


def _meshes(text: str) -> dict[str, _Mesh]:
    """The Shardy meshes a module declares, by name."""
    out = {}
    for name, axes, ids in _MESH.findall(text):
        out[name] = _Mesh(tuple((a, int(n)) for a, n in _AXIS.findall(axes)),
                          tuple(int(i) for i in ids.split(",")) if ids.strip() else None)
    return out


def _groups(attrs: str, partitions: int,
            meshes: dict[str, _Mesh] | None = None) -> tuple[tuple[int, ...], ...]:
    """Replica groups or source-target pairs of an op (all devices when absent or empty).

    JAX 0.10 writes replica groups as a dense device-id array; JAX 0.12 as the mesh axes
    they span (``#stablehlo.replica_group_mesh_axes<mesh = @m, axes = [...]>``), read here
    against the module's ``sdy.mesh`` declarations."""
    by_axes = _MESH_AXES.search(attrs)
    if by_axes is not None:
        mesh = (meshes or {}).get(by_axes.group(1))
        if mesh is None:
            raise CollectiveParseError(f"replica groups name the mesh @{by_axes.group(1)}, "
                                       f"which the module does not declare")
        refs = _AXIS_REF.findall(by_axes.group(2))
        if any(extra for _, extra in refs):
            raise CollectiveParseError(f"replica groups over sub-axes: {by_axes.group(0)}")
        return mesh.groups([name for name, _ in refs])
    m = _GROUPS.search(attrs)
    if m is None:
        return (tuple(range(partitions)),)
    _, body, shape = m.groups()
    dims = [int(d) for d in shape.split("x") if d]
    if not body or 0 in dims:
        return (tuple(range(partitions)),)
    if body.lstrip().startswith("["):
        rows = json.loads(body)
    else:
        rows = [[int(body)] * dims[1] for _ in range(dims[0])]
    return tuple(tuple(r) for r in rows)


@dataclass(eq=False)
class _Loop:
    """A ``stablehlo.while`` being read: its counter's start, limit and step.

    Values are read when seen: SSA names repeat across sibling regions (cond and body).
    """

    start: dict[str, int | None]
    depth: int
    counter: str | None = None
    limit: int | None = None
    step: int = 1
    trips: int | None = None
    unreadable: str | None = None   # why ``trips`` could not be read
    in_body: bool = False

    def finish(self) -> None:
        """Read the trip count, or note why it cannot be read: only a loop that runs a
        collective needs one (a data-dependent loop of local work holds none)."""
        if self.counter is None:
            self.unreadable = ("a stablehlo.while loop has no counter compare in its "
                               "condition; cannot count the collectives in its body")
            return
        start = self.start[self.counter]
        if start is None or self.limit is None:
            self.unreadable = (f"cannot read the trip count of a stablehlo.while loop "
                               f"(counter {self.counter}); its start and limit must be "
                               f"constants")
            return
        self.trips = max(0, -(-(self.limit - start) // self.step))


def _times(loops: tuple[_Loop, ...]) -> int:
    """How often a collective inside ``loops`` runs per execution."""
    for loop in loops:
        if loop.trips is None:
            raise CollectiveParseError(loop.unreadable or "an unfinished stablehlo.while loop")
    return math.prod(loop.trips for loop in loops)


@dataclass
class _Site:
    """A collective or call found in a function, inside ``loops`` (outermost first)."""

    loops: tuple[_Loop, ...]
    kind: str = ""
    attrs: str = ""
    depth: int = 0
    callee: str = ""
    operands: tuple[TensorType, ...] = ()
    results: tuple[TensorType, ...] = ()


class _ModuleReader:
    """Reads StableHLO text line by line: functions, loops, collectives and calls.

    Region nesting is followed by counting braces outside string literals; a collective
    with a reduction region (all_reduce, reduce_scatter) gets its types from the line that
    closes the region.
    """

    def __init__(self):
        self.functions: dict[str, list[_Site]] = {}
        self.sites: list[_Site] | None = None
        self.depth = 0
        self.consts: dict[str, int] = {}
        self.loops: list[_Loop] = []
        self.pending: list[_Site] = []
        self.raw = ""

    def enclosing(self) -> tuple[_Loop, ...]:
        return tuple(loop for loop in self.loops if loop.in_body)

    def record(self, site: _Site, signature: str) -> None:
        sig = _SIGNATURE.search(signature)
        if sig is None:
            raise CollectiveParseError(f"no type signature found for stablehlo.{site.kind}")
        site.operands, site.results = _tensor_types(sig.group(1)), _tensor_types(sig.group(2))
        self.sites.append(site)

    def read(self, text: str) -> None:
        for raw in text.splitlines():
            line = _strip_strings(raw)
            function = _FUNC.search(line)
            if function:
                self.sites = self.functions.setdefault(function.group(1), [])
                self.consts = {}
            elif self.sites is not None:
                self.raw = raw
                self.read_body_line(line)
            self.depth += line.count("{") - line.count("}")

    def read_body_line(self, line: str) -> None:
        const = _CONST.search(line)
        if const:
            self.consts[const.group(1)] = int(const.group(2))
        stripped = line.strip()
        if stripped.startswith("}") and self.loops and self.depth == self.loops[-1].depth + 1:
            if stripped.startswith("} do {"):
                self.loops[-1].in_body = True
            else:
                self.loops.pop().finish()
        if stripped.startswith("})") and self.pending \
                and self.depth == self.pending[-1].depth + 1:
            self.record(self.pending.pop(), line)
        op = _OP.search(line)
        if op:
            site = _Site(self.enclosing(), kind=op.group(1), attrs=self.raw, depth=self.depth)
            if line.rstrip().endswith("{"):
                self.pending.append(site)
            else:
                self.record(site, line)
        for callee in _CALL.findall(line):
            self.sites.append(_Site(self.enclosing(), callee=callee))
        self.read_loop_line(line)

    def read_loop_line(self, line: str) -> None:
        loop_start = _WHILE.search(line)
        if loop_start:
            start = {}
            for pair in loop_start.group(1).split(","):
                if "=" in pair:
                    arg, value = (s.strip() for s in pair.split("=", 1))
                    start[arg] = self.consts.get(value)
            self.loops.append(_Loop(start, self.depth))
            return
        if not self.loops:
            return
        loop = self.loops[-1]
        if not loop.in_body:
            compare = _COMPARE.search(line)
            if compare and compare.group(2) in loop.start:
                op, loop.counter, limit = compare.groups()
                loop.limit = None if limit not in self.consts else \
                    self.consts[limit] + (op == "LE")
        else:
            add = _ADD.search(line)
            if add and add.group(1) == loop.counter and add.group(2) in self.consts:
                loop.step = self.consts[add.group(2)]


def count_collectives(text: str) -> CommunicationReport:
    """Every collective in a StableHLO module, with how often it runs per execution."""
    m = _PARTITIONS.search(text)
    partitions = int(m.group(1)) if m else 1
    reader = _ModuleReader()
    reader.read(text)
    meshes = _meshes(text)
    report = CommunicationReport()

    def walk(name: str, loops: tuple[_Loop, ...], stack: tuple[str, ...]) -> None:
        if name in stack:
            raise CollectiveParseError(f"recursive call to @{name}")
        for site in reader.functions.get(name, ()):
            if site.callee:
                walk(site.callee, loops + site.loops, stack + (name,))
                continue
            groups = _groups(site.attrs, partitions, meshes)
            size = 2 if site.kind == "collective_permute" else len(groups[0])
            report.collectives.append(Collective(site.kind, site.operands, site.results,
                                                 groups, size, name,
                                                 _times(loops + site.loops)))

    entry = "main" if "main" in reader.functions else next(iter(reader.functions), None)
    if entry is not None:
        walk(entry, (), ())
    return report


def lower_and_count(fn, *args, **kwargs) -> CommunicationReport:
    """Lower ``jax.jit(fn)`` on ``args`` (arrays or ``jax.ShapeDtypeStruct``) and count."""
    return count_collectives(jax.jit(fn).lower(*args, **kwargs).as_text())
