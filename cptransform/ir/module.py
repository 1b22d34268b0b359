"""``Module``: a traced program (closed jaxpr plus the pytrees around it)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

import jax

from cptransform.ir import compat
from cptransform.ir.facts import Facts


@dataclass(frozen=True)
class Module:
    """A traced program: a closed jaxpr over flat inputs, and how to (un)flatten them.

    ``facts`` carries what passes learn about the whole program (mesh, matches, plan) for
    later passes, ``explain()`` and the CLI; passes return new modules and never mutate one.
    """

    jaxpr: Any
    in_tree: Any
    out_tree: Any
    name: str = "fn"
    facts: Facts = field(default_factory=Facts)

    @property
    def eqns(self) -> list:
        return list(compat.open_jaxpr(self.jaxpr).eqns)

    @property
    def in_avals(self) -> list:
        return [compat.aval_of(v) for v in compat.open_jaxpr(self.jaxpr).invars]

    @property
    def out_avals(self) -> list:
        return [compat.aval_of(v) for v in compat.open_jaxpr(self.jaxpr).outvars]

    def replace(self, **changes) -> "Module":
        return dataclasses.replace(self, **changes)

    def with_jaxpr(self, jaxpr: Any, **facts) -> "Module":
        """The same program signature with a new body; ``facts`` fields are replaced."""
        return dataclasses.replace(self, jaxpr=jaxpr, facts=self.facts.replace(**facts))

    def with_facts(self, **facts) -> "Module":
        """The same program with ``facts`` fields replaced."""
        return dataclasses.replace(self, facts=self.facts.replace(**facts))

    def flat_call(self, *flat_args) -> list:
        """Evaluate on flat arguments under the current trace."""
        return compat.eval_jaxpr(self.jaxpr, *flat_args)

    def __call__(self, *args, **kwargs):
        flat, tree = jax.tree_util.tree_flatten((args, kwargs))
        if tree != self.in_tree:
            raise TypeError(f"{self.name}: arguments have structure {tree}, but the module "
                            f"was traced for {self.in_tree}")
        return jax.tree_util.tree_unflatten(self.out_tree, self.flat_call(*flat))

    def as_function(self) -> Callable:
        """A plain Python callable with the original signature (wrap it in ``jax.jit``)."""
        return lambda *args, **kwargs: self(*args, **kwargs)

    def count(self, primitive: Any, *, recursive: bool = True) -> int:
        """How many equations of ``primitive`` the program holds (inside sub-jaxprs too)."""
        return sum(1 for eqn in iter_eqns(self.jaxpr, recursive=recursive)
                   if eqn.primitive is primitive)

    def __str__(self) -> str:
        return str(self.jaxpr)


def iter_eqns(jaxpr: Any, *, recursive: bool = True):
    """All equations of ``jaxpr``, depth first into sub-jaxprs when ``recursive``."""
    for eqn in compat.open_jaxpr(jaxpr).eqns:
        yield eqn
        if recursive:
            for _, sub in compat.eqn_subjaxprs(eqn):
                yield from iter_eqns(sub, recursive=True)


def trace(fn: Callable, *args, name: str | None = None, **kwargs) -> Module:
    """Trace ``fn(*args, **kwargs)`` to a :class:`Module`.

    Arguments may be arrays or ``jax.ShapeDtypeStruct``s (nothing is computed). Params
    are in canonical form (:func:`~cptransform.ir.compat.canonical_params`); the
    ``canonicalize`` pass makes the rest of the program canonical.
    """
    flat, in_tree = jax.tree_util.tree_flatten((args, kwargs))
    out_tree_box: list = []

    def flat_fn(*flat_args):
        a, kw = jax.tree_util.tree_unflatten(in_tree, flat_args)
        out = fn(*a, **kw)
        leaves, out_tree = jax.tree_util.tree_flatten(out)
        out_tree_box.append(out_tree)
        return leaves

    closed = compat.canonical_params(jax.make_jaxpr(flat_fn)(*flat))
    return Module(closed, in_tree, out_tree_box[0],
                  name=name or getattr(fn, "__name__", "fn"))
