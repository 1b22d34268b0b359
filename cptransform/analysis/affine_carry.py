"""Whether a scan's carry is affine in itself, ``h' = A(x_t)·h + b(x_t)``, and the shape of
its linear part ``A``, read off the body's jaxpr.

The carry is affine when, in the equations its next value depends on, it flows only
through maps the primitives table marks linear (:class:`~cptransform.analysis.primitives.
Linear`): sums, reshapes, slices and selects of carry-dependent values and carry-free
ones (``b``), and products (``mul``, ``dot_general``, a division's numerator) of a
carry-dependent value with a carry-free one (a coefficient of ``A``). The per-step outputs
may be any function of the carry and the inputs; they are not looked at.

Each carry leaf gets a :class:`~cptransform.op.recurrence.CarryMap`: every dim of a
carry-dependent value is *labelled* with the carry dim it indexes (the dim links of the
primitives table carry the labels through reshapes, transposes and contractions); a dim
that an op reads across (a contraction, a sum, a slice) or where two labels meet is
*mixed*, a dim along which some coefficient varies (a contraction's batch dim, a product
with a value that is not a broadcast along it) is *batch*, the rest are *free*. Each leaf
must depend on itself only (no coupling between leaves).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from cptransform.analysis.primitives import Family, Linear, acting_dims, facts, seq_links
from cptransform.ir import compat
from cptransform.op.recurrence import CarryMap


@dataclass
class _Leaf:
    mixed: set = field(default_factory=set)
    varying: set = field(default_factory=set)


def _floating(atom) -> bool:
    return np.issubdtype(compat.aval_of(atom).dtype, np.floating)


def carry_slice(body, carries: int) -> list[int]:
    """The indices of the body equations the next carry (the first ``carries`` results)
    depends on."""
    jaxpr = compat.open_jaxpr(body)
    wanted = {v for v in jaxpr.outvars[:carries] if not compat.is_literal(v)}
    needed = []
    for index in range(len(jaxpr.eqns) - 1, -1, -1):
        eqn = jaxpr.eqns[index]
        if any(v in wanted for v in eqn.outvars):
            needed.append(index)
            wanted |= {v for v in eqn.invars if not compat.is_literal(v)}
    return needed[::-1]


def _constant_dims(eqn, constant: dict) -> list[set[int]]:
    """Per result of a carry-free equation, the dims along which it is provably one value
    (a broadcast along them, or an elementwise op of such values)."""
    row = facts(eqn.primitive.name)
    out = eqn.outvars[0]
    if eqn.primitive.name == "broadcast_in_dim":
        x = eqn.invars[0]
        shape = compat.aval_of(x).shape
        kept = set(range(len(shape))) if compat.is_literal(x) else constant.get(x, set())
        mapped = {d: i for i, d in enumerate(eqn.params["broadcast_dimensions"])}
        return [{d for d in range(out.aval.ndim)
                 if d not in mapped or shape[mapped[d]] == 1 or mapped[d] in kept}]
    if row is not None and row.family is Family.ELEMENTWISE and len(eqn.outvars) == 1:
        dims = set(range(out.aval.ndim))
        for x in eqn.invars:
            if compat.is_literal(x) or compat.aval_of(x).ndim == 0:
                continue
            dims &= constant.get(x, set())
        return [dims]
    return [set() for _ in eqn.outvars]


def affine_carries(body, consts: int, carries: int) -> tuple[tuple[CarryMap, ...] | None, str]:
    """``(maps, "")`` with one :class:`CarryMap` per carry leaf when the scan body's carry
    is affine in itself, else ``(None, why)``."""
    jaxpr = compat.open_jaxpr(body)
    carry_in = jaxpr.invars[consts:consts + carries]
    for v in carry_in:
        if not _floating(v):
            return None, f"its carry holds a {v.aval.dtype} value (only float carries are affine)"
    needed = carry_slice(body, carries)
    labels = {v: tuple(range(v.aval.ndim)) for v in carry_in}
    leaf_of = {v: i for i, v in enumerate(carry_in)}
    leaves = [_Leaf() for _ in carry_in]
    constant: dict = {}
    needed_set = set(needed)
    for index, eqn in enumerate(jaxpr.eqns):
        dep = [i for i, x in enumerate(eqn.invars)
               if not compat.is_literal(x) and x in leaf_of]
        if not dep:
            constant.update(zip(eqn.outvars, _constant_dims(eqn, constant)))
            continue
        if index not in needed_set:
            continue
        why = _step(eqn, dep, labels, leaf_of, leaves, constant)
        if why:
            return None, f"{why} ({eqn.primitive.name} at {compat.source_line(eqn)})"
    maps = []
    for i, (v_in, v_out) in enumerate(zip(carry_in, jaxpr.outvars[:carries])):
        if compat.is_literal(v_out) or v_out not in leaf_of:
            maps.append(CarryMap(depends=False))
            continue
        if leaf_of[v_out] != i:
            return None, f"carry {i} is computed from carry {leaf_of[v_out]}"
        leaf = leaves[i]
        for d, label in enumerate(labels[v_out]):
            if label != d:
                leaf.mixed.add(d)
                if label is not None:
                    leaf.mixed.add(label)
        free = tuple(d for d in range(v_in.aval.ndim)
                     if d not in leaf.mixed and d not in leaf.varying)
        maps.append(CarryMap(True, tuple(sorted(leaf.mixed)), free))
    return tuple(maps), ""


def _step(eqn, dep: list[int], labels: dict, leaf_of: dict, leaves: list,
          constant: dict) -> str:
    """Carry ``eqn``'s labels to its results (``dep``: its carry-dependent operands);
    the reason it is not affine, or ``""``."""
    row = facts(eqn.primitive.name)
    linear = row.linear if row is not None else None
    if linear is None:
        return "the carry goes through an op that is not linear"
    owners = {leaf_of[eqn.invars[i]] for i in dep}
    if len(owners) > 1:
        return "two carry leaves meet"
    (owner,) = owners
    if any(not _floating(eqn.invars[i]) for i in dep) \
            or any(not _floating(o) for o in eqn.outvars):
        return "the carry becomes a non-float value"
    if linear is Linear.EACH and len(dep) > 1:
        return "the carry multiplies itself"
    if linear is Linear.NUMERATOR and dep != [0]:
        return "the carry divides"
    leaf = leaves[owner]
    acting = acting_dims(eqn)
    for i in dep:
        dims = set(range(eqn.invars[i].aval.ndim)) if acting is None else acting[i]
        leaf.mixed |= {labels[eqn.invars[i]][d] for d in dims} - {None}
    sources: dict = {}
    for a, da, b, db in seq_links(eqn):
        for (x, dx), (y, dy) in (((a, da), (b, db)), ((b, db), (a, da))):
            if y in eqn.outvars and x in eqn.invars:
                sources.setdefault((y, dy), []).append((x, dx))
    for out in eqn.outvars:
        result = []
        for d in range(out.aval.ndim):
            linked = sources.get((out, d), [])
            found = [labels[x][dx] for x, dx in linked if x in leaf_of and x in labels]
            # A coefficient (a product's other factor, a select's predicate) that is not
            # one value along this dim makes the map vary along it.
            for x, dx in linked:
                if x in leaf_of or compat.is_literal(x) or dx in constant.get(x, set()):
                    continue
                if linear is not Linear.JOINT or not _floating(x):
                    leaf.varying |= set(found) - {None}
            unique = set(found)
            if len(unique) == 1 and None not in unique:
                result.append(found[0])
            else:
                leaf.mixed |= unique - {None}
                result.append(None)
        labels[out] = tuple(result)
        leaf_of[out] = owner
    return ""
