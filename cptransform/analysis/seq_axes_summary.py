"""The sequence axes of a whole program: the analysis with the module's overrides, and the
stable summary (per flat input and output, its sequence dims) kept in ``Module.facts``."""
from __future__ import annotations

from dataclasses import dataclass

import jax

from cptransform.analysis.seq_axes import SeqAxes, infer_seq_axes
from cptransform.analysis.sequence_groups import sharded_dim
from cptransform.ir import compat
from cptransform.ir.module import Module


@dataclass(frozen=True)
class SeqAxesSummary:
    """Stable per-program facts: the length of each sequence (one, or more for
    cross-attention) and the sequence dims of each flat input/output (``()`` for values
    that do not carry one): an int per dim holding a whole sequence, a
    :data:`~cptransform.analysis.dim_rules.Group` per group of dims holding one merged
    (``((1, 1), (2, 1))``: dims 1 and 2 of ``[B, H, W, C]``)."""

    lengths: tuple[int, ...]
    inputs: tuple[tuple[int, ...], ...]
    outputs: tuple[tuple[int, ...], ...]
    input_names: tuple[str, ...] = ()
    output_names: tuple[str, ...] = ()
    starts: tuple[str, ...] = ()  # where the sequence starts when no input carries it
    #: Per flat input, the dim that carries the CP sharding of each of its merged groups
    #: (``None``: none splits evenly; see :func:`~cptransform.analysis.sequence_groups.
    #: sharded_dim`), in the order of its groups in ``inputs``.
    sharded: tuple[tuple[int | None, ...], ...] = ()

    @property
    def seq_len(self) -> int | None:
        """The length when the program has exactly one sequence, else ``None``."""
        return self.lengths[0] if len(self.lengths) == 1 else None

    def describe(self) -> str:
        def side(dims, names, prefix, sharded=()):
            return ", ".join(f"{names[i] if i < len(names) else f'{prefix}{i}'} "
                             f"{describe_dims(d, sharded[i] if i < len(sharded) else ())}"
                             for i, d in enumerate(dims) if d) or "none"
        length = f"length {self.seq_len}" if self.seq_len is not None else \
            f"{len(self.lengths)} sequences of lengths {list(self.lengths)}"
        inputs = side(self.inputs, self.input_names, "in", self.sharded)
        if self.starts:
            inputs += f" (the sequence starts at {', '.join(self.starts)})"
        return (f"{length}; inputs: {inputs}; "
                f"outputs: {side(self.outputs, self.output_names, 'out')}")


def describe_dims(entries: tuple, sharded: tuple = ()) -> str:
    """``dim [1]``, ``dim [1, 2]`` (two dims, each a sequence), ``dims (1, 2) merged``, or
    ``dims (1, 2) merged in patches of 4x4`` (a group whose members are chunked), each
    group with the dim it is sharded on when ``sharded`` says (one entry per group)."""
    plain = [d for d in entries if not isinstance(d, tuple)]
    parts = [f"dim {plain}"] if plain else []
    groups = [d for d in entries if isinstance(d, tuple)]
    for index, group in enumerate(groups):
        text = f"dims {tuple(d for d, _ in group)} merged"
        if any(c != 1 for _, c in group):
            text += " in patches of " + "x".join(str(c) for _, c in group)
        if index < len(sharded):
            text += (f", sharded on dim {sharded[index]}" if sharded[index] is not None
                     else ", not sharded (no dim of it splits evenly over the devices)")
        parts.append(text)
    return ", ".join(parts)


def analyse(module: Module) -> SeqAxes:
    """Sequence axes of ``module`` with its ``seq_axes`` overrides (``facts``).

    Passes re-run this on their own input: variables change with every re-trace."""
    return infer_seq_axes(module.jaxpr, module.facts.seq_axes_overrides)


def leaf_names(tree, prefix: str) -> tuple[str, ...]:
    """Readable names of a pytree's leaves, e.g. ``args[1]`` or ``args[0]['embed']``.

    ``prefix="args"`` names the leaves of an ``(args, kwargs)`` input tree."""
    dummy = jax.tree_util.tree_unflatten(tree, list(range(tree.num_leaves)))
    paths = jax.tree_util.tree_flatten_with_path(dummy)[0]
    names = []
    for path, _ in paths:
        if prefix == "args" and path:
            head = "args" if getattr(path[0], "idx", 0) == 0 else "kwargs"
            names.append(head + jax.tree_util.keystr(path[1:]))
        else:
            names.append(prefix + jax.tree_util.keystr(path))
    return tuple(names)


def summarize(module: Module, axes: SeqAxes) -> SeqAxesSummary:
    """The stable summary of ``axes`` for ``module``'s flat inputs and outputs (with the
    sharded dim of each merged group when the module has its CP mesh)."""
    jaxpr = compat.open_jaxpr(module.jaxpr)
    cp = module.facts.cp if module.facts.mesh is not None else None
    sharded = tuple(tuple(sharded_dim(v.aval.shape, g, cp) for g in axes.groups(v))
                    if cp else () for v in jaxpr.invars)
    return SeqAxesSummary(axes.lengths,
                          tuple(axes.dims(v) + axes.groups(v) for v in jaxpr.invars),
                          tuple(axes.dims(v) + axes.groups(v) for v in jaxpr.outvars),
                          leaf_names(module.in_tree, "args"),
                          leaf_names(module.out_tree, "out"), sharded=sharded)
