"""From a :class:`Candidate` to the equations that replace the attention subgraph.

The replacement runs while the program is re-traced: it arranges q, k, v (and segment ids,
padding, the dense mask and biases) into the spec's ``(*batch, T, H, D)`` layout, folds
the logits' data factors (a temperature per head or per query) into q, binds
``attention_p``, and arranges the result back into the layout of the output it replaces.
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from cptransform.ir import compat
from cptransform.ir.rewrite import Replacement
from cptransform.op.attention import attention_p
from cptransform.analysis.mask_values import TOPK_DIM, Dense
from cptransform.op.attention_spec import AttentionSpec
from cptransform.op.dropout import offsets
from cptransform.passes.match_attention.candidate import (K_FEATURE, Q_FEATURE, V_FEATURE,
                                                          Candidate)


def replacement(c: Candidate, spec: AttentionSpec) -> Replacement:
    """The rewrite of ``c.root``: one ``attention_p`` with ``spec`` and the arranging around
    it. Its inputs are q, k, v, then the segment ids, the query and key padding parts (each
    and-ed into one boolean ``[*batch, T]`` operand), the region padding's tested data
    (its inside and outside tests, each ``[*batch, T]``), the dense mask parts, the
    biases, the sink source, the top-k indices, the query coordinates, the dropout key and
    the data factors, in that order."""
    sizes, nbl = c.sizes, len(c.batch)
    batch, heads = list(c.batch), c.heads
    q_target = [*batch, c.q_seq, heads, Q_FEATURE]
    kv_heads = () if c.kv_head is None else (c.kv_head,)
    k_target = [*batch, c.kv_seq, *kv_heads, K_FEATURE]
    v_target = [*batch, c.kv_seq, *kv_heads, V_FEATURE]
    out_target = [*batch, c.q_seq, *heads, V_FEATURE]
    pair_target = [*batch, heads, c.q_seq, c.kv_seq]
    full = (c.q_seq, c.kv_seq)
    q_seq_target, kv_seq_target = [*batch, c.q_seq], [*batch, c.kv_seq]
    out_dtype = compat.aval_of(c.out).dtype
    n_seg, n_dense = len(c.segments), len(c.dense)
    n_qpad, n_kvpad = len(c.q_pads), len(c.kv_pads)
    region_data = () if c.region is None else tuple(t for t in c.region[1:]
                                                        if isinstance(t, Dense))
    n_region = len(region_data)

    def build(q, k, v, *side_values):
        operands = [arrange(q, c.q.labels, q_target, sizes),
                    arrange(k, c.k.labels, k_target, sizes),
                    arrange(v, c.v.labels, v_target, sizes)]
        vals = list(side_values)
        if n_seg:
            operands += [arrange(vals[0], c.segments[0].dims, q_seq_target, sizes, (c.q_seq,)),
                         arrange(vals[1], c.segments[1].dims, kv_seq_target, sizes,
                                 (c.kv_seq,))]
        vals = vals[n_seg:]
        if n_qpad:
            operands.append(all_of(c.q_pads, vals[:n_qpad], q_seq_target, sizes, (c.q_seq,)))
        if n_kvpad:
            operands.append(all_of(c.kv_pads, vals[n_qpad:n_qpad + n_kvpad], kv_seq_target,
                                    sizes, (c.kv_seq,)))
        vals = vals[n_qpad + n_kvpad:]
        if c.region is not None:
            operands += _region_tests(c.region[1:], vals[:n_region], kv_seq_target, sizes,
                                      c.kv_seq, len(batch))
            vals = vals[n_region:]
        if n_dense:
            operands.append(all_of(c.dense, vals[:n_dense], pair_target, sizes, full))
        vals = vals[n_dense:]
        if c.biases:
            operands.append(_bias_sum(c.biases, vals, pair_target, sizes, full))
        vals = vals[len(c.biases):]
        if c.sink is not None:
            operands.append(_split_arrange(vals[0], c.sink.labels, [*batch, heads], sizes))
            vals = vals[1:]
        if c.topk is not None:
            k = compat.aval_of(c.topk.var).shape[c.topk.dims.index(TOPK_DIM)]
            operands.append(arrange(lax.convert_element_type(vals[0], jnp.int32), c.topk.dims,
                                    [*batch, heads, c.q_seq, TOPK_DIM],
                                    {**sizes, TOPK_DIM: k}, (c.q_seq, TOPK_DIM)))
            vals = vals[1:]
        if c.coordinates is not None:
            operands.append(arrange(lax.convert_element_type(vals[0], jnp.int32),
                                    c.coordinates.dims, q_seq_target, sizes, (c.q_seq,)))
            vals = vals[1:]
        if c.dropout is not None:
            operands.append(_dropout_seed(vals[0], dict(c.dropout.strides), sizes, batch,
                                          heads))
            vals = vals[1:]
        if c.factors:
            operands[0] = _fold_factors(operands[0], c.factors, vals, q_target, sizes)
        out = attention_p.bind(*operands, spec=spec)
        split = out.shape[:nbl + 1] + tuple(sizes[lab] for lab in heads) + out.shape[-1:]
        out = arrange(lax.reshape(out, split) if split != out.shape else out, out_target,
                      c.out_labels, sizes)
        for eqn in c.after:
            out = compat.bind_eqn(eqn, [out])[0]
        return [out if out.dtype == out_dtype else lax.convert_element_type(out, out_dtype)]

    sides = [s.var for s in c.segments]
    sides += [d.source.var for d in c.q_pads + c.kv_pads + region_data + c.dense]
    sides += [b.var for b, _ in c.biases]
    sides += [] if c.sink is None else [c.sink.atom]
    sides += [c.topk.var] if c.topk is not None else []
    sides += [c.coordinates.var] if c.coordinates is not None else []
    sides += [c.dropout.key] if c.dropout is not None else []
    sides += [f.atom for f, _ in c.factors]
    return Replacement(c.root, (c.q.atom, c.k.atom, c.v.atom, *sides), build)


def _bias_sum(biases, values, target, sizes: dict, full):
    """The float32 sum of the biases (each ``(operand, coefficient)``), arranged to
    ``target``."""
    total = None
    for (b, coef), val in zip(biases, values):
        term = arrange(lax.convert_element_type(val, jnp.float32), b.dims, target, sizes, full)
        term = lax.mul(term, jnp.float32(coef)) if coef != 1 else term
        total = term if total is None else lax.add(total, term)
    return total


def _dropout_seed(key, strides: dict, sizes: dict, batch: list, heads: tuple):
    """The ``(*batch, H, 4)`` uint32 dropout seed: the key's two words, then the offset of
    each (batch entry, head) in the flat index of the bits (:mod:`cptransform.op.dropout`)."""
    where = offsets(strides, sizes, batch, heads)
    data = jax.random.key_data(key).astype(jnp.uint32)
    data = lax.broadcast_in_dim(data, where.shape, (len(where.shape) - 1,))
    return lax.concatenate([data, jnp.asarray(where)], len(where.shape) - 1)


def _fold_factors(q, factors, values, target, sizes: dict):
    """``q`` (arranged to ``target``) multiplied by each data factor of the logits (or
    divided by it), in the dtype the two promote to: ``(q·t)·k`` is ``(q·k)·t``."""
    for (factor, exponent), value in zip(factors, values):
        dtype = jnp.promote_types(q.dtype, value.dtype)
        term = _split_arrange(lax.convert_element_type(value, dtype), factor.labels, target,
                              sizes)
        term = lax.broadcast_in_dim(term, q.shape, tuple(range(q.ndim)))
        wide = lax.convert_element_type(q, dtype)
        wide = lax.mul(wide, term) if exponent > 0 else lax.div(wide, term)
        q = lax.convert_element_type(wide, q.dtype)
    return q


def _split_arrange(x, dims: Sequence[tuple], target: Sequence, sizes: dict):
    """``x`` (each dim holding a tuple of labels, in order: a sink source, a data factor)
    as ``target``: dims holding several labels are split first."""
    shape, labels = [], []
    for n, labs in zip(x.shape, dims):
        shape += [sizes[lab] for lab in labs] if len(labs) > 1 else [n]
        labels += list(labs) if labs else [None]
    if tuple(shape) != x.shape:
        x = lax.reshape(x, tuple(shape))
    return arrange(x, labels, target, sizes)


#: The compares a dense part's ``test`` ends with (``source op value``).
_COMPARE = {"eq": lax.eq, "ne": lax.ne, "lt": lax.lt, "le": lax.le, "gt": lax.gt, "ge": lax.ge}
#: The steps a dense part's ``test`` takes before its compare (``mask_values.Data``).
_STEPS = {"min": lax.min, "max": lax.max, "mul": lax.mul, "add": lax.add,
          "and": lax.bitwise_and, "or": lax.bitwise_or,
          "convert": lambda x, dtype: lax.convert_element_type(x, jnp.dtype(dtype))}


def _tested(val, test):
    """``val`` put through a dense part's ``test``: its steps, then its compare, each on
    the value's own dtype, as the program computed them."""
    *steps, (op, value) = test
    for kind, arg in steps:
        val = _STEPS[kind](val, arg if kind == "convert" else jnp.asarray(arg, val.dtype))
    return _COMPARE[op](val, jnp.asarray(value, val.dtype))


def _region_tests(tests, values, target, sizes, kv_seq, n_batch: int) -> list:
    """The region padding's ``kv_inside`` and ``kv_outside`` operands (boolean
    ``[*batch, T]``): each test a key-only dense part put through its test (its value the
    next of ``values``), or a test that always holds, all True."""
    out, values = [], list(values)
    for test in tests:
        if not isinstance(test, Dense):
            out.append(jnp.ones((1,) * n_batch + (sizes[kv_seq],), jnp.bool_))
        else:
            out.append(all_of((test,), values[:1], target, sizes, (kv_seq,)))
            values = values[1:]
    return out


def all_of(parts, values, target, sizes, full):
    """The conjunction of dense mask parts, each arranged to ``target`` (boolean)."""
    mask = None
    for d, val in zip(parts, values):
        if d.test:
            val = _tested(val, d.test)
        elif val.dtype != jnp.bool_:
            val = lax.ne(val, jnp.zeros((), val.dtype))
        val = lax.bitwise_not(val) if d.negated else val
        val = arrange(val, d.source.dims, target, sizes, full)
        mask = val if mask is None else lax.bitwise_and(mask, val)
    return mask


def arrange(x, dims: Sequence, target: Sequence, sizes: dict, full: Sequence = ()):
    """Rearrange ``x`` (dims labelled ``dims``; None = size 1) to ``target``.

    ``target`` entries are labels or tuples of labels merged into one dim (in that order);
    labels absent from ``x`` become size 1, except those in ``full`` (broadcast to size).
    Emits only the reshapes/transposes/broadcasts that change something (``lax``, not
    ``jnp``: this runs once per attention while re-tracing).
    """
    keep = [i for i, d in enumerate(dims) if d is not None and x.shape[i] != 1]
    labs = [dims[i] for i in keep]
    flat = [lab for t in target for lab in (t if isinstance(t, tuple) else (t,))]
    if keep != list(range(x.ndim)):
        x = lax.reshape(x, tuple(x.shape[i] for i in keep))
    perm = [labs.index(lab) for lab in flat if lab in labs]
    if perm != sorted(perm):
        x = lax.transpose(x, perm)
    labs = [labs[i] for i in perm]
    want, merged = [], []
    for t in target:
        group = t if isinstance(t, tuple) else (t,)
        have = [x.shape[labs.index(lab)] if lab in labs else 1 for lab in group]
        grow = any(lab in full for lab in group) or (len(group) > 1 and any(n != 1 for n in have))
        sub = [sizes[lab] if grow else n for lab, n in zip(group, have)]
        want.extend(sub)
        merged.append(int(np.prod(sub)))
    placed = [flat.index(lab) for lab in labs]
    if tuple(want) != x.shape or placed != list(range(len(flat))):
        x = lax.broadcast_in_dim(x, tuple(want), tuple(placed))
    if tuple(merged) != x.shape:
        x = lax.reshape(x, tuple(merged))
    return x
