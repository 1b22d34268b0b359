"""``bench/accelerator_check.py`` without a GPU or TPU: the tier runs, every test skips with
its reason, nothing is measured or written, and the command succeeds."""
import sys
from pathlib import Path

import jax
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))


@pytest.mark.slow
@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the dry mode is for a CPU machine")
def test_one_command_skips_with_a_reason_on_a_cpu(capsys, tmp_path):
    import accelerator_check

    out = tmp_path / "never.json"
    assert accelerator_check.main(["--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "accelerator tier:" in text and "skipped" in text and "passed" not in text
    assert "no GPU or TPU here" in text
    assert not out.exists()
