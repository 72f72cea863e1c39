"""Regression tests for the reviewer's findings on the server (issue 5 review): early context
rejection of huge bodies, tool-schema keywords, strict JSON types, history structure, streamed
logprobs, block-aligned ``cached_tokens`` and the small surface fixes."""

from __future__ import annotations

import threading
import time

import httpx

from tests.server.conftest import API_KEY, MODEL, user

BASE = {"model": MODEL, "messages": user(), "max_completion_tokens": 1}


def _error(r: httpx.Response, status: int = 400) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type"}, body
    return body["error"]["message"]


def test_huge_text_is_rejected_before_tokenizing(http, server, tokenizer):
    ctx = http.get("/v1/models").json()["data"][0]["context_length"]
    per_token = max(len(tokenizer.decode_bytes([i])) for i in range(tokenizer.vocab_size))
    chars = ctx * per_token + 1  # just over the sound bound: certainly more than ctx tokens
    text = ("hello " * (chars // 6 + 1))[:chars]
    health_times: list[float] = []
    stop = threading.Event()

    def probe():
        with httpx.Client(base_url=server.base, timeout=10) as c:
            while not stop.is_set():
                t = time.monotonic()
                assert c.get("/health").status_code == 200
                health_times.append(time.monotonic() - t)

    th = threading.Thread(target=probe)
    th.start()
    try:
        t0 = time.monotonic()
        msg = _error(http.post("/v1/chat/completions", json=dict(BASE, messages=user(text))))
        elapsed = time.monotonic() - t0
    finally:
        stop.set()
        th.join()
    assert msg.startswith(f"Your request exceeded model token limit: {ctx} (requested: at least ")
    assert elapsed < 5.0, elapsed
    assert health_times and max(health_times) < 2.0, health_times
    # the bound is sound: the same text one character shorter is still tokenized and judged exactly
    n_tokens = len(tokenizer.encode_text(text[:-1]))
    assert n_tokens > ctx or n_tokens * per_token >= chars - 1
