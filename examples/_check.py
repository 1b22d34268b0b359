"""What every example prints and checks: the transform's report, then the transformed loss
and its gradients against the single-device run.

The reference is always the undecorated function, jitted and differentiated on one device;
the check passes when every attention of the program was rewritten (sharded) and the loss
and every gradient array agree to ``rtol`` relative to that array's largest entry (float32:
1e-5). The last line is ``MATCH`` only then; ``NOT SHARDED`` when some attention was not
sharded (equal numbers from an unsharded program prove nothing), ``MISMATCH`` otherwise,
and the script exits non-zero (:func:`main`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp

from cptransform.api.plan_chart import ring_chart
from cptransform.op.layouts import SequenceLayout

#: float32 agreement with the single-device run (loss and gradients).
RTOL = 1e-5


@dataclass(frozen=True)
class TreeError:
    """The worst :func:`relative_error` over the arrays of a pytree (gradients, parameters)."""

    arrays: int
    worst: float
    where: str  # the path of the worst array

    def __str__(self) -> str:
        return f"{self.arrays} arrays, worst relative error {self.worst:.2e} ({self.where})"


def relative_error(got, want) -> float:
    """``max |got - want|`` over ``max |want|`` (0 where both are all zero)."""
    scale = float(jnp.max(jnp.abs(want)))
    err = float(jnp.max(jnp.abs(got - want)))
    return err / scale if scale else err


def tree_error(got_tree, want_tree) -> TreeError:
    """:class:`TreeError` of ``got_tree`` against ``want_tree`` (same structure)."""
    want = jax.tree_util.tree_leaves_with_path(want_tree)
    got = jax.tree_util.tree_leaves(got_tree)
    if len(got) != len(want):
        raise ValueError(f"{len(got)} arrays against {len(want)}")
    worst, where = max(((relative_error(g, w), jax.tree_util.keystr(path))
                        for (path, w), g in zip(want, got)), default=(0.0, "-"))
    return TreeError(len(want), worst, where)


@dataclass(frozen=True)
class Sharding:
    """How many of a program's attentions the transform rewrote into a CP schedule, of the
    attentions the matcher saw (rewritten, or left whole over a q·k product), and how many
    of its recurrences along the sequence pass state between the devices (not gathered)."""

    rewritten: int
    attentions: int
    passed: int = 0
    recurrences: int = 0

    @property
    def ok(self) -> bool:
        return self.rewritten == self.attentions and self.passed == self.recurrences \
            and self.rewritten + self.passed > 0

    def __str__(self) -> str:
        line = f"attentions sharded: {self.rewritten} of {self.attentions}"
        if self.recurrences:
            line += f"; recurrences passing state: {self.passed} of {self.recurrences}"
        return line + ("" if self.ok else "  NOT SHARDED")


def sharding(cp_fn, *args) -> Sharding:
    """:class:`Sharding` of ``cp_fn`` (a ``context_parallel`` function) for ``args``."""
    facts = cp_fn.module(*args).facts
    matches = facts.matches or ()
    along = [r for r in facts.recurrences if r.method is not None]
    return Sharding(sum(m.rewritten for m in matches),
                    sum(m.rewritten or m.runs_unsharded for m in matches),
                    sum(r.method != "gather" for r in along), len(along))


def verdict(shards: Sharding, equal: bool, rtol: float = RTOL) -> str:
    """The last line an example prints: ``MATCH`` only for a sharded program with the
    single-device numbers."""
    if not shards.ok:
        passing = f", {shards.passed} of {shards.recurrences} recurrences passing state" \
            if shards.recurrences else ""
        return (f"NOT SHARDED ({shards.rewritten} of {shards.attentions} attentions "
                f"sharded{passing})")
    return "MATCH" if equal else f"MISMATCH (rtol {rtol:g})"


def main(check: Callable[[], bool]) -> int:
    """An example's exit status: 0 when ``check()`` (which prints :func:`verdict`) holds;
    1 otherwise, and when the transform refuses to run unsharded (its message, then
    ``NOT SHARDED``)."""
    from cptransform import UnshardedError
    try:
        return 0 if check() else 1
    except UnshardedError as error:
        print(f"{error}\nNOT SHARDED")
        return 1


@dataclass(frozen=True)
class Comparison:
    """The transformed run against the single-device one; ``temp_bytes`` is the compiled
    temporary memory per device of each program (single device, context parallel)."""

    loss: float
    cp_loss: float
    grads: TreeError
    temp_bytes: tuple[int, int]
    sharding: Sharding
    rtol: float = RTOL

    @property
    def equal(self) -> bool:
        return (abs(self.cp_loss - self.loss) <= self.rtol * abs(self.loss)
                and self.grads.worst <= self.rtol)

    @property
    def ok(self) -> bool:
        return self.sharding.ok and self.equal

    def __str__(self) -> str:
        one, many = self.temp_bytes
        return (f"temporary memory per device: single device {one / 2**20:.1f} MiB, "
                f"context parallel {many / 2**20:.1f} MiB ({many / max(one, 1):.2f}x)\n"
                f"loss: single device {self.loss:.7f}, context parallel {self.cp_loss:.7f}\n"
                f"gradients: {self.grads}\n{self.sharding}\n"
                + verdict(self.sharding, self.equal, self.rtol))


def compare_gradients(loss, cp_loss, *args) -> Comparison:
    """Loss and gradients (with respect to the first argument) of ``cp_loss`` against the
    single-device ``loss``, each ``jax.jit(jax.value_and_grad(...))`` compiled once: the
    same executable gives the numbers and the memory."""
    ref, got = (jax.jit(jax.value_and_grad(f)).lower(*args).compile() for f in (loss, cp_loss))
    (ref_loss, ref_grads), (got_loss, got_grads) = ref(*args), got(*args)
    return Comparison(float(ref_loss), float(got_loss), tree_error(got_grads, ref_grads),
                      tuple(c.memory_analysis().temp_size_in_bytes for c in (ref, got)),
                      sharding(cp_loss, *args))


def report(cp_fn, *args, segment_ids=None) -> str:
    """``cp_fn.explain(*args)``, then the block picture of each distinct ring: per device
    and ring step, which key blocks are computed and which are skipped (for this batch's
    documents when ``segment_ids [B, S]`` is given)."""
    module = cp_fn.module(*args)
    lines = [cp_fn.explain(*args)]
    seen = set()
    for step in module.facts.plan or ():
        if step.schedule != "ring" or step.mask in seen:
            continue
        seen.add(step.mask)
        layout = module.facts.layout or SequenceLayout("contiguous", step.shape.seq_len,
                                                       step.shape.cp)
        lines += [f"\nattention #{step.index} and every ring with its mask "
                  f"({step.mask.describe()}):", ring_chart(step.mask, layout, segment_ids)]
    return "\n".join(lines)
