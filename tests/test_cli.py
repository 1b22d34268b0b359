"""The ``cptransform`` command, through a subprocess and in-process via ``main``."""
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cptransform.api.cli import main
from cptransform.api.entry_points import parse_shapes

ROOT = Path(__file__).resolve().parents[1]
LLAMA = str(ROOT / "examples" / "llama.py")


def run_cli(*argv):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-m", "cptransform.api.cli", *argv], cwd=ROOT,
                          capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.slow
def test_opt_prints_banner_jaxpr_and_summary_per_pass():
    proc = run_cli("opt", f"{LLAMA}:make", "-p", "canonicalize,canonicalize",
                   "--print-ir-after-all")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    parts = re.split(r"^# ----- IR after canonicalize -----\n", out, flags=re.M)
    assert parts[0] == "" and len(parts) == 3
    for part in parts[1:]:
        assert re.match(r"(let \w+ = )?\{ lambda ", part)
        assert "scan[" in part and "dot_general" in part
        assert re.search(r"^# canonicalize: \d+ equations \(\d+ before\), 0 attention ops, "
                         r"[\d.]+ ms, (changed|unchanged)$", part, re.M)


@pytest.mark.slow
def test_passes_lists_canonicalize_with_options():
    proc = run_cli("passes")
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"^canonicalize\s+inline jit", proc.stdout, re.M)
    assert "    fold_scales: str = ulp" in proc.stdout
    lower = proc.stdout.split("lower-context-parallel", 1)[1]
    assert lower.splitlines()[1] == "    requires: mesh, plan"


@pytest.mark.slow
def test_unknown_pass_is_one_line_exit_2():
    proc = run_cli("opt", f"{LLAMA}:make", "-p", "canonicalize,nosuch")
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr
    assert "unknown pass 'nosuch'" in lines[0] and "canonicalize" in lines[0]


@pytest.fixture
def entry_file(tmp_path):
    path = tmp_path / "prog.py"
    path.write_text(textwrap.dedent("""
        import jax
        import jax.numpy as jnp

        def scaled(x, ids):
            return jax.jit(lambda a: a / 4.0)(x) * 2.0 + ids.astype(jnp.float32)[..., None]

        def broken():
            return 3

        def raises():
            raise RuntimeError("no model today\\nsecond line")

        def make_bad():
            return (lambda x: x.reshape(7), (jnp.ones(4),))
    """))
    return path


def test_function_with_args(entry_file, capsys):
    assert main(["opt", f"{entry_file}:scaled", "--args", "f32[2,8,4] i32[2,8]"]) == 0
    out = capsys.readouterr().out
    assert "a:f32[2,8,4] b:i32[2,8]" in out
    assert "mul a 0.5:f32[]" in out and "jit" not in out


@pytest.mark.parametrize("argv, message", [
    (["{f}:scaled"], r"scaled takes arguments \(x, ids\); give their shapes with --args"),
    (["{f}:scaled", "--args", "f32[2,8,4]"], r"takes 2 arguments .* --args gives 1"),
    (["{f}:scaled", "--args", "q32[2] i32[2]"],
     r"unknown dtype 'q32' in 'q32\[2\]'; known dtypes: f16"),
    (["{f}:scaled", "--args", "f32(2) i32[2]"], r"cannot read argument shape 'f32\(2\)'"),
    (["{f}:nothing"], r"has no 'nothing'; its functions: broken, make_bad, raises, scaled"),
    (["{f}:raises"], r"raises\(\) failed: RuntimeError: no model today$"),
    (["{f}:make_bad"], r"tracing <lambda> failed: TypeError: cannot reshape"),
    (["{f}:broken"], r"broken\(\) must return \(fn, example_args\)"),
    (["missing.py:make"], r"no such file: missing.py"),
    (["{f}"], r"must look like FILE.py:NAME"),
    (["{f}:scaled", "--args", "f32[2,8,4] i32[2,8]", "--print-ir-after", "nosuch"],
     r"--print-ir-after: unknown pass 'nosuch'; known passes: .*canonicalize"),
    (["{f}:scaled", "--args", "f32[2,8,4] i32[2,8]", "-p", "canonicalize{x=1}"],
     r"pass canonicalize has no option 'x'"),
    (["{f}:scaled", "--args", "f32[2,8,4] i32[2,8]", "--cp", "100000"],
     r"--cp 100000: at most 1024 devices can be simulated on the CPU"),
    (["{f}:scaled", "--args", "f32[2,8,4] i32[2,8]", "--cp", "0"],
     r"--cp 0: the CP size must be at least 1"),
    (["{f}:scaled", "--args", "f32[2,8,4] i32[2,8]", "--ir-dump-dir", "{f}/dump"],
     r"--ir-dump-dir .*/dump: cannot create it"),
    (["{f}:scaled", "--args", "f32[2,,4] i32[2,8]"],
     r"cannot read argument shape 'f32\[2,,4\]': an empty dimension"),
    (["{f}:scaled", "--args", "f32[99999999999999999999] i32[2,8]"],
     r"holds 99999999999999999999 elements, more than any array can"),
    (["{f}:scaled", "--args", "f32[2,8,4] i32[2,8]", "--axis", "", "--mesh", "2"],
     r"--axis '': an empty mesh axis name"),
    (["{f}:scaled", "--args", "f32[2,8,4] i32[2,8]", "--axis", "uly,", "--mesh", "2,2"],
     r"--axis 'uly,': an empty mesh axis name"),
    (["{f}:scaled", "--args", "f32[2,8,4] i32[2,8]", "--print-ir-after", "match-attention"],
     r"--print-ir-after match-attention: the pipeline does not run that pass; it runs "
     r"canonicalize$"),
    (["{f}:scaled", "--args", "f32[2,8,4] i32[2,8]", "--print-ir-after", "canonicalise"],
     r"unknown pass 'canonicalise' \(did you mean 'canonicalize'\?\)"),
    (["{f}:scaled", "--args", "i32[2,8,4] i32[2,8]", "--grad"],
     r"--grad differentiates w.r.t. the first argument, which holds int32"),
    (["{f}:scaled", "--args", "f32[2,8,4] i32[2,8]", "--mesh", "2", "--load-balance",
      "documents"], r"argument --load-balance: load_balance='documents' \(per-document zigzag"),
    (["{f}:scaled", "--args", "f32[2,8,4] i32[2,8]", "--mesh", "2", "--kernel", "palas"],
     r"unknown kernel='palas' \(did you mean 'pallas'\?\)"),
    (["{f}:scaled", "--args", "f32[2,8,4] i32[2,8]", "--no-such-flag"],
     r"unrecognized arguments: --no-such-flag"),
    (["{f}:scaled", "--args", "f32[2,8,4] i32[2,8]", "-p", "canonicalize{fold_scale=ulp}"],
     r"has no option 'fold_scale' \(did you mean 'fold_scales'\?\)"),
])
def test_bad_input_is_one_line_exit_2(entry_file, capsys, argv, message):
    argv = [a.replace("{f}", str(entry_file)) for a in argv]
    assert main(["opt", *argv]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert re.search(message, err), err


def test_dump_timing_match_stats_and_no_verify(entry_file, tmp_path, capsys):
    dump = tmp_path / "dump"
    argv = ["opt", f"{entry_file}:scaled", "--args", "f32[2,8,4] i32[2,8]",
            "-p", "canonicalize,canonicalize", f"--ir-dump-dir={dump}", "--time-passes",
            "--match-stats", "--no-verify", "--print-ir-after=canonicalize",
            "--print-ir-after-change"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert sorted(p.name for p in dump.iterdir()) == [
        "00-input.txt", "01-canonicalize.txt", "02-canonicalize.txt"]
    assert out.count("# ----- IR after canonicalize -----") == 1  # the second changed nothing
    assert re.search(r"^# canonicalize\s+[\d.]+\s+[\d.]+%", out, re.M)
    assert "# no match statistics (run match-attention)" in out


def test_parse_shapes():
    a, b, c = parse_shapes("f32[2,64,4,16] i32[2, 64] bf16[]")
    assert (a.shape, str(a.dtype)) == ((2, 64, 4, 16), "float32")
    assert (b.shape, str(b.dtype)) == ((2, 64), "int32")
    assert (c.shape, str(c.dtype)) == ((), "bfloat16")


def test_a_file_calling_sys_exit_is_one_line(tmp_path, capsys):
    script = tmp_path / "script.py"
    script.write_text("import sys\nsys.exit(3)\n")
    assert main(["opt", f"{script}:make"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"cptransform: error: importing {script} called sys.exit(3); guard its "
                   'script part with `if __name__ == "__main__":`']



@pytest.mark.skipif(not (os.path.isdir("/proc") and os.access("/proc", os.W_OK)),
                    reason="needs a directory os.access calls writable that is not (/proc)")
def test_dump_dir_that_os_access_calls_writable_but_is_not(entry_file, capsys):
    assert main(["opt", f"{entry_file}:scaled", "--args", "f32[2,8,4] i32[2,8]",
                 "--ir-dump-dir", "/proc"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert "--ir-dump-dir /proc: the directory is not writable" in err


def test_a_model_file_imports_the_helper_beside_it(tmp_path, capsys):
    (tmp_path / "ux_helper_layers.py").write_text("def double(x):\n    return 2.0 * x\n")
    (tmp_path / "model.py").write_text(
        "from ux_helper_layers import double\n\ndef f(x):\n    return double(x)\n")
    assert main(["opt", f"{tmp_path / 'model.py'}:f", "--args", "f32[4]"]) == 0
    assert "mul" in capsys.readouterr().out


def test_a_bug_keeps_its_traceback(entry_file, monkeypatch):
    """Only CPTransformError and the CLI's own errors become one line; anything else is a
    bug in cptransform and must surface as one."""
    from cptransform.passes.canonicalize import Canonicalize

    def broken(self, module):
        raise ValueError("a bug inside a pass")
    monkeypatch.setattr(Canonicalize, "run", broken)
    with pytest.raises(ValueError, match="a bug inside a pass"):
        main(["opt", f"{entry_file}:scaled", "--args", "f32[2,8,4] i32[2,8]"])


def test_png_without_matplotlib_fails_before_printing(entry_file, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["plan", f"{entry_file}:scaled", "--args", "f32[2,8,4] i32[2,8]", "--cp", "2",
                 "--png", "plan.png"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1
    assert ".venv/bin/pip install matplotlib" in err and "pip install -e '.[plot]'" in err
