"""Every documented bad-request case returns the platform's status and Kimi error envelope
(api.md §1.5, §1.7, §3, §6.1, §11), against the real server; plus auth, 404/405/413 and a 500
that leaks nothing (in-process app over a broken engine)."""

from __future__ import annotations

import socket
from urllib.parse import urlparse

import httpx
import openai
import pytest

from openk3.chat_format import encode_request
from tests.server.conftest import API_KEY, MODEL, user

BASE = {"model": MODEL, "messages": user(), "max_completion_tokens": 1}


def _error(r: httpx.Response, status: int, type_: str = "invalid_request_error") -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type"}, body
    assert body["error"]["type"] == type_
    return body["error"]["message"]


def test_thinking_bool_is_rejected(http):
    msg = _error(http.post("/v1/chat/completions", json=dict(BASE, thinking=True)), 400)
    assert msg == "the thinking field in the request (expected type object) is illegal, and bool is not acceptable"


@pytest.mark.parametrize("field,value,allowed", [
    ("temperature", 1.1, "1"), ("temperature", 2.0, "1"), ("temperature", -0.1, "1"), ("top_p", 0.8, "0.95"),
    ("n", 2, "1"), ("presence_penalty", 0.5, "0"), ("frequency_penalty", 0.5, "0"),
])
def test_fixed_sampling_rejects_other_values(http, field, value, allowed):
    msg = _error(http.post("/v1/chat/completions", json=dict(BASE, **{field: value})), 400)
    assert msg == f"invalid {field}: only {allowed} is allowed for this model"


@pytest.mark.parametrize("extra", [
    {"temperature": 1.0}, {"temperature": 0.6}, {"temperature": 0.0}, {"top_p": 0.95}, {"n": 1},
    {"presence_penalty": 0.0, "frequency_penalty": 0.0},
    {"thinking": {"type": "disabled"}, "temperature": 0.6},
])
def test_fixed_sampling_accepts_the_defaults(http, extra):
    r = http.post("/v1/chat/completions", json=dict(BASE, **extra))
    assert r.status_code == 200, r.text


def test_instant_mode_temperature(http):
    msg = _error(http.post("/v1/chat/completions", json=dict(BASE, thinking={"type": "disabled"}, temperature=1.0)),
                 400)
    assert msg == "invalid temperature: only 0.6 is allowed for this model"
    r = http.post("/v1/chat/completions", json=dict(BASE, thinking={"type": "disabled"})).json()
    assert "reasoning_content" not in r["choices"][0]["message"]  # thinking off: no reasoning field


def test_tool_choice_cases(http):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    assert "required" in _error(http.post("/v1/chat/completions", json=dict(BASE, tool_choice="required")), 400)
    assert "tools" in _error(http.post("/v1/chat/completions", json=dict(BASE, tools=[])), 400)
    named = {"type": "function", "function": {"name": "f"}}
    assert "tool_choice" in _error(http.post("/v1/chat/completions", json=dict(BASE, tools=[tool],
                                                                                tool_choice=named)), 400)
    bad_name = {"type": "function", "function": {"name": "1bad name", "parameters": {"type": "object"}}}
    assert "name" in _error(http.post("/v1/chat/completions", json=dict(BASE, tools=[bad_name])), 400)
    builtin = {"type": "builtin_function", "function": {"name": "$web_search"}}
    assert "function" in _error(http.post("/v1/chat/completions", json=dict(BASE, tools=[builtin])), 400)
    too_many = [{"type": "function", "function": {"name": f"t{i}"}} for i in range(129)]
    assert "128" in _error(http.post("/v1/chat/completions", json=dict(BASE, tools=too_many)), 400)
    dynamic_dup = user() + [{"role": "system", "tools": [tool]}]  # same name request-level and dynamic
    assert "duplicate" in _error(http.post("/v1/chat/completions", json=dict(BASE, messages=dynamic_dup,
                                                                             tools=[tool])), 400)
    r = http.post("/v1/chat/completions", json=dict(BASE, tools=[tool], tool_choice="none"))
    assert r.status_code == 200


def test_preserved_thinking_keep_all(http):
    history = user() + [{"role": "assistant", "content": "Hi!"}] + user("again")
    assert http.post("/v1/chat/completions", json=dict(BASE, messages=history)).status_code == 200
    msg = _error(http.post("/v1/chat/completions", json=dict(BASE, messages=history, thinking={"type": "enabled",
                                                                                               "keep": "all"})), 400)
    assert msg == ("preserved thinking (thinking.keep=all) requires reasoning_content on every assistant message, "
                   "but assistant message at index 1 is missing reasoning_content")
    ok = [history[0], dict(history[1], reasoning_content=""), history[2]]  # key presence is enough (§11)
    assert http.post("/v1/chat/completions", json=dict(BASE, messages=ok, thinking={"keep": "all"})).status_code == 200


def test_context_length(http, tokenizer):
    n_prompt = len(encode_request({"messages": user()}, tokenizer).token_ids)
    for field in ("max_completion_tokens", "max_tokens"):
        body = {"model": MODEL, "messages": user(), field: 5000}
        msg = _error(http.post("/v1/chat/completions", json=body), 400)
        assert msg == f"Your request exceeded model token limit: 4096 (requested: {n_prompt + 5000})"
    body = {"model": MODEL, "messages": user(), "max_completion_tokens": 4096 - n_prompt}  # exactly fits
    with http.stream("POST", "/v1/chat/completions", json=dict(body, stream=True)) as r:
        assert r.status_code == 200  # accepted; not read to the end
    huge = [{"role": "user", "content": "word " * 5000}]
    assert "token limit" in _error(http.post("/v1/chat/completions", json={"model": MODEL, "messages": huge}), 400)


def test_image_inputs(http):
    def body(url):
        return dict(BASE, messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": url}}]}])

    png = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR4nGNgYGD4DwABBAEAwS2OUAAAAABJRU5ErkJggg=="
    assert _error(http.post("/v1/chat/completions", json=body(png)), 400) == "model does not support image input"
    assert "http" in _error(http.post("/v1/chat/completions", json=body("https://example.com/cat.png")), 400)
    assert "base64" in _error(http.post("/v1/chat/completions", json=body("ms://file-123")), 400)


@pytest.mark.parametrize("patch,needle", [
    ({"messages": [{"role": "user", "content": ""}]}, "content"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "role"),
    ({"messages": []}, "messages"),
    ({"messages": "hello"}, "messages"),
    ({"messages": user() + [{"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
        "function": {"name": "f", "arguments": "{}"}}], "reasoning_content": "r"}, {"role": "tool", "content": "x"}]},
     "tool_call_id"),
    ({"stop": ["a", "b", "c", "d", "e", "f"]}, "stop"),
    ({"stop": "x" * 33}, "stop"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"reasoning_effort": "extreme"}, "effort"),
    ({"thinking": {"type": "sometimes"}}, "thinking"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "schema"),
    ({"messages": user() + [{"role": "user", "content": "x", "tools": [{"type": "function", "function": {
        "name": "f"}}]}]}, "tools"),
])
def test_bad_requests(http, patch, needle):
    assert needle in _error(http.post("/v1/chat/completions", json=dict(BASE, **patch)), 400)


def test_malformed_json_and_missing_fields(http):
    _error(http.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}), 400)
    _error(http.post("/v1/chat/completions", json={"messages": user()}), 400)  # model missing


def test_unknown_model_is_404(http, client):
    msg = _error(http.post("/v1/chat/completions", json=dict(BASE, model="kimi-k9")), 404, "resource_not_found_error")
    assert msg == "Not found the model kimi-k9 or Permission denied"
    _error(http.post("/v1/tokenizers/estimate-token-count", json={"model": "nope", "messages": user()}), 404,
           "resource_not_found_error")
    _error(http.get("/v1/models/nope"), 404, "resource_not_found_error")
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="kimi-k9", messages=user())


def test_sdk_surfaces_the_envelope(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=user(), temperature=1.5)
    assert e.value.status_code == 400
    assert e.value.body == {"message": "invalid temperature: only 1 is allowed for this model",
                            "type": "invalid_request_error"}


def test_auth(server):
    url = server.base + "/v1/chat/completions"
    _error(httpx.post(url, json=BASE), 401, "invalid_authentication_error")
    _error(httpx.post(url, json=BASE, headers={"Authorization": "Bearer sk-wrong"}), 401, "invalid_authentication_error")
    assert httpx.post(url, json=BASE, headers={"x-api-key": API_KEY}, timeout=60).status_code == 200
    r = httpx.post(server.base + "/anthropic/v1/messages", json={"model": MODEL, "max_tokens": 1, "messages": user()})
    assert r.status_code == 401 and r.json()["type"] == "error" and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(server.base + "/health").json()["status"] == "ok"  # probes need no key
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url, api_key="sk-wrong", max_retries=0).models.list()


def test_body_too_large(server, http):
    limit = 32 * 2**20
    host, port = urlparse(server.base).hostname, urlparse(server.base).port
    with socket.create_connection((host, port), timeout=30) as s:  # declared length over the limit
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Authorization: Bearer " + API_KEY.encode() + b"\r\nContent-Length: %d\r\n\r\n" % (limit + 1))
        head = b""
        while b"invalid_request_error" not in head:  # headers and body may arrive in separate reads
            data = s.recv(65536)
            if not data:
                break
            head += data
    assert head.startswith(b"HTTP/1.1 413") and b"invalid_request_error" in head

    def chunks():  # no Content-Length: counted while received
        yield b'{"model": "kimi-k3", "messages": [{"role": "user", "content": "'
        for _ in range(33):
            yield b"x" * 2**20
        yield b'"}]}'

    _error(http.post("/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"}), 413)


def test_unknown_route_and_method(http):
    _error(http.get("/v1/nothing-here"), 404, "resource_not_found_error")
    assert _error(http.get("/v1/chat/completions"), 405) == "Method not allowed"


def test_internal_error_leaks_nothing(tokenizer):
    """A broken engine yields 500 with a generic message (in-process app, the same code paths)."""
    import asyncio

    from openk3.server import ChatServing, ModelInfo, create_app
    from openk3.server.metrics import Metrics

    class BrokenEngine:
        async def generate(self, *a, **k):
            raise RuntimeError("secret internal detail /home/x/model.py:42")
            yield  # pragma: no cover

        def abort(self, rid):
            pass

    app = create_app(ChatServing(BrokenEngine(), tokenizer, ModelInfo("m", 4096), Metrics()))

    async def call():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return await c.post("/v1/chat/completions", json={"model": "m", "messages": user()})

    r = asyncio.run(call())
    assert _error(r, 500, "server_error") == "Internal server error"
    assert "secret" not in r.text
