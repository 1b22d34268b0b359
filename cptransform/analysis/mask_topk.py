"""Top-k masks: a boolean scatter of True into all-False at a sparse indexer's picks.

``zeros.at[b, q, idx].set(True)`` and ``put_along_axis`` trace to a ``scatter`` whose
indices are iotas along every dim but one and a ``lax.top_k``'s indices along that one:
:func:`topk_scatter` reads it as a :class:`TopK` (the key positions each query selected).
"""
from __future__ import annotations

from typing import Any

from cptransform.analysis.mask_values import TOPK_DIM, Affine, Const, DimMap, Opaque, TopK
from cptransform.analysis.primitives import Moves, moving
from cptransform.ir import compat
from cptransform.ir.graph import Graph

#: Ops an index passes through unchanged on its way to the scatter.
_PASS_THROUGH = moving(Moves.IDENTITY, Moves.BARRIER)
_UNIT_RESHAPES = moving(Moves.RESHAPE, Moves.SQUEEZE)


def topk_scatter(analyzer, eqn, dims: DimMap, here: Opaque) -> TopK | None:
    """The :class:`TopK` a boolean scatter of True into all-False computes, or None
    (``analyzer``: the :class:`~cptransform.analysis.mask_analysis.MaskAnalyzer` reading
    the mask, which reads the operands).

    Every operand dim must be indexed by one scatter index component: an iota along
    one update dim (``arange`` broadcast, what advanced indexing and
    ``put_along_axis`` build) or, for exactly one dim, the indices output of a
    ``top_k`` whose other dims are those update dims and whose ``k`` dim is the one
    update dim no iota names. Anything else is data (None).
    """
    operand, indices, updates = eqn.invars
    dn = eqn.params["dimension_numbers"]
    nd = len(compat.aval_of(operand).shape)
    upd_shape = compat.aval_of(updates).shape
    if dn.update_window_dims or dn.operand_batching_dims \
            or sorted(dn.inserted_window_dims) != list(range(nd)) \
            or sorted(dn.scatter_dims_to_operand_dims) != list(range(nd)) \
            or compat.aval_of(indices).shape != (*upd_shape, nd):
        return None
    if analyzer.predicate(operand, dims) != Const(value=False) \
            or analyzer.predicate(updates, (None,) * len(upd_shape)) != Const(value=True):
        return None
    components = _index_components(analyzer.graph, indices, nd)
    if components is None:
        return None
    # Update dim u is labelled -1 - u while reading the components (no top dim is < 0).
    upd_dims = tuple(-1 - u for u in range(len(upd_shape))) + (None,)
    op_shape = compat.aval_of(operand).shape
    by_update: dict[int, int] = {}
    key = None
    for component, d in zip(components, dn.scatter_dims_to_operand_dims):
        value = analyzer.analyze(component, upd_dims)
        if isinstance(value, Affine) and value.const == 0 and len(value.coeffs) == 1 \
                and value.coeffs[0][1] == 1 and -1 - value.coeffs[0][0] not in by_update:
            u = -1 - value.coeffs[0][0]
            if upd_shape[u] != op_shape[d]:
                return None
            by_update[u] = d
            continue
        selected = _topk_indices(analyzer.graph, component, upd_shape)
        if selected is None or key is not None or dims[d] is None:
            return None
        key = (selected, d)
    if key is None:
        return None
    (top_k_indices, k_dim), key_d = key
    if set(by_update) | {k_dim} != set(range(len(upd_shape))) or k_dim in by_update:
        return None
    idx_dims = tuple(TOPK_DIM if u == k_dim else dims[by_update[u]]
                     for u in range(len(upd_shape)))
    return TopK(indices=Opaque.of(top_k_indices, idx_dims), key_dim=dims[key_d],
                origin=here)


def unwrapped_index(graph: Graph, eqn) -> Any:
    """``x`` when ``eqn`` is ``select_n(x < 0, x, x + n)`` (how ``jnp`` indexing wraps
    negative indices), else None."""
    if eqn.primitive.name != "select_n" or len(eqn.invars) != 3:
        return None
    pred, x, wrapped = eqn.invars
    test, plus = graph.producer(pred), graph.producer(wrapped)
    if test is None or plus is None or test.primitive.name != "lt" \
            or plus.primitive.name != "add" or test.invars[0] is not x \
            or plus.invars[0] is not x or not compat.is_literal(test.invars[1]) \
            or compat.literal_value(test.invars[1]) != 0 or not compat.is_literal(plus.invars[1]):
        return None
    return x


def _index_components(graph: Graph, indices: Any, n: int) -> list | None:
    """The ``n`` scatter index components (each ``[..., 1]``) that a concatenate along the
    last dim builds ``indices`` from, or None."""
    eqn = graph.producer(indices)
    if eqn is None or eqn.primitive.name != "concatenate" \
            or eqn.params["dimension"] != len(compat.aval_of(indices).shape) - 1 \
            or any(compat.aval_of(x).shape[-1] != 1 for x in eqn.invars) \
            or len(eqn.invars) != n:
        return None
    return list(eqn.invars)


def _topk_indices(graph: Graph, component: Any, upd_shape: tuple) -> tuple | None:
    """``(indices, k_dim)`` when ``component`` (``[*upd_shape, 1]``) is the indices output
    of a ``top_k`` of shape ``upd_shape`` (its ``k`` dim ``k_dim``), through the trailing
    unit dim and the negative-index wrap, else None."""
    atom = component
    while True:
        eqn = graph.producer(atom)
        if eqn is None:
            return None
        name = eqn.primitive.name
        if name == "broadcast_in_dim" and compat.aval_of(eqn.invars[0]).shape == upd_shape \
                and tuple(eqn.params["broadcast_dimensions"]) == tuple(range(len(upd_shape))):
            atom = eqn.invars[0]
        elif name in _PASS_THROUGH or (name in _UNIT_RESHAPES and compat.aval_of(
                eqn.invars[0]).shape == upd_shape):
            atom = eqn.invars[0]
        elif unwrapped_index(graph, eqn) is not None:
            atom = unwrapped_index(graph, eqn)
        elif name == "top_k" and atom is eqn.outvars[1] \
                and compat.aval_of(atom).shape == upd_shape:
            nd = len(upd_shape)
            return atom, eqn.params.get("axis", nd - 1) % nd
        else:
            return None
