"""One table of what cptransform knows about each JAX primitive, keyed by name.

Each row (:class:`PrimFacts`) says which :class:`Family` the primitive belongs to, how its
operand dims link to its result dims (the sequence axis flows along those links), which
dims it acts on, whether it is order-safe along the sequence, and the few facts passes
need beyond that (a reduction's identity, how a value-preserving op moves its value, what
kind of body a call carries). Families get a standard row in a loop; exceptions are
explicit rows. Every set of primitive names a pass or analysis needs is read off this
table (:func:`names_where`). A primitive missing from the table has no links, acts on
unknown dims and is not order-safe: it is refused or handled positionally, never guessed.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import Any, Callable

import numpy as np

from cptransform.analysis.dim_rules import (ActsOn, GroupRule, Link, LinkRule,
                                            acts_on_contracting,
                                            acts_on_dynamic_slice, acts_on_gather,
                                            acts_on_nothing, acts_on_pad, acts_on_param,
                                            acts_on_params, acts_on_recurrence,
                                            acts_on_seq_window,
                                            acts_on_slice, acts_on_top_k,
                                            groups_reshape, link_attention,
                                            link_broadcast_in_dim, link_concatenate,
                                            link_dot_general, link_dropping, link_gather,
                                            link_pairwise,
                                            link_recurrence, link_reshape, link_same_dims,
                                            link_seq_window,
                                            link_slice_like,
                                            link_sort, link_split, link_stack, link_top_k,
                                            link_transpose, link_unstack)
from cptransform.op.attention import attention_p
from cptransform.op.recurrence import recurrence_p
from cptransform.op.seq_permute import seq_permute_p
from cptransform.op.seq_window import seq_window_p


class Family(enum.Enum):
    """Kinds of primitive that share a standard row."""

    ELEMENTWISE = "elementwise"  # same shape in and out, position by position
    REDUCTION = "reduction"      # drops the dims it reduces
    CONTRACTION = "contraction"  # dot_general
    SHAPE = "shape"              # broadcast, reshape, squeeze, transpose: moves values only
    CUMULATIVE = "cumulative"    # running sums/maxima along one dim
    INDEXING = "indexing"        # slices, pads, concatenates, gathers, reversals, sorts
    CALL = "call"                # carries a body (jit, remat, loops, custom derivatives)
    ATTENTION = "attention"      # cptransform's own attention_p
    WINDOW = "window"            # reads a bounded window of neighbours along a dim
    RECURRENCE = "recurrence"    # cptransform's own recurrence_p: steps along one dim


class Linear(enum.Enum):
    """How a primitive's result depends on its floating-point operands, for the affine-carry
    analysis (``h' = A·h + b``: the carry may only flow through linear maps). Integer and
    boolean operands (indices, predicates) are parameters of the map, never linear in it."""

    JOINT = "joint"          # linear in its float operands together: sums, reshapes, slices
    EACH = "each"            # linear in each float operand, the others fixed: mul, dot_general
    NUMERATOR = "numerator"  # linear in its first operand only: div


class Moves(enum.Enum):
    """How a value-preserving primitive passes its (single) operand on."""

    IDENTITY = "identity"    # stop_gradient, copy: the same value
    BARRIER = "barrier"      # optimization_barrier: the same value, but a scheduling fence
    CAST = "cast"            # convert_element_type
    BROADCAST = "broadcast"  # broadcast_in_dim
    RESHAPE = "reshape"
    SQUEEZE = "squeeze"
    PERMUTE = "permute"      # transpose


class CallKind(enum.Enum):
    """What the body of a call-like primitive means."""

    JIT = "jit"                            # a jit boundary: inlining changes nothing
    CALL = "call"                          # a plain closed call
    REMAT = "remat"                        # a memory policy around the body
    CUSTOM_DERIVATIVE = "custom-derivative"  # custom_jvp / custom_vjp rules
    CONTROL_FLOW = "control-flow"          # scan, while, cond


@dataclass(frozen=True)
class PrimFacts:
    """What is known about one primitive.

    ``seq_link``: the dim links of an equation (None: none, the sequence does not flow
    through; calls link their bodies separately). ``acts_on``: per operand, the dims the
    op acts on (None: unknown, assume all); an op acting on no sequence dim keeps the
    token order even when it is not ``order_safe``. ``order_safe``: commutes with a
    permutation of any sequence dim it carries. ``shiftable``: can run on a sequence held
    unsliced (see ``reorder-sequence``). ``identity``: for reductions, the element that
    leaves the result unchanged. ``moves``: set when the op only moves, casts or
    broadcasts its operand. ``call``: for calls, what kind of body. ``inlinable``: a call
    whose body can be evaluated in place of it (jit, closed calls, remat, custom derivative
    rules; not control flow), which is what the rewriter inlines (:data:`INLINABLE`).
    ``linear``: how the result is linear in the operands (:class:`Linear`; None: not).
    """

    family: Family
    seq_link: LinkRule | None = None
    acts_on: ActsOn | None = None
    order_safe: bool = False
    shiftable: bool = False
    identity: Any = None
    moves: Moves | None = None
    call: CallKind | None = None
    inlinable: bool = False
    linear: Linear | None = None
    groups: GroupRule | None = None


ELEMENTWISE_NAMES = """
add add_any sub mul div rem pow max min neg sign floor ceil round is_finite exp exp2 log log1p expm1
tanh logistic log2 one_minus_square sin cos tan asin acos atan atan2 sinh cosh asinh acosh atanh sqrt rsqrt cbrt
abs integer_pow square erf erfc erf_inv lgamma digamma not and or xor eq ne lt le gt ge
select_n convert_element_type clamp nextafter shift_left shift_right_logical
shift_right_arithmetic population_count copy copy_p reduce_precision imag real conj complex
stop_gradient optimization_barrier sharding_constraint name
""".split()

#: Order-free reductions and their identity elements.
REDUCTION_IDENTITIES = {"reduce_sum": 0, "reduce_max": -np.inf, "reduce_min": np.inf,
                        "reduce_prod": 1, "reduce_and": True, "reduce_or": False,
                        "reduce_xor": False}

PRIMS: dict[str, PrimFacts] = {}

for _name in ELEMENTWISE_NAMES:
    PRIMS[_name] = PrimFacts(Family.ELEMENTWISE, link_same_dims, acts_on_nothing,
                             order_safe=True, shiftable=True)
for _name, _moves in {"stop_gradient": Moves.IDENTITY, "copy": Moves.IDENTITY,
                        "copy_p": Moves.IDENTITY, "optimization_barrier": Moves.BARRIER,
                        "convert_element_type": Moves.CAST,
                        # A model's own sharding annotation: the same value; lowering
                        # re-expresses it on the CP mesh (lower-context-parallel).
                        "sharding_constraint": Moves.IDENTITY,
                        # checkpoint_name: a label remat policies read, the same value.
                        "name": Moves.IDENTITY}.items():
    PRIMS[_name] = PrimFacts(Family.ELEMENTWISE, link_same_dims, acts_on_nothing,
                             order_safe=True, shiftable=True, moves=_moves)
# A device_put inside a traced function places each operand as its sharding says: the same
# values; lowering re-expresses a NamedSharding on the CP mesh, as for a constraint.
PRIMS["device_put"] = PrimFacts(Family.ELEMENTWISE, link_pairwise, acts_on_nothing,
                                order_safe=True)
for _name, _identity in REDUCTION_IDENTITIES.items():
    PRIMS[_name] = PrimFacts(Family.REDUCTION, link_dropping("axes"), acts_on_params("axes"),
                             order_safe=True, shiftable=True, identity=_identity)
# An argmax answers with a position: reordering the sequence changes it.
for _name in ("argmax", "argmin"):
    PRIMS[_name] = PrimFacts(Family.REDUCTION, link_dropping("axes"), acts_on_params("axes"))
for _name in ("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"):
    PRIMS[_name] = PrimFacts(Family.CUMULATIVE, link_same_dims, acts_on_param("axis"))

# A contraction over the sequence is exact in layout order only when both operands hold the
# contracted dims in the same order: the reorder pass aligns them per equation.
PRIMS["dot_general"] = PrimFacts(Family.CONTRACTION, link_dot_general, acts_on_contracting)

# Shape ops move values without reading across any dim (a reshape's merges and splits are
# followed by the layout analysis of ``reorder-sequence``).
PRIMS["broadcast_in_dim"] = PrimFacts(Family.SHAPE, link_broadcast_in_dim, acts_on_nothing,
                                      order_safe=True, shiftable=True, moves=Moves.BROADCAST)
PRIMS["reshape"] = PrimFacts(Family.SHAPE, link_reshape, acts_on_nothing, order_safe=True,
                             shiftable=True, moves=Moves.RESHAPE, groups=groups_reshape)
PRIMS["squeeze"] = PrimFacts(Family.SHAPE, link_dropping("dimensions"), acts_on_nothing,
                             order_safe=True, shiftable=True, moves=Moves.SQUEEZE)
PRIMS["transpose"] = PrimFacts(Family.SHAPE, link_transpose, acts_on_nothing,
                               order_safe=True, moves=Moves.PERMUTE)
# JAX 0.12's stack puts whole operands side by side along a new dim; unstack takes them
# apart along one.
PRIMS["stack"] = PrimFacts(Family.SHAPE, link_stack, acts_on_nothing, order_safe=True)
PRIMS["unstack"] = PrimFacts(Family.INDEXING, link_unstack, acts_on_param("axis"))

# Indexing ops are positional along the dims they act on and keep the order of the others.
PRIMS["gather"] = PrimFacts(Family.INDEXING, link_gather, acts_on_gather, shiftable=True)
PRIMS["slice"] = PrimFacts(Family.INDEXING, link_slice_like, acts_on_slice)
PRIMS["dynamic_slice"] = PrimFacts(Family.INDEXING, link_slice_like, acts_on_dynamic_slice)
PRIMS["pad"] = PrimFacts(Family.INDEXING, link_slice_like, acts_on_pad)
PRIMS["concatenate"] = PrimFacts(Family.INDEXING, link_concatenate, acts_on_param("dimension"))
PRIMS["split"] = PrimFacts(Family.INDEXING, link_split, acts_on_param("axis"))
PRIMS["rev"] = PrimFacts(Family.INDEXING, link_same_dims, acts_on_params("dimensions"))
# A sort permutes along its dimension by value; its other dims keep their order.
# A layout conversion (reorder-sequence's): it moves tokens along its dim, keeping every dim.
PRIMS[seq_permute_p.name] = PrimFacts(Family.INDEXING, link_same_dims, acts_on_param("dim"))
PRIMS["sort"] = PrimFacts(Family.INDEXING, link_sort, acts_on_param("dimension"))
# A top-k answers with positions along its dim (like argmax): reordering the sequence there
# changes them, so it runs in natural order; its other dims (a sparse indexer's queries)
# keep their order.
PRIMS["top_k"] = PrimFacts(Family.INDEXING, link_top_k, acts_on_top_k)

for _name, _kind in {"pjit": CallKind.JIT, "jit": CallKind.JIT,
                     "closed_call": CallKind.CALL, "core_call": CallKind.CALL,
                     "remat": CallKind.REMAT, "remat2": CallKind.REMAT,
                     "checkpoint": CallKind.REMAT,
                     "custom_jvp_call": CallKind.CUSTOM_DERIVATIVE,
                     "custom_vjp_call": CallKind.CUSTOM_DERIVATIVE,
                     "custom_vjp_call_jaxpr": CallKind.CUSTOM_DERIVATIVE,
                     "scan": CallKind.CONTROL_FLOW, "while": CallKind.CONTROL_FLOW,
                     "cond": CallKind.CONTROL_FLOW}.items():
    PRIMS[_name] = PrimFacts(Family.CALL, call=_kind,
                             inlinable=_kind is not CallKind.CONTROL_FLOW)

PRIMS[attention_p.name] = PrimFacts(Family.ATTENTION, link_attention)
PRIMS[recurrence_p.name] = PrimFacts(Family.RECURRENCE, link_recurrence, acts_on_recurrence)

# Windowed ops along the sequence run with a halo exchange once match-windows wraps them as
# seq_window_p (layout-aware: reorder-sequence keeps them in layout order); the raw ones
# (strided, several windowed dims, a generic reduction) carry no links, and the CP lowering
# refuses them on a sharded sequence: XLA's partitioning of some of their gradients
# (select_and_scatter) on a sharded window dim is wrong.
PRIMS[seq_window_p.name] = PrimFacts(Family.WINDOW, link_seq_window, acts_on_seq_window)
for _name in ("reduce_window", "reduce_window_max", "reduce_window_min", "reduce_window_sum",
              "conv_general_dilated", "select_and_scatter", "select_and_scatter_add",
              "select_and_gather_add"):
    PRIMS[_name] = PrimFacts(Family.WINDOW)


# The linear column: a carry flowing only through these is affine in itself.
for _name, _linear in {
        **dict.fromkeys("add add_any sub neg copy copy_p stop_gradient convert_element_type "
                        "select_n broadcast_in_dim reshape squeeze transpose reduce_sum "
                        "concatenate pad slice dynamic_slice rev "
                        "cumsum".split(), Linear.JOINT),
        "mul": Linear.EACH, "dot_general": Linear.EACH, "div": Linear.NUMERATOR}.items():
    PRIMS[_name] = replace(PRIMS[_name], linear=_linear)


def facts(name: str) -> PrimFacts | None:
    """The row of primitive ``name``, or None when the table does not know it."""
    return PRIMS.get(name)


def names_where(test: Callable[[PrimFacts], bool]) -> frozenset[str]:
    """The names of the primitives whose row satisfies ``test``."""
    return frozenset(name for name, row in PRIMS.items() if test(row))


def names_of(*families: Family) -> frozenset[str]:
    """The names of the primitives in ``families``."""
    return names_where(lambda row: row.family in families)


def moving(*kinds: Moves) -> frozenset[str]:
    """The names of the value-preserving primitives that move their value as ``kinds``."""
    return names_where(lambda row: row.moves in kinds)


def calls(*kinds: CallKind) -> frozenset[str]:
    """The names of the call-like primitives of ``kinds``."""
    return names_where(lambda row: row.call in kinds)


def seq_links(eqn) -> list[Link]:
    """The dim links of one equation (none for a primitive without a link rule)."""
    row = PRIMS.get(eqn.primitive.name)
    return row.seq_link(eqn) if row is not None and row.seq_link is not None else []


def group_links(eqn) -> tuple[list, list]:
    """The group links and member links of one equation (none for a primitive that
    neither merges nor splits dims)."""
    row = PRIMS.get(eqn.primitive.name)
    return row.groups(eqn) if row is not None and row.groups is not None else ([], [])


def acting_dims(eqn) -> list[set[int]] | None:
    """Per operand, the dims along which an op indexes, reduces or contracts (``None``:
    unknown, assume all).

    A slice or split of the features or a concatenate of heads is order-free along the
    sequence even though ``slice``/``split``/``concatenate`` are positional in general.
    """
    row = PRIMS.get(eqn.primitive.name)
    return row.acts_on(eqn) if row is not None and row.acts_on is not None else None


#: The call-like primitives whose body the rewriter may evaluate inline (the ``inlinable``
#: column); every :class:`~cptransform.ir.rewrite.Rewriter` of a pass is given it.
INLINABLE = names_where(lambda row: row.inlinable)
