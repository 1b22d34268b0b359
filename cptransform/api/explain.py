"""``explain()``: what the transform did to a program, written for a newcomer."""
from __future__ import annotations

from typing import Any

from cptransform.analysis.load_balance import DATA_MASK_NOTE
from cptransform.lowering.sharding_leaks import sequence_all_gathers


def balance_lines(balances) -> list[str]:
    """The load balance of every candidate layout (``module.facts.balance``): FLOPs per
    layout rank over all attentions under the schedules each layout leads to."""
    if not balances:
        return []
    lines = ["  load balance per layout (FLOPs per rank, fwd+bwd after block skipping, summed "
             "over attentions; max/mean):"]
    lines += [f"    {b.describe()}" for b in balances]
    if any(b.data_masks for b in balances):
        lines.append(f"    note: {DATA_MASK_NOTE}")
    return lines


def leak_lines(hlo_text: str, lengths: tuple[int, ...]) -> list[str]:
    """The "sharding leaks:" lines for the compiled program ``hlo_text`` whose sequences
    have ``lengths``."""
    if not lengths:
        return ["  sharding leaks: no sequence axis, nothing is sharded"]
    gathers = [g for n in sorted(set(lengths)) for g in sequence_all_gathers(hlo_text, n)]
    if not gathers:
        return ["  sharding leaks: none (no all-gather of the whole sequence outside the "
                "attention schedules in the compiled program)"]
    return ([f"  sharding leaks: {len(gathers)} all-gather(s) of the whole sequence outside "
             "the attention schedules (compiled program):"]
            + [f"    {g.describe()}" for g in gathers])


def explain_module(module, options: Any, hlo_text: str | None = None) -> str:
    """The report behind ``ContextParallelFunction.explain``; with the compiled program's
    HLO text (``hlo_text``), also its sharding leaks."""
    facts = module.facts
    mesh, axes, layout, seq = facts.mesh, facts.cp_axes, facts.layout, facts.seq_axes
    cp = facts.cp if mesh is not None else None
    inside = sorted({p.layout for p in facts.plan or ()} - {"contiguous"})
    program = layout.name if layout is not None else "contiguous" if not inside else \
        f"{', '.join(inside)} inside the attentions, the program in natural order"
    lines = [f"context_parallel over mesh axes {tuple(axes)} (cp={cp}) of mesh "
             f"{dict(mesh.shape) if mesh is not None else '?'}",
             f"  layout: {program} (load_balance={options.load_balance}); kernel: "
             f"{options.kernel}"]
    if seq is not None and seq.lengths:
        lines.append(f"  sequence axis: {seq.describe()}")
    matches = facts.matches or []
    if matches:
        found = sum(1 for m in matches if m.rewritten)
        lines.append(f"  matcher: {found} attention(s) rewritten, {len(matches) - found} "
                     "softmax(es) left alone")
        lines += [f"    {m}" for m in matches]
    plans = facts.plan or ()
    if not plans:
        lines.append("  no attention found: the function runs unchanged; nothing is sharded "
                     "(pass seq_axes= or use cptransform.attention for an attention the "
                     "matcher does not see)")
    for p in plans:
        bytes_line = ", ".join(f"{s} {b / 2**20:.3f} MiB" for s, b in p.bytes_per_device.items())
        lines += [f"  attention #{p.index} at {p.source}",
                  f"    schedule: {p.schedule} — {p.reason}",
                  f"    mask: {p.mask.describe()}; heads {p.shape.heads} / kv heads {p.shape.kv_heads}, "
                  f"head dim {p.shape.head_dim}, " + (
                      f"sequence {p.shape.seq_len}" if p.shape.kv_len == p.shape.seq_len else
                      f"cross-attention: {p.shape.seq_len} queries, {p.shape.kv_len} keys"),
                  f"    layout: {p.layout}" + (
                      "" if p.layout == "contiguous" or (layout is not None) else
                      " (applied inside this attention; the program stays in natural order)"),
                  f"    padding: {p.shape.describe_padding()}",
                  f"    forward communication per device: {bytes_line}"]
        if p.predictions:
            lines.append("    predicted per device (fastest first):")
            lines += [f"      {prediction.describe()}" for prediction in p.predictions]
    lines += balance_lines(facts.balance)
    for entry in facts.reorder_log:
        lines.append(f"  {entry}")
    if facts.conversions:
        lines.append(f"  layout conversions: {len(facts.conversions)}, "
                     f"{sum(c.bytes for c in facts.conversions)} bytes: "
                     + "; ".join(c.describe() for c in facts.conversions))
    if hlo_text is not None:
        lines += leak_lines(hlo_text, seq.lengths if seq is not None else ())
    return "\n".join(lines)

