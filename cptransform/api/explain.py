"""``explain()``: what the transform did to a program, written for a newcomer."""
from __future__ import annotations

from typing import Any

from cptransform.analysis.load_balance import DATA_MASK_NOTE
from cptransform.api.plan import build_plan
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


def explain_module(module, options: Any, hlo_text: str | None = None, *,
                   verbose: bool = False) -> str:
    """The report behind ``ContextParallelFunction.explain``: the plan, identical
    attentions once; with the compiled program's HLO text (``hlo_text``), also its
    sharding leaks. ``verbose`` adds what the user did not ask about: the softmaxes left
    alone, the schedules excluded and why, every candidate's bytes and prices, padding
    that is none, and the balance of every candidate layout."""
    plan = build_plan(module)
    facts = module.facts
    seq = facts.seq_axes
    program = plan.layout if plan.reordered or plan.layout == "contiguous" else \
        f"{plan.layout} inside the attentions, the program in natural order"
    kernels = sorted({g.kernel for g in plan.attentions})
    lines = [f"context_parallel over mesh axes {plan.cp_axes} (cp={plan.cp}) of mesh "
             f"{plan.mesh or '?'}",
             f"  layout: {program} (load_balance={options.load_balance}); kernel: "
             f"{', '.join(kernels) if kernels else options.kernel}"
             + (f" (kernel={options.kernel})" if kernels and options.kernel == "auto" else "")]
    if seq is not None and seq.lengths:
        lines.append(f"  sequence axis: {seq.describe()}")
    if facts.sharded_sequence is not None:
        lines.append(f"  {facts.sharded_sequence.describe()}")
    lines += _matcher_lines(facts.matches or (), verbose)
    if not plan.attentions and not facts.recurrences:
        lines.append("  no attention found: the function runs unchanged; nothing is sharded "
                     "(pass seq_axes= or use cptransform.attention for an attention the "
                     "matcher does not see)")
    for group in plan.attentions:
        lines += _group_lines(group, verbose)
    for recurrence in facts.recurrences:
        lines += recurrence_lines(recurrence, verbose)
    if verbose:
        lines += balance_lines(facts.balance)
    else:
        lines += [_chosen_balance_line(b) for b in facts.balance if b.chosen]
    lines += [f"  {entry}" for entry in plan.conversions]
    if facts.conversions:
        lines.append(f"  layout conversions: {len(facts.conversions)}, "
                     f"{sum(c.bytes for c in facts.conversions)} bytes: "
                     + "; ".join(c.describe() for c in facts.conversions))
    if hlo_text is not None:
        lines += leak_lines(hlo_text, seq.lengths if seq is not None else ())
    if not verbose:
        lines.append("  (explain(..., verbose=True) adds each softmax the matcher saw, the "
                     "excluded schedules, every candidate's cost and every layout)")
    return "\n".join(lines)


#: Where the planner's reason lists the schedules it could not use (a note, not the why).
EXCLUDED = "; excluded: "


def _group_lines(group, verbose: bool) -> list[str]:
    """The lines of one :class:`~cptransform.api.plan.AttentionGroup`."""
    shape = group.shape
    reason = group.reason if verbose else group.reason.split(EXCLUDED)[0]
    costs = group.bytes_per_device if verbose else {
        k: v for k, v in group.bytes_per_device.items() if k == group.schedule}
    lines = [f"  {group.label} at {group.source}"]
    if group.library_source is not None:
        lines.append(f"    in library code at {group.library_source}")
    lines += [f"    schedule: {group.schedule} — {reason}",
              f"    mask: {group.mask}; heads {shape.heads} / kv heads {shape.kv_heads}, "
              f"head dim {shape.head_dim}, " + (
                  f"sequence {shape.seq_len}" if shape.kv_len == shape.seq_len else
                  f"cross-attention: {shape.seq_len} queries, {shape.kv_len} keys"),
              f"    layout: {group.layout}; kernel: {group.kernel} ({group.kernel_reason})"]
    padding = shape.describe_padding()
    if verbose or padding != "none":
        lines.append(f"    padding: {padding}")
    lines.append("    forward communication per device: "
                 + ", ".join(f"{s} {b / 2**20:.3f} MiB" for s, b in costs.items()))
    if verbose and group.predictions:
        lines.append("    predicted per device (fastest first):")
        lines += [f"      {prediction.describe()}" for prediction in group.predictions]
    elif group.chosen is not None:
        lines.append(f"    predicted per device: {group.chosen.describe()}")
    return lines


def recurrence_lines(plan, verbose: bool) -> list[str]:
    """The lines of one :class:`~cptransform.analysis.recurrence_cost.RecurrencePlan`: what
    it is, how it runs across devices and why, and the bytes each method moves."""
    lines = [f"  recurrence #{plan.index} at {plan.source}: {plan.what}"]
    if plan.method is None:
        return lines + [f"    not sharded: {plan.reason}"]
    grain = "token" if plan.chunk == 1 else f"chunk of {plan.chunk} tokens"
    reason = plan.reason if verbose else plan.reason.split(EXCLUDED)[0]
    lines.append(f"    method: {plan.method} — {reason}; {plan.steps} steps of one {grain}")
    costs = plan.costs if verbose else [c for c in plan.costs if c.method == plan.method]
    if costs:
        lines.append("    forward communication per device: "
                     + ", ".join(f"{c.method} {c.bytes / 2**20:.3f} MiB" for c in costs))
    if verbose:
        lines += [f"      {c.describe()}" for c in plan.costs]
    return lines


def _chosen_balance_line(balance) -> str:
    """The chosen layout's balance on one line, its schedules counted, not listed."""
    counts = {s: balance.schedules.count(s) for s in balance.schedules}
    used = ", ".join(f"{s} ×{n}" if n > 1 else s for s, n in counts.items())
    line = (f"  load balance ({balance.layout}): max/mean {balance.balance:.2f}x, busiest rank "
            f"{balance.slowest / 1e9:.3g} GFLOP")
    if balance.time_s is not None:
        line += f", predicted {balance.time_s * 1e3:.3g} ms"
    return line + f" ({used or 'no attention'})"


def _matcher_lines(matches, verbose: bool) -> list[str]:
    """The matcher's outcome in one line; with ``verbose`` each softmax, identical ones
    once with their count, the ones left alone (the loss's own softmax, ...) included."""
    if not matches:
        return []
    rewritten = [str(m) for m in matches if m.rewritten]
    refused = [str(m) for m in matches if not m.rewritten]
    lines = [f"  matcher: {len(rewritten)} attention(s) rewritten, {len(refused)} "
             "softmax(es) left alone"]
    lines += [f"    unsharded attention (whole S×S on every device): {m}"
              for m in matches if m.runs_unsharded]
    if not verbose:
        return lines
    shown = rewritten + refused
    counts = {line: shown.count(line) for line in shown}
    lines += [f"    {line}" + (f" ({n}×)" if n > 1 else "") for line, n in counts.items()]
    return lines
