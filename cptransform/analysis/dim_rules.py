"""How an equation's operand dims relate to its result dims, one rule per kind of primitive.

Two kinds of rule, both read through :mod:`cptransform.analysis.primitives`:

* a *link rule* lists ``(atom, dim, atom, dim)`` pairs that are the same axis ("dim 1 of
  x is dim 2 of y"), contracting and batch dims of a contraction included;
* an *acting rule* gives, per operand, the dims along which an op indexes, reduces or
  contracts (a slice or split of the features acts only on the feature dim, so it is
  order-free along the sequence; a gather acts on the operand dims it indexes, never on
  its indices).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

from cptransform.ir import compat

Link = tuple[Any, int, Any, int]  # (atom, dim, atom, dim): the two dims are the same axis
#: Dims that hold one axis together, major first: ``(dim, chunk)`` per member, the member's
#: index ``i`` standing for ``i // chunk`` (a patch of ``chunk`` pixels is one token), so
#: the group's index is the row-major merge of its members'. ``((1, 1), (2, 1))`` is dims 1
#: and 2 of ``[B, H, W, C]`` merged into ``H·W`` tokens.
Group = tuple[tuple[int, int], ...]
#: ``(atom, group, atom, group)``: the two groups are the same axis (a reshape merging dims
#: into one, or splitting one into several).
GroupLink = tuple[Any, Group, Any, Group]
#: ``(atom, dim, atom, dim, factor)``: member ``(dim, c)`` of the first atom is member
#: ``(dim, c * factor)`` of the second (``factor`` 1: the same axis, as a :data:`Link`; a
#: reshape's major dim of a split is the high digit of the dim it splits, its chunk the
#: product of the minor dims' sizes).
MemberLink = tuple[Any, int, Any, int, int]
#: ``rule(eqn)``: the dim links of one equation.
LinkRule = Callable[[Any], list[Link]]
#: ``rule(eqn)``: for each operand, the set of its dims the op acts on.
ActsOn = Callable[[Any], list[set[int]]]
#: ``rule(eqn)``: the group links and member links of one equation (reshapes).
GroupRule = Callable[[Any], tuple[list, list]]


# -- link rules ------------------------------------------------------------------------------

def link_same_dims(eqn) -> list[Link]:
    """Elementwise: every operand of the result's rank keeps its dims (broadcast ones aside)."""
    out = eqn.outvars[0]
    links = []
    for atom in eqn.invars:
        if compat.is_literal(atom) or atom.aval.ndim != out.aval.ndim:
            continue
        for d in range(out.aval.ndim):
            if atom.aval.shape[d] == out.aval.shape[d]:
                links.append((atom, d, out, d))
    return links


def link_pairwise(eqn) -> list[Link]:
    """Operand ``i`` is result ``i``, dim for dim (``device_put`` of several arrays)."""
    return [(x, d, out, d) for x, out in zip(eqn.invars, eqn.outvars)
            if not compat.is_literal(x) for d in range(out.aval.ndim)]


def link_broadcast_in_dim(eqn) -> list[Link]:
    """Each operand dim to its ``broadcast_dimensions`` slot, unless it is broadcast."""
    x, out = eqn.invars[0], eqn.outvars[0]
    return [(x, i, out, d) for i, d in enumerate(eqn.params["broadcast_dimensions"])
            if x.aval.shape[i] == out.aval.shape[d]]


def reshape_dim_map(in_shape: tuple, out_shape: tuple) -> dict[int, int]:
    """Input dims that survive a reshape unchanged (same size, same position in the
    row-major order of elements), mapped to their output dims. Size-1 dims are ignored."""
    ins = [(i, n) for i, n in enumerate(in_shape) if n != 1]
    outs = [(j, n) for j, n in enumerate(out_shape) if n != 1]
    mapping, a, b = {}, 0, 0
    while a < len(ins) and b < len(outs):
        if ins[a][1] == outs[b][1]:
            mapping[ins[a][0]] = outs[b][0]
            a += 1
            b += 1
            continue
        pi, pj = ins[a][1], outs[b][1]
        a += 1
        b += 1
        while pi != pj:
            if pi < pj:
                pi *= ins[a][1]
                a += 1
            else:
                pj *= outs[b][1]
                b += 1
    return mapping


def reshape_groups(in_shape: Sequence[int], out_shape: Sequence[int]) -> list | None:
    """A reshape as ``(input dims, output dims)`` groups holding the same elements, in
    row-major order: ``((0,), (0,))`` keeps a dim, ``((1, 2), (1,))`` merges two,
    ``((1,), (1, 2))`` splits one. A size-1 dim joins the group after it (``[1, 6] ->
    [6]`` is one merge) unless both sides have one there; size-1 dims past the end are
    dropped ``((i,), ())`` or added ``((), (j,))``. None when a dim is empty."""
    if 0 in in_shape or 0 in out_shape:
        return None
    groups, a, b = [], 0, 0
    while a < len(in_shape) and b < len(out_shape):
        if in_shape[a] == out_shape[b] == 1:
            groups.append(((a,), (b,)))
            a, b = a + 1, b + 1
            continue
        gi, go = [a], [b]
        pi, po = in_shape[a], out_shape[b]
        a, b = a + 1, b + 1
        while pi != po:
            if pi < po:
                gi.append(a)
                pi *= in_shape[a]
                a += 1
            else:
                go.append(b)
                po *= out_shape[b]
                b += 1
        groups.append((tuple(gi), tuple(go)))
    groups += [((i,), ()) for i in range(a, len(in_shape))]
    groups += [((), (j,)) for j in range(b, len(out_shape))]
    return groups


def digit_stride(shape: Sequence[int], dim: int, inner: int = 1) -> int:
    """The row-major flat stride of a digit sitting in ``dim`` at stride ``inner`` within
    it (a full dim: ``inner`` 1)."""
    stride = inner
    for n in shape[dim + 1:]:
        stride *= n
    return stride


def digit_after_reshape(out_shape: Sequence[int], stride: int,
                        size: int) -> tuple[int, int, int] | None:
    """Where a digit of the row-major flat index (``size`` values at flat ``stride``: the
    sequence of ``[B, S, D]`` is ``(D, S)``) lands after a reshape to ``out_shape``, which
    keeps the flat index: ``(dim, inner, chunk)`` with the digit's high part (``size //
    chunk`` values) in output dim ``dim`` at stride ``inner`` inside it and its low part
    (``chunk`` values, ``1`` when the digit sits whole in ``dim``) in the dims after it.
    ``[B*S, D]`` puts it in dim 0 (inner 1), ``[B, S*D]`` in dim 1 (inner ``D``),
    ``[B, S/c, c, D]`` in dim 1 with chunk ``c``. ``None`` when the high part is spread
    over several dims."""
    top = stride * size
    lower = 1
    for dim in range(len(out_shape) - 1, -1, -1):
        n = out_shape[dim]
        upper = lower * n
        if n != 1 and lower < top <= upper:
            if upper % top:
                return None
            if stride >= lower:
                return (dim, stride // lower, 1) if stride % lower == 0 else None
            return (dim, 1, lower // stride) if lower % stride == 0 else None
        lower = upper
    return None


def unit_reshape_dims(src_shape: Sequence[int], out_shape: Sequence[int],
                      dims: tuple, *, forward: bool = False) -> tuple | None:
    """Labels across a reshape that only adds or drops size-1 dims (None for any other).

    ``dims`` label the output, and the input's labels are returned; with ``forward`` it is
    the other way round (``dims`` label the input)."""
    src_big = [i for i, n in enumerate(src_shape) if n != 1]
    out_big = [i for i, n in enumerate(out_shape) if n != 1]
    if [src_shape[i] for i in src_big] != [out_shape[i] for i in out_big]:
        return None
    if forward:
        src_big, out_big, src_shape = out_big, src_big, out_shape
    labels = [None] * len(src_shape)
    for i, o in zip(src_big, out_big):
        labels[i] = dims[o]
    return tuple(labels)


def link_reshape(eqn) -> list[Link]:
    """The dims that survive a reshape (see :func:`reshape_dim_map`)."""
    x, out = eqn.invars[0], eqn.outvars[0]
    return [(x, a, out, b) for a, b in reshape_dim_map(x.aval.shape, out.aval.shape).items()]


def _big_dims(shape: Sequence[int], dims: tuple[int, ...]) -> tuple[int, ...]:
    """``dims`` without the size-1 ones (they hold no index)."""
    return tuple(d for d in dims if shape[d] != 1)


def group_links_reshape(eqn) -> list[GroupLink]:
    """A reshape merging dims into one links the merged dims (a group, major first) to the
    result dim; a split links the dim to the group of dims it becomes. Size-1 dims are left
    out; dims that keep their size are :func:`link_reshape`'s."""
    x, out = eqn.invars[0], eqn.outvars[0]
    links = []
    for ins, outs in reshape_groups(x.aval.shape, out.aval.shape) or ():
        ins, outs = _big_dims(x.aval.shape, ins), _big_dims(out.aval.shape, outs)
        if len(ins) + len(outs) > 2 and min(len(ins), len(outs)) == 1:
            links.append((x, tuple((d, 1) for d in ins), out, tuple((d, 1) for d in outs)))
    return links


def member_links_reshape(eqn) -> list[MemberLink]:
    """The major dim of a merge or split as a member of the other side: in a merge of
    ``(d1, d2, ..)`` into ``e``, ``d1``'s index is ``e``'s divided by the minor dims' sizes
    (its chunk); in a split of ``d`` into ``(e1, e2, ..)``, ``e1`` is ``d`` in chunks of the
    minor dims' sizes (a row of patches of an image split ``H -> (H/p, p)``)."""
    x, out = eqn.invars[0], eqn.outvars[0]
    links = []
    for ins, outs in reshape_groups(x.aval.shape, out.aval.shape) or ():
        ins, outs = _big_dims(x.aval.shape, ins), _big_dims(out.aval.shape, outs)
        if len(ins) == 1 and len(outs) > 1:
            minor = math.prod(out.aval.shape[e] for e in outs[1:])
            links.append((out, outs[0], x, ins[0], minor))
        elif len(outs) == 1 and len(ins) > 1:
            minor = math.prod(x.aval.shape[d] for d in ins[1:])
            links.append((x, ins[0], out, outs[0], minor))
    return links


def groups_reshape(eqn) -> tuple[list[GroupLink], list[MemberLink]]:
    """A reshape's merges and splits (:func:`group_links_reshape`,
    :func:`member_links_reshape`)."""
    return group_links_reshape(eqn), member_links_reshape(eqn)


def link_dropping(param: str) -> LinkRule:
    """Rule for ops that remove the dims listed in ``params[param]`` (squeeze, reductions)."""
    def rule(eqn) -> list[Link]:
        x, out = eqn.invars[0], eqn.outvars[0]
        dropped = set(eqn.params[param])
        kept = [d for d in range(x.aval.ndim) if d not in dropped]
        return [(x, d, out, j) for j, d in enumerate(kept)]
    return rule


def link_transpose(eqn) -> list[Link]:
    """Each dim to where the permutation puts it."""
    x, out = eqn.invars[0], eqn.outvars[0]
    return [(x, src, out, dst) for dst, src in enumerate(eqn.params["permutation"])]


def link_dot_general(eqn) -> list[Link]:
    """Batch dims of both operands to the leading result dims, free dims after them in
    order, and each contracting dim of one operand to its partner in the other: a weight
    contracted with the sequence (learned pooling over ``[S]``, token mixing with
    ``[S, S]``) carries the sequence along that dim, and must be held in the same order."""
    lhs, rhs = eqn.invars
    out = eqn.outvars[0]
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    links = [(lhs, a, rhs, b) for a, b in zip(lc, rc)]
    for k, (a, b) in enumerate(zip(lb, rb)):
        links += [(lhs, a, out, k), (rhs, b, out, k)]
    pos = len(lb)
    for operand, contract, batch in ((lhs, lc, lb), (rhs, rc, rb)):
        for d in range(operand.aval.ndim):
            if d not in contract and d not in batch:
                links.append((operand, d, out, pos))
                pos += 1
    return [link for link in links
            if not compat.is_literal(link[0]) and not compat.is_literal(link[2])]


def link_gather(eqn) -> list[Link]:
    """Index batch dims and operand batching dims to the result's batch dims; whole
    (unsliced) operand dims to their offset dims."""
    operand, indices = eqn.invars
    out = eqn.outvars[0]
    dn = eqn.params["dimension_numbers"]
    batch_out = [d for d in range(out.aval.ndim) if d not in dn.offset_dims]
    index_dims = list(range(indices.aval.ndim - 1))
    links = [(indices, i, out, o) for i, o in zip(index_dims, batch_out)]
    for ob, ib in zip(dn.operand_batching_dims, dn.start_indices_batching_dims):
        links.append((operand, ob, out, batch_out[index_dims.index(ib)]))
    sliced = [d for d in range(operand.aval.ndim)
              if d not in dn.collapsed_slice_dims and d not in dn.operand_batching_dims]
    for d, o in zip(sliced, dn.offset_dims):
        if operand.aval.shape[d] == out.aval.shape[o]:
            links.append((operand, d, out, o))
    return links


def link_slice_like(eqn) -> list[Link]:
    """Positional ops keep their dims (with new sizes along sliced axes)."""
    x, out = eqn.invars[0], eqn.outvars[0]
    if x.aval.ndim != out.aval.ndim:
        return []
    return [(x, d, out, d) for d in range(x.aval.ndim)]


def link_split(eqn) -> list[Link]:
    """Every piece keeps the operand's dims (with a new size along the split axis)."""
    x = eqn.invars[0]
    return [(x, d, out, d) for out in eqn.outvars for d in range(x.aval.ndim)]


def link_sort(eqn) -> list[Link]:
    """Operand ``i`` to result ``i``, dim by dim (all operands share one shape)."""
    return [(x, d, out, d) for x, out in zip(eqn.invars, eqn.outvars)
            for d in range(x.aval.ndim)]


def top_k_axis(eqn) -> int:
    """The dim a ``top_k`` selects along (its ``axis`` param; the last dim where JAX has
    none)."""
    nd = eqn.invars[0].aval.ndim
    return eqn.params.get("axis", nd - 1) % nd


def link_top_k(eqn) -> list[Link]:
    """The operand's dims other than the selected one to both results' (values and
    indices); the ``k`` dim of the results is new."""
    x, axis = eqn.invars[0], top_k_axis(eqn)
    return [(x, d, out, d) for out in eqn.outvars for d in range(x.aval.ndim) if d != axis]


def acts_on_top_k(eqn) -> list[set[int]]:
    """A ``top_k`` reads across its selected dim."""
    return [{top_k_axis(eqn)}]


def link_concatenate(eqn) -> list[Link]:
    """Every operand keeps its dims."""
    out = eqn.outvars[0]
    return [(x, d, out, d) for x in eqn.invars if not compat.is_literal(x)
            for d in range(out.aval.ndim)]


def link_stack(eqn) -> list[Link]:
    """Every operand's dim ``d`` is the result's ``d`` before the new ``axis``, ``d + 1``
    from it on (JAX 0.12's ``stack``)."""
    out, axis = eqn.outvars[0], eqn.params["axis"]
    return [(x, d, out, d if d < axis else d + 1) for x in eqn.invars
            if not compat.is_literal(x) for d in range(x.aval.ndim)]


def link_unstack(eqn) -> list[Link]:
    """The operand's dims but ``axis`` to every result's (JAX 0.12's ``unstack``, the
    transpose of ``stack``)."""
    x, axis = eqn.invars[0], eqn.params["axis"]
    return [(x, d, out, d if d < axis else d - 1) for out in eqn.outvars
            for d in range(x.aval.ndim) if d != axis]


def link_attention(eqn) -> list[Link]:
    """Attention links its q and out dims (other than features), and each batch dim of q to
    the same batch dim of every other operand (k and v at their layouts' batch dims, the
    optional operands at their leading dims; not where one broadcasts it): a batch dim is
    one axis across the operands (the frames of a spatial attention over ``[B, T, P, H,
    D]``), whose order must agree in all of them. The keys' sequence and heads dims link
    nothing through it (cross-attention keys are a sequence of their own; GQA heads are
    not the queries')."""
    spec = eqn.params["spec"]
    q, out = eqn.invars[0], eqn.outvars[0]
    links = [(q, d, out, d) for d in range(q.aval.ndim) if d != spec.q.feature]
    batch_dims = {"k": spec.k.batch, "v": spec.v.batch}
    for name, operand in zip(spec.operand_names()[1:], eqn.invars[1:]):
        dims = batch_dims.get(name, range(len(spec.q.batch)))
        links += [(q, a, operand, b) for a, b in zip(spec.q.batch, dims)
                  if not compat.is_literal(operand)
                  and q.aval.shape[a] == operand.aval.shape[b]]
    return links


def link_seq_window(eqn) -> list[Link]:
    """A windowed op links the dims of its first operand that its result keeps in place
    (the windowed dim included); its other operands (a conv's kernel) link nothing."""
    x, out = eqn.invars[0], eqn.outvars[0]
    return [(x, d, out, d) for d in eqn.params["window"].kept]


# -- acting rules ----------------------------------------------------------------------------

def _on_first(eqn, dims: set[int]) -> list[set[int]]:
    """``dims`` of the first operand; the others (a pad value, slice start indices) are
    scalars or index operands the op does not act along."""
    return [set(dims)] + [set() for _ in eqn.invars[1:]]


def acts_on_nothing(eqn) -> list[set[int]]:
    """Elementwise ops read no dim across."""
    return [set() for _ in eqn.invars]


def acts_on_param(param: str) -> ActsOn:
    """Ops acting along the one dim ``params[param]`` of every operand (cumulative ops,
    concatenate, split, sort: the operands share one dim numbering)."""
    return lambda eqn: [{eqn.params[param]} for _ in eqn.invars]


def acts_on_params(param: str) -> ActsOn:
    """Ops acting along the dims listed in ``params[param]`` (reductions, rev)."""
    return lambda eqn: [set(eqn.params[param]) for _ in eqn.invars]


def acts_on_slice(eqn) -> list[set[int]]:
    """The dims a slice actually cuts or strides."""
    params, shape = eqn.params, eqn.invars[0].aval.shape
    strides = params.get("strides") or (1,) * len(shape)
    return _on_first(eqn, {d for d in range(len(shape)) if params["start_indices"][d] != 0
                           or params["limit_indices"][d] != shape[d] or strides[d] != 1})


def acts_on_pad(eqn) -> list[set[int]]:
    """The dims a pad actually pads."""
    return _on_first(eqn, {d for d, cfg in enumerate(eqn.params["padding_config"])
                           if tuple(cfg) != (0, 0, 0)})


def acts_on_seq_window(eqn) -> list[set[int]]:
    """A windowed op reads across its window's dim of the first operand, and all of the
    others (a conv's kernel)."""
    rest = [set(range(compat.aval_of(a).ndim)) for a in eqn.invars[1:]]
    return [{eqn.params["window"].dim}] + rest


def acts_on_dynamic_slice(eqn) -> list[set[int]]:
    """The dims a dynamic slice does not take whole."""
    shape = eqn.invars[0].aval.shape
    return _on_first(eqn, {d for d in range(len(shape))
                           if eqn.params["slice_sizes"][d] != shape[d]})


def acts_on_gather(eqn) -> list[set[int]]:
    """The operand dims a gather indexes or slices; not its batching dims (paired with the
    indices' own dims, as ``take_along_axis`` per token) and never the indices, whose dims
    become result dims in their order (an embedding lookup by tokens)."""
    dn, shape = eqn.params["dimension_numbers"], eqn.invars[0].aval.shape
    sliced = {d for d in range(len(shape)) if eqn.params["slice_sizes"][d] != shape[d]}
    return _on_first(eqn, (set(dn.start_index_map) | sliced) - set(dn.operand_batching_dims))


def acts_on_contracting(eqn) -> list[set[int]]:
    """A contraction sums over its contracting dims of both operands."""
    (lc, rc), _ = eqn.params["dimension_numbers"]
    return [set(lc), set(rc)]


def link_recurrence(eqn) -> list[Link]:
    """A recurrence links the axis of every operand and result that runs along it (the
    steps: a scan's ``xs`` and ``ys``); an elementwise-shaped one (a cumulative op, an
    associative scan) links each operand's dims to its result's, leaf by leaf. A scan's
    consts and carries link nothing through it."""
    rec = eqn.params["recurrence"]
    ins = [x for x, it in zip(eqn.invars, rec.iterated) if it and not compat.is_literal(x)]
    outs = [y for y, it in zip(eqn.outvars, rec.iterated_out) if it]
    if rec.loop is None:
        return [(x, d, y, d) for x, y in zip(ins, outs) for d in range(x.aval.ndim)]
    axis = rec.axis
    steps = ins + outs
    return [(a, axis, b, axis) for a, b in zip(steps, steps[1:])]


def acts_on_recurrence(eqn) -> list[set[int]]:
    """A recurrence reads across its axis; a scan's body may read across any dim of its
    step slices and of its consts and carries."""
    rec = eqn.params["recurrence"]
    if rec.loop is None:
        return [{rec.axis} if it else set(range(compat.aval_of(x).ndim))
                for x, it in zip(eqn.invars, rec.iterated)]
    return [set(range(compat.aval_of(x).ndim)) for x in eqn.invars]
