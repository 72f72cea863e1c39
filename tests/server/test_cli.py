"""``openk3 serve`` without a model, and ``examples/capabilities.py`` against the running server."""

from __future__ import annotations

import subprocess
import sys

from tests.server.conftest import API_KEY, REPO


def test_serve_without_model_exits_2():
    r = subprocess.run([sys.executable, "-m", "openk3.cli", "serve"], cwd=REPO, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2
    assert "no MODEL given" in r.stderr and "openk3 serve CHECKPOINT_DIR" in r.stderr


def test_serve_rejects_a_missing_directory(tmp_path):
    r = subprocess.run([sys.executable, "-m", "openk3.cli", "serve", str(tmp_path / "nope")], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "not a checkpoint directory" in r.stderr


def test_capabilities_example(server):
    r = subprocess.run([sys.executable, "examples/capabilities.py", "--base-url", server.url, "--api-key", API_KEY,
                        "--max-tokens", "250"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [line for line in r.stdout.splitlines() if line.startswith(("PASS", "FAIL"))]
    assert len(lines) == 9 and all(line.startswith("PASS") for line in lines), r.stdout
