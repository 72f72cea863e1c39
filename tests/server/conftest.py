"""Server test fixtures: one tiny checkpoint per session and real ``openk3 serve`` processes on loopback.

``server`` is shared by the whole server suite (API key required, model id ``kimi-k3``);
``small_server`` (module-scoped where used) has one running slot and a one-request waiting queue,
for the 429 and SIGTERM-drain tests. Servers bind port 0 and the fixture reads the actual port from
the startup line, so parallel runs cannot collide.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.server.checkpoint import build_checkpoint

REPO = Path(__file__).resolve().parents[2]
API_KEY = "sk-test-openk3"
MODEL = "kimi-k3"
_STARTUP = re.compile(r"openk3 serve: model (\S+) at (http://\S+)/v1")


class ServerProcess:
    """``python -m openk3.cli serve [CHECKPOINT] --port 0 ...`` in a subprocess (no CHECKPOINT:
    the shipped default model).

    Attributes:
        base: ``http://127.0.0.1:PORT``; ``url``: ``base + "/v1"``; ``proc``: the Popen.
    """

    def __init__(self, checkpoint: Path | None, *args: str, log_dir: Path, timeout: float = 120.0):
        self.log = log_dir / f"server-{os.getpid()}-{time.monotonic_ns()}.log"
        self._out = open(self.log, "w+")
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        env.pop("OPENK3_API_KEY", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "openk3.cli", "serve", *([str(checkpoint)] if checkpoint else []),
             "--port", "0", *args],
            cwd=REPO, stdout=self._out, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        while True:
            text = self.log.read_text()
            m = _STARTUP.search(text)
            if m:
                self.model, self.base = m.group(1), m.group(2)
                break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError(f"server did not start (exit {self.proc.poll()}):\n{text}")
            time.sleep(0.05)
        self.url = self.base + "/v1"

    def output(self) -> str:
        return self.log.read_text()

    def engine_stats(self) -> dict[str, float]:
        """``openk3_engine_stat{key=...}`` values from /metrics, plus running / waiting."""
        text = httpx.get(self.base + "/metrics", timeout=10).text
        out = {}
        for line in text.splitlines():
            m = re.match(r'openk3_engine_stat\{key="([^"]+)"\} (\S+)', line)
            if m:
                out[m.group(1)] = float(m.group(2))
            m = re.match(r"openk3_requests_(running|waiting) (\S+)", line)
            if m:
                out[m.group(1)] = float(m.group(2))
        return out

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._out.close()
        return self.proc.returncode


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("server") / "k3-tiny")


@pytest.fixture(scope="session")
def tokenizer(checkpoint):
    from openk3.tokenizer import load_tokenizer

    return load_tokenizer(checkpoint)


@pytest.fixture(scope="session")
def server(checkpoint, tmp_path_factory):
    srv = ServerProcess(checkpoint, "--served-model-name", MODEL, "--api-key", API_KEY, "--max-num-seqs", "8",
                        log_dir=tmp_path_factory.mktemp("logs"))
    yield srv
    code = srv.stop()
    assert "Traceback" not in srv.output(), srv.output()
    assert code == 0, srv.output()  # SIGTERM: drained, then a clean exit


@pytest.fixture
def client(server):
    from openai import OpenAI

    with OpenAI(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.base, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as c:
        yield c


def user(text: str = "Hello there, what is the weather in Paris?") -> list[dict]:
    return [{"role": "user", "content": text}]
