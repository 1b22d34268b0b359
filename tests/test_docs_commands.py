"""Every command in README.md, docs/*.md and tests/README.md runs as written.

The ```sh blocks are read out line by line (a trailing backslash continues a line) and each
command is matched against the tables below: run in the fast tier (the cheap CLI calls), run
in the slow tier (the examples, the CLI on the Llama example), or skipped for the reason
given. A command no row matches fails the test, so a command added to the docs must be
classified here. The ```python blocks run too (slow unless named in FAST_PYTHON), except the ones
skipped below by reason.
``.venv/bin/`` is this interpreter's folder, so the commands run in the environment the
tests run in; the working directory is the repository root.
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "tests" / "README.md"]
TIMEOUT_S = 900

#: (pattern at the start of a command, tier) for the commands that run.
RUN = [
    (r"\.venv/bin/cptransform passes\b", "fast"),
    (r"\.venv/bin/cptransform opt examples/tiny_attention\.py:", "fast"),
    (r"\.venv/bin/cptransform (plan|opt) examples/llama\.py:", "slow"),
    (r"\.venv/bin/python examples/\w+\.py(\s|$)", "slow"),
]

#: (pattern at the start of a command, why it is not run here).
SKIP = [
    (r"python -m venv \.venv && ", "creates a virtualenv and installs into it: .ci/run runs "
                                   "the README's commands in a fresh clone"),
    (r"JAX_PLATFORMS=(tpu|cuda) ", "needs a TPU or GPU slice"),
    (r"\.venv/bin/python -m pytest\b", "runs (part of) this test suite, which CI runs itself"),
    (r"\.venv/bin/python bench/", "a benchmark: minutes to hours; its results are in "
                                  "bench/results/"),
    (r"python train\.py ", "a user's training script, one process per host"),
    (r"\s*(python3\.1[12] -m venv \.venv-stock-|\.venv-stock-\w+/bin/)",
     "the stock-model environments (MaxText, EasyDeL): installed by hand, not in CI"),
]

#: Substrings of the ```python blocks cheap enough for the fast tier (the rest are slow).
FAST_PYTHON = ["Pipeline.parse("]

#: (substring of a ```python block, why it is not run here).
SKIP_PYTHON = [
    ("jax.distributed.initialize(coordinator_address=args.coordinator",
     "a fragment of a multi-host script (args, loss_fn, local_tokens are the user's); "
     "tests/test_multiprocess.py runs the same on two processes"),
    ("plan = fn.plan(params, tokens)",
     "a fragment (fn, params and tokens are the reader's); tests/test_plan.py reads the same "
     "fields of a real plan"),
    ("loss_cp = context_parallel(loss, mesh=mesh, axis=\"cp\")",
     "a fragment (loss, rules, params and tokens are the reader's model); "
     "examples/maxtext_style.py and tests/test_sharded_models.py run the same calls"),
]


def _blocks(path: Path, language: str) -> list[tuple[int, str]]:
    """``(first line number, text)`` of each fenced block of ``language`` in ``path``."""
    blocks, current, start = [], None, 0
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if current is None and line.strip() == f"```{language}":
            current, start = [], number + 1
        elif current is not None and line.strip() == "```":
            blocks.append((start, "\n".join(current)))
            current = None
        elif current is not None:
            current.append(line)
    return blocks


def _commands(path: Path) -> list[tuple[int, str]]:
    """``(line number, command)`` of each command of the ```sh blocks of ``path``."""
    commands = []
    for start, text in _blocks(path, "sh"):
        pending, first = "", 0
        for offset, line in enumerate(text.splitlines()):
            if not pending and (not line.strip() or line.lstrip().startswith("#")):
                continue
            first = first if pending else start + offset
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1]
                continue
            commands.append((first, pending + line))
            pending = ""
    return commands


def _classify(command: str) -> tuple[str, str]:
    """``("fast" | "slow", "")`` for a command to run, ``("skip", reason)`` otherwise."""
    for pattern, tier in RUN:
        if re.match(pattern, command):
            return tier, ""
    for pattern, reason in SKIP:
        if re.match(pattern, command):
            return "skip", reason
    return "unclassified", ""


def _cases():
    for path in DOCS:
        for line, command in _commands(path):
            tier, reason = _classify(command)
            marks = [pytest.mark.slow] if tier == "slow" else []
            yield pytest.param(command, tier, reason, marks=marks,
                               id=f"{path.relative_to(ROOT)}:{line}")


def _python_cases():
    for path in DOCS:
        for line, text in _blocks(path, "python"):
            reason = next((why for needle, why in SKIP_PYTHON if needle in text), "")
            fast = any(needle in text for needle in FAST_PYTHON)
            yield pytest.param(text, reason, marks=[] if fast else [pytest.mark.slow],
                               id=f"{path.relative_to(ROOT)}:{line}")


def _run(argv: list[str], what: str) -> None:
    result = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert result.returncode == 0, (f"{what}\nexited {result.returncode}:\n"
                                    f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")


@pytest.mark.parametrize("command,tier,reason", list(_cases()))
def test_command_runs_as_written(command, tier, reason):
    assert tier != "unclassified", (
        f"{command!r} is in no table of tests/test_docs_commands.py: add it to RUN (fast or "
        "slow) or to SKIP with the reason")
    if tier == "skip":
        pytest.skip(reason)
    if "--png" in command:
        pytest.importorskip("matplotlib")
    bin_dir = Path(sys.executable).parent
    _run(["bash", "-c", f"set -euo pipefail; {command.replace('.venv/bin/', f'{bin_dir}/')}"],
         command)


@pytest.mark.parametrize("text,reason", list(_python_cases()))
def test_python_block_runs(text, reason):
    if reason:
        pytest.skip(reason)
    _run([sys.executable, "-c", text], text)


def test_the_readme_commands_come_first():
    """The install+demo and install+test commands are the first lines of the README's first
    two ```sh blocks (.ci/run reads the second), within its first 60 lines, and the second
    runs the fast tier."""
    blocks = _blocks(ROOT / "README.md", "sh")
    demo, tests = blocks[0], blocks[1]
    assert demo[0] <= 60 and tests[0] <= 60
    assert demo[1].splitlines()[0].endswith(".venv/bin/python examples/llama.py")
    assert tests[1].splitlines()[0].endswith('-m pytest -q -m "not slow" -n 2 --dist load')
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200
