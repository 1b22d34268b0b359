"""Pictures of a plan: each attention's chosen schedule as a grid of blocks, and the work per
rank under every candidate layout.

A schedule's picture is one :class:`Chart` per grid of its statement
(:class:`~cptransform.analysis.schedule_statement.Grid`), each cell one (query positions,
key positions) block of a :class:`~cptransform.op.mask_terms.BlockKind`: skipped, partial
or full by the mask's terms of positions (unknown where segment ids, a dense mask or top-k
indices decide): the ring and the double
ring devices × steps (their rotations), all-gather devices × key shards (one kernel call),
Ulysses the query shards × key shards every device runs for its ``H/cp`` heads, the hybrid
both levels (ring groups × steps, then the shards inside a group), halo devices × the key
pieces of their one call. A name with no schedule gets a line saying so.
:func:`render_text` draws a chart as text, :func:`render_png` all of them with matplotlib
(the ``plot`` extra).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cptransform.analysis.schedule_statement import Calls
from cptransform.ir.errors import PlotError
from cptransform.lowering.ring import ring_rotation
from cptransform.lowering.schedule import schedules
from cptransform.op import mask_terms
from cptransform.op.mask_terms import BlockKind
from cptransform.op.attention_reference import visible
from cptransform.op.attention_spec import MaskSpec
from cptransform.op.layouts import SequenceLayout

#: How each block kind is drawn: its character in the text chart, its name, its colour in
#: the PNG; the legend lists them in this order.
DRAWN = {BlockKind.FULL: ("#", "full", "#264653"),
         BlockKind.PARTIAL: ("+", "partial", "#f4a261"),
         BlockKind.SKIP: (".", "skipped", "#eeeeee"),
         BlockKind.UNKNOWN: ("?", "data-dependent", "#bbbbff")}
LEGEND = "(" + ", ".join(f"{c} {name}" for c, name, _ in DRAWN.values()) + ")"


#: At most this many pieces per side classify a block: a side whose positions form more
#: runs of consecutive positions (striped layouts) is cut into this many equal pieces.
MAX_PIECES = 64


def _pieces(positions: np.ndarray) -> mask_terms.Ranges:
    """``[1, n]`` (min, max) of the runs of consecutive positions in ``positions`` (exact
    ranges), or of :data:`MAX_PIECES` equal pieces when there are more runs (hulls)."""
    pos = np.asarray(positions, np.int64)
    starts = np.flatnonzero(np.diff(pos) != 1) + 1
    if len(starts) >= MAX_PIECES:
        starts = np.linspace(0, len(pos), MAX_PIECES, endpoint=False).astype(np.int64)[1:]
    edges = np.concatenate([[0], starts, [len(pos)]])
    lo = np.minimum.reduceat(pos, edges[:-1])
    hi = np.maximum.reduceat(pos, edges[:-1])
    return mask_terms.Ranges(lo[None], hi[None])


def block_kind(mask: MaskSpec, q_pos: np.ndarray, kv_pos: np.ndarray,
               segment_ids: np.ndarray | None = None) -> BlockKind:
    """Classify one (query shard, key shard) block by the mask's terms of positions.

    The terms classify the runs of consecutive positions of each side from their ranges
    (:func:`~cptransform.op.mask_terms.meet`), never a dense visibility, so a chart at
    a million tokens costs a few arrays of ``MAX_PIECES²``. The other terms (segment ids,
    dense masks, top-k indices, …) depend on data: such blocks are ``UNKNOWN`` unless
    the positions already hide
    them entirely — or, for segments, unless ``segment_ids`` (``[B, S]`` in natural order,
    an example-sized batch) gives the data: then the block is classified for that batch
    element by element. Under a finite fill no block is skipped: one with a masked pair
    is ``PARTIAL``."""
    terms = mask.terms()
    positional = tuple(t for t in terms if t.key_hull is not None)
    may, full = mask_terms.meet(positional, mask_terms.Blocks(_pieces(q_pos), _pieces(kv_pos)))
    if mask.fill is not None and not (len(positional) == len(terms) and np.all(full)):
        return BlockKind.PARTIAL
    if not np.any(may):
        return BlockKind.SKIP
    if mask.segments and segment_ids is not None:
        seg = np.asarray(segment_ids)
        known = positional + tuple(t for t in terms if isinstance(t, mask_terms.Segments))
        seen = np.asarray(mask_terms.visible(known, mask_terms.Tile(
            q_pos=q_pos[None, :, None], kv_pos=kv_pos[None, None, :],
            q_seg=seg[:, q_pos, None], kv_seg=seg[:, None, kv_pos])))
        if not seen.any():
            return BlockKind.SKIP
        if not _data_beside_segments(mask):
            return BlockKind.FULL if seen.all() else BlockKind.PARTIAL
    if len(positional) < len(terms):
        return BlockKind.UNKNOWN
    return BlockKind.FULL if np.all(full) else BlockKind.PARTIAL


def _data_beside_segments(mask: MaskSpec) -> bool:
    """Whether a term other than segments depends on data (a dense mask, top-k indices,
    …): no example segment ids classify its blocks."""
    return any(t.key_hull is None and not isinstance(t, mask_terms.Segments)
               for t in mask.terms())


def device_work(mask: MaskSpec, positions: np.ndarray, seq_len: int,
                segment_ids: np.ndarray | None = None) -> np.ndarray | None:
    """Visible (query, key) pairs per device (rows of ``positions``); ``None`` when the mask
    depends on data not given (a term of data other than segments: a dense mask, top-k
    indices, …), or segment ids without ``segment_ids``
    (``[B, S]`` in natural order; the pairs are then summed over the batch, counted on a
    ``[B, S, S]`` array: for inspecting example-sized batches). Without data, each query's
    visible keys are the interval its terms' key hull gives. Under a finite fill every pair
    is computed: every key of every query."""
    if mask.fill is not None:
        return np.full(positions.shape[0], positions.shape[1] * seq_len, float)
    if _data_beside_segments(mask) or (mask.segments and segment_ids is None):
        return None
    if mask.segments:
        seg = np.asarray(segment_ids)
        pos = np.arange(seq_len)[None]
        seen = visible(mask.replace(bias=False), pos, pos, q_seg=seg, kv_seg=seg)  # [B, 1, S, S]
        per_query = np.asarray(seen).sum(axis=(0, 1, 3))
        return per_query[positions].sum(axis=-1).astype(float)
    q = positions.astype(np.int64)
    first, last = mask_terms.key_hull(mask.terms(), q, q)
    first = np.zeros_like(q) if first is None else np.maximum(0, first)
    last = np.full_like(q, seq_len - 1) if last is None else np.minimum(seq_len - 1, last)
    return np.maximum(0, last - first + 1).sum(axis=-1).astype(float)


@dataclass(frozen=True)
class Chart:
    """One grid: its title, what rows and columns are, the cells (one block kind each) and
    optionally each row's work relative to the mean (``work``)."""

    title: str
    row_label: str
    column_label: str
    cells: tuple[tuple[BlockKind, ...], ...]
    work: tuple[float, ...] = ()


def _grid(mask: MaskSpec, rows: np.ndarray, columns,
          segment_ids: np.ndarray | None = None) -> tuple[tuple[str, ...], ...]:
    """Cells for query positions ``rows[i]`` against key positions ``columns(i)``."""
    return tuple(tuple(block_kind(mask, q, k, segment_ids) for k in columns(i))
                 for i, q in enumerate(rows))


def _relative(device_flops: tuple[int, ...], count: int) -> tuple[float, ...]:
    """Each of the first ``count`` devices' FLOPs over their mean (none when unknown)."""
    if not device_flops:
        return ()
    work = np.asarray(device_flops, dtype=float)[:count]
    return tuple(work / work.mean()) if work.mean() > 0 else ()


def charts_for(plan, layout: SequenceLayout) -> tuple[Chart, ...] | str:
    """The charts of ``plan``'s chosen schedule, drawn from its statement's grids
    (:class:`~cptransform.analysis.schedule_statement.Grid`; ``layout`` names the layout in
    their titles), or a line saying it has none. The grids whose rows make kernel calls
    show each row's work relative to the mean."""
    record = schedules().get(plan.schedule)
    if record is None:
        return f"no chart for schedule {plan.schedule!r}"
    said = record.statement(plan.shape)
    work = said.work(plan.shape).device_flops
    return tuple(Chart(grid.title.format(layout=layout.name), grid.rows, grid.columns,
                       _grid(plan.mask, grid.queries, lambda r, grid=grid: grid.keys[r]),
                       _relative(work, len(grid.queries))
                       if grid.calls in (Calls.EACH_BLOCK, Calls.EACH_ROW) else ())
                 for grid in said.grids)


def render_text(chart: Chart) -> str:
    """The chart as text: a header row of column numbers, one row per grid row, then the
    work per row relative to the mean and the slowest row."""
    width = len(chart.row_label) + 4
    lines = [f"{chart.title} {LEGEND}",
             f"{chart.column_label:>{width - 1}} "
             + " ".join(f"{i:>2}" for i in range(len(chart.cells[0])))]
    lines += [f"{chart.row_label} {r:>2} " + " ".join(f"{DRAWN[c][0]:>2}" for c in row)
              for r, row in enumerate(chart.cells)]
    if chart.work:
        lines.append(f"{'work/mean':<{width}} " + " ".join(f"{w:.2f}" for w in chart.work))
        lines.append(f"slowest {chart.row_label}: {max(chart.work):.2f}x the mean")
    return "\n".join(lines)


def ring_chart(mask: MaskSpec, layout: SequenceLayout,
               segment_ids: np.ndarray | None = None) -> str:
    """The ring's devices × steps grid and the work per device relative to the mean, for
    one batch: with ``segment_ids`` (``[B, S]``, natural order) blocks and work are those of
    that data (the planner's charts cannot know them)."""
    cp, pos = layout.cp, layout.all_positions()
    work = device_work(mask, pos, layout.seq_len, segment_ids)
    relative = () if work is None or work.mean() <= 0 else tuple(work / work.mean())
    return render_text(Chart(
        f"ring over {cp} devices, {layout.name} layout", "device", "step",
        _grid(mask, pos, lambda r: pos[ring_rotation(cp)[r]], segment_ids), relative))


def balance_table(balances) -> str:
    """Work per layout rank under every candidate layout (all attentions, forward +
    backward FLOPs after block skipping, relative to the mean)."""
    lines = ["work per rank by layout (FLOPs over all attentions / mean; * chosen):"]
    for b in balances:
        work = np.asarray(b.rank_flops)
        mean = work.mean() if work.mean() > 0 else 1.0
        lines.append(f"{'*' if b.chosen else ' '} {b.layout:<10} "
                     + " ".join(f"{w / mean:.2f}" for w in work)
                     + f"  max/mean {b.balance:.2f}x")
    return "\n".join(lines)


#: How to install matplotlib, in a source checkout (its virtualenv) or as the package extra.
INSTALL_MATPLOTLIB = ".venv/bin/pip install matplotlib (or pip install -e '.[plot]' in a " \
                     "source checkout; pip install 'cptransform[plot]' for an installed package)"


def require_matplotlib() -> None:
    """Raise :class:`PlotError` naming the install command when matplotlib is missing
    (the CLI asks before it prints anything)."""
    import importlib.util
    if importlib.util.find_spec("matplotlib") is None:
        raise PlotError(f"--png needs matplotlib: {INSTALL_MATPLOTLIB}")


def render_png(path: str, charts: list[tuple[str, Chart]], balances) -> None:
    """Every chart (``(heading, chart)`` pairs: one per distinct attention) as a colour grid
    with a legend of the block kinds and each row's work next to it, and the work per rank
    of every layout as grouped bars on the same scale (relative to the mean), in one PNG
    at ``path``."""
    require_matplotlib()
    import textwrap

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    panels = len(charts) + bool(balances)
    fig, axes = plt.subplots(panels, 1, figsize=(7.5, 3.4 * max(panels, 1)), squeeze=False)
    kinds = sorted(BlockKind)
    colours = ListedColormap([DRAWN[k][2] for k in kinds])
    for ax, (heading, chart) in zip(axes[:, 0], charts):
        grid = np.array([[int(c) for c in row] for row in chart.cells])
        ax.imshow(grid, cmap=colours, vmin=0, vmax=len(kinds) - 1)
        ax.set_xticks(range(grid.shape[1]))
        ax.set_yticks(range(grid.shape[0]))
        ax.set_title(textwrap.fill(f"{heading}: {chart.title}", 70), fontsize=8)
        ax.set_xlabel(chart.column_label)
        ax.set_ylabel(chart.row_label)
        for row, work in enumerate(chart.work):
            ax.text(grid.shape[1] - 0.3, row, f" work {work:.2f}x mean", va="center",
                    fontsize=7)
        seen = [k for k in DRAWN if any(k in row for row in chart.cells)]
        ax.legend(handles=[Patch(facecolor=DRAWN[k][2], edgecolor="#999999",
                                 label=DRAWN[k][1]) for k in seen],
                  fontsize=7, loc="lower left", bbox_to_anchor=(1.45, 0.0), frameon=False)
    if balances:
        ax = axes[-1, 0]
        width = 0.8 / len(balances)
        for i, b in enumerate(balances):
            work = np.asarray(b.rank_flops, dtype=float)
            mean = work.mean() if work.mean() > 0 else 1.0
            ranks = np.arange(len(work))
            ax.bar(ranks + i * width, work / mean, width,
                   label=f"{b.layout}{' (chosen)' if b.chosen else ''}: max/mean "
                         f"{b.balance:.2f}x", edgecolor="black" if b.chosen else None)
        ax.axhline(1.0, color="#888888", linewidth=0.8, linestyle=":")
        ax.set_xticks(np.arange(len(balances[0].rank_flops)) + 0.4 - width / 2)
        ax.set_xticklabels(range(len(balances[0].rank_flops)))
        ax.set_title(textwrap.fill("FLOPs per layout rank over all attentions (fwd+bwd after "
                                   "block skipping), relative to the mean, by layout", 70),
                     fontsize=8)
        ax.set_xlabel("layout rank")
        ax.set_ylabel("work / mean")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
