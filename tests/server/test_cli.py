"""``openk3 serve`` without a model, and ``examples/capabilities.py`` against the running server."""

from __future__ import annotations

import json
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
    out = r.stdout.splitlines()
    lines = [i for i, line in enumerate(out) if line.startswith(("PASS", "WEAK", "FAIL"))]
    assert len(lines) == 9 and not any(out[i].startswith("FAIL") for i in lines), r.stdout
    # every capability that produces model output prints it; a WEAK one says why
    silent = [out[i][6:26].strip() for i in lines if not (i + 1 < len(out) and out[i + 1].lstrip().startswith("answer: "))]
    # all but the cached-prefix probe (one token) and, on this text-only model, the refused image
    assert silent == ["image input", "cached long prefix"], r.stdout
    for i in lines:
        if out[i].startswith("WEAK"):
            assert any(line.lstrip().startswith("weak:   ") for line in out[i + 1:i + 3]), r.stdout
    n_weak = sum(out[i].startswith("WEAK") for i in lines)
    assert out[-1].endswith(f"; {n_weak} with an empty or malformed answer (WEAK)"), r.stdout


def _capabilities_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("capabilities", REPO / "examples" / "capabilities.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_capabilities_flags_empty_and_malformed_answers_apart_from_protocol():
    cap = _capabilities_module()
    assert cap.suspect_value("Paris", expect="Paris") is None
    assert cap.suspect_value("") == "empty value ''"
    assert "reads like reasoning text" in cap.suspect_value("The user wants the weather in a city, so I call it")
    assert "reads like reasoning text" in cap.suspect_value("Paris\nThe arguments fit the schema")
    assert cap.suspect_value("London", expect="Paris") == "'London' where the request implies 'Paris'"
    assert cap._json_object_problem("{}") == "an empty JSON object (no keys)"
    assert cap._json_object_problem("[1]") == "a JSON list, not an object"
    assert cap._json_object_problem('{"city": "Paris"}') is None
    assert cap._json_object_problem("{").startswith("not JSON")


def test_greedy_switch_decodes_argmax_and_says_so(checkpoint, server, tmp_path):
    # `openk3 serve --greedy` (the evaluation switch): every response is marked, and the answer no
    # longer depends on the seed; the default server samples at the platform's temperature.
    import httpx

    from tests.server.conftest import MODEL, ServerProcess

    body = {"model": MODEL, "max_tokens": 24, "messages": [{"role": "user", "content": "Hello there"}]}
    auth = {"Authorization": f"Bearer {API_KEY}"}
    plain = [httpx.post(server.url + "/chat/completions", json=dict(body, seed=s), headers=auth, timeout=60)
             for s in (1, 2, 3)]
    assert all(r.status_code == 200 and "x-openk3-decoding" not in r.headers for r in plain)
    assert len({json.dumps(r.json()["choices"][0]["message"]) for r in plain}) > 1  # sampled
    srv = ServerProcess(checkpoint, "--served-model-name", MODEL, "--greedy", log_dir=tmp_path)
    try:
        assert "--greedy: argmax decoding for evaluation" in srv.output()
        got = [httpx.post(srv.url + "/chat/completions", json=dict(body, seed=s), timeout=60) for s in (1, 2, 3)]
        assert all(r.status_code == 200 and r.headers["x-openk3-decoding"] == "greedy" for r in got)
        assert len({json.dumps(r.json()["choices"][0]["message"]) for r in got}) == 1
        assert httpx.get(srv.base + "/health", timeout=10).headers["x-openk3-decoding"] == "greedy"
    finally:
        srv.stop()
    assert "Traceback" not in srv.output()
