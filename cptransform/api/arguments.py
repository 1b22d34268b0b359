"""Which arguments of a transformed function are traced and which are static.

Like ``jax.jit``: ``static_argnums`` / ``static_argnames`` name static arguments, and so
does the value itself when it holds no array — a Python bool, int, float or string (or a
tuple of them, or ``None``) configures the program rather than feeding it, so it is baked
into the trace and becomes part of the cache key. Pass a ``jnp`` array to keep a number
traced.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
import numpy as np

from cptransform.ir.errors import ContextParallelOptionError

_ARRAY_TYPES = (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct)


def _is_static(value: Any) -> bool:
    """Leaves, none of them an array: a configuration value (a pytree without leaves, such as
    ``{}`` or ``None``, is traced: its structure is part of the signature already)."""
    leaves = jax.tree_util.tree_leaves(value)
    return bool(leaves) and not any(isinstance(leaf, _ARRAY_TYPES) or hasattr(leaf, "aval")
                                    for leaf in leaves)


@dataclass(frozen=True)
class CallArguments:
    """One call's arguments split into traced ones and static ones.

    ``args``/``kwargs`` hold the traced arguments (static positions removed); ``static``
    is a hashable description of the rest, ``(("arg", index, value) | ("kw", name, value))``.
    """

    args: tuple
    kwargs: dict
    static: tuple
    positional: int                      # how many positional arguments the call had

    @classmethod
    def split(cls, args: tuple, kwargs: dict, static_argnums: tuple[int, ...],
              static_argnames: tuple[str, ...]) -> "CallArguments":
        nums = {i % len(args) if args else i for i in static_argnums}
        static, dyn_args, dyn_kwargs = [], [], {}
        for i, value in enumerate(args):
            if i in nums or _is_static(value):
                static.append(("arg", i, _hashable(value, f"argument {i}")))
            else:
                dyn_args.append(value)
        for name, value in kwargs.items():
            if name in static_argnames or _is_static(value):
                static.append(("kw", name, _hashable(value, f"argument {name!r}")))
            else:
                dyn_kwargs[name] = value
        return cls(tuple(dyn_args), dyn_kwargs, tuple(static), len(args))

    @property
    def static_key(self) -> tuple:
        """``static`` keyed by value *and* type, as ``jax.jit`` keys static arguments: ``1``,
        ``1.0`` and ``True`` are equal and hash alike, yet trace different programs."""
        return tuple((kind, where, _typed(value)) for kind, where, value in self.static)

    def bind(self, fn: Callable) -> Callable:
        """``fn`` as a function of the traced arguments only (static ones baked in)."""
        fixed = {i: v for kind, i, v in self.static if kind == "arg"}
        fixed_kw = {n: v for kind, n, v in self.static if kind == "kw"}

        def call(*args, **kwargs):
            it = iter(args)
            full = [fixed[i] if i in fixed else next(it) for i in range(self.positional)]
            return fn(*full, **kwargs, **fixed_kw)

        return call

    def traced_positions(self) -> list[int]:
        """Original positions of the traced positional arguments, in order."""
        fixed = {i for kind, i, _ in self.static if kind == "arg"}
        return [i for i in range(self.positional) if i not in fixed]


def _typed(value: Any) -> tuple:
    leaves, tree = jax.tree_util.tree_flatten(value)
    return tree, tuple((type(leaf), leaf) for leaf in leaves)


def _hashable(value: Any, what: str) -> Any:
    try:
        hash(value)
    except TypeError:
        raise ContextParallelOptionError(
            f"{what} ({type(value).__name__}) holds no array, so it is static, but it is not "
            "hashable; pass it as a jnp array, or as a hashable value (a tuple, not a list)") \
            from None
    return value
