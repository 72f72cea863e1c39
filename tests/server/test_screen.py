"""The body screen (:mod:`openk3.server.screen`): large bodies are checked in a worker process, so
that the server never parses a body it refuses, and its verdicts are the server's own answers.

Timing (``/health`` latency, the first-token time of other streams while a large body is being
checked) is measured in ``benchmarks/hostile_requests.py``, not asserted here.
"""

from __future__ import annotations

import json
import os
import re
import threading

import httpx
import pytest

from tests.server.conftest import API_KEY, MODEL


def _values(v) -> int:
    if isinstance(v, list):
        return 1 + sum(_values(x) for x in v)
    if isinstance(v, dict):
        return 1 + sum(_values(x) for x in v.values())
    return 1


@pytest.mark.parametrize("text", [
    "0", "[]", "{}", "[ ]", '""', '"a,b[{"', '"\\"[,{"', '["\\\\",",",[1,{}]]', '{"a": [1, 2], "b": {}}',
    '[[],[],[]]', '{"a":{ }, "b":[ [ ] ], "c":[{"d":"}"}]}', '[\n 1 ,\t2 ,\r\n 3 ]', '{"k\\u0022,": ["x\\\\", "]"]}',
])
def test_json_values_are_counted_exactly_on_the_bytes(text):
    from openk3.server.screen import json_values_exceed

    n = _values(json.loads(text))
    raw = text.encode()
    assert json_values_exceed(raw, n - 1) and not json_values_exceed(raw, n)


def test_the_value_limit_is_what_a_body_under_the_threshold_can_hold():
    """``[0,0,...,0]`` of SCREEN_BYTES - 1 bytes is the densest body below the threshold: exactly
    MAX_JSON_VALUES values, so the limit never refuses what an unscreened body could carry."""
    from openk3.server.screen import MAX_JSON_VALUES, SCREEN_BYTES, json_values_exceed

    n = (SCREEN_BYTES - 1 - 1) // 2  # "[" + n * "0," with the last comma replaced by "]"
    raw = b"[" + b"0," * (n - 1) + b"0]"
    assert len(raw) == SCREEN_BYTES - 1 and _values(json.loads(raw)) == MAX_JSON_VALUES
    assert not json_values_exceed(raw, MAX_JSON_VALUES)
    assert json_values_exceed(raw[:-1] + b",0]", MAX_JSON_VALUES)


def _big(serving) -> str:
    return "x" * (serving.model.context_length * serving.max_token_bytes() + 1)


def _hostile(big: str) -> dict[str, tuple[str, dict]]:
    """name -> (path, body) of bodies that the server refuses from their first checks."""
    user = [{"role": "user", "content": "hi"}]
    fn = {"name": "f", "parameters": {"type": "object"}}
    tool = [{"type": "function", "function": dict(fn, description=big)}]
    reasoning = user + [{"role": "assistant", "content": "ok", "reasoning_content": big}, {"role": "user", "content": "?"}]
    a_tool = [{"name": "f", "description": big, "input_schema": {"type": "object"}}]
    return {
        "chat tool description": ("/v1/chat/completions", {"model": MODEL, "messages": user, "tools": tool}),
        "chat reasoning, thinking on": ("/v1/chat/completions", {"model": MODEL, "messages": reasoning,
                                                                 "thinking": {"type": "enabled"}}),
        "chat unknown model": ("/v1/chat/completions", {"model": "gpt-x", "messages": user, "tools": tool}),
        "count tool description": ("/v1/tokenizers/estimate-token-count", {"model": MODEL, "messages": user,
                                                                           "tools": tool}),
        "anthropic tool description": ("/anthropic/v1/messages", {"model": MODEL, "max_tokens": 4, "messages": user,
                                                                  "tools": a_tool}),
        "anthropic count": ("/anthropic/v1/messages/count_tokens", {"model": MODEL, "messages": user, "tools": a_tool}),
        "responses tool description": ("/v1/responses", {"model": MODEL, "input": "hi", "tools": [
            {"type": "function", "name": "f", "description": big, "parameters": {"type": "object"}}]}),
        "responses unknown model": ("/v1/responses", {"model": "gpt-x", "input": big}),
    }


def _direct(serving, path: str, body: dict):
    """The in-process answer of the server's own code path (no screen): the APIError raised."""
    from openk3.server import anthropic
    from openk3.server.protocol import APIError

    try:
        if path == "/v1/chat/completions":
            serving.prepare(serving.parse(body))
        elif path == "/v1/tokenizers/estimate-token-count":
            serving.count_tokens(serving.parse(body, counting=True))
        elif path == "/anthropic/v1/messages":
            anthropic.prepare(serving, body)
        elif path == "/v1/responses":
            from openk3.server import responses

            responses.prepare(serving, body)
        else:
            anthropic.count_tokens(serving, body)
    except APIError as e:
        return e.status, e.message
    raise AssertionError(f"{path}: not refused")


def test_screen_verdicts_are_the_servers_own_answers(tokenizer):
    """For every refused body the worker's verdict (status, message) equals what the server's
    checks raise on the same body in-process; bodies it does not refuse are left to the server."""
    from openk3.server.metrics import Metrics
    from openk3.server.screen import ScreenSpec, screen
    from openk3.server.serving import ChatServing, ModelInfo

    serving = ChatServing(None, tokenizer, ModelInfo(MODEL, 1024), Metrics())
    spec = ScreenSpec(MODEL, 1024, serving.max_token_bytes())
    worker = ChatServing(None, None, ModelInfo(MODEL, 1024), None, max_token_bytes=spec.max_token_bytes)
    for name, (path, body) in _hostile(_big(serving)).items():
        verdict = screen(path, json.dumps(body).encode(), worker, spec)
        assert verdict == _direct(serving, path, body), name
    fine = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "user": "u" * 300_000}
    for path in ("/v1/chat/completions", "/v1/tokenizers/estimate-token-count"):
        assert screen(path, json.dumps(fine).encode(), worker, spec) is None
    for path in ("/v1/chat/completions", "/anthropic/v1/messages", "/v1/responses"):  # the parse's 400, as routed
        assert screen(path, b"[1, 2]", worker, spec) == _direct(serving, path, [1, 2])
    many = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}] * 10_001}
    assert screen("/v1/chat/completions", json.dumps(many).encode(), worker, spec) == (
        400, "messages: at most 10000 messages are allowed") == _direct(serving, "/v1/chat/completions", many)
    assert screen("/v1/chat/completions", b'{"model": x' + b" " * 10, worker, spec) == (
        400, "Invalid request: body: invalid JSON (Expecting value at character 10)")
    deep = b"[" * 100_000 + b"]" * 100_000
    assert screen("/v1/chat/completions", deep, worker, spec) == (
        400, "Invalid request: body: JSON nested too deeply to parse")
    long_int = b'{"model": "m", "messages": [], "user": "' + b"u" * 300_000 + b'", "max_tokens": ' + b"7" * 5000 + b"}"
    assert screen("/v1/chat/completions", long_int, worker, spec) == (
        400, "Invalid request: max_tokens: an integer of more than 4300 digits")


def test_the_worker_refuses_in_tokens_and_stops_at_the_context(tokenizer, monkeypatch):
    """Text under the character bound whose tokens reach the context is refused by the worker's
    token count (the route's 400; Anthropic's ``prompt is too long`` on its surface; ``not
    counted`` on the count endpoints), the same status as the server's own path gives; the count
    stops at the piece that reaches the context (of a 1.7M-character description's 68 pieces, only
    those up to it are tokenized); a body within the context is left to the server."""
    from openk3.server.metrics import Metrics
    from openk3.server.screen import ScreenSpec, screen
    from openk3.server.serving import ChatServing, ModelInfo

    ctx = 131_072
    serving = ChatServing(None, tokenizer, ModelInfo(MODEL, ctx), Metrics())
    spec = ScreenSpec(MODEL, ctx, serving.max_token_bytes())
    long = "x" * (68 * 25_000)  # 68 pieces of a 25,000-character run, under the character bound
    assert len(long) <= ctx * serving.max_token_bytes()
    per_piece = len(tokenizer.encode_text("x" * 25_000))
    assert 68 * per_piece > ctx
    pieces = []
    real = tokenizer._b.iter_encode

    def spy(text):
        for ids in real(text):
            if len(text) > 64:  # the description's text, not the markup around it
                pieces.append(len(ids))
            yield ids

    monkeypatch.setattr(tokenizer._b, "iter_encode", spy)
    bodies = _hostile(long)
    for name in ("chat tool description", "count tool description", "anthropic tool description",
                 "anthropic count", "responses tool description"):
        path, body = bodies[name]
        pieces.clear()
        status, message = screen(path, json.dumps(body).encode(), serving, spec)
        n = sum(pieces)
        assert status == 400 and ctx <= n and len(pieces) == ctx // per_piece + 1, (name, pieces)
        want = {"/v1/chat/completions": f"Your request exceeded model token limit: {ctx} (requested: at least ",
                "/v1/responses": f"Your request exceeded model token limit: {ctx} (requested: at least ",
                "/anthropic/v1/messages": "prompt is too long: ",
                "/v1/tokenizers/estimate-token-count": "request: the text to render (at least ",
                "/anthropic/v1/messages/count_tokens": "request: the text to render (at least "}[path]
        assert message.startswith(want), (name, message)
        reported = int(re.search(r"at least (\d+)|too long: (\d+)", message).group(1) or
                       re.search(r"too long: (\d+)", message).group(1))
        assert n <= reported < n + 100, (name, message)  # + the markup text around the description
        if path == "/anthropic/v1/messages":
            assert message == f"prompt is too long: {reported} tokens > {ctx - 1} maximum"
    monkeypatch.setattr(tokenizer._b, "iter_encode", real)
    small = ChatServing(None, tokenizer, ModelInfo(MODEL, 4096), Metrics())
    short = "x" * 100_000  # the server's own path refuses it too, with its exact count
    for name in ("chat tool description", "anthropic tool description", "count tool description"):
        path, body = _hostile(short)[name]
        assert _direct(small, path, body)[0] == 400
    fine = {"model": MODEL, "messages": [{"role": "user", "content": "hi " * 30_000}]}
    assert screen("/v1/chat/completions", json.dumps(fine).encode(), serving, spec) is None


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def test_large_bodies_are_screened_by_openk3_serve(server, checkpoint):
    """Against ``openk3 serve``: large refused bodies get the same answers as the server's checks
    give in-process (every surface), an invalid large body the same 400 as a small one, a body with
    a million values a 400 naming the limit, and a large body within the limits is served; the
    worker is a child of the server that exits with it (the fixture checks a clean SIGTERM exit)."""
    from openk3.server.metrics import Metrics
    from openk3.server.serving import ChatServing, ModelInfo
    from openk3.tokenizer import load_tokenizer

    headers = {"Authorization": f"Bearer {API_KEY}", "content-type": "application/json"}
    with httpx.Client(base_url=server.base, headers=headers, timeout=120) as http:
        ctx = http.get(f"/v1/models/{MODEL}").json()["context_length"]
        serving = ChatServing(None, load_tokenizer(checkpoint), ModelInfo(MODEL, ctx), Metrics())
        for name, (path, body) in _hostile(_big(serving)).items():
            r = http.post(path, content=json.dumps(body))
            status, message = _direct(serving, path, body)
            assert (r.status_code, r.json()["error"]["message"]) == (status, message), name
        small, large = b'{"model": x' + b" " * 10, b'{"model": x' + b" " * 400_000
        r_small, r_large = http.post("/v1/chat/completions", content=small), http.post("/v1/chat/completions", content=large)
        assert r_large.status_code == r_small.status_code == 400 and r_large.json() == r_small.json()
        enum = {"type": "object", "properties": {"a": {"enum": list(range(1_000_000))}}}
        r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                    "tools": [{"type": "function", "function": {"name": "f", "parameters": enum}}]})
        assert r.status_code == 400 and r.json()["error"]["message"] == (
            "Invalid request: body: more than 131072 JSON values (array elements and object members), this server's limit")
        fine = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "user": "u" * 400_000}
        r = http.post("/v1/chat/completions", json=fine)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text
        assert http.get("/health").json()["status"] == "ok"
    workers = _children(server.proc.pid)
    assert len(workers) == 1
    with open(f"/proc/{workers[0]}/cmdline", "rb") as f:
        assert b"openk3.server.screen" in f.read()


class _App:
    """``create_app`` served by uvicorn in a thread of this process, so that a test can watch what
    the server itself parses and reach the screen."""

    def __init__(self, checkpoint):
        from tests.server.test_hostile import _LiveApp

        self.live = _LiveApp(checkpoint, max_num_seqs=4)
        self.screen = self.live.server.config.app.state.screen
        self.base = self.live.base


@pytest.fixture(scope="module")
def app(checkpoint):
    a = _App(checkpoint)
    yield a
    a.live.close()


def test_the_server_never_parses_a_body_it_refuses(app, monkeypatch):
    """While a 5 MiB tool description is being refused, no ``json.loads`` of the server process
    sees it (only the worker parses it); /health and a second client's stream are answered while
    that body is still being uploaded; the worker, killed between requests, is replaced."""
    import time

    seen: list[int] = []
    real = json.loads

    def spy(s, *a, **k):
        seen.append(len(s))
        return real(s, *a, **k)

    monkeypatch.setattr(json, "loads", spy)
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}, "description": "x" * (5 << 20)}}]}
    ).encode()
    others_done = threading.Event()

    cut = len(body) - 1000

    def upload():  # the last piece waits for the other clients: the big request is in flight meanwhile
        for i in range(0, cut, 65536):
            yield body[i:min(i + 65536, cut)]
        others_done.wait(120)
        yield body[cut:]

    result: dict = {}

    def big():
        with httpx.Client(base_url=app.base, timeout=120) as c:
            result["r"] = c.post("/v1/chat/completions", content=upload(), headers={"content-type": "application/json"})

    t = threading.Thread(target=big)
    t.start()
    with httpx.Client(base_url=app.base, timeout=120) as c:
        assert c.get("/health").json()["status"] == "ok"
        ask = {"model": MODEL, "stream": True, "max_completion_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
        with c.stream("POST", "/v1/chat/completions", json=ask) as s:
            lines = [ln for ln in s.iter_lines() if ln.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        assert "r" not in result  # still uploading
        others_done.set()
        t.join(120)
        r = result["r"]
        assert r.status_code == 400 and r.json()["error"]["message"].startswith("Your request exceeded model token limit")
        assert max(seen, default=0) < len(body) // 2
        pid = app.screen.pid
        os.kill(pid, 9)
        deadline = time.monotonic() + 30
        while app.screen.pid == pid and time.monotonic() < deadline:  # reaped: the next check starts a new one
            r2 = c.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
            assert r2.status_code == 400 and r2.json() == r.json()
        assert app.screen.pid not in (None, pid)
    stats = app.live.aengine.engine.stats()
    assert stats["kda_slots"]["used"] == 0 and stats["mla_blocks"]["used"] == 0


def test_a_worker_that_grew_is_replaced_by_a_fresh_one(app):
    """After a 25 MiB description the worker's resident set is back within RETIRE_GROWTH of its
    start: either it stayed there (trim gave the pages back) or the worker retired after its
    answer (what trim cannot give back goes with the process) and a fresh one was started at
    once; the next large body is answered either way."""
    import time

    from openk3.server.screen import RETIRE_GROWTH

    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": [
        {"type": "function", "function": {"name": "f", "description": "x" * (25 << 20)}}]})
    with httpx.Client(base_url=app.base, timeout=120, headers={"content-type": "application/json"}) as http:
        assert http.post("/v1/chat/completions", content=body[:300_000] + "x").status_code == 400  # a worker runs
        first = app.screen.pid
        with open(f"/proc/{first}/status") as f:
            start_rss = next(int(x.split()[1]) * 1024 for x in f if x.startswith("VmRSS:"))
        assert http.post("/v1/chat/completions", content=body).status_code == 400
        deadline = time.monotonic() + 60
        while True:
            time.sleep(0.5)  # a retiring worker exits at once after its answer
            pid = app.screen.pid
            try:
                with open(f"/proc/{pid}/status") as f:
                    rss = next(int(x.split()[1]) * 1024 for x in f if x.startswith("VmRSS:"))
                break
            except (OSError, TypeError):  # exited, being replaced
                assert time.monotonic() < deadline, "no worker"
        assert rss < start_rss + RETIRE_GROWTH
        r = http.post("/v1/chat/completions", content=body)
        assert r.status_code == 400 and "exceeded model token limit" in r.json()["error"]["message"]