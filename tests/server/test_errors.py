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


@pytest.mark.parametrize("value,why", [
    (1.5, "Input should be less than or equal to 1"), (-0.1, "Input should be greater than or equal to 0"),
    ("0.1", "Input should be a valid number"), (True, "Input should be a valid number"),
])
def test_min_p_out_of_range_or_wrong_type_is_400_naming_it(http, value, why):
    msg = _error(http.post("/v1/chat/completions", json=dict(BASE, min_p=value)), 400)
    assert msg == f"Invalid request: min_p: {why}"


@pytest.mark.parametrize("value", [0, 0.05, 1])
def test_min_p_in_range_is_accepted(http, value):
    r = http.post("/v1/chat/completions", json=dict(BASE, min_p=value))
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
    # an empty list declares no tools (kosong sends it on every call); `required` still needs one
    assert http.post("/v1/chat/completions", json=dict(BASE, tools=[])).status_code == 200
    assert "required" in _error(http.post("/v1/chat/completions", json=dict(BASE, tools=[],
                                                                             tool_choice="required")), 400)
    assert "tool_choice" in _error(http.post("/v1/chat/completions", json=dict(BASE, tools=[tool],
                                                                                tool_choice={"type": "x"})), 400)
    untyped = {"function": dict(tool["function"], name="g")}
    assert _error(http.post("/v1/chat/completions", json=dict(BASE, tools=[tool, untyped])), 400) == \
        "tools[1].type: required (only 'function' tools are supported)"
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


def test_budget_overshoot_with_own_tokenizer_is_capped(http, tokenizer):
    """The served checkpoint has its own BPE (not the platform's Kimi BPE): a completion budget
    below the context that overshoots it with the prompt is served capped at what is left, on all
    three surfaces; a budget of the whole context stays the platform's 400."""
    n_prompt = len(encode_request({"messages": user()}, tokenizer).token_ids)
    left = 4096 - n_prompt
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": user(), "max_completion_tokens": left + 7})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= left, r.json()["usage"]
    msg = _error(http.post("/v1/chat/completions", json=dict(BASE, max_completion_tokens=4096)), 400)
    assert msg == f"Your request exceeded model token limit: 4096 (requested: {n_prompt + 4096})"
    r = http.post("/anthropic/v1/messages", json={"model": MODEL, "max_tokens": 4000, "messages": user()})
    assert r.status_code == 200 and r.json()["usage"]["output_tokens"] <= left, r.text
    r = http.post("/v1/responses", json={"model": MODEL, "input": "Hello there", "max_output_tokens": 4095})
    assert r.status_code == 200, r.text

    from openk3.server import ChatServing, ModelInfo
    from openk3.server.metrics import Metrics

    serving = ChatServing(None, tokenizer, ModelInfo(MODEL, 4096), Metrics(), make_constraint=lambda *a, **k: None)
    assert not serving.platform_counts
    prep = serving.prepare(serving.parse({"model": MODEL, "messages": user(), "max_completion_tokens": left + 7}))
    assert prep.params.max_tokens == left and len(prep.prompt_ids) == n_prompt


def test_budget_overshoot_with_kimi_bpe_is_the_platform_400():
    """With the Kimi BPE the prompt count is the platform's, and so is its rule: prompt +
    max_completion_tokens > context_length is a 400, one token over; exactly the context fits."""
    from openk3.server import ChatServing, ModelInfo
    from openk3.server.metrics import Metrics
    from openk3.server.protocol import APIError
    from tests.conftest import kimi_tokenizer

    tok = kimi_tokenizer()
    serving = ChatServing(None, tok, ModelInfo(MODEL, 4096), Metrics(), make_constraint=lambda *a, **k: None)
    assert serving.platform_counts
    n_prompt = len(encode_request({"messages": user()}, tok).token_ids)
    body = {"model": MODEL, "messages": user(), "max_completion_tokens": 4096 - n_prompt + 1}
    with pytest.raises(APIError) as e:
        serving.prepare(serving.parse(body))
    assert e.value.status == 400
    assert e.value.message == "Your request exceeded model token limit: 4096 (requested: 4097)"
    prep = serving.prepare(serving.parse(dict(body, max_completion_tokens=4096 - n_prompt)))
    assert prep.params.max_tokens == 4096 - n_prompt and len(prep.prompt_ids) == n_prompt


def test_image_inputs(http):
    def body(url):
        return dict(BASE, messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": url}}]}])

    png = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR4nGNgYGD4DwABBAEAwS2OUAAAAABJRU5ErkJggg=="
    assert _error(http.post("/v1/chat/completions", json=body(png)), 400) == "model does not support image input"
    msg = _error(http.post("/v1/chat/completions", json=body("https://example.com/cat.png")), 400)
    assert msg.startswith("messages[0].content[1].image_url.url: http(s) image URLs are not supported"), msg
    msg = _error(http.post("/v1/chat/completions", json=body("ms://file-123")), 400)
    assert msg.startswith("messages[0].content[1].image_url.url: must be a base64 data URL"), msg


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
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "bad name!", "schema": {"type": "object"}}}},
     "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": "false",
                                                                  "schema": {"type": "object"}}}}, "strict"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": 1}}]}, "strict"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n" * 65, "schema": {"type": "object"}}}},
     "response_format.json_schema.name"),
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


# ----------------------------------------------------------------------- in-process review fixes
# Malformed input found by review: each is a 400 naming the field (never a 500 or a logged
# traceback), and a client that leaves mid-upload is counted as 499. In-process app over an engine
# that must never be reached: every request here is refused (or only counted) before generation.

MAX_DEPTH = 64  # the documented schema nesting limit (openk3.engine.constraints.MAX_SCHEMA_DEPTH)
DEPTH_MSG = "nested too deeply (at most 64 levels of objects / arrays are supported)"


class _NoEngine:
    async def generate(self, *a, **k):
        raise AssertionError("a refused request reached the engine")
        yield  # pragma: no cover

    def abort(self, rid):
        pass


@pytest.fixture
def app_serving(tokenizer):
    from openk3.server import ChatServing, ModelInfo, create_app
    from openk3.server.metrics import Metrics

    serving = ChatServing(_NoEngine(), tokenizer, ModelInfo("m", 4096), Metrics())
    return create_app(serving), serving


def _post_all(app, requests: list[tuple[str, object]]) -> list[httpx.Response]:
    """POST each ``(path, body)``; a ``bytes`` body is sent verbatim as JSON."""
    import asyncio
    import json

    async def run():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            out = []
            for path, body in requests:
                content = body if isinstance(body, bytes) else json.dumps(body).encode()
                out.append(await c.post(path, content=content, headers={"content-type": "application/json"}))
            return out

    return asyncio.run(run())


def _kimi(r: httpx.Response, status: int, message: str) -> None:
    assert r.status_code == status, r.text
    assert r.json() == {"error": {"message": message, "type": "invalid_request_error"}}, r.text


def _anthropic(r: httpx.Response, status: int, message: str) -> None:
    assert r.status_code == status, r.text
    assert r.json() == {"type": "error", "error": {"type": "invalid_request_error", "message": message}}, r.text


def _nested(levels: int) -> dict:
    """A valid object schema whose objects / arrays nest exactly `levels` deep (>= 3)."""
    schema: dict = {"type": "string"} if levels % 2 else {"enum": ["x"]}  # 1 or 2 levels
    for _ in range((levels - (1 if levels % 2 else 2)) // 2):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def _depth(value) -> int:
    return 1 + max(map(_depth, value.values() if isinstance(value, dict) else value), default=0) \
        if isinstance(value, (dict, list)) else 0


def _nested_text(levels: int) -> str:
    """The JSON text of ``_nested(2 * n + 1)`` for depths ``json.dumps`` cannot reach."""
    n = (levels - 1) // 2
    return '{"type":"object","properties":{"a":' * n + '{"type":"string"}' + "}}" * n


def test_deep_schemas_are_a_field_named_400(app_serving, caplog):
    app, _ = app_serving
    assert _depth(_nested(MAX_DEPTH)) == MAX_DEPTH and _depth(_nested(MAX_DEPTH + 1)) == MAX_DEPTH + 1
    chat, anth = "/v1/chat/completions", "/anthropic/v1/messages"
    msgs = [{"role": "user", "content": "hi"}]

    def bodies(schema):
        rf = {"model": "m", "messages": msgs, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": schema}}}
        tool = {"model": "m", "messages": msgs, "tools": [{"type": "function", "function": {"name": "f",
                                                                                              "parameters": schema}}]}
        dyn = {"model": "m", "messages": [{"role": "system", "content": "", "tools": [
            {"type": "function", "function": {"name": "g", "parameters": schema}}]}] + msgs}
        anthropic_ = {"model": "m", "max_tokens": 5, "messages": msgs, "tools": [
            {"name": "t", "input_schema": {"type": "object"}}, {"name": "f", "input_schema": schema}]}
        return [(chat, rf), (chat, tool), (chat, dyn), (anth, anthropic_)]

    wheres = ["response_format.json_schema.schema", "tools[0].function.parameters",
              "messages[0].tools[0].function.parameters", "tools[1].input_schema"]
    with caplog.at_level("ERROR", logger="openk3.server"):
        for levels in (MAX_DEPTH + 1, 201, 401):  # 201: jsonschema's RecursionError, a 500 before
            for (path, body), r, where in zip(bodies(_nested(levels)), _post_all(app, bodies(_nested(levels))), wheres):
                (_anthropic if path == anth else _kimi)(r, 400, f"{where}: {DEPTH_MSG}")
        # deeper than Python's JSON parser can go: still a 400, the body named
        deep = _nested_text(5001)
        raw = [(chat, ('{"model": "m", "messages": [{"role": "user", "content": "hi"}], "response_format": '
                       '{"type": "json_schema", "json_schema": {"name": "x", "schema": %s}}}' % deep).encode()),
               (anth, ('{"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], '
                       '"tools": [{"name": "f", "input_schema": %s}]}' % deep).encode())]
        r_chat, r_anth = _post_all(app, raw)
        _kimi(r_chat, 400, "Invalid request: body: JSON nested too deeply to parse")
        _anthropic(r_anth, 400, "Invalid request: body: JSON nested too deeply to parse")
    assert not caplog.records, [r.getMessage() for r in caplog.records]


def test_schema_depth_limit_is_exact(app_serving):
    """64 levels compile into a constraint; 65 are refused — by the server and by the engine's own check."""
    from openk3.engine.constraints import MAX_SCHEMA_DEPTH, check_json_schema
    from openk3.server.protocol import APIError

    assert MAX_SCHEMA_DEPTH == MAX_DEPTH
    _, serving = app_serving
    msgs = [{"role": "user", "content": "hi"}]
    for levels, ok in ((MAX_DEPTH, True), (MAX_DEPTH + 1, False)):
        schema = _nested(levels)
        for body in ({"model": "m", "messages": msgs, "response_format": {"type": "json_schema", "json_schema": {
                         "name": "x", "schema": schema}}},
                     {"model": "m", "messages": msgs, "tools": [{"type": "function", "function": {
                         "name": "f", "parameters": schema}}], "tool_choice": "required"}):
            if ok:
                assert serving.prepare(serving.parse(body)).constraint is not None
            else:
                with pytest.raises(APIError) as e:
                    serving.prepare(serving.parse(body))
                assert e.value.status == 400 and e.value.message.endswith(DEPTH_MSG)
    check_json_schema(_nested(MAX_DEPTH))
    deep: dict = {}
    for _ in range(100_000):  # far beyond the recursion limit: the check itself must not recurse
        deep = {"type": "object", "properties": {"a": deep}}
    for schema in (_nested(MAX_DEPTH + 1), deep):
        with pytest.raises(ValueError, match=r"^tools\[3\]\.function\.parameters: nested too deeply"):
            check_json_schema(schema, "tools[3].function.parameters")


def test_seed_range_names_the_field(app_serving):
    """seed is an int64 (OpenAI's documented range); every accepted value seeds torch's generator."""
    import torch


    app, serving = app_serving
    base = '{"model": "m", "messages": [{"role": "user", "content": "hi"}], "seed": %d}'
    over, under = _post_all(app, [("/v1/chat/completions", (base % 2**64).encode()),
                                  ("/v1/chat/completions", (base % (-2**63 - 1)).encode())])
    _kimi(over, 400, "Invalid request: seed: Input should be less than or equal to 9223372036854775807")
    _kimi(under, 400, "Invalid request: seed: Input should be greater than or equal to -9223372036854775808")
    for seed in (2**63 - 1, -2**63, 0):
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "seed": seed}
        prep = serving.prepare(serving.parse(body))
        assert prep.params.seed == seed
        torch.Generator().manual_seed(seed)  # raised "Overflow when unpacking long long" at 2**64


def test_lone_surrogates_name_the_field(app_serving, caplog):
    app, _ = app_serving
    chat, count, anth = "/v1/chat/completions", "/v1/tokenizers/estimate-token-count", "/anthropic/v1/messages"
    user_hi = '{"role": "user", "content": "hi"}'
    cases = [
        (chat, '{"model": "m", "messages": [{"role": "user", "content": "a\\ud800b"}]}',
         "messages[0].content: unpaired UTF-16 surrogate U+D800 at character 1"),
        (chat, '{"model": "m", "messages": [%s, {"role": "assistant", "content": "ok"}, {"role": "user", "content": '
               '[{"type": "text", "text": "x"}, {"type": "text", "text": "\\udc00"}]}]}' % user_hi,
         "messages[2].content[1].text: unpaired UTF-16 surrogate U+DC00 at character 0"),
        (count, '{"model": "m", "messages": [%s], "tools": [{"type": "function", "function": {"name": "f", '
                '"parameters": {"type": "object", "properties": {"\\ud83d": {}}}}}]}' % user_hi,
         "tools[0].function.parameters.properties (an object key): unpaired UTF-16 surrogate U+D83D at character 0"),
        (anth, '{"model": "m", "max_tokens": 5, "system": "s", "messages": [{"role": "user", "content": '
               '[{"type": "text", "text": "ok\\ud800"}]}]}',
         "messages[0].content[0].text: unpaired UTF-16 surrogate U+D800 at character 2"),
    ]
    with caplog.at_level("ERROR", logger="openk3.server"):
        rs = _post_all(app, [(path, body.encode()) for path, body, _ in cases])
        for (path, _, message), r in zip(cases, rs):
            (_anthropic if path == anth else _kimi)(r, 400, message + "; text must be valid Unicode")
        # a surrogate *pair* is ordinary text; a model id with a lone one is a 404 quoting it escaped
        pair, model = _post_all(app, [
            (count, b'{"model": "m", "messages": [{"role": "user", "content": "\\ud83d\\ude00"}]}'),
            (chat, b'{"model": "k\\ud800", "messages": [{"role": "user", "content": "hi"}]}')])
    assert pair.status_code == 200 and pair.json()["data"]["total_tokens"] > 0, pair.text
    assert model.status_code == 404 and model.json() == {"error": {
        "message": "Not found the model k\\ud800 or Permission denied", "type": "resource_not_found_error"}}
    assert not caplog.records, [r.getMessage() for r in caplog.records]


def test_empty_and_non_object_bodies_name_the_body(app_serving):
    app, _ = app_serving
    chat, count, anth = "/v1/chat/completions", "/v1/tokenizers/estimate-token-count", "/anthropic/v1/messages"
    rs = _post_all(app, [(chat, b""), (count, b""), (anth, b""), (chat, b"  "), (chat, b"[]"), (chat, b"{}")])
    empty = "Invalid request: body: the request body is empty; a JSON object with model, messages is required"
    _kimi(rs[0], 400, empty)
    _kimi(rs[1], 400, empty)
    _anthropic(rs[2], 400, "Invalid request: body: the request body is empty; a JSON object with model, max_tokens, "
                           "messages is required")
    _kimi(rs[3], 400, "Invalid request: body: invalid JSON (Expecting value at character 2)")
    _kimi(rs[4], 400, "Invalid request: body: Input should be a valid dictionary or object to extract fields from")
    _kimi(rs[5], 400, "Invalid request: model: Field required")


def test_client_leaving_mid_upload_counts_as_499(app_serving):
    """Content-Length 1000, 10 bytes sent, then the connection closes: nothing is answered, and
    /metrics counts a 499 (client closed request), not a 500."""
    import asyncio
    import re

    app, serving = app_serving
    incoming = [{"type": "http.request", "body": b'{"model": ', "more_body": True}, {"type": "http.disconnect"}]
    sent: list[dict] = []

    async def receive():
        return incoming.pop(0) if incoming else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions", "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json"), (b"content-length", b"1000")],
             "client": ("127.0.0.1", 1), "server": ("t", 80)}
    asyncio.run(app(scope, receive, send))
    assert sent == []
    counts = dict(re.findall(r'openk3_requests_total\{endpoint="/v1/chat/completions",status="(\d+)"\} (\S+)',
                             serving.metrics.render().decode()))
    assert counts == {"499": "1.0"}, counts


@pytest.mark.parametrize("content,where", [
    ([{"type": "text", "text": 5}], "messages[0].content[0].text"),
    ([{"type": "image_url", "image_url": {"url": 5}}], "messages[0].content[0].image_url"),
    (["just a string"], "messages[0].content[0]"),
])
def test_nested_content_errors_name_the_client_field(http, content, where):
    msg = _error(http.post("/v1/chat/completions", json=dict(BASE, messages=[{"role": "user", "content": content}])), 400)
    assert msg.startswith(f"Invalid request: {where}"), msg
    assert ".str" not in msg and "list[" not in msg, msg
