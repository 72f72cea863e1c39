"""Load, overload and shutdown against real server processes.

* 32 concurrent streaming clients (a quarter disconnect mid-stream) finish without errors, and the
  engine's pools are empty afterwards (disconnects abort their requests and free their cache);
* a full waiting queue answers 429 ``engine_overloaded_error`` with ``Retry-After``, and the openai
  SDK's retries (which honour it) get through once the queue drains;
* SIGTERM stops accepting connections but lets an in-flight stream finish.
"""

from __future__ import annotations

import asyncio
import re
import signal
import threading
import time

import httpx
import openai
import pytest

from tests.server.conftest import API_KEY, MODEL, ServerProcess, user


def _wait_idle(server, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        stats = server.engine_stats()
        if stats.get("running") == 0 and stats.get("waiting") == 0:
            return stats
        assert time.monotonic() < deadline, f"engine still busy: {stats}"
        time.sleep(0.1)


def test_32_streaming_clients_with_disconnects(server):
    async def one(client, i: int) -> tuple[str, int]:
        stream = await client.chat.completions.create(
            model=MODEL, messages=user(f"Client {i}, tell me a story."), max_completion_tokens=24, stream=True)
        n, finish = 0, None
        async for chunk in stream:
            n += 1
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
            if i % 4 == 0 and n == 1:
                await stream.close()  # a quarter of the clients hang up mid-stream (after the role chunk)
                return "disconnected", n
        return finish, n

    async def run():
        async with openai.AsyncOpenAI(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    results = asyncio.run(run())
    assert sum(r[0] == "disconnected" for r in results) == 8
    # the others end normally: the grammar-constrained reply either completes or runs to max tokens
    assert all(r[0] in ("stop", "length") for i, r in enumerate(results) if i % 4), results
    stats = _wait_idle(server)
    assert stats["mla_blocks.used"] == 0 and stats["mla_blocks.reserved"] == 0, stats
    assert stats["kda_slots.used"] == 0, stats
    metrics = httpx.get(server.base + "/metrics").text
    assert 'openk3_requests_total{endpoint="/v1/chat/completions",status="500"}' not in metrics


@pytest.fixture(scope="module")
def small_server(checkpoint, tmp_path_factory):
    srv = ServerProcess(checkpoint, "--served-model-name", MODEL, "--max-num-seqs", "1", "--max-waiting", "1",
                        log_dir=tmp_path_factory.mktemp("small"))
    yield srv
    srv.stop()
    assert "Traceback" not in srv.output(), srv.output()


def _stream_in_background(url: str, max_tokens: int) -> tuple[threading.Thread, dict]:
    box: dict = {}

    def run():
        with httpx.stream("POST", url + "/chat/completions", timeout=120, json={
                "model": MODEL, "messages": user(), "max_completion_tokens": max_tokens, "stream": True}) as r:
            box["status"] = r.status_code
            box["lines"] = [line for line in r.iter_lines() if line]

    t = threading.Thread(target=run)
    t.start()
    return t, box


def _busy(server, running: int, waiting: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        s = server.engine_stats()
        if s.get("running", 0) >= running and s.get("waiting", 0) >= waiting:
            return
        assert time.monotonic() < deadline, s
        time.sleep(0.02)


def test_overload_429_and_sdk_retry(small_server):
    threads = [_stream_in_background(small_server.url, 300)]
    _busy(small_server, 1, 0)
    threads.append(_stream_in_background(small_server.url, 60))
    _busy(small_server, 1, 1)
    r = httpx.post(small_server.url + "/chat/completions", timeout=30,
                   json={"model": MODEL, "messages": user(), "max_completion_tokens": 1})
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert r.json() == {"error": {"message": "The engine is currently overloaded, please try again later",
                                  "type": "engine_overloaded_error"}}
    with pytest.raises(openai.RateLimitError):
        openai.OpenAI(base_url=small_server.url, api_key="x", max_retries=0).chat.completions.create(
            model=MODEL, messages=user(), max_completion_tokens=1)
    # the SDK retries after Retry-After; it gets through once the queue has room
    retrying = openai.OpenAI(base_url=small_server.url, api_key="x", max_retries=8, timeout=60)
    ok = retrying.chat.completions.create(model=MODEL, messages=user(), max_completion_tokens=1)
    assert ok.choices[0].finish_reason in ("length", "stop")
    for t, box in threads:
        t.join(120)
        assert box["status"] == 200 and box["lines"][-1] == "data: [DONE]"
    m = re.search(r"^openk3_overloaded_total (\S+)$", httpx.get(small_server.base + "/metrics").text, re.M)
    assert m and float(m.group(1)) >= 2


def test_sigterm_drains_in_flight_stream(small_server):
    lines: list[str] = []
    with httpx.stream("POST", small_server.url + "/chat/completions", timeout=120, json={
            "model": MODEL, "messages": user(), "max_completion_tokens": 120, "stream": True}) as r:
        it = r.iter_lines()
        lines.append(next(it))
        small_server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        with pytest.raises(httpx.ConnectError):  # no new connections once draining
            httpx.get(small_server.base + "/health", timeout=5)
        lines.extend(line for line in it if line)
    assert lines[-1] == "data: [DONE]"
    # the in-flight reply ran to its normal end (grammar complete or max tokens)
    assert '"finish_reason": "length"' in lines[-2] or '"finish_reason": "stop"' in lines[-2]
    assert small_server.proc.wait(30) == 0  # drained, then a clean exit (not -15)
