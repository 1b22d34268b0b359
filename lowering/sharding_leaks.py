"""Sharding leaks: all-gathers of the whole sequence that XLA's SPMD partitioner inserted.

A context-parallel program keeps every activation sharded on its sequence dim; the only
collectives over the full sequence belong to the attention schedules, which run in
``shard_map`` islands (manual partitioning: GSPMD inserts nothing inside them, so every
collective there is one a schedule wrote, e.g. the all-gather schedule's K/V gather). A
floating-point all-gather whose gathered dim becomes the whole sequence *outside* those
islands means some op made GSPMD un-shard an activation (a positional op wrapped in
un-permute/permute, a sharding constraint that could not be honoured).

This reads the *compiled* HLO text (``jax.jit(f).lower(...).compile().as_text()``), where
GSPMD's collectives exist; the StableHLO that :mod:`cptransform.lowering.collectives`
counts holds only the ones the program wrote. Integer all-gathers (positions, segment ids,
token ids) are small and left out.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

_ALL_GATHER = re.compile(r"^\s*%?(?P<name>[\w.-]+)\s*=\s*(?P<type>\(?[^=]*?\)?)\s+"
                         r"all-gather(?:-start)?\(")
_ARRAY = re.compile(r"(?P<dtype>[a-z]+\d*(?:e\d+m\d+\w*)?)\[(?P<dims>[\d,]*)\]")
_DIMENSIONS = re.compile(r"\bdimensions=\{(\d+)\}")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_FLOAT = re.compile(r"^(f\d+|bf16|f8\w*)$")


@dataclass(frozen=True)
class SequenceGather:
    """One all-gather of the whole sequence outside the attention schedules.

    ``shape``/``dtype``: the gathered result (per device); ``dim``: the gathered dim;
    ``op_name``: the JAX op that made the partitioner insert it (from HLO metadata; empty
    when the compiler dropped it)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    dim: int
    op_name: str

    def describe(self) -> str:
        shape = ",".join(map(str, self.shape))
        return (f"all-gather {self.dtype}[{shape}] on dim {self.dim}"
                + (f" for {self.op_name}" if self.op_name else ""))


def sequence_all_gathers(hlo_text: str, seq_len: int) -> list[SequenceGather]:
    """The floating-point all-gathers of compiled HLO ``hlo_text`` whose gathered dim is the
    whole sequence (``seq_len``) and that lie outside any ``shard_map`` island."""
    found = []
    for line in hlo_text.splitlines():
        match = _ALL_GATHER.match(line)
        dims = _DIMENSIONS.search(line)
        if match is None or dims is None:
            continue
        op_name = (_OP_NAME.search(line) or [None, ""])[1]
        if "shard_map" in op_name:
            continue  # a collective a schedule wrote: GSPMD inserts none in manual regions
        dim = int(dims.group(1))
        # An async all-gather-start's result is a tuple (operand, result): the last array.
        array = _ARRAY.findall(match.group("type"))[-1]
        dtype, shape = array[0], tuple(int(n) for n in array[1].split(",") if n)
        if _FLOAT.match(dtype) and dim < len(shape) and shape[dim] == seq_len:
            found.append(SequenceGather(match.group("name"), dtype, shape, dim, op_name))
    return found
