"""The installed layout: every package folder of the source tree is in pyproject.toml's
``packages`` list, under the name its ``package-dir`` mapping gives it (a folder left out
imports from a checkout or an editable install, and is missing from a wheel)."""
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_folder_is_listed():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    found = set()
    for name, folder in setuptools["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((name, *parts)))
    assert found - listed == set(), f"package folders missing from pyproject.toml: {found - listed}"
    assert listed - found == set(), f"listed packages without a folder: {listed - found}"
