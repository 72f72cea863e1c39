"""Request-validation leniencies closed after review (against the real server): a ``json_schema``
response format without ``name``, a non-boolean ``parallel_tool_calls``, and Anthropic ``thinking``
without a valid ``budget_tokens``. Each bad form is a 400 with the route's error envelope naming the
field; the valid form next to it still answers. (Image parts outside user messages: test_images.py,
which has a vision model to tell the role check from "model does not support image input".)"""

from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import MODEL, user

CHAT, COUNT = "/v1/chat/completions", "/v1/tokenizers/estimate-token-count"
MESSAGES, MESSAGES_COUNT = "/anthropic/v1/messages", "/anthropic/v1/messages/count_tokens"
BASE = {"model": MODEL, "messages": user(), "max_completion_tokens": 1}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def kimi_error(r: httpx.Response, message: str) -> None:
    assert r.status_code == 400, r.text
    assert r.json() == {"error": {"message": message, "type": "invalid_request_error"}}, r.text


def anthropic_error(r: httpx.Response, message: str) -> None:
    assert r.status_code == 400, r.text
    assert r.json() == {"type": "error", "error": {"type": "invalid_request_error", "message": message}}, r.text


# ------------------------------------------------------------------ response_format.json_schema.name

@pytest.mark.parametrize("wrapper", [{"schema": SCHEMA}, {"schema": SCHEMA, "strict": True}, {"strict": False,
                                                                                             "schema": SCHEMA}])
def test_json_schema_without_name_is_400(http, wrapper):
    rf = {"type": "json_schema", "json_schema": wrapper}
    want = "Invalid request: response_format.json_schema.name: Field required"
    kimi_error(http.post(CHAT, json=dict(BASE, response_format=rf)), want)
    kimi_error(http.post(COUNT, json={"model": MODEL, "messages": user(), "response_format": rf}), want)


def test_json_schema_name_must_be_a_string(http):
    rf = {"type": "json_schema", "json_schema": {"name": 7, "schema": SCHEMA}}
    kimi_error(http.post(CHAT, json=dict(BASE, response_format=rf)),
               "Invalid request: response_format.json_schema.name: Input should be a valid string")


def test_json_schema_with_name_still_answers(http):
    rf = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}
    r = http.post(CHAT, json=dict(BASE, response_format=rf))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "length"
    counted = http.post(COUNT, json={"model": MODEL, "messages": user(), "response_format": rf})
    assert counted.status_code == 200 and counted.json()["data"]["total_tokens"] > 0, counted.text


# ------------------------------------------------------------------------------ parallel_tool_calls

@pytest.mark.parametrize("value", ["yes", "true", "false", 1, 0, [True], {"v": True}])
def test_parallel_tool_calls_must_be_a_boolean(http, value):
    kimi_error(http.post(CHAT, json=dict(BASE, tools=[TOOL], parallel_tool_calls=value)),
               "Invalid request: parallel_tool_calls: Input should be a valid boolean")


@pytest.mark.parametrize("value", [True, False, None])
def test_parallel_tool_calls_boolean_is_accepted(http, value):
    r = http.post(CHAT, json=dict(BASE, tools=[TOOL], parallel_tool_calls=value))
    assert r.status_code == 200, r.text


# ----------------------------------------------------------------------- anthropic thinking budget

def _anth(**kw) -> dict:
    return {"model": MODEL, "max_tokens": 4096, "messages": [{"role": "user", "content": "hi"}], **kw}


@pytest.mark.parametrize("thinking,max_tokens,message", [
    ({"type": "enabled"}, 4096, "thinking.budget_tokens: required when thinking.type is 'enabled'"),
    ({"type": "enabled", "budget_tokens": None}, 4096,
     "thinking.budget_tokens: required when thinking.type is 'enabled'"),
    ({"type": "enabled", "budget_tokens": 1023}, 4096, "thinking.budget_tokens: must be >= 1024, got 1023"),
    ({"type": "enabled", "budget_tokens": 0}, 4096, "thinking.budget_tokens: must be >= 1024, got 0"),
    ({"type": "enabled", "budget_tokens": 2048}, 2048,
     "thinking.budget_tokens: must be less than max_tokens (2048), got 2048"),
    ({"type": "enabled", "budget_tokens": 3000}, 2048,
     "thinking.budget_tokens: must be less than max_tokens (2048), got 3000"),
    ({"type": "enabled", "budget_tokens": "2048"}, 4096,
     "Invalid request: thinking.budget_tokens: Input should be a valid integer"),
    ({"type": "enabled", "budget_tokens": 2048.0}, 4096,
     "Invalid request: thinking.budget_tokens: Input should be a valid integer"),
    ({"type": "enabled", "budget_tokens": True}, 4096,
     "Invalid request: thinking.budget_tokens: Input should be a valid integer"),
    ({"budget_tokens": 2048}, 4096, "Invalid request: thinking.type: Field required"),
    ({"type": "auto"}, 4096, "Invalid request: thinking.type: Input should be 'enabled', 'disabled', 'adaptive' "
                             "or 'between_tools'"),
])
def test_anthropic_thinking_budget_is_validated(http, thinking, max_tokens, message):
    anthropic_error(http.post(MESSAGES, json=_anth(thinking=thinking, max_tokens=max_tokens)), message)


def test_anthropic_thinking_budget_on_count_tokens(http):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    anthropic_error(http.post(MESSAGES_COUNT, json=dict(body, thinking={"type": "enabled"})),
                    "thinking.budget_tokens: required when thinking.type is 'enabled'")
    anthropic_error(http.post(MESSAGES_COUNT, json=dict(body, thinking={"type": "enabled", "budget_tokens": 100})),
                    "thinking.budget_tokens: must be >= 1024, got 100")
    # no max_tokens on count_tokens: any budget >= 1024 is fine, and it does not change the count
    plain = http.post(MESSAGES_COUNT, json=body)
    budgeted = http.post(MESSAGES_COUNT, json=dict(body, thinking={"type": "enabled", "budget_tokens": 100_000}))
    assert plain.status_code == budgeted.status_code == 200, (plain.text, budgeted.text)
    assert budgeted.json() == plain.json() and plain.json()["input_tokens"] > 0


def test_anthropic_thinking_valid_forms_still_answer(http):
    # the smallest legal budget needs max_tokens >= 1025: stream and stop after the first events
    # (the budget is accepted but not enforced, api.md §7)
    with http.stream("POST", MESSAGES, json=_anth(max_tokens=1025, stream=True,
                                                  thinking={"type": "enabled", "budget_tokens": 1024})) as r:
        assert r.status_code == 200
        first = next(r.iter_lines())
    assert first == "event: message_start", first
    for thinking, has_thinking_block in (({"type": "disabled"}, False), ({"type": "adaptive"}, True),
                                         ({"type": "between_tools"}, True), (None, True)):
        r = http.post(MESSAGES, json=_anth(max_tokens=2, thinking=thinking))
        assert r.status_code == 200, (thinking, r.text)
        kinds = [b["type"] for b in r.json()["content"]]
        assert ("thinking" in kinds) == has_thinking_block, (thinking, kinds)
    # budget_tokens next to "disabled" is ignored, as before
    r = http.post(MESSAGES, json=_anth(max_tokens=2, thinking={"type": "disabled", "budget_tokens": 5}))
    assert r.status_code == 200, r.text


def test_openai_route_thinking_budget_stays_accept_and_ignore(http):
    """api.md §1.3: the chat route's ``thinking`` has no budget field; ``budget_tokens`` from client
    SDKs is accepted and ignored there (only the Anthropic surface has Anthropic's rule)."""
    r = http.post(CHAT, json=dict(BASE, thinking={"type": "enabled", "budget_tokens": 5}))
    assert r.status_code == 200, r.text


def test_unknown_model_still_wins_over_a_bad_thinking_budget(http):
    r = http.post(MESSAGES, json=_anth(model="gpt-x", thinking={"type": "enabled"}))
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error", r.text


# ------------------------------------------------------------ parallel_tool_calls: false -> one call

@pytest.mark.parametrize("value, want", [(False, {"max_tool_calls": 1}), (True, {}), (None, {})])
def test_parallel_tool_calls_false_allows_one_call(value, want):
    """``parallel_tool_calls: false`` builds the tool constraint with at most one call (the
    constraint's limit itself: tests/engine/test_constraints.py); true / absent keep the default."""
    from openk3.server import ChatServing, ModelInfo
    from openk3.server.metrics import Metrics
    from openk3.tokenizer import load_tokenizer

    seen = []

    def factory(tokenizer, kind, **kw):
        seen.append(kw)
        return None

    serving = ChatServing(None, load_tokenizer("openk3-tiny"), ModelInfo(MODEL, 4096), Metrics(),
                          make_constraint=factory)
    body = dict(BASE, tools=[TOOL])
    if value is not None:
        body["parallel_tool_calls"] = value
    serving.prepare(serving.parse(body))
    assert len(seen) == 1 and {k: v for k, v in seen[0].items() if k == "max_tool_calls"} == want


def test_anthropic_disable_parallel_tool_use_maps_to_one_call(http):
    from openk3.server.anthropic import to_chat_request

    req = _anth(tools=[{"name": "get_weather", "input_schema": SCHEMA}],
                tool_choice={"type": "auto", "disable_parallel_tool_use": True})
    assert to_chat_request(req).parallel_tool_calls is False
    assert to_chat_request(dict(req, tool_choice={"type": "auto"})).parallel_tool_calls is None
    bad = dict(req, tool_choice={"type": "auto", "disable_parallel_tool_use": "yes"})
    anthropic_error(http.post(MESSAGES, json=bad),
                    "tool_choice.disable_parallel_tool_use: must be a boolean, got 'yes'")
