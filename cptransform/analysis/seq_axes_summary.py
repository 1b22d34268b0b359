"""The sequence axes of a whole program: the analysis with the module's overrides, and the
stable summary (per flat input and output, its sequence dims) kept in ``Module.facts``."""
from __future__ import annotations

from dataclasses import dataclass

import jax

from cptransform.analysis.seq_axes import SeqAxes, infer_seq_axes
from cptransform.ir import compat
from cptransform.ir.module import Module


@dataclass(frozen=True)
class SeqAxesSummary:
    """Stable per-program facts: the length of each sequence (one, or more for
    cross-attention) and the sequence dims of each flat input/output (``()`` for values
    that do not carry one)."""

    lengths: tuple[int, ...]
    inputs: tuple[tuple[int, ...], ...]
    outputs: tuple[tuple[int, ...], ...]
    input_names: tuple[str, ...] = ()
    output_names: tuple[str, ...] = ()

    @property
    def seq_len(self) -> int | None:
        """The length when the program has exactly one sequence, else ``None``."""
        return self.lengths[0] if len(self.lengths) == 1 else None

    def describe(self) -> str:
        def side(dims, names, prefix):
            return ", ".join(f"{names[i] if i < len(names) else f'{prefix}{i}'} dim {list(d)}"
                             for i, d in enumerate(dims) if d) or "none"
        length = f"length {self.seq_len}" if self.seq_len is not None else \
            f"{len(self.lengths)} sequences of lengths {list(self.lengths)}"
        return (f"{length}; inputs: {side(self.inputs, self.input_names, 'in')}; "
                f"outputs: {side(self.outputs, self.output_names, 'out')}")


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
    """The stable summary of ``axes`` for ``module``'s flat inputs and outputs."""
    jaxpr = compat.open_jaxpr(module.jaxpr)
    return SeqAxesSummary(axes.lengths,
                          tuple(axes.dims(v) for v in jaxpr.invars),
                          tuple(axes.dims(v) for v in jaxpr.outvars),
                          leaf_names(module.in_tree, "args"),
                          leaf_names(module.out_tree, "out"))
