"""``openk3 serve --compile``: decode steps through the compiled static-shape step
(:mod:`openk3.engine.decode_step`), answering exactly what the eager server answers (greedy), and
``OPENK3_DECODE_BACKEND=reference`` forcing the eager reference from the environment.

The compiled server compiles one (batch 1, block-table) bucket on its first decode step: Inductor's
C++ build of the model's whole step. For the six-layer test checkpoint that measured 31 s of
in-process CPU plus the C++ compiler's (353 s wall at load 5-6 on the shared 2-core VM, 56 s with a
warm Inductor cache); the greedy comparison therefore serves a two-layer checkpoint of the same
kind (one KDA + one MLA layer, dense and MoE FFNs, Block AttnRes: every branch of the step) and is
still ``slow``, with a longer timeout.
"""

from __future__ import annotations

import os

import httpx
import pytest

from tests.server.checkpoint import build_checkpoint
from tests.server.conftest import MODEL, ServerProcess, user

# one request's prompt + reply stay within 16 blocks of 16 tokens: one block-table bucket, one compile
FLAGS = ("--served-model-name", MODEL, "--greedy", "--max-num-seqs", "1", "--max-model-len", "256", "--quiet")
PROMPTS = ["Hello there, what is the weather in Paris?", "The quick brown fox"]


def _answers(srv: ServerProcess) -> list[tuple[str, int, str]]:
    out = []
    for text in PROMPTS:
        r = httpx.post(srv.url + "/chat/completions", timeout=1200, json={
            "model": MODEL, "messages": user(text), "max_completion_tokens": 12})
        assert r.status_code == 200, r.text
        body = r.json()
        choice = body["choices"][0]
        out.append((choice["message"]["content"], body["usage"]["completion_tokens"], choice["finish_reason"]))
    return out


@pytest.fixture(scope="module")
def two_layer_checkpoint(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("compiled") / "k3-tiny-2", num_hidden_layers=2,
                            layer_types=["linear_attention", "full_attention"], mlp_layer_types=["dense", "sparse"])


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_compiled_server_answers_the_eager_servers_greedy_tokens(two_layer_checkpoint, tmp_path, monkeypatch):
    checkpoint = two_layer_checkpoint
    monkeypatch.delenv("OPENK3_DECODE_BACKEND", raising=False)
    eager = ServerProcess(checkpoint, *FLAGS, log_dir=tmp_path)
    try:
        assert "compiled decode step" not in eager.output()
        want = _answers(eager)
    finally:
        assert eager.stop() == 0, eager.output()
    compiled = ServerProcess(checkpoint, *FLAGS, "--compile", log_dir=tmp_path)
    try:
        # the startup line names the backend: the flag reached EngineConfig(compile=True)
        assert "; cpu, float32, compiled decode step; --greedy" in compiled.output().splitlines()[-1], compiled.output()
        got = _answers(compiled)
    finally:
        code = compiled.stop()
    assert code == 0 and "Traceback" not in compiled.output(), compiled.output()
    assert all(n >= 2 for _, n, _ in want), want  # decode steps ran (not only the prefill's token)
    assert got == want


def test_environment_forces_the_reference_over_compile(checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("OPENK3_DECODE_BACKEND", "reference")
    srv = ServerProcess(checkpoint, *FLAGS, "--compile", log_dir=tmp_path)
    try:
        line = srv.output().splitlines()[-1]
        assert line.endswith("; cpu, float32; --greedy: argmax decoding for evaluation, not the platform's sampling)"), line
    finally:
        assert srv.stop() == 0, srv.output()


def test_unknown_decode_backend_is_a_startup_error_naming_the_variable(checkpoint):
    import subprocess
    import sys

    from tests.server.conftest import REPO

    env = dict(os.environ, OMP_NUM_THREADS="1", OPENK3_DECODE_BACKEND="fast")
    p = subprocess.run([sys.executable, "-m", "openk3.cli", "serve", str(checkpoint), "--port", "0", "--compile"],
                       capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "OPENK3_DECODE_BACKEND='fast': unknown; known: ['compiled', 'reference']" in p.stderr, p.stderr
