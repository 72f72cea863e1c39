"""``openk3 serve`` without a model, and ``examples/capabilities.py`` against the running server."""

from __future__ import annotations

import subprocess
import sys

from openk3.cli import main as cli
from tests.server.conftest import API_KEY, REPO


def test_serve_without_model_and_without_the_shipped_model_exits_2(capsys, monkeypatch):
    # An installation stripped of its data files: `openk3 serve` explains instead of crashing.
    # (With the model present, tests/server/test_default_model.py serves it.)
    import openk3.shipped

    monkeypatch.setattr(openk3.shipped, "SHIPPED_DIR", openk3.shipped.SHIPPED_DIR / "nonexistent")
    assert cli(["serve"]) == 2
    err = capsys.readouterr().err
    assert "no MODEL given" in err and "is missing" in err and "openk3 serve CHECKPOINT_DIR" in err


def test_serve_rejects_a_missing_directory(tmp_path, capsys):
    assert cli(["serve", str(tmp_path / "nope")]) == 2
    assert "not a checkpoint directory" in capsys.readouterr().err


def test_capabilities_example(server):
    r = subprocess.run([sys.executable, "examples/capabilities.py", "--base-url", server.url, "--api-key", API_KEY,
                        "--max-tokens", "250"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [line for line in r.stdout.splitlines() if line.startswith(("PASS", "FAIL"))]
    assert len(lines) == 9 and all(line.startswith("PASS") for line in lines), r.stdout
