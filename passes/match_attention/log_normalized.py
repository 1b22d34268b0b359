"""Probabilities written through the log-sum-exp: ``exp(x - logsumexp(x))`` and
``exp(log_softmax(x))``.

With the softmax core ``e = exp(a)`` (``a = x - c``, or ``x``) summed into ``S`` and read by
nothing else, the probabilities are ``exp(z)`` where ``z`` adds up, through adds,
subtracts and broadcasts, to ``a - log(S)``: ``x - (log S + c)`` (``jax.nn.logsumexp``,
whose ``c`` is the guarded row max) or ``(x - c) - log S`` (``jax.nn.log_softmax``). The
check compares signed terms, each a value with the map from its dims to the logits' dims,
so a term broadcast along the wrong dims, or a different stabiliser, does not cancel.
"""
from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from cptransform.ir import compat
from cptransform.ir.graph import Graph
from cptransform.passes.match_attention.anchor import Softmax, is_normalizer
from cptransform.passes.match_attention.stats import NotAttention
from cptransform.passes.match_attention.walk import WRAPPERS, single_user, step_back

#: ``exp`` of a value that is the sum of more terms than this is not a log-softmax.
_MAX_TERMS = 8
#: Sign of each operand of the linear equations the exponent may be built from.
_SIGNS = {"add": (1, 1), "sub": (1, -1), "neg": (-1,)}
#: ``log|S|``: logsumexp takes the log of the absolute value (the sum is positive anyway).
_ABS = "abs"


def log_normalized(graph: Graph, softmax: Softmax) -> Any:
    """The probabilities ``exp(a - log S)`` of ``softmax`` (their value), or NotAttention."""
    log = _log_of_sum(graph, softmax)
    atom, probs = log.outvars[0], None
    while probs is None:
        user = single_user(graph, atom)
        if user is None or user.primitive.name not in WRAPPERS | set(_SIGNS) | {"exp"}:
            raise NotAttention("the log of the softmax row sum is not subtracted inside an exp")
        probs = user if user.primitive.name == "exp" else None
        atom = user.outvars[0]
    ident = tuple(range(len(compat.aval_of(softmax.e).shape)))
    got = Counter(_terms(graph, probs.invars[0], ident))
    log_terms = [t for t in got if t[1] is log.outvars[0]]
    if len(log_terms) != 1 or got[log_terms[0]] != 1 or log_terms[0][0] != -1:
        raise NotAttention("exp of the logits minus the log row sum taken more than once")
    inner = log.invars[0]
    producer = graph.producer(inner)
    if producer is not None and producer.primitive.name == _ABS:
        inner = producer.invars[0]
    if not is_normalizer(graph, inner, softmax, log_terms[0][2]):
        raise NotAttention("the log-sum-exp is broadcast along other dims than the row sum")
    del got[log_terms[0]]
    if got != Counter(_terms(graph, softmax.exp_eqn.invars[0], ident)):
        raise NotAttention("exp(x - logsumexp) subtracts it from other logits, or with "
                           "another stabiliser, than the row sum's")
    return probs.outvars[0]


def _log_of_sum(graph: Graph, softmax: Softmax) -> Any:
    """The ``log`` equation that is the only reader of the row sum (through broadcasts and
    ``abs``), or NotAttention."""
    atom = softmax.sum
    while True:
        user = single_user(graph, atom)
        if user is None or user.primitive.name not in WRAPPERS | {_ABS, "log"}:
            raise NotAttention("the exponentials are summed but neither divided by the sum "
                               "nor normalised by its log")
        if user.primitive.name == "log":
            return user
        atom = user.outvars[0]


def _terms(graph: Graph, atom: Any, dims: tuple) -> list[tuple]:
    """``atom`` as signed terms ``(sign, value, dims)`` through adds, subtracts, negations
    and moves (``dims``: the logits' dim of each of the value's dims; None: size 1)."""
    out: list[tuple] = []
    stack = [(1, atom, dims)]
    while stack:
        sign, a, labels = stack.pop()
        eqn = None if compat.is_literal(a) else graph.producer(a)
        name = eqn.primitive.name if eqn is not None else None
        shape = compat.aval_of(a).shape
        if name in _SIGNS:
            for s, operand in zip(_SIGNS[name], eqn.invars):
                # Elementwise operands broadcast their size-1 dims implicitly.
                if len(compat.aval_of(operand).shape) != len(shape):
                    raise NotAttention("a rank-changing operand in the log-softmax exponent")
                sub = tuple(None if n == 1 else lab
                            for n, lab in zip(compat.aval_of(operand).shape, labels))
                stack.append((sign * s, operand, sub))
            continue
        back = step_back(eqn, a, labels) if name in WRAPPERS else None
        if back is not None:
            stack.append((sign, *back))
            continue
        key = float(np.asarray(compat.literal_value(a))) if compat.is_literal(a) else a
        out.append((sign, key, tuple(None if n == 1 else lab for n, lab in zip(shape, labels))))
        if len(out) > _MAX_TERMS:
            raise NotAttention("the log-softmax exponent has too many terms")
    return out
