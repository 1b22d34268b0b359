"""What ``match-attention`` decided about one softmax: rewritten, or refused and why.

Reports are kept in ``module.facts.matches`` for the CLI's ``--match-stats``, later
passes and ``explain()``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from cptransform.op.attention_spec import AttentionSpec

Status = Literal["rewritten", "refused"]


@dataclass(frozen=True)
class MatchReport:
    """One candidate attention (anchored on a softmax) and the outcome.

    ``source``: ``file:line (function)`` of the softmax; ``reason``: why it was refused
    (empty when rewritten); ``spec``: the attention it became; ``mask_kind``: the mask
    parts found (``causal``, ``window(4)``, ``segments``, ``dense``, ``bias``, ``full``);
    ``rule``: the softmax pattern that anchored it; ``depth``: nesting level of the
    (sub-)jaxpr it sits in (0 = top level); ``over_keys``: a refused softmax that
    normalizes a q·k product over its keys (an attention that runs unsharded).
    """

    source: str
    status: Status
    reason: str = ""
    spec: AttentionSpec | None = None
    mask_kind: str = ""
    rule: str = ""
    depth: int = 0
    over_keys: bool = False

    @property
    def rewritten(self) -> bool:
        return self.status == "rewritten"

    @property
    def runs_unsharded(self) -> bool:
        """An attention the matcher left whole (refused, over a sequence's keys)."""
        return not self.rewritten and self.over_keys

    def describe_spec(self) -> str:
        return self.spec.describe() if self.spec is not None else ""

    def __str__(self) -> str:
        if self.rewritten:
            return f"{self.source}: rewritten [{self.mask_kind or 'full'}] {self.describe_spec()}"
        return f"{self.source}: refused: {self.reason}"
