"""Recognise ``lax.associative_scan`` in its traced form, by reconstruction.

``lax.associative_scan(fn, elems, axis=d)`` traces as a tree of strided slices: the first
level combines ``elems[0:-1:2]`` with ``elems[1::2]`` by ``fn``, recurses on the result,
and interleaves by pads and adds. A candidate is read off the program and then proved:

1. *leaves*: values sliced ``[0:n-1:2]`` and ``[1:n:2]`` along one dim ``d``;
2. *combine*: the equations computed from those slices alone (literals aside), up to the
   next level's strided slices; its results, in the order the next level slices them;
3. the combine must be position-wise along ``d`` (no op reads across it: the primitives
   table's acting dims) and run at any length (:class:`~cptransform.op.recurrence.Combine`
   records which params hold the length);
4. *proof*: ``lax.associative_scan`` is traced again with that combine, and its equations
   are found in the program one by one, each on the images of its operands. A result whose
   whole computation was found is the scan's result; the rest of the program is untouched.

A reversed scan (``reverse=True``: its leaves and results reversed along ``d``) is proved
the same way from the reversed leaves.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import jax
import numpy as np
from jax import lax

from cptransform.analysis.primitives import Family, acting_dims, facts
from cptransform.analysis.seq_axes import linked_dims
from cptransform.ir import compat
from cptransform.ir.rewrite import interpret
from cptransform.op.recurrence import Combine

#: Params that hold a length: the combine runs at other lengths with them rewritten.
RESIZED = {"broadcast_in_dim": "shape", "reshape": "new_sizes", "iota": "shape"}
#: Families whose params hold no length (their shapes follow their operands).
SHAPELESS = (Family.ELEMENTWISE, Family.REDUCTION, Family.CONTRACTION)
SHAPELESS_NAMES = frozenset({"transpose", "squeeze"})


@dataclass(frozen=True)
class Found:
    """One associative scan proved in a jaxpr: its leaves (``elems``), the program's
    variables holding its results (``None`` where the program does not compute one), its
    combine, axis and direction."""

    elems: tuple
    outputs: tuple
    combine: Combine
    axis: int
    reverse: bool


def _stride_slice(eqn, start: int) -> tuple[int, int] | None:
    """``(dim, length)`` when ``eqn`` slices ``[start : ... : 2]`` along one dim of its
    operand, whole along the others (the even half ends at ``n - 1``, the odd at ``n``)."""
    if eqn.primitive.name != "slice":
        return None
    shape = eqn.invars[0].aval.shape
    strides = eqn.params.get("strides") or (1,) * len(shape)
    starts, limits = eqn.params["start_indices"], eqn.params["limit_indices"]
    dims = [d for d in range(len(shape))
            if (starts[d], limits[d], strides[d]) != (0, shape[d], 1)]
    if len(dims) != 1:
        return None
    (d,) = dims
    n = shape[d]
    want = n - 1 if start == 0 else n
    if strides[d] != 2 or starts[d] != start or limits[d] != want or n < 2:
        return None
    return d, n


class _Program:
    """Use-def indexes of one jaxpr."""

    def __init__(self, jaxpr):
        self.eqns = list(jaxpr.eqns)
        self.index = {id(e): i for i, e in enumerate(self.eqns)}
        self.users: dict = {}
        self.producer: dict = {}
        for eqn in self.eqns:
            for x in eqn.invars:
                if not compat.is_literal(x):
                    self.users.setdefault(x, []).append(eqn)
            for y in eqn.outvars:
                self.producer[y] = eqn
        self.outvars = {v for v in jaxpr.outvars if not compat.is_literal(v)}

    def halves(self, x, d: int, n: int):
        """The even and odd stride-2 slices of ``x`` along ``d``, or None."""
        even = odd = None
        for eqn in self.users.get(x, ()):
            if _stride_slice(eqn, 0) == (d, n) and even is None:
                even = eqn
            elif _stride_slice(eqn, 1) == (d, n) and odd is None:
                odd = eqn
        return (even, odd) if even is not None and odd is not None else None


def find_associative_scans(jaxpr) -> list[Found]:
    """Every associative scan proved in the open ``jaxpr`` (its own equations only)."""
    program = _Program(jaxpr)
    found, taken = [], set()
    for eqn in program.eqns:
        place = _stride_slice(eqn, 0)
        if place is None or compat.is_literal(eqn.invars[0]) or eqn.invars[0] in taken:
            continue
        leaf = eqn.invars[0]
        hit = _candidate(program, leaf, *place)
        if hit is not None:
            found.append(hit)
            taken.update(hit.elems)
    return found


def _candidate(program: _Program, seed, d: int, n: int) -> Found | None:
    halves = {seed: program.halves(seed, d, n)}
    if halves[seed] is None:
        return None
    region = _combine_region(program, halves, d, n)
    if region is None:
        return None
    eqns, leaves, outputs = region
    combine = _combine(eqns, [halves[x][0].outvars[0] for x in leaves]
                       + [halves[x][1].outvars[0] for x in leaves], outputs, d)
    if combine is None:
        return None
    reverse = all(program.producer.get(x) is not None
                  and program.producer[x].primitive.name == "rev"
                  and tuple(program.producer[x].params["dimensions"]) == (d,) for x in leaves)
    for rev in ((True, False) if reverse else (False,)):
        elems = tuple(program.producer[x].invars[0] for x in leaves) if rev else tuple(leaves)
        outs = _prove(program, elems, combine, d, rev)
        if outs is not None:
            return Found(elems, outs, combine, d, rev)
    return None


def _reads_across(eqn, values: set, d: int) -> bool:
    """``eqn`` reads a combine value across dim ``d`` (the next level's slices, the
    interleave): it belongs to the scan's tree, not to the combine."""
    acting = acting_dims(eqn)
    return any(acting is None or d in acting[i] for i, x in enumerate(eqn.invars)
               if not compat.is_literal(x) and x in values)


def _joined(program: _Program, outside: list, d: int, n: int):
    """``(constants made, halves of further leaves)`` when every operand of a combine
    equation from outside it is a constant the combine makes (``ones_like``) or a half of
    another leaf; ``None`` when one is not."""
    made, pairs = [], {}
    for x in outside:
        producer = program.producer.get(x)
        if producer is None:
            return None
        if all(map(compat.is_literal, producer.invars)):
            made.append(producer)
            continue
        leaf = producer.invars[0]
        pair = None if compat.is_literal(leaf) else program.halves(leaf, d, n)
        if pair is None or producer not in pair:
            return None
        pairs[leaf] = pair
    return made, pairs


def _combine_region(program: _Program, halves: dict, d: int, n: int):
    """The first level's combine: ``(equations, leaves in order, results in order)``."""
    values = {h.outvars[0] for pair in halves.values() for h in pair}
    eqns = []
    start = min(program.index[id(h)] for pair in halves.values() for h in pair)
    for eqn in program.eqns[start:]:
        ins = [x for x in eqn.invars if not compat.is_literal(x)]
        if not any(x in values for x in ins) or _reads_across(eqn, values, d):
            continue
        joined = _joined(program, [x for x in ins if x not in values], d, n)
        if joined is None:
            continue
        made, pairs = joined
        eqns += made + [eqn]
        halves.update(pairs)
        values |= {v for e in made + [eqn] for v in e.outvars}
        values |= {h.outvars[0] for pair in pairs.values() for h in pair}
    if not eqns:
        return None
    eqns = sorted(set(eqns), key=lambda e: program.index[id(e)])
    leaves = sorted(halves, key=lambda x: program.index[id(halves[x][0])])
    inner = set().union(*(set(e.outvars) for e in eqns))
    results = [v for v in inner if v in program.outvars
               or any(e not in eqns for e in program.users.get(v, ()))]
    nexts = {}
    for v in results:
        first = [program.index[id(e)] for e in program.users.get(v, ())
                 if _stride_slice(e, 0) == (d, n // 2)]
        if not first:
            return None
        nexts[v] = min(first)
    if len(results) != len(leaves):
        return None
    return eqns, leaves, sorted(results, key=nexts.get)


def _combine(eqns, inputs, outputs, d: int) -> Combine | None:
    """The combine as a :class:`Combine`, or None when it is not position-wise along
    ``d`` or holds a length it cannot rewrite."""
    def run(*xs):
        region = SimpleNamespace(constvars=[], invars=list(inputs), eqns=eqns,
                                 outvars=list(outputs))
        return interpret(region, [], xs,
                         lambda eqn, read: compat.bind_eqn(eqn, [read(x) for x in eqn.invars]))

    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in inputs]
    closed = compat.canonical_params(jax.make_jaxpr(run)(*avals))
    jaxpr = compat.open_jaxpr(closed)
    if compat.consts_of(closed):
        return None
    seeds = [(v, d) for v in jaxpr.invars]
    candidates = [(v, k) for e in jaxpr.eqns for v in e.outvars for k in range(v.aval.ndim)]
    along = linked_dims(closed, seeds, candidates) | set(seeds)
    resize = []
    for index, eqn in enumerate(jaxpr.eqns):
        name = eqn.primitive.name
        row = facts(name)
        if list(compat.eqn_subjaxprs(eqn)) or row is None:
            return None
        acting = acting_dims(eqn)
        for i, x in enumerate(eqn.invars):
            if compat.is_literal(x):
                continue
            on_axis = {k for k in range(x.aval.ndim) if (x, k) in along}
            if acting is None or acting[i] & on_axis:
                return None
        out_axis = tuple(k for k in range(eqn.outvars[0].aval.ndim)
                         if (eqn.outvars[0], k) in along)
        if name in RESIZED:
            if name == "iota" and eqn.params["dimension"] in out_axis:
                return None
            if out_axis:
                resize.append((index, RESIZED[name], out_axis))
        elif row.family not in SHAPELESS and name not in SHAPELESS_NAMES:
            return None
    if any((v, d) not in along for v in jaxpr.outvars):
        return None
    return Combine(closed, len(outputs), d, tuple(resize))


def _same(recon, orig) -> bool:
    """Whether two equations compute the same thing from operands already matched."""
    if recon.primitive is not orig.primitive or len(recon.invars) != len(orig.invars):
        return False
    return recon.params == orig.params


def _prove(program: _Program, elems: tuple, combine: Combine, d: int,
           reverse: bool) -> tuple | None:
    """The program's variables holding ``lax.associative_scan(combine, elems)``'s results
    (None where it does not compute one), or None when none of them is found."""
    avals = [jax.ShapeDtypeStruct(x.aval.shape, x.aval.dtype) for x in elems]
    recon = compat.open_jaxpr(compat.canonical_params(jax.make_jaxpr(
        lambda *xs: lax.associative_scan(combine, xs, reverse=reverse, axis=d))(*avals)))
    image: dict = dict(zip(recon.invars, elems))
    for eqn in recon.eqns:
        ins = [x for x in eqn.invars if not compat.is_literal(x)]
        if any(x not in image for x in ins):
            continue
        pool = program.users.get(image[ins[0]], ()) if ins else program.eqns
        match = next((e for e in pool if _same(eqn, e) and _operands_match(eqn, e, image)),
                     None)
        if match is not None:
            image.update(zip(eqn.outvars, match.outvars))
    outputs = tuple(image.get(v) if not compat.is_literal(v) else None for v in recon.outvars)
    return outputs if any(o is not None for o in outputs) else None


def _operands_match(recon, orig, image: dict) -> bool:
    for a, b in zip(recon.invars, orig.invars):
        if compat.is_literal(a):
            if not compat.is_literal(b):
                return False
            va, vb = np.asarray(compat.literal_value(a)), np.asarray(compat.literal_value(b))
            if va.dtype != vb.dtype or not np.array_equal(va, vb):
                return False
        elif compat.is_literal(b) or image.get(a) is not b:
            return False
    return True
