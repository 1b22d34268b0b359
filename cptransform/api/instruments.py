"""Instruments for :class:`~cptransform.ir.pipeline.Pipeline`: the pass-debugging habits of
MLIR's ``-mlir-print-ir-after-all`` and friends.

* :class:`PrintIR` prints the program before/after every pass, after named passes, or only
  when a pass changed something, each under a banner and over a summary line::

      # ----- IR after canonicalize -----
      { lambda ; a:f32[2,64]. let ... }
      # canonicalize: 57 equations (61 before), 2 attention ops, 3.1 ms, changed

* :class:`DumpIR` writes the same text to numbered files (``00-input.txt``,
  ``01-canonicalize.txt``, ...).
* :class:`TimePasses` collects a per-pass timing table.
* :class:`VerifyEach` type-checks the jaxpr after every pass and runs the pass's own
  :meth:`~cptransform.ir.pipeline.Pass.verify`; a failure names the pass.
"""
from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence, TextIO

from cptransform.ir import compat
from cptransform.op.attention import attention_p
from cptransform.ir.module import Module, iter_eqns
from cptransform.ir.pipeline import Instrument, Pass, PassResult


class VerificationError(RuntimeError):
    """A pass produced an ill-typed program or broke its own invariants."""

    def __init__(self, pass_name: str, reason: str):
        super().__init__(f"verification failed after pass {pass_name}: {reason}")
        self.pass_name = pass_name
        self.reason = reason


def count_equations(module: Module) -> int:
    """Equations in the program, counting those inside sub-jaxprs."""
    return sum(1 for _ in iter_eqns(module.jaxpr))


def banner(when: str, name: str) -> str:
    """``# ----- IR after canonicalize -----``."""
    return f"# ----- IR {when} {name} -----"


def summary(name: str, module: Module, *, before: int | None = None,
            seconds: float | None = None, changed: bool | None = None) -> str:
    """``# canonicalize: 57 equations (61 before), 2 attention ops, 3.1 ms, changed``."""
    text = f"# {name}: {count_equations(module)} equations"
    if before is not None:
        text += f" ({before} before)"
    text += f", {module.count(attention_p)} attention ops"
    if seconds is not None:
        text += f", {seconds * 1e3:.1f} ms"
    if changed is not None:
        text += ", changed" if changed else ", unchanged"
    return text


def render(when: str, name: str, module: Module, **summary_args) -> str:
    """Banner, program text and summary line, newline-terminated."""
    return f"{banner(when, name)}\n{module}\n{summary(name, module, **summary_args)}\n"


@dataclass
class PrintIR(Instrument):
    """Print the program around passes.

    ``before_all``/``after_all`` print around every pass; ``after`` names passes to print
    after; ``only_on_change`` skips "after" prints of passes that changed nothing.
    """

    before_all: bool = False
    after_all: bool = False
    after_passes: Sequence[str] = ()
    only_on_change: bool = False
    stream: TextIO | None = None

    def __post_init__(self):
        self._input_sizes: dict[int, int] = {}

    def _write(self, text: str) -> None:
        out = self.stream or sys.stdout
        out.write(text)
        out.flush()

    def before(self, index: int, p: Pass, module: Module) -> None:
        self._input_sizes[index] = count_equations(module)
        if self.before_all:
            self._write(render("before", p.name, module))

    def after(self, index: int, p: Pass, result: PassResult, seconds: float) -> None:
        wanted = self.after_all or p.name in self.after_passes or (
            self.only_on_change and not self.after_passes)
        if not wanted or (self.only_on_change and not result.changed):
            return
        self._write(render("after", p.name, result.module,
                           before=self._input_sizes.get(index), seconds=seconds,
                           changed=result.changed))


_NUMBERED = re.compile(r"\d\d-.*\.txt")


@dataclass
class DumpIR(Instrument):
    """Write ``00-input.txt`` and one ``NN-<pass>.txt`` per pass into ``directory``.

    Numbered files left by an earlier run are removed first, so the directory always
    describes one pipeline run.
    """

    directory: Any

    def __post_init__(self):
        self.path = Path(self.directory)
        self._input_sizes: dict[int, int] = {}
        self.written: list[Path] = []

    def before(self, index: int, p: Pass, module: Module) -> None:
        self._input_sizes[index] = count_equations(module)
        if index == 0:
            self.path.mkdir(parents=True, exist_ok=True)
            for old in self.path.iterdir():
                if _NUMBERED.fullmatch(old.name):
                    old.unlink()
            self._save("00-input.txt", f"# ----- IR input -----\n{module}\n"
                                       f"{summary('input', module)}\n")

    def after(self, index: int, p: Pass, result: PassResult, seconds: float) -> None:
        self._save(f"{index + 1:02d}-{p.name}.txt",
                   render("after", p.name, result.module, before=self._input_sizes.get(index),
                          seconds=seconds, changed=result.changed))

    def _save(self, name: str, text: str) -> None:
        target = self.path / name
        target.write_text(text)
        self.written.append(target)


@dataclass(frozen=True)
class PassTime:
    """One row of the timing table."""

    name: str
    seconds: float
    equations_before: int
    equations_after: int
    changed: bool


@dataclass
class TimePasses(Instrument):
    """Collect per-pass wall time; print the table at the end when ``stream`` is given."""

    stream: TextIO | None = None

    def __post_init__(self):
        self.rows: list[PassTime] = []
        self._input_sizes: dict[int, int] = {}

    def before(self, index: int, p: Pass, module: Module) -> None:
        self._input_sizes[index] = count_equations(module)

    def after(self, index: int, p: Pass, result: PassResult, seconds: float) -> None:
        self.rows.append(PassTime(p.name, seconds, self._input_sizes.get(index, 0),
                                  count_equations(result.module), result.changed))

    def table(self) -> str:
        """The timing table: one line per pass and a total."""
        width = max([len(r.name) for r in self.rows] + [len("total")])
        total = sum(r.seconds for r in self.rows) or 1.0
        lines = [f"# {'pass':<{width}}  {'ms':>9}  {'share':>6}  {'equations':>15}  changed"]
        for r in self.rows:
            eqns = f"{r.equations_before} -> {r.equations_after}"
            lines.append(f"# {r.name:<{width}}  {r.seconds * 1e3:9.1f}  "
                         f"{100 * r.seconds / total:5.1f}%  {eqns:>15}  "
                         f"{'yes' if r.changed else 'no'}")
        lines.append(f"# {'total':<{width}}  {sum(r.seconds for r in self.rows) * 1e3:9.1f}")
        return "\n".join(lines) + "\n"

    def finish(self, result: PassResult) -> None:
        if self.stream is not None:
            self.stream.write(self.table())
            self.stream.flush()


class VerifyEach(Instrument):
    """After each pass: ``check_jaxpr`` and the pass's own ``verify``; raise on failure."""

    def after(self, index: int, p: Pass, result: PassResult, seconds: float) -> None:
        try:
            compat.check_jaxpr(result.module.jaxpr)
        except compat.JaxprTypeError as err:
            raise VerificationError(p.name, f"ill-typed jaxpr: {err}") from err
        try:
            p.verify(result.module)
        except AssertionError as err:
            raise VerificationError(p.name, str(err) or "its verify() failed") from err


__all__ = ["DumpIR", "PassTime", "PrintIR", "TimePasses", "VerificationError", "VerifyEach",
           "banner", "count_equations", "render", "summary"]
