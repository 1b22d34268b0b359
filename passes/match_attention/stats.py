"""Refusals and per-rule statistics of one ``match-attention`` run."""
from __future__ import annotations

import enum
import time
from contextlib import contextmanager
from dataclasses import dataclass, field


class NotAttention(Exception):
    """A softmax that is not a rewritable attention; the message is the reason.

    ``attention_like``: both products (q·k and p·v) were found, so ``strict`` objects.
    ``rule``: the normalisation rule that anchored it, once one did.
    """

    attention_like = False
    rule = ""


class Rule(enum.Enum):
    """The stages of one match; each is timed and counted in ``RuleStats``."""

    SOFTMAX = "softmax"                               # exp(x - max), summed over one axis
    NORMALIZED = "normalized-probabilities"           # (e / sum) @ v
    DEFERRED = "deferred-normalization"               # (e @ v) / sum
    LOG_NORMALIZED = "log-normalized"                 # exp(x - logsumexp(x)) @ v
    LOGITS_CHAIN = "logits-chain"                     # back from x to the q·k product
    VALUE_PRODUCT = "value-product"                   # the p·v product and the candidate
    MASK = "mask"                                     # mask classification


def _entry() -> dict:
    return {"attempts": 0, "hits": 0, "seconds": 0.0}


@dataclass
class RuleStats:
    """Attempts, hits and time per key over one run of the pass.

    Keys are the :class:`Rule` values (always present) and any other key passed to
    :meth:`attempt`, such as one per chain-table primitive (``chain:mul``), counted from
    its first use. A refusal is an attempt without a hit.
    """

    table: dict = field(default_factory=lambda: {rule.value: _entry() for rule in Rule})

    @contextmanager
    def attempt(self, key: Rule | str):
        """Count one attempt of ``key``, and a hit if the block does not raise."""
        entry = self.table.setdefault(key.value if isinstance(key, Rule) else key, _entry())
        entry["attempts"] += 1
        start = time.perf_counter()
        ok = False
        try:
            yield
            ok = True
        finally:
            entry["seconds"] += time.perf_counter() - start
            entry["hits"] += ok
