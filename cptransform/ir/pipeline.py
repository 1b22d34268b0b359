"""Passes and pipelines parsed from text (``"a,b{opt=1}"``).

A pass is a small named object with typed options (the xDSL habit): subclass :class:`Pass`,
give it a kebab-case ``name`` and dataclass fields for options, declare the
facts (:class:`~cptransform.ir.facts.Fact`) it ``requires`` and ``ensures``, implement ``run``.
It returns a :class:`PassResult`; it never mutates the module it was given.

The IR toolkit knows no pass: the registry lives with the passes
(``cptransform.passes.get_all_passes()``, lazy factories by name) and is handed to
:meth:`Pipeline.parse` as ``available``.
"""
from __future__ import annotations

import dataclasses
import logging
import re
import time
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Mapping, Sequence

from cptransform.ir.errors import PipelineError, did_you_mean
from cptransform.ir.facts import Fact
from cptransform.ir.module import Module, iter_eqns

#: Child of the ``cptransform`` logger: INFO per pass (wall time, what changed), DEBUG the IR.
log = logging.getLogger(__name__)

#: Pass names to factories returning the pass class (imported only when asked for).
PassFactories = Mapping[str, Callable[[], "type[Pass]"]]


@dataclass(frozen=True)
class PassTiming:
    """One pass of a pipeline run: its wall time, whether it changed the program, and the
    equations (sub-jaxprs included) before and after."""

    name: str
    seconds: float
    changed: bool
    equations_before: int
    equations_after: int


@dataclass(frozen=True)
class PassResult:
    """What a pass returns: the new module and whether anything changed; a pipeline's
    result also has the ``timings`` of its passes."""

    module: Module
    changed: bool
    log: tuple[str, ...] = ()
    timings: tuple[PassTiming, ...] = ()


@dataclass(frozen=True)
class Pass:
    """Base class. Subclasses are frozen dataclasses whose fields are the options."""

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    requires: ClassVar[tuple[Fact, ...]] = ()
    ensures: ClassVar[tuple[Fact, ...]] = ()

    def run(self, module: Module) -> PassResult:
        raise NotImplementedError(f"pass {self.name} does not implement run()")

    def verify(self, module: Module) -> None:
        """Pass-specific invariants on its output; raise ``AssertionError`` with a reason."""

    @classmethod
    def options(cls) -> dict[str, dataclasses.Field]:
        return {f.name: f for f in dataclasses.fields(cls)}

    def spelled(self) -> str:
        """This pass as pipeline text, with options that differ from their defaults."""
        changed = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            default = f.default if f.default is not dataclasses.MISSING else (
                f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
            if value != default:
                changed.append(f"{f.name}={value}")
        return self.name + ("{" + " ".join(changed) + "}" if changed else "")


def _parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(text)


def _parse_none(text: str) -> None:
    if text.lower() != "none":
        raise ValueError(text)


#: How option text becomes a value of each type an option may be declared with.
_PARSERS: dict[type, Callable[[str], Any]] = {
    type(None): _parse_none, bool: _parse_bool, int: int, float: float, str: str}


def _option_types(cls: type[Pass], field: dataclasses.Field) -> tuple[type, ...]:
    """The types option ``field`` of ``cls`` accepts, from its resolved annotation; a
    union's members with ``None`` first, so ``none`` is never read as a string."""
    declared = typing.get_type_hints(cls)[field.name]
    members = typing.get_args(declared) if isinstance(declared, types.UnionType) \
        or typing.get_origin(declared) is typing.Union else (declared,)
    return tuple(sorted(members, key=lambda t: t is not type(None)))


def _convert(cls: type[Pass], field: dataclasses.Field, text: str) -> Any:
    """The value of option ``field`` spelled ``text``: the first of its declared types
    that reads it (``memory_limit: int | str | None`` takes ``1000``, ``80%``, ``none``)."""
    accepted = _option_types(cls, field)
    for kind in accepted:
        try:
            return _PARSERS[kind](text)
        except ValueError:
            continue
    names = " | ".join("None" if t is type(None) else t.__name__ for t in accepted)
    raise PipelineError(f"pass {cls.name}: option {field.name} expects {names}, "
                        f"got {text!r}")


def make_pass(name: str, options: dict[str, str] | None = None, *,
              available: PassFactories) -> Pass:
    """Instantiate pass ``name`` of ``available`` from textual options."""
    if name not in available:
        raise PipelineError(f"unknown pass {name!r}{did_you_mean(name, available)}; known passes: "
                            f"{', '.join(available) or 'none'}")
    cls = available[name]()
    fields = cls.options()
    kwargs = {}
    for key, text in (options or {}).items():
        if key not in fields:
            raise PipelineError(f"pass {name} has no option {key!r}"
                                f"{did_you_mean(key, fields)}; its options: "
                                f"{', '.join(fields) or 'none'}")
        kwargs[key] = _convert(cls, fields[key], text)
    return cls(**kwargs)


_ITEM = re.compile(r"\s*([A-Za-z0-9_-]+)\s*(\{([^{}]*)\})?\s*(,|$)")


def parse_pipeline(text: str, *, available: PassFactories) -> list[Pass]:
    """``"canonicalize,match-attention{strict=true}"`` → pass objects of ``available``."""
    passes, pos = [], 0
    text = text.strip()
    if not text:
        raise PipelineError("empty pipeline; known passes: " + ", ".join(available))
    while pos < len(text):
        m = _ITEM.match(text, pos)
        if not m or m.end() == pos:
            raise PipelineError(f"cannot parse pipeline at {text[pos:]!r}; expected "
                                "name or name{opt=value ...}, separated by commas")
        opts = {}
        for item in (m.group(3) or "").replace(",", " ").split():
            if "=" not in item:
                raise PipelineError(f"option {item!r} of pass {m.group(1)} needs the form key=value")
            key, value = item.split("=", 1)
            opts[key.strip()] = value.strip()
        passes.append(make_pass(m.group(1), opts, available=available))
        pos = m.end()
        if m.group(4) == "," and pos >= len(text):
            raise PipelineError("pipeline ends with a comma")
    return passes


class Instrument:
    """Hooks called around each pass (printing, dumping, timing, verifying)."""

    def before(self, index: int, p: Pass, module: Module) -> None:
        """Called before pass number ``index`` runs."""

    def after(self, index: int, p: Pass, result: PassResult, seconds: float) -> None:
        """Called after it ran."""

    def finish(self, result: PassResult) -> None:
        """Called once after the last pass with the pipeline's result."""


@dataclass
class Pipeline:
    """An ordered list of passes with instruments around each."""

    passes: Sequence[Pass]
    instruments: Sequence[Instrument] = ()

    @classmethod
    def parse(cls, text: str, instruments: Sequence[Instrument] = (), *,
              available: PassFactories) -> "Pipeline":
        """The pipeline spelled by ``text``, its passes taken from ``available``."""
        return cls(parse_pipeline(text, available=available), instruments)

    def run(self, module: Module) -> PassResult:
        changed = False
        logs: list[str] = []
        timings: list[PassTiming] = []
        for i, p in enumerate(self.passes):
            missing = [f for f in p.requires if not module.facts.has(f)]
            if missing:
                raise PipelineError(f"pass {p.name} requires "
                                    f"{'; '.join(f.value for f in missing)}")
            for inst in self.instruments:
                inst.before(i, p, module)
            before = _equations(module)
            log.info("pass %d/%d %s: running", i + 1, len(self.passes), p.spelled())
            start = time.perf_counter()
            result = p.run(module)
            seconds = time.perf_counter() - start
            lost = [f for f in p.ensures if not result.module.facts.has(f)]
            if lost:
                raise AssertionError(f"pass {p.name} did not provide "
                                     f"{', '.join(f.name for f in lost)}")
            timings.append(PassTiming(p.name, seconds, result.changed, before,
                                      _equations(result.module)))
            _log_pass(timings[-1], result)
            for inst in self.instruments:
                inst.after(i, p, result, seconds)
            module = result.module
            changed |= result.changed
            logs.extend(result.log)
        final = PassResult(module, changed, tuple(logs), tuple(timings))
        for inst in self.instruments:
            inst.finish(final)
        return final

    def spelled(self) -> str:
        return ",".join(p.spelled() for p in self.passes)


def _equations(module: Module) -> int:
    return sum(1 for _ in iter_eqns(module.jaxpr))


def _log_pass(timing: PassTiming, result: PassResult) -> None:
    """INFO: the pass, its wall time and what it changed (its log lines); DEBUG: the IR."""
    log.info("pass %s: %.1f ms, %s, %d -> %d equations", timing.name, timing.seconds * 1e3,
             "changed" if timing.changed else "unchanged", timing.equations_before,
             timing.equations_after)
    for line in result.log:
        log.info("  %s", line)
    if log.isEnabledFor(logging.DEBUG):
        log.debug("IR after %s:\n%s", timing.name, result.module)
