"""The package is formatted by ``ruff format`` at the line length in pyproject.toml ([tool.ruff]):
one mechanical style instead of lines packed by hand."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _ruff() -> list[str]:
    exe = Path(sys.executable).with_name("ruff")
    if exe.is_file():
        return [str(exe)]
    found = shutil.which("ruff")
    if found is None:
        pytest.fail("ruff is not installed (it is in the test extras: pip install -e '.[test]')")
    return [found]


def test_package_is_ruff_formatted():
    out = subprocess.run(
        [*_ruff(), "format", "--check", "openk3"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, f"run `ruff format openk3`:\n{out.stdout}{out.stderr}"
