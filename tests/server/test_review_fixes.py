"""Regression tests for the reviewer's findings on the server (issue 5 review): early context
rejection of huge bodies, tool-schema keywords, strict JSON types, history structure, streamed
logprobs, block-aligned ``cached_tokens`` and the small surface fixes."""

from __future__ import annotations

import re

import threading
import time
from pathlib import Path

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
        deadline = time.monotonic() + 10
        while not health_times and time.monotonic() < deadline:
            time.sleep(0.01)
        stop.set()
        th.join()
    assert msg.startswith(f"Your request exceeded model token limit: {ctx} (requested: at least ")
    assert elapsed < 5.0, elapsed
    assert health_times and max(health_times) < 2.0, health_times
    # the bound is sound: the same text one character shorter is still tokenized and judged exactly
    n_tokens = len(tokenizer.encode_text(text[:-1]))
    assert n_tokens > ctx or n_tokens * per_token >= chars - 1


def _tool(name: str, params: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": params}}


def test_unenforceable_tool_keywords_are_rejected(http):
    cases = [({"type": "object", "properties": {"a": {"type": "string"}}, "not": {"required": ["a"]}}, '"not"'),
             ({"type": "object", "properties": {"a": {"type": "string"}}, "if": {"required": ["a"]},
               "then": {"required": ["b"]}}, '"if"'),
             ({"type": "object", "properties": {"xs": {"type": "array", "uniqueItems": True}}}, '"uniqueItems"')]
    for params, keyword in cases:
        body = dict(BASE, tools=[_tool("lookup", params)], tool_choice="required")
        msg = _error(http.post("/v1/chat/completions", json=body))
        assert "tools[0].function.parameters (tool 'lookup')" in msg and keyword in msg, msg
    # the same rule for dynamic tools in a system message
    dyn = [{"role": "system", "content": "", "tools": [_tool("dyn", cases[0][0])]}] + user()
    msg = _error(http.post("/v1/chat/completions", json=dict(BASE, messages=dyn)))
    assert "'dyn'" in msg and '"not"' in msg
    # an unknown format is only an annotation: still accepted
    ok = _tool("lookup", {"type": "object", "properties": {"a": {"type": "string", "format": "weird"}}})
    assert http.post("/v1/chat/completions", json=dict(BASE, tools=[ok])).status_code == 200


def test_empty_property_name_compiles(http):
    import json

    import jsonschema

    params = {"type": "object", "properties": {"": {"type": "string", "maxLength": 4}}, "required": [""]}
    body = dict(BASE, tools=[_tool("blank", params)], tool_choice="required", max_completion_tokens=250)
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    for call in r.json()["choices"][0]["message"].get("tool_calls") or []:
        jsonschema.validate(json.loads(call["function"]["arguments"]), params)


def test_capabilities_budget_is_capped_by_context():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "capabilities.py"
    spec = importlib.util.spec_from_file_location("capabilities_example", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.output_budget(None, 4096) == 2048      # the 8192 default no longer exceeds a small window
    assert mod.output_budget(None, 262_144) == 8192
    assert mod.output_budget(250, 4096) == 250
    assert mod.output_budget(10_000, 4096) == 2048


def test_cached_tokens_are_block_aligned_and_cost_agrees(http, server):
    from openk3.cost import fetch_server_usage
    from openk3.server.serving import usage_dict

    # the one place the decision lives: capped at prompt_tokens, whole 256-token blocks
    assert usage_dict(1000, 700, 3)["cached_tokens"] == 512
    assert usage_dict(1000, 255, 3)["cached_tokens"] == 0
    assert usage_dict(300, 900, 3)["prompt_tokens_details"]["cached_tokens"] == 256
    before = fetch_server_usage(server.base, API_KEY)
    system = "You are a careful assistant. " * 120  # > 512 tokens shared
    reported = []
    for q in ("First?", "Second question here!"):
        body = dict(BASE, messages=[{"role": "system", "content": system}, {"role": "user", "content": q}])
        u = http.post("/v1/chat/completions", json=body).json()["usage"]
        assert u["cached_tokens"] % 256 == 0 and u["cached_tokens"] == u["prompt_tokens_details"]["cached_tokens"]
        reported.append(u)
    assert reported[1]["cached_tokens"] >= 256
    after = fetch_server_usage(server.base, API_KEY)
    # other tests may run against the same server only sequentially: the delta is exactly ours
    assert after.cached_tokens - before.cached_tokens == sum(u["cached_tokens"] for u in reported)
    assert after.prompt_tokens - before.prompt_tokens == sum(u["prompt_tokens"] for u in reported)


def _call(cid: str, kind: str = "function") -> dict:
    return {"id": cid, "type": kind, "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def _turn(*calls: dict) -> dict:
    return {"role": "assistant", "content": "", "reasoning_content": "r", "tool_calls": list(calls)}


def _result(cid: str) -> dict:
    return {"role": "tool", "tool_call_id": cid, "content": "18 C"}


def test_tool_call_history_structure(http):
    q = user("Weather?")
    post = lambda msgs: http.post("/v1/chat/completions", json=dict(BASE, messages=msgs))  # noqa: E731
    ok = q + [_turn(_call("functions.get_weather:0"), _call("functions.get_weather:1")),
              _result("functions.get_weather:1"), _result("functions.get_weather:0")]
    assert post(ok).status_code == 200
    missing = q + [_turn(_call("a"), _call("b")), _result("a"), {"role": "user", "content": "and?"}]
    msg = _error(post(missing))
    assert msg.startswith("messages[1].tool_calls: tool call id 'b' has no tool result"), msg
    assert "'b'" in _error(post(q + [_turn(_call("a"), _call("b")), _result("a")]))  # history ends unanswered
    dup = q + [_turn(_call("a")), _result("a"), _turn(_call("a")), _result("a")]
    assert _error(post(dup)) == "messages[3].tool_calls[0].id: duplicate tool call id 'a'"
    wrong = q + [_turn(_call("a", kind="custom")), _result("a")]
    assert _error(post(wrong)) == "messages[1].tool_calls[0].type: only 'function' is supported, got 'custom'"


def test_stream_carries_logprobs(client):
    kw = dict(model=MODEL, messages=user(), max_completion_tokens=6, logprobs=True, top_logprobs=2, seed=7)
    entries, finish = [], None
    for ch in client.chat.completions.create(stream=True, **kw):
        for c in ch.choices:
            if c.logprobs is not None:
                entries.extend(c.logprobs.content)
            finish = c.finish_reason or finish
    assert finish == "length" and len(entries) == 6  # one entry per generated token, none lost or repeated
    for e in entries:
        assert e.logprob <= 0 and len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.logprob - 1e-6
        assert bytes(e.bytes).decode("utf-8", errors="replace") == e.token
    # without logprobs the chunks carry none
    plain = client.chat.completions.create(stream=True, **dict(kw, logprobs=None, top_logprobs=None))
    assert all(c.logprobs is None for ch in plain for c in ch.choices)


def test_wrong_json_types_are_not_coerced(http):
    cases = [("temperature", "1"), ("temperature", True), ("n", True), ("max_tokens", "5"),
             ("max_completion_tokens", 5.0), ("stream", "yes"), ("logprobs", "yes"), ("top_p", "0.95"),
             ("stream_options", {"include_usage": "yes"})]
    for field, value in cases:
        msg = _error(http.post("/v1/chat/completions", json=dict(BASE, **{field: value})))
        assert msg.startswith(f"Invalid request: {field}"), (field, value, msg)
    assert http.post("/v1/chat/completions", json=dict(BASE, temperature=1)).status_code == 200  # an int is a number
    anth = {"model": MODEL, "max_tokens": "10", "messages": [{"role": "user", "content": "hi"}]}
    r = http.post("/anthropic/v1/messages", json=anth)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("Invalid request: max_tokens"), r.text


def test_open_routes_are_the_documented_ones(server):
    with httpx.Client(base_url=server.base, timeout=30) as anon:  # no API key
        for path in ("/health", "/metrics", "/openapi.json", "/docs", "/redoc"):
            assert anon.get(path).status_code == 200, path
        assert anon.get("/v1/models").status_code == 401
        assert anon.post("/anthropic/v1/messages", json={}).status_code == 401
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert "`/openapi.json`, `/docs`, `/redoc` stay open" in readme


def test_port_out_of_range_is_an_argparse_error(capsys):
    import pytest

    from openk3.cli import build_parser

    for bad in ("70000", "-1", "http"):
        with pytest.raises(SystemExit) as exc:
            build_parser().parse_args(["serve", "x", "--port", bad])
        assert exc.value.code == 2
        assert "--port" in capsys.readouterr().err
    assert build_parser().parse_args(["serve", "x", "--port", "0"]).port == 0


def test_thinking_keep_values(http):
    for keep in ("none", "last", 1):
        msg = _error(http.post("/v1/chat/completions", json=dict(BASE, thinking={"keep": keep})))
        assert "thinking.keep" in msg, msg
    for keep in (None, "all"):
        assert http.post("/v1/chat/completions", json=dict(BASE, thinking={"keep": keep})).status_code == 200


def test_anthropic_errors_use_anthropic_names(http):
    def post(**kw):
        body = {"model": MODEL, "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}], **kw}
        r = http.post("/anthropic/v1/messages", json=body)
        assert r.status_code == 400 and r.json()["type"] == "error", r.text
        return r.json()["error"]["message"]

    msg = post(max_tokens=100_000)  # Anthropic's own wording, which Claude Code parses to shrink max_tokens
    assert re.fullmatch(r"input length and `max_tokens` exceed context limit: \d+ \+ 100000 > 4096, "
                        r"decrease input length or `max_tokens` and try again", msg), msg
    msg = post(tool_choice={"type": "any"})
    assert "tool_choice: 'any' needs at least one tool" in msg and "required" not in msg, msg
    msg = post(tools=[{"type": "web_search_20250305", "name": "web_search", "max_uses": 3}])
    assert msg.startswith("tools[0].type: unsupported tool type 'web_search_20250305'"), msg
    msg = post(max_tokens=0)
    assert msg.startswith("max_tokens") and "max_completion_tokens" not in msg, msg


def test_grammar_with_empty_property_name_compiles(tokenizer):
    from openk3.engine.constraints import make_constraint

    tool = _tool("blank", {"type": "object", "properties": {"": {"type": "string"}, "a": {"type": "integer"}}})
    c = make_constraint(tokenizer, "text", tools=[tool], tool_choice="required")  # raised on the empty regex before
    assert int(c.allowed_tokens().sum()) > 0
