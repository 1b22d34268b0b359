"""Pipeline parsing, running, and the instruments (printing, dumps, timing, verification)."""
import dataclasses
import io
import re
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import pytest

from cptransform import attention, trace
from cptransform.api.instruments import (DumpIR, PrintIR, TimePasses, VerificationError,
                                     VerifyEach, count_equations)
from cptransform.ir.pipeline import (Pass, PassResult, Pipeline, PipelineError, make_pass,
                                     parse_pipeline)
from cptransform.passes import get_all_passes

PASSES = get_all_passes()


def program():
    def f(q, k, v):
        o = attention(q, k, v, causal=True)
        return jax.jit(lambda a: a * 1.0)(o) / 2.0

    x = jax.random.normal(jax.random.key(0), (1, 8, 2, 4), jnp.float32)
    return trace(f, x, x, x)


def test_parse_options_and_spelling():
    (p,) = parse_pipeline(" canonicalize{ fold_scales=exact inline_jit=false } ", available=PASSES)
    assert (p.fold_scales, p.inline_jit, p.inline_calls) == ("exact", False, True)
    assert p.spelled() == "canonicalize{inline_jit=False fold_scales=exact}"
    two = Pipeline.parse("canonicalize,canonicalize{drop_noops=0}", available=PASSES)
    assert [q.drop_noops for q in two.passes] == [True, False]
    assert Pipeline.parse(two.spelled(), available=PASSES).spelled() == two.spelled()


#: A value other than its default for each non-boolean option of a built-in pass.
OPTION_SAMPLES = {"fold_scales": ("exact",), "schedule": ("ring", "halo"),
                  "load_balance": ("zigzag", "none"), "hardware": ("h100",),
                  "memory_limit": ("80%", 2 ** 30), "kernel": ("xla", "pallas"),
                  "recurrences": ("gather",)}


def _changed_options(cls):
    """Instances of pass ``cls`` with every option set away from its default, one sample
    value of each option per instance."""
    fields = dataclasses.fields(cls)
    values = {f.name: (not f.default,) if f.type == "bool" else OPTION_SAMPLES[f.name]
              for f in fields}
    rounds = max((len(v) for v in values.values()), default=1)
    return [cls(**{name: v[i % len(v)] for name, v in values.items()}) for i in range(rounds)]


@pytest.mark.parametrize("name", list(PASSES))
def test_every_pass_spelling_parses_back(name):
    for p in _changed_options(PASSES[name]()):
        again = Pipeline.parse(Pipeline([p]).spelled(), available=PASSES).passes
        assert list(again) == [p], Pipeline([p]).spelled()


def test_documented_memory_limit_spelling_parses():
    (p,) = parse_pipeline("plan-context-parallel{memory_limit=80%}", available=PASSES)
    assert p.memory_limit == "80%"
    (p,) = parse_pipeline("plan-context-parallel{memory_limit=1024 hardware=none}",
                          available=PASSES)
    assert (p.memory_limit, p.hardware) == (1024, None)
    with pytest.raises(PipelineError, match="expects bool, got 'maybe'"):
        parse_pipeline("match-attention{strict=maybe}", available=PASSES)


def test_registry_names_each_pass_after_its_module():
    for name, factory in PASSES.items():
        cls = factory()
        assert cls.name == name
        assert re.fullmatch(r"[a-z][a-z0-9]*(-[a-z0-9]+)*", name)
        assert cls.__module__.startswith("cptransform.passes." + name.replace("-", "_"))


@pytest.mark.parametrize("text, missing", [
    ("canonicalize,lower-context-parallel", "the CP mesh"),
    ("canonicalize,reorder-sequence", "run plan-context-parallel first"),
])
def test_a_missing_fact_is_one_error_naming_its_source(text, missing):
    with pytest.raises(PipelineError, match=missing):
        Pipeline.parse(text, available=PASSES).run(program())


@pytest.mark.parametrize("text, message", [
    ("canonicalize,nosuch", r"unknown pass 'nosuch'; known passes: .*canonicalize"),
    ("canonicalize{nosuch=1}", r"has no option 'nosuch'; its options: inline_jit"),
    ("canonicalize{inline_jit=maybe}", r"option inline_jit expects bool, got 'maybe'"),
    ("canonicalize{inline_jit}", r"needs the form key=value"),
    ("canonicalize,", r"pipeline ends with a comma"),
    ("", r"empty pipeline; known passes: .*canonicalize"),
    ("canonicalize;x", r"cannot parse pipeline"),
])
def test_parse_errors(text, message):
    with pytest.raises(PipelineError, match=message):
        Pipeline.parse(text, available=PASSES)


def test_make_pass_unknown_names_known():
    with pytest.raises(PipelineError, match="known passes"):
        make_pass("frobnicate", available=PASSES)


@dataclass(frozen=True)
class Breaks(Pass):
    """A test pass that breaks its own invariant (never registered)."""

    name = "breaks-things"

    def run(self, module):
        return PassResult(module, False)

    def verify(self, module):
        assert False, "the widget count is wrong"


def test_run_reports_changes_and_printing():
    out = io.StringIO()
    pipeline = Pipeline.parse("canonicalize,canonicalize",
                              [PrintIR(after_all=True, stream=out)], available=PASSES)
    result = pipeline.run(program())
    assert result.changed
    text = out.getvalue()
    banners = re.findall(r"^# ----- IR after canonicalize -----$", text, re.M)
    assert len(banners) == 2
    summaries = re.findall(r"^# canonicalize: (\d+) equations \((\d+) before\), "
                           r"1 attention ops, [\d.]+ ms, (changed|unchanged)$", text, re.M)
    assert [s[2] for s in summaries] == ["changed", "unchanged"]
    after_first = int(summaries[0][0])
    assert after_first < int(summaries[0][1]) and int(summaries[1][1]) == after_first
    assert after_first == count_equations(result.module)
    assert "attention[causal" in text


def test_print_before_named_and_on_change():
    out = io.StringIO()
    Pipeline.parse("canonicalize,canonicalize",
                   [PrintIR(before_all=True, only_on_change=True, stream=out)], available=PASSES).run(program())
    text = out.getvalue()
    assert text.count("# ----- IR before canonicalize -----") == 2
    assert text.count("# ----- IR after canonicalize -----") == 1
    out = io.StringIO()
    Pipeline([Breaks(), make_pass("canonicalize", available=PASSES)],
             [PrintIR(after_passes=("breaks-things",), stream=out)]).run(program())
    assert re.findall(r"# ----- IR after (\S+) -----", out.getvalue()) == ["breaks-things"]


def test_dump_dir_numbered_files(tmp_path):
    (tmp_path / "07-stale.txt").write_text("old")
    (tmp_path / "notes.md").write_text("keep")
    Pipeline.parse("canonicalize,canonicalize", [DumpIR(tmp_path)], available=PASSES).run(program())
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["00-input.txt", "01-canonicalize.txt", "02-canonicalize.txt", "notes.md"]
    first = (tmp_path / "01-canonicalize.txt").read_text()
    assert first.startswith("# ----- IR after canonicalize -----\n{ lambda")
    assert "jit" in (tmp_path / "00-input.txt").read_text()


def test_timing_table():
    out = io.StringIO()
    timing = TimePasses(stream=out)
    Pipeline.parse("canonicalize,canonicalize", [timing], available=PASSES).run(program())
    assert [r.name for r in timing.rows] == ["canonicalize", "canonicalize"]
    assert all(r.seconds > 0 for r in timing.rows)
    assert [r.changed for r in timing.rows] == [True, False]
    lines = out.getvalue().splitlines()
    assert lines[0].split()[1:4] == ["pass", "ms", "share"]
    assert re.fullmatch(r"# canonicalize\s+[\d.]+\s+[\d.]+%\s+\d+ -> \d+\s+yes", lines[1])
    assert lines[-1].startswith("# total")


def test_verify_each_names_the_pass():
    with pytest.raises(VerificationError, match="after pass breaks-things: the widget count"):
        Pipeline([make_pass("canonicalize", available=PASSES), Breaks()], [VerifyEach()]).run(program())


def test_verify_each_catches_ill_typed_jaxpr():
    @dataclass(frozen=True)
    class Corrupts(Pass):
        name = "corrupts"

        def run(self, module):
            other = trace(lambda x: x.astype(jnp.int32), jnp.ones(3))
            jaxpr = module.jaxpr.jaxpr.replace(eqns=other.eqns)
            return PassResult(module.with_jaxpr(module.jaxpr.replace(jaxpr=jaxpr)), True)

    with pytest.raises(VerificationError, match="after pass corrupts: ill-typed jaxpr"):
        Pipeline([Corrupts()], [VerifyEach()]).run(program())


def test_the_collector_is_paused_while_tracing_and_restored_after():
    """The transform traces the user's function with the cyclic collector paused (its
    generation-2 passes cost a third of a long program's transform) and leaves the
    collector as it found it: enabled, or disabled by the caller, also after an error."""
    import gc

    import numpy as np

    from cptransform import context_parallel
    from cptransform.ir.gc_pause import gc_paused

    seen = []

    def f(q, k, v):
        seen.append(gc.isenabled())
        return attention(q, k, v, causal=True) * 2.0

    x = jax.random.normal(jax.random.key(1), (1, 16, 2, 4), jnp.float32)
    cp = context_parallel(f, cp=2)
    got = jax.jit(jax.grad(lambda x: jnp.sum(cp(x, x, x))))(x)
    want = jax.grad(lambda x: jnp.sum(f(x, x, x)))(x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # The transform's traces, then the reference's call.
    assert len(seen) >= 2 and not any(seen[:-1]) and seen[-1] and gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
    with pytest.raises(ZeroDivisionError):
        with gc_paused():
            1 / 0
    assert gc.isenabled()
