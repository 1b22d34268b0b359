"""The options declared once (``cptransform.api.options.OPTIONS``): the allowed values are
their registries; the ``Options`` record, the passes' fields, the CLI's flags, the README's
options table and ``docs/cli.md``'s flag table agree with the declaration; every allowed
value is taken and a bad one is one clear error, by the API and by the command."""
import dataclasses
import re
from pathlib import Path

import pytest

from cptransform import context_parallel
from cptransform.analysis.hardware import HARDWARE
from cptransform.api.cli import build_parser, main
from cptransform.api.context_parallel import cp_pipeline
from cptransform.api.options import OPTIONS, Options
from cptransform.ir.errors import ContextParallelOptionError
from cptransform.lowering.kernels import kernels
from cptransform.lowering.schedule import schedules
from cptransform.op.layouts import LAYOUTS
from cptransform.passes import get_all_passes
from cptransform.op.recurrence import Method
from cptransform.passes.plan_context_parallel import LOAD_BALANCES

ROOT = Path(__file__).resolve().parents[1]
CHOICE_OPTIONS = [name for name, spec in OPTIONS.items() if spec.choices]
FLAGS = [name for name, spec in OPTIONS.items() if spec.flag]


def test_allowed_values_are_the_registries():
    choices = {name: OPTIONS[name].choices() for name in CHOICE_OPTIONS}
    assert choices == {"schedule": ("auto", *schedules()), "kernel": ("auto", *sorted(kernels())),
                       "load_balance": ("auto", "zigzag", "striped", "none"),
                       "hardware": tuple(HARDWARE),
                       "recurrences": ("auto", "pass", Method.GATHER.value)}
    assert {"halo", "double_ring"} <= set(schedules()) and set(kernels()) >= {"xla", "pallas"}
    assert {v for v in LOAD_BALANCES.values() if v is not None} == set(LAYOUTS)


def test_options_record_is_the_declaration():
    fields = dataclasses.fields(Options)
    assert [f.name for f in fields] == list(OPTIONS)
    assert {f.name: (f.type, f.default) for f in fields} == \
        {name: (spec.type, spec.default) for name, spec in OPTIONS.items()}
    assert all(spec.help and "\n" not in spec.help for spec in OPTIONS.values())


def test_passes_take_the_options_they_consume():
    passes = get_all_passes()
    consumers = {spec.consumer for spec in OPTIONS.values()} - {None}
    assert consumers == {"plan-context-parallel", "reorder-sequence"}
    for consumer in consumers:
        fields = {f.name: f.default for f in dataclasses.fields(passes[consumer]())}
        assert fields == {spec.name: spec.default for spec in OPTIONS.values()
                          if spec.consumer == consumer}, consumer
    options = Options(schedule="ring", load_balance="zigzag", kernel="xla", hardware="h100",
                      memory_limit="80%", strict=True, keep_permuted=True)
    assert cp_pipeline(None, options).spelled().split(",")[5:] == [
        "plan-context-parallel{schedule=ring load_balance=zigzag hardware=h100 "
        "memory_limit=80% kernel=xla}",
        "reorder-sequence{keep_permuted=True strict=True}",
        "lower-context-parallel"]


@pytest.mark.parametrize("name", CHOICE_OPTIONS)
def test_the_api_takes_every_allowed_value_and_names_them_for_a_bad_one(name):
    for value in OPTIONS[name].choices():
        assert getattr(context_parallel(lambda x: x, cp=2, **{name: value}).options,
                       name) == value
    allowed = ", ".join(OPTIONS[name].choices())
    with pytest.raises(ContextParallelOptionError) as err:
        context_parallel(lambda x: x, cp=2, **{name: "bogus"})
    assert str(err.value) == f"unknown {name}='bogus'; use one of {allowed}"


def test_the_api_refuses_documents_and_a_bad_memory_limit():
    with pytest.raises(NotImplementedError, match=r"^load_balance='documents' \(per-document"):
        context_parallel(lambda x: x, cp=2, load_balance="documents")
    with pytest.raises(ContextParallelOptionError, match=r"^memory_limit='lots': give bytes"):
        context_parallel(lambda x: x, cp=2, memory_limit="lots")


def _plan_args(*flags):
    return build_parser().parse_args(["plan", "model.py:make", *flags])


def test_the_command_defaults_are_the_declaration():
    args = _plan_args()
    assert {name: getattr(args, name) for name in FLAGS} == \
        {name: OPTIONS[name].default for name in FLAGS}
    assert args.axis == OPTIONS["axis"].default


@pytest.mark.parametrize("name", CHOICE_OPTIONS)
def test_the_command_takes_every_allowed_value_and_names_them_for_a_bad_one(name, capsys):
    spec = OPTIONS[name]
    assert spec.flag and spec.flag_name == "--" + name.replace("_", "-")
    for value in spec.choices():
        assert getattr(_plan_args(spec.flag_name, value), name) == value
    assert main(["plan", "model.py:make", spec.flag_name, "bogus"]) == 2
    allowed = ", ".join(spec.choices())
    assert capsys.readouterr().err == (
        f"cptransform: error: argument {spec.flag_name}: unknown {name}='bogus'; use one of "
        f"{allowed} (see cptransform plan --help)\n")


@pytest.mark.parametrize("flags, value", [(["--cp", "4"], 4), (["--memory-limit", "80%"], "80%"),
                                          (["--memory-limit", "1024"], 1024)])
def test_the_command_parses_open_values(flags, value):
    assert getattr(_plan_args(*flags), flags[0][2:].replace("-", "_")) == value


@pytest.mark.parametrize("flags, message", [
    (["--cp", "x"], "argument --cp: invalid int value: 'x'"),
    (["--memory-limit", "lots"], "argument --memory-limit: memory_limit='lots': give bytes"),
    (["--load-balance", "documents"],
     "argument --load-balance: load_balance='documents' (per-document zigzag"),
])
def test_the_command_refuses_bad_open_values_in_one_line(flags, message, capsys):
    assert main(["plan", "model.py:make", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"cptransform: error: {message}") and err.count("\n") == 1, err


def _table(path: Path, heading: str) -> list[list[str]]:
    """The cells of each body row of the first markdown table from ``heading`` on (a line of
    the document; the table's own header row may be it)."""
    lines = path.read_text().splitlines()
    lines = lines[lines.index(heading):]
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")),
               len(lines))
    return [[cell.strip() for cell in line.strip("|").split(" | ")]
            for line in lines[start + 2:end]]


def _ticked(cell: str) -> list[str]:
    return re.findall(r"`([^`]*)`", cell)


def test_readme_options_table_is_the_declaration():
    rows = _table(ROOT / "README.md", "## Options")
    assert sorted(name for row in rows for name in _ticked(row[0])) == sorted(OPTIONS)
    values = {name: _ticked(row[1]) for row in rows for name in _ticked(row[0])}
    for name in CHOICE_OPTIONS:
        assert values[name] == list(OPTIONS[name].choices()), name


def test_cli_doc_flag_table_is_the_parser():
    """``docs/cli.md``'s table against ``cptransform plan --help``'s context-parallelism
    group: the same flags in the same order, their choices (default first) or default, and
    their help."""
    plan = build_parser()._subparsers._group_actions[0].choices["plan"]
    group = next(g for g in plan._action_groups if g.title == "context parallelism")
    rows = _table(ROOT / "docs" / "cli.md", "| flag | values (default first) | what it does |")
    assert [_ticked(row[0]) for row in rows] == [a.option_strings for a in group._group_actions]
    for row, action in zip(rows, group._group_actions):
        want = list(action.choices or ([action.default] if action.default else []))
        assert _ticked(row[1]) == want, row
        assert row[2] == action.help.replace("%%", "%"), row
