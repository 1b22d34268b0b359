"""The ``q·k`` product at the start of the logits chain: which operand is the query, which
the key, and a label for every dim.

The labels are the dims of the product's output: its batch dims ``0..nb-1`` (shared by q
and k), then the free dims of each operand, then the labels of dims the chain merged. The
key operand is the one owning the softmax axis; it must have exactly one free dim (its
sequence position).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cptransform.ir import compat
from cptransform.passes.match_attention.chain import ChainReader, Step
from cptransform.passes.match_attention.stats import NotAttention


@dataclass(frozen=True)
class QKProduct:
    """One q·k product read through its logits chain.

    ``q``/``k``: the operands; ``q_contract``/``k_contract``: their contracting dims;
    ``n_batch``: the number of shared batch dims (labels ``0..n_batch-1``); ``q_free``:
    the labels of q's free dims; ``kv``: the label of k's sequence dim; ``q_dims``/
    ``k_dims``: label -> operand dim; ``sizes``: label -> size; ``steps``: the chain read
    forward; ``labels``: the label of each dim of the softmax input; ``merged``: label ->
    its parts (outermost first) for dims the chain merged.
    """

    q: Any
    k: Any
    q_contract: int
    k_contract: int
    n_batch: int
    q_free: tuple
    kv: int
    q_dims: dict
    k_dims: dict
    sizes: dict
    steps: tuple[Step, ...]
    labels: tuple
    merged: dict


def read_qk_product(reader: ChainReader, chain: list, axis: int) -> QKProduct:
    """Read the walked ``chain`` (see :meth:`ChainReader.walk`) whose softmax is over
    ``axis`` of its last value."""
    qk = chain[0][0]
    (lc, rc), (lb, rb) = qk.params["dimension_numbers"]
    lhs, rhs = qk.invars
    nl, nr = (len(compat.aval_of(a).shape) for a in (lhs, rhs))
    if len(lc) != 1 or len(rc) != 1:
        raise NotAttention("the q·k product contracts several dims")
    l_free = [d for d in range(nl) if d not in lc and d not in lb]
    r_free = [d for d in range(nr) if d not in rc and d not in rb]
    nb = len(lb)
    steps, labels, merged = reader.read(chain, tuple(range(nb + len(l_free) + len(r_free))))
    kv_label = labels[axis]
    if kv_label is None:
        raise NotAttention("the softmax axis is not a dim of the q·k product")
    if kv_label in merged:
        raise NotAttention("the softmax axis merges several dims of the q·k product")
    if kv_label >= nb + len(l_free):
        if len(r_free) != 1:
            raise NotAttention("the key operand has several free dims")
        q_var, k_var, q_free, k_seq = lhs, rhs, l_free, r_free[0]
        qb, kb, qc, kc = lb, rb, lc[0], rc[0]
        q_free_labels = tuple(range(nb, nb + len(l_free)))
    elif kv_label >= nb:
        if len(l_free) != 1:
            raise NotAttention("the key operand has several free dims")
        q_var, k_var, q_free, k_seq = rhs, lhs, r_free, l_free[0]
        qb, kb, qc, kc = rb, lb, rc[0], lc[0]
        q_free_labels = tuple(range(nb + 1, nb + 1 + len(r_free)))
    else:
        raise NotAttention("softmax axis is a batch dim of the q·k product, not K's "
                           "sequence axis")
    q_dims = {i: qb[i] for i in range(nb)}
    q_dims.update({lab: d for lab, d in zip(q_free_labels, q_free)})
    k_dims = {i: kb[i] for i in range(nb)}
    k_dims[kv_label] = k_seq
    q_shape = compat.aval_of(q_var).shape
    sizes = {lab: q_shape[d] for lab, d in q_dims.items()}
    sizes[kv_label] = compat.aval_of(k_var).shape[k_seq]
    return QKProduct(q_var, k_var, qc, kc, nb, q_free_labels, kv_label, q_dims, k_dims,
                     sizes, tuple(steps), labels, merged)
