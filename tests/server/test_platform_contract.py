"""Platform-contract regressions found by Moonshot's vendor verifier and real clients, each with the
input that showed it (README "Platform leniency and strictness" has the decisions and evidence).

In-process checks use :class:`ChatServing` on the shipped tokenizer (no engine: ``prepare`` renders,
validates and builds the constraint); live checks use the session's steered test server.
"""

from __future__ import annotations

import json
import math

import httpx
import pytest

from openk3.server.metrics import Metrics
from openk3.server.protocol import APIError
from openk3.server.serving import ChatServing, ModelInfo
from tests.server.conftest import API_KEY, MODEL, user

BASE = {"model": MODEL, "messages": user(), "max_completion_tokens": 40}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def serving():
    from openk3.tokenizer import load_tokenizer

    return ChatServing(None, load_tokenizer("openk3-tiny"), ModelInfo(MODEL, 8192), Metrics())


def prepare(serving, body):
    body = dict({"model": MODEL}, **body)
    return serving.prepare(serving.parse(body))


def feed(serving, constraint, text_or_ids):
    """Feed text (ordinary tokens) or ids; returns how many were accepted."""
    tok = serving.tokenizer
    ids = tok.encode_text(text_or_ids) if isinstance(text_or_ids, str) else text_or_ids
    for n, tid in enumerate(ids):
        if not constraint.accept(tid):
            return n
    return len(ids)


def markers(serving, *parts):
    """Ids of an XTML sequence: ("open", "tools", "sep") ..."""
    tok = serving.tokenizer
    ids = []
    for p in parts:
        ids += [{"open": tok.open_id, "close": tok.close_id, "sep": tok.sep_id}[p]] if p in ("open", "close", "sep") \
            else tok.encode_text(p)
    return ids


# ----------------------------------------------------------------------------- no tools, no calls

@pytest.mark.parametrize("extra", [{}, {"tools": []}, {"tools": [WEATHER], "tool_choice": "none"}])
def test_no_declared_tool_leaves_the_tools_channel_unreachable(serving, extra):
    """The verifier-style request `What is the weather in Paris?` without tools gave tool calls to an
    invented tool (4 of 8 seeds): now the output grammar has no tools channel at all."""
    prep = prepare(serving, dict({"messages": user("What is the weather in Paris?"), "max_tokens": 300, "seed": 0},
                                 **extra))
    assert prep.constraint is not None and not prep.tools_enabled
    c = prep.constraint
    assert feed(serving, c, "Let me think.") == len(serving.tokenizer.encode_text("Let me think."))
    closing = markers(serving, "close", "think", "sep", "open")
    assert feed(serving, c, closing) == len(closing)
    tools_tag = serving.tokenizer.encode_text("tools")
    assert not c.allowed_tokens()[tools_tag[0]]  # after the think close only the response opener is allowed
    rest = markers(serving, "response", "sep") + serving.tokenizer.encode_text("Sunny.") + \
        markers(serving, "close", "response", "sep", "open")
    assert feed(serving, c, rest) == len(rest) - 1  # no second opener (a tools channel) after the response


def test_declared_tools_keep_their_channel(serving):
    prep = prepare(serving, {"messages": user(), "tools": [WEATHER]})
    assert prep.tools_enabled
    ids = markers(serving, "close", "think", "sep", "open", "response", "sep", "close", "response", "sep", "open",
                  "tools", "sep")
    assert feed(serving, prep.constraint, ids) == len(ids)


# ----------------------------------------------------------------------------- numbers and layout

CASE_SCHEMA = {"type": "object", "required": ["value"], "additionalProperties": False, "properties": {"value": {
    "type": "object", "properties": {"items": {"type": "array", "items": {"type": "number"}}}}}}


def _args_prefix(serving, form: str, value_schema: dict | None = None):
    """Ids up to the argument `value` (schema `value_schema`, default CASE_SCHEMA's): required call of
    `kvv_walle_case`, thinking off."""
    params = CASE_SCHEMA if value_schema is None else dict(CASE_SCHEMA, properties={"value": value_schema})
    tool = {"type": "function", "function": {"name": "kvv_walle_case", "parameters": params, "strict": True}}
    prep = prepare(serving, {"messages": user(), "tools": [tool], "tool_choice": "required",
                             "thinking": {"type": "disabled"}})
    c = prep.constraint
    head = markers(serving, "close", "response", "sep", "open", "tools", "sep", "open",
                   'call tool="kvv_walle_case" index="1"', "sep", "open")
    if form == "typed":
        head += markers(serving, 'argument key="value" type="object"', "sep")
    else:
        head += markers(serving, 'json type="object"', "sep") + serving.tokenizer.encode_text('{"value": ')
    assert feed(serving, c, head) == len(head)
    return c


@pytest.mark.parametrize("form", ["typed", "json"])
@pytest.mark.parametrize("value, ok", [('{"items": [1, 2903E493]}', False), ('{"items": [1, 1e5]}', False),
                                       ('{"items": [1, 2903.5, -0.25]}', True),
                                       ('{"items": [90071992547409910]}', False), ('{"items": [9007199254740991]}', True)])
def test_argument_numbers_are_finite_float64(serving, form, value, ok):
    """`2903E493` (a number no decoder reads back as finite) came back as the whole arguments object
    re-wrapped into a JSON string; the grammar now bounds numbers to |x| <= 2**53 - 1 in plain
    decimal notation."""
    c = _args_prefix(serving, form)
    text = value if form == "typed" else value + "}"
    n = feed(serving, c, text)
    assert (n == len(serving.tokenizer.encode_text(text))) == ok
    if ok:
        assert all(math.isfinite(x) for x in json.loads(value)["items"])


@pytest.mark.parametrize("text, ok", [('{"city": "Austin", "temperature" \n:6400e-119}', False),
                                      ('{"city":"Austin",\t"temperature":64}', False),
                                      ('{ "city": "Austin", "temperature": 64}', False),
                                      ('{"city": "Austin", "temperature": 64}', True),
                                      ('{"city":"Austin","temperature":64.5}', True)])
def test_json_output_is_compact(serving, text, ok):
    """4 of 6 json_schema answers held newlines / tabs / runs of spaces (the grammar allowed up to 64
    at every position); the verifier's test_response_format_with requires none."""
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "temperature": {"type": "number"}},
              "required": ["city", "temperature"], "additionalProperties": False}
    prep = prepare(serving, {"messages": user(), "thinking": {"type": "disabled"},
                             "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": schema}}})
    n = feed(serving, prep.constraint, text)
    assert (n == len(serving.tokenizer.encode_text(text))) == ok


LAYOUTS = [('{"city": "Austin", "temperature" \n:64}', False), ('{"city":"Austin",\t"temperature":64}', False),
           ('{\n  "city": "Austin"}', False), ('{"city": "Austin",  "temperature": 64}', False),
           ('{"city": "Austin", "temperature": 64}', True), ('{"city":"Austin","temperature":64.5}', True)]


@pytest.mark.parametrize("text, ok", LAYOUTS)
def test_json_mode_is_compact(serving, text, ok):
    """JSON mode (`response_format: json_object`) has the same compact layout as json_schema."""
    prep = prepare(serving, {"messages": user(), "thinking": {"type": "disabled"},
                             "response_format": {"type": "json_object"}})
    n = feed(serving, prep.constraint, text)
    assert (n == len(serving.tokenizer.encode_text(text))) == ok


@pytest.mark.parametrize("form", ["typed", "json"])
@pytest.mark.parametrize("text, ok", LAYOUTS)
def test_tool_arguments_are_compact(serving, form, text, ok):
    """Tool arguments, as a typed `object` argument or as the json block, have the compact layout too."""
    c = _args_prefix(serving, form, {"type": "object", "properties": {"city": {"type": "string"},
                                                                      "temperature": {"type": "number"}}})
    body = text if form == "typed" else text + "}"
    n = feed(serving, c, body)
    assert (n == len(serving.tokenizer.encode_text(body))) == ok


# ----------------------------------------------------------------------------- schemas

@pytest.mark.parametrize("schema_id", ["#user", "anyOf with refs", "https://example.com/schemas/user#/definitions/name",
                                       "https://example.com/schemas/user#/$defs/name"])
def test_id_is_an_annotation(http, schema_id):
    """The four walle-valid tool schemas refused over their `$id` (llguidance resolves references
    against it): annotations are never a 400."""
    params = {"$id": schema_id, "type": "object", "required": ["value"], "additionalProperties": False,
              "properties": {"value": {"$ref": "#/$defs/n"}}, "$defs": {"n": {"type": "integer"}}}
    tool = {"type": "function", "function": {"name": "kvv_walle_case", "parameters": params, "strict": True}}
    r = http.post("/v1/chat/completions", json=dict(BASE, tools=[tool], tool_choice="required"))
    assert r.status_code == 200, r.text


CLAUDE_CODE_LIKE = {"$schema": "http://json-schema.org/draft-07/schema#", "$comment": "generated", "type": "object",
                    "additionalProperties": False,
                    "properties": {"metadata": {"type": "object", "propertyNames": {"type": "string"},
                                                "additionalProperties": {"type": "string"}, "title": "Metadata",
                                                "examples": [{"k": "v"}], "deprecated": False, "readOnly": False},
                                   "id": {"type": "string", "default": "x", "description": "task id"}},
                    "required": ["id"]}


def test_keywords_that_constrain_nothing_are_accepted(http):
    """Claude Code's default TaskCreate / TaskUpdate tools carry `propertyNames: {"type": "string"}`
    (object keys are strings anyway) and annotations: accepted on both surfaces."""
    tool = {"type": "function", "function": {"name": "TaskUpdate", "parameters": CLAUDE_CODE_LIKE}}
    assert http.post("/v1/chat/completions", json=dict(BASE, tools=[tool])).status_code == 200
    r = http.post("/anthropic/v1/messages", json={"model": MODEL, "max_tokens": 20, "messages": user(), "tools": [
        {"name": "TaskUpdate", "description": "Update a task.", "input_schema": CLAUDE_CODE_LIKE}]})
    assert r.status_code == 200, r.text


UNIQUE = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}}}


def test_unenforceable_keywords_follow_the_strict_level(http):
    """A keyword the grammar cannot enforce: a strict tool (the platform's default) is a 400 naming
    the tool and keyword; `strict: false` is accepted with the keyword left out of the grammar.
    The Anthropic surface defaults to non-strict (Anthropic's own default)."""
    def openai(strict):
        fn = {"name": "tagger", "parameters": UNIQUE}
        if strict is not None:
            fn["strict"] = strict
        return http.post("/v1/chat/completions", json=dict(BASE, tools=[{"type": "function", "function": fn}]))

    for strict in (None, True):
        r = openai(strict)
        assert r.status_code == 400
        assert r.json()["error"]["message"].startswith(
            "tools[0].function.parameters (tool 'tagger'): JSON Schema keyword(s) \"uniqueItems\" cannot be enforced")
    assert openai(False).status_code == 200

    def anthropic(**extra):
        return http.post("/anthropic/v1/messages", json={"model": MODEL, "max_tokens": 20, "messages": user(),
                                                         "tools": [dict({"name": "tagger", "input_schema": UNIQUE},
                                                                        **extra)]})
    assert anthropic().status_code == 200
    r = anthropic(strict=True)
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert "(tool 'tagger')" in r.json()["error"]["message"] and '"uniqueItems"' in r.json()["error"]["message"]


def test_strict_response_schema_names_the_keyword(http):
    r = http.post("/v1/chat/completions", json=dict(BASE, response_format={"type": "json_schema", "json_schema": {
        "name": "t", "schema": UNIQUE}}))
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith('response_format.json_schema.schema: JSON Schema keyword(s) '
                                                   '"uniqueItems" cannot be enforced')


# ----------------------------------------------------------------------------- tools and tool_choice

def test_tool_without_type_is_rejected(http):
    """The verifier's test_dynamic_tool_missing_required_field_rejected[missing_type]."""
    untyped = {"function": {"name": "good_tool", "description": "A tool.", "parameters": {"type": "object",
                                                                                        "properties": {}}}}
    dyn = [{"role": "system", "content": "", "tools": [untyped]}, {"role": "user", "content": "hello"}]
    r = http.post("/v1/chat/completions", json=dict(BASE, messages=dyn))
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "messages[0].tools[0].type: required (only 'function' tools are supported)"
    r = http.post("/v1/chat/completions", json=dict(BASE, tools=[untyped]))
    assert r.json()["error"]["message"] == "tools[0].type: required (only 'function' tools are supported)"


def test_empty_tools_is_no_tools(serving):
    """kosong sends `"tools": []` on every tool-less call."""
    with_empty = prepare(serving, {"messages": user(), "tools": []})
    without = prepare(serving, {"messages": user()})
    assert with_empty.prompt_ids == without.prompt_ids and not with_empty.tools_enabled
    with pytest.raises(APIError, match="'required' needs at least one tool"):
        prepare(serving, {"messages": user(), "tools": [], "tool_choice": "required"})


def test_anthropic_named_tool_choice_is_accepted(http):
    body = {"model": MODEL, "max_tokens": 1, "messages": user(), "tools": [
        {"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}]}
    named = http.post("/anthropic/v1/messages", json=dict(body, tool_choice={"type": "tool", "name": "get_weather"}))
    auto = http.post("/anthropic/v1/messages", json=body)
    assert named.status_code == 200 and auto.status_code == 200
    def prompt(r):  # input_tokens exclude cache hits (Anthropic semantics): add them back
        return r.json()["usage"]["input_tokens"] + r.json()["usage"]["cache_read_input_tokens"]
    assert prompt(named) == prompt(auto)


def test_anthropic_system_turn_renders_at_its_position(http):
    """Claude Code's first request has a `role: "system"` turn inside `messages`: rendered as a K3
    system message at that position (the same prompt as the chat-completions body)."""
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [{"type": "thinking",
                                                                                   "thinking": "t"},
                                                                                  {"type": "text", "text": "Hello"}]},
             {"role": "system", "content": [{"type": "text", "text": "Answer briefly."}]},
             {"role": "user", "content": "and now?"}]
    anth = http.post("/anthropic/v1/messages/count_tokens", json={"model": MODEL, "messages": turns})
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello", "reasoning_content": "t"},
            {"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "and now?"}]
    kimi = http.post("/v1/tokenizers/estimate-token-count", json={"model": MODEL, "messages": chat})
    assert anth.status_code == 200 and kimi.status_code == 200, (anth.text, kimi.text)
    assert anth.json()["input_tokens"] == kimi.json()["data"]["total_tokens"]
    r = http.post("/anthropic/v1/messages", json={"model": MODEL, "max_tokens": 5, "messages": turns})
    assert r.status_code == 200, r.text


def test_reasoning_effort_none_is_rejected(http):
    r = http.post("/v1/chat/completions", json=dict(BASE, reasoning_effort="none"))
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith("reasoning_effort: unsupported value 'none' (low, medium, high, max)")
    r = http.post("/v1/chat/completions", json=dict(BASE, thinking={"type": "disabled"}))
    assert r.status_code == 200 and "reasoning_content" not in r.json()["choices"][0]["message"]


# ----------------------------------------------------------------------------- truncated calls

def _stream(http, body) -> tuple[list, str]:
    calls, finish = {}, None
    with http.stream("POST", "/v1/chat/completions", json=dict(body, stream=True)) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for ch in json.loads(line[6:])["choices"]:
                for tc in ch["delta"].get("tool_calls") or []:
                    slot = calls.setdefault(tc["index"], {"id": None, "type": "function",
                                                          "function": {"name": None, "arguments": ""}})
                    slot["id"] = tc.get("id") or slot["id"]
                    slot["function"]["name"] = tc.get("function", {}).get("name") or slot["function"]["name"]
                    slot["function"]["arguments"] += tc.get("function", {}).get("arguments") or ""
                finish = ch.get("finish_reason") or finish
    return [calls[k] for k in sorted(calls)], finish


def test_a_call_cut_by_max_tokens_is_length_in_both_modes(http):
    """A call cut by max_tokens came back as `tool_calls` (when an earlier call was complete) and
    only the stream showed it: now `length`, and both modes return the call as far as it got."""
    body = {"model": MODEL, "messages": user(), "tools": [WEATHER], "tool_choice": "required", "seed": 7,
            "thinking": {"type": "disabled"}}
    full = http.post("/v1/chat/completions", json=dict(body, max_completion_tokens=200, logprobs=True)).json()
    assert full["choices"][0]["finish_reason"] == "tool_calls"
    tokens = [t["token"] for t in full["choices"][0]["logprobs"]["content"]]
    ends = [i for i in range(len(tokens)) if tokens[i] == "<|close|>"
            and "".join(tokens[i + 1:i + 5]).startswith(("json", "argument"))]  # a call's last argument ends
    budget = ends[-1] - 1  # stops inside the last call's arguments
    r = http.post("/v1/chat/completions", json=dict(body, max_completion_tokens=budget)).json()
    msg = r["choices"][0]["message"]
    assert r["choices"][0]["finish_reason"] == "length"
    assert msg["tool_calls"] and msg["tool_calls"][-1] != full["choices"][0]["message"]["tool_calls"][-1]
    calls, finish = _stream(http, dict(body, max_completion_tokens=budget))
    assert finish == "length" and calls == msg["tool_calls"]


# ----------------------------------------------------------------------------- small endpoints

def test_anthropic_models_endpoints(server):
    import anthropic

    with anthropic.Anthropic(base_url=server.base + "/anthropic", api_key=API_KEY, max_retries=0) as ac:
        models = list(ac.models.list())
        assert [m.id for m in models] == [MODEL] and models[0].type == "model"
        assert ac.models.retrieve(MODEL).id == MODEL
        with pytest.raises(anthropic.NotFoundError):
            ac.models.retrieve("claude-x")


@pytest.mark.parametrize("path", ["/", "/v1", "/anthropic", "/health"])
def test_head_probes(server, path):
    assert httpx.head(server.base + path, timeout=10).status_code == 200
