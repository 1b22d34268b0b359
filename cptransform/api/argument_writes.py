"""Writes a transformed function makes into its arguments, carried back to the caller.

The transform traces the function once and runs the traced program; an assignment into an
argument (an NNX ``Variable``, a dict entry) would only touch the tracing copy. Such writes
become outputs of the program instead, and are assigned to the caller's objects after each
call, as the undecorated function would have done.
"""
from __future__ import annotations

from typing import Callable

import jax

from cptransform.ir.errors import ContextParallelError


def returning_argument_writes(fn: Callable, name: str, written: list) -> Callable:
    """``fn`` returning ``(its output, the new values of the argument leaves it assigned)``,
    the flat indices of those leaves appended to ``written``.

    A function may write into its arguments: ``nnx.Dropout`` advances an ``nnx.Rngs``
    counter, ``nnx.scan`` writes the layers' state back, a step counter goes into a dict.
    Traced once, those writes would be lost; as outputs of the transformed program they are
    written back into the caller's objects after each call, as the undecorated function
    does (:func:`write_back`)."""
    def call(*args, **kwargs):
        before = jax.tree_util.tree_leaves((args, kwargs))
        out = fn(*args, **kwargs)
        after = jax.tree_util.tree_leaves((args, kwargs))
        if len(after) != len(before):
            raise ContextParallelError(
                f"{name} changes the structure of its "
                "arguments (adds or removes arrays); context_parallel cannot write that back: "
                "return the new state as an output instead")
        written.extend(i for i, (new, old) in enumerate(zip(after, before)) if new is not old)
        return out, [after[i] for i in written]

    return call


def write_back(arguments: tuple, written: tuple[int, ...], values: list) -> None:
    """Assign ``values`` to the leaves ``written`` (flat indices) of ``arguments``, the
    caller's ``(args, kwargs)``, through each leaf's key path (a dict entry, an attribute
    such as an NNX ``Variable``'s ``value``, a list item)."""
    if not written:
        return
    paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(arguments)[0]]
    for index, value in zip(written, values):
        *parents, last = paths[index]
        node = arguments
        for key in parents:
            node = _child(node, key, paths[index])
        if isinstance(last, jax.tree_util.DictKey):
            node[last.key] = value
        elif isinstance(last, jax.tree_util.GetAttrKey) and last.name == "value" \
                and hasattr(node, "set_value"):
            node.set_value(value)  # an NNX Variable: its `.value` setter is deprecated
        elif isinstance(last, jax.tree_util.GetAttrKey):
            setattr(node, last.name, value)
        elif isinstance(last, jax.tree_util.SequenceKey) and isinstance(node, list):
            node[last.idx] = value
        else:
            raise ContextParallelError(_unwritable(paths[index]))


def _child(node, key, path):
    if isinstance(key, jax.tree_util.DictKey):
        return node[key.key]
    if isinstance(key, jax.tree_util.GetAttrKey):
        return getattr(node, key.name)
    if isinstance(key, jax.tree_util.SequenceKey):
        return node[key.idx]
    raise ContextParallelError(_unwritable(path))


def _unwritable(path) -> str:
    group, *rest = path
    where = ("args" if group.idx == 0 else "kwargs") + jax.tree_util.keystr(tuple(rest))
    return (f"the function wrote into {where}, which context_parallel cannot write back "
            "(no dict key, attribute or list index leads there); return the new value as an "
            "output instead")
