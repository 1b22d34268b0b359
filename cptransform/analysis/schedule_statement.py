"""What a schedule states once for one attention: its transfers, its kernel calls and its
local step; its volume, work, memory and steps are derived from that one statement.

A :class:`Statement` has three parts:

* ``transfers``: every collective it runs (:class:`~cptransform.analysis.cost_model.Transfer`:
  what moves, by which collective, how often, over which mesh axis, in which pass) — the
  ring's rotation, Ulysses' all-to-alls, the all-gather, the halo exchange alike;
* ``grids``: which query positions meet which key positions on which device, as grids of
  blocks (:class:`Grid`): the ring's devices × steps (the block a device holds at step ``t``),
  all-gather's devices × key shards of its one call, Ulysses' shard grid that every device
  runs for its heads, halo's devices × key pieces. The first grid is the one the kernel calls
  run (its :attr:`Grid.calls` says how cells make calls), later ones show the inside of
  those calls (hybrid's Ulysses level); the plan chart draws them all;
* ``local``: the largest kernel call of a device and the float32 state it keeps
  (:class:`LocalStep`).

From them: :meth:`Statement.volume` (the transfers), :meth:`Statement.work` (the executed
FLOPs of the first grid's calls after block skipping), :meth:`Statement.steps` (how many
pipelined steps the overlapped transfers hide behind) and :meth:`Statement.memory` (the
shards, what the forward transfers deliver — twice for an overlapped one: the block computed
on and the one arriving — the float32 query state and dK/dV accumulators, one score tile).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, replace

import numpy as np

from cptransform.analysis.attention_shape import AttentionShape
from cptransform.analysis.block_work import Work, work_of
from cptransform.analysis.cost_model import CommVolume, Transfer
from cptransform.analysis.local_memory import kv_bytes, query_state_bytes, shard_bytes, \
    tile_bytes


class Calls(enum.Enum):
    """How the blocks of a :class:`Grid` are kernel calls."""

    #: Each block is one call: the columns are steps (the ring's rotation).
    EACH_BLOCK = "each block"
    #: Each row (a device) is one call over all its key columns (all-gather, halo).
    EACH_ROW = "each row"
    #: The whole grid is one call, the same on every device (Ulysses, for its heads).
    WHOLE_GRID = "whole grid"
    #: None of its own: the blocks inside the previous grid's calls, drawn finer.
    INSIDE = "inside"


@dataclass(frozen=True)
class Grid:
    """Rows of query positions against columns of key positions.

    ``queries[r]`` are the positions of row ``r``'s queries, ``keys[r][c]`` those of the
    keys it meets in column ``c``; ``calls`` says which blocks are one kernel call, each over
    ``heads`` query heads. ``title`` (with ``{layout}`` for the layout's name), ``rows`` and
    ``columns`` label the grid for the plan chart.
    """

    title: str
    rows: str
    columns: str
    queries: tuple[np.ndarray, ...]
    keys: tuple[tuple[np.ndarray, ...], ...]
    calls: Calls
    heads: int

    def kernel_calls(self) -> list[list[tuple[np.ndarray, np.ndarray]]]:
        """``[device][call]``: the ``(q_pos, k_pos)`` of each kernel call (one device for a
        grid every device runs whole)."""
        if self.calls is Calls.EACH_BLOCK:
            return [[(q, k) for k in row] for q, row in zip(self.queries, self.keys)]
        if self.calls is Calls.EACH_ROW:
            return [[(q, np.concatenate(row))] for q, row in zip(self.queries, self.keys)]
        if self.calls is Calls.WHOLE_GRID:
            return [[(np.concatenate(self.queries), np.concatenate(self.keys[0]))]]
        raise ValueError(f"a grid of calls {self.calls} makes no kernel calls of its own")


def rotated(title: str, rows: str, blocks: np.ndarray, rotation: np.ndarray,
            heads: int) -> Grid:
    """The grid of a schedule that passes KV blocks around: row ``s`` holds the queries of
    ``blocks[s]`` and at step ``t`` the KV block of ``blocks[rotation[s, t]]``, one kernel
    call per step."""
    return Grid(title, rows, "step", tuple(blocks),
                tuple(tuple(blocks[t] for t in row) for row in rotation),
                Calls.EACH_BLOCK, heads)


def shard_grid(title: str, rows: str, positions: np.ndarray, calls: Calls,
               heads: int) -> Grid:
    """Every row of ``positions`` (``[n, tokens]``) against every shard of it as columns."""
    return Grid(title, rows, "key shard", tuple(positions),
                tuple(tuple(positions) for _ in positions), calls, heads)


@dataclass(frozen=True)
class LocalStep:
    """A device's largest kernel call: ``queries`` × ``keys`` tokens over ``heads`` query
    heads and ``kv_heads`` KV heads; ``accumulators`` copies of the float32 dK/dV of its
    keys are held at once (travelling ones: the one held and the one in flight)."""

    queries: int
    keys: int
    heads: int
    kv_heads: int
    accumulators: int = 1


@dataclass(frozen=True)
class Statement:
    """One schedule for one attention shape (see the module doc)."""

    transfers: tuple[Transfer, ...]
    grids: tuple[Grid, ...]
    local: LocalStep

    def volume(self, schedule: str) -> CommVolume:
        """The per-device :class:`CommVolume` of schedule ``schedule``."""
        return CommVolume(schedule, self.transfers)

    def work(self, shape: AttentionShape) -> Work:
        """The :class:`Work` of the first grid's kernel calls, whose tiles fold the local
        step's query-head group and hold its heads' scores (:func:`tile_bytes`)."""
        calls, step = self.grids[0], self.local
        return replace(work_of(shape, calls.kernel_calls(), calls.heads),
                       group=step.heads // step.kv_heads,
                       tile_bytes=tile_bytes(shape, step.heads, step.queries, step.keys))

    def steps(self) -> int:
        """How many compute steps the overlapped transfers are pipelined over: the first
        grid's steps, or 1 when each device computes in one call."""
        calls = self.grids[0]
        return len(calls.keys[0]) if calls.calls is Calls.EACH_BLOCK else 1

    def overlaps(self) -> bool:
        """Whether some transfer is sent while the previous step computes."""
        return any(t.overlapped for t in self.transfers)

    def memory(self, shape: AttentionShape) -> int:
        """Peak bytes per device of the local step (see the module doc)."""
        delivered = sum(t.resident * (2 if t.overlapped else 1) for t in self.transfers
                        if t.payload and not t.backward)
        step = self.local
        return (shard_bytes(shape) + delivered
                + query_state_bytes(shape, step.queries, step.heads)
                + step.accumulators * kv_bytes(shape, step.keys, step.kv_heads,
                                               shape.grad_bytes)
                + tile_bytes(shape, step.heads, step.queries, step.keys))
