"""``POST /v1/responses`` through the official ``openai`` SDK (``client.responses.create`` and
``client.responses.stream``) against a live ``openk3 serve``, plus the request shapes Codex CLI
0.171 sends (recorded once from the real client; the bodies below are synthetic ones of the same
shape: its item and tool kinds, ids on input items, ``include``, ``prompt_cache_key``,
``client_metadata``, a default ``web_search`` tool and a ``namespace`` of function tools)."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from tests.server.conftest import API_KEY, MODEL, user

WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather for a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                          "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                          "required": ["city", "days"], "additionalProperties": False}}
PATCH = {"type": "custom", "name": "apply_patch", "description": "Apply a patch to the workspace.",
         "format": {"type": "grammar", "syntax": "lark", "definition": "start: /[a-z ]+/"}}
AGENTS = {"type": "namespace", "name": "agents", "description": "Sub-agent tools.",
          "tools": [{"type": "function", "name": "spawn", "description": "Start a sub-agent.", "strict": False,
                     "parameters": {"type": "object", "properties": {"task": {"type": "string"}},
                                    "required": ["task"], "additionalProperties": False}}]}


@pytest.fixture
def client(server):
    """The suite's client with a longer read timeout: these requests carry tool declarations and
    reasoning back, and on a loaded 2-core machine a 250-token reply can take over a minute."""
    with openai.OpenAI(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=300) as c:
        yield c


def _chat_prompt_tokens(client, messages: list[dict], **kw) -> int:
    return client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=1, **kw
                                          ).usage.prompt_tokens


def test_create_text_renders_as_chat_does(client):
    r = client.responses.create(model=MODEL, instructions="Be brief.", input="Hello there", max_output_tokens=12)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.status in ("completed", "incomplete") and r.store is False
    assert (r.status == "incomplete") == (r.incomplete_details is not None)
    kinds = [item.type for item in r.output]
    assert kinds[0] == "reasoning"  # thinking is on by default, as on chat
    assert set(kinds) <= {"reasoning", "message"}
    # same K3 prompt as the chat surface for the same conversation: the same renderer
    chat = _chat_prompt_tokens(client, [{"role": "system", "content": "Be brief."}] + user("Hello there"))
    assert r.usage.input_tokens == chat
    assert 0 < r.usage.output_tokens <= 12
    assert 0 <= r.usage.output_tokens_details.reasoning_tokens <= r.usage.output_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.input_tokens_details.cached_tokens >= 0
    text = "".join(c.text for item in r.output if item.type == "message" for c in item.content)
    assert r.output_text == text


def test_effort_none_is_instant_mode(client):
    r = client.responses.create(model=MODEL, input="Hello there", reasoning={"effort": "none"}, max_output_tokens=6)
    assert [item.type for item in r.output] in (["message"], [])
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    chat = _chat_prompt_tokens(client, user("Hello there"), extra_body={"thinking": {"type": "disabled"}})
    assert r.usage.input_tokens == chat


def test_stream_event_sequence(client):
    with client.responses.stream(model=MODEL, input="Hello there", max_output_tokens=24) as stream:
        events = list(stream)
        kinds = [ev.type for ev in events]
        assert kinds[-1] in ("response.completed", "response.incomplete")
        final = events[-1].response
        if kinds[-1] == "response.completed":  # the SDK's accumulated response (it has none for incomplete)
            assert stream.get_final_response().output == final.output
        else:  # cut by max_output_tokens, as the API reports it
            assert final.status == "incomplete" and final.incomplete_details.reason == "max_output_tokens"
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert [ev.sequence_number for ev in events] == list(range(len(events)))
    assert {ev.response.id for ev in events if ev.type.startswith("response.") and hasattr(ev, "response")
            and ev.type in ("response.created", "response.in_progress", kinds[-1])} == {final.id}
    added = [ev.item.id for ev in events if ev.type == "response.output_item.added"]
    done = [ev.item for ev in events if ev.type == "response.output_item.done"]
    assert added == [item.id for item in done] == [item.id for item in final.output]
    reasoning = "".join(ev.delta for ev in events if ev.type == "response.reasoning_text.delta")
    assert final.output[0].type == "reasoning" and final.output[0].content[0].text == reasoning
    text = "".join(ev.delta for ev in events if ev.type == "response.output_text.delta")
    assert final.output_text == text
    for ev in events:
        if ev.type == "response.output_text.done":
            assert ev.text == text
    assert final.usage.output_tokens <= 24


def test_tool_loop_with_items_sent_back(client):
    r1 = client.responses.create(model=MODEL, input="Weather in Paris for 3 days?", tools=[WEATHER],
                                 tool_choice="required", max_output_tokens=250)
    calls = [item for item in r1.output if item.type == "function_call"]
    assert r1.status == "completed" and calls
    call = calls[0]
    assert call.name == "get_weather" and re.fullmatch(r"functions\.get_weather:0", call.call_id)
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    # the SDK's documented loop: the output items go back as input, then the tool's result
    history = [{"role": "user", "content": "Weather in Paris for 3 days?"}] + [item.model_dump() for item in r1.output]
    history += [{"type": "function_call_output", "call_id": c.call_id, "output": '{"temp_c": 18}'} for c in calls]
    r2 = client.responses.create(model=MODEL, input=history, tools=[WEATHER], max_output_tokens=8)
    assert r2.status in ("completed", "incomplete")
    assert r2.usage.input_tokens > r1.usage.input_tokens
    # the same turn through chat completions renders to the same prompt
    content = "".join(c.text for item in r1.output if item.type == "message" for c in item.content)
    turn = {"role": "assistant", "content": content, "reasoning_content": r1.output[0].content[0].text,
            "tool_calls": [{"id": c.call_id, "type": "function",
                            "function": {"name": c.name, "arguments": c.arguments}} for c in calls]}
    chat_tool = {"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}
    messages = user("Weather in Paris for 3 days?") + [turn] + [
        {"role": "tool", "tool_call_id": c.call_id, "content": '{"temp_c": 18}'} for c in calls]
    assert r2.usage.input_tokens == _chat_prompt_tokens(client, messages, tools=[chat_tool])


def test_stream_function_call_arguments(client):
    with client.responses.stream(model=MODEL, input="Weather in Paris?", tools=[WEATHER], tool_choice="required",
                                 max_output_tokens=250) as stream:
        events = list(stream)
        final = stream.get_final_response()
    call = next(item for item in final.output if item.type == "function_call")
    deltas = "".join(ev.delta for ev in events if ev.type == "response.function_call_arguments.delta"
                     and ev.item_id == call.id)
    assert deltas == call.arguments
    done = [ev for ev in events if ev.type == "response.function_call_arguments.done"]
    assert done and done[0].arguments == call.arguments and done[0].item_id == call.id
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])


def test_custom_tool_call_is_free_text(client):
    r = client.responses.create(model=MODEL, input="Fix it.", tools=[PATCH], tool_choice="required",
                                max_output_tokens=200)
    calls = [item for item in r.output if item.type == "custom_tool_call"]
    assert calls and calls[0].name == "apply_patch" and isinstance(calls[0].input, str)
    back = [{"role": "user", "content": "Fix it."}] + [item.model_dump() for item in r.output] + [
        {"type": "custom_tool_call_output", "call_id": calls[0].call_id, "output": "done"}]
    r2 = client.responses.create(model=MODEL, input=back, tools=[PATCH], max_output_tokens=4)
    assert r2.status in ("completed", "incomplete")


def test_namespace_tool_call_names_its_namespace(client):
    r = client.responses.create(model=MODEL, input="Delegate.", tools=[AGENTS], tool_choice="required",
                                max_output_tokens=200)
    call = next(item for item in r.output if item.type == "function_call")
    assert call.name == "spawn" and call.namespace == "agents"
    assert set(json.loads(call.arguments)) == {"task"}


def test_text_format_json_schema(client):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    r = client.responses.create(model=MODEL, input="Give n.", max_output_tokens=250, reasoning={"effort": "none"},
                                text={"format": {"type": "json_schema", "name": "t", "schema": schema, "strict": True}})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema" and r.text.format.name == "t"


def _sse(resp: httpx.Response) -> list[dict]:
    events = []
    for block in resp.text.split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if "data" in lines:
            data = json.loads(lines["data"])
            assert lines.get("event") == data["type"]
            events.append(data)
    return events


def test_codex_shaped_turns(server):
    """Two turns shaped as Codex CLI 0.171 sends them over the Responses wire (streamed)."""
    tools = [{"type": "function", "name": "exec_command", "description": "Run a shell command.", "strict": False,
              "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"],
                             "additionalProperties": False}},
             AGENTS, {"type": "web_search", "external_web_access": False}]
    first = [{"type": "message", "id": "msg_a", "role": "developer",
              "content": [{"type": "input_text", "text": "You are a coding agent."}]},
             {"type": "message", "id": "msg_b", "role": "user",
              "content": [{"type": "input_text", "text": "<environment_context>cwd=/w</environment_context>"}]},
             {"type": "message", "id": "msg_c", "role": "user", "content": [{"type": "input_text", "text": "say hi"}]}]
    body = {"model": MODEL, "stream": True, "input": first, "tools": tools, "tool_choice": "required",
            "parallel_tool_calls": True, "reasoning": {"summary": "auto"}, "store": False,
            "include": ["reasoning.encrypted_content"], "prompt_cache_key": "k1",
            "client_metadata": {"session_id": "s1"}, "max_output_tokens": 250}
    headers = {"Authorization": f"Bearer {API_KEY}", "accept": "text/event-stream"}
    with httpx.Client(base_url=server.base, headers=headers, timeout=300) as http:
        r1 = http.post("/v1/responses", json=body)
        assert r1.status_code == 200 and r1.headers["content-type"].startswith("text/event-stream")
        events = _sse(r1)
        assert events[-1]["type"] == "response.completed"
        final = events[-1]["response"]
        reasoning = next(item for item in final["output"] if item["type"] == "reasoning")
        assert reasoning["encrypted_content"]
        call = next(item for item in final["output"] if item["type"] == "function_call")
        assert call["name"] in ("exec_command", "spawn")
        # Codex sends reasoning back without its id and with only what it keeps
        second = first + [{"type": "reasoning", "summary": [], "content": reasoning["content"],
                           "encrypted_content": reasoning["encrypted_content"]},
                          {k: call[k] for k in ("type", "status", "name", "arguments", "call_id", "namespace")
                           if k in call},
                          {"type": "function_call_output", "id": "fco_1", "call_id": call["call_id"], "output": "hi"}]
        r2 = http.post("/v1/responses", json=dict(body, input=second, tool_choice="auto", max_output_tokens=8))
        assert r2.status_code == 200
        assert _sse(r2)[-1]["type"] in ("response.completed", "response.incomplete")
        # encrypted_content alone (no raw content) carries the reasoning back: the same prompt
        only_enc = [dict(second[3], content=[])]
        r3 = http.post("/v1/responses", json=dict(body, input=second[:3] + only_enc + second[4:], stream=False,
                                                  tool_choice="auto", max_output_tokens=1))
        r4 = http.post("/v1/responses", json=dict(body, input=second, stream=False, tool_choice="auto",
                                                  max_output_tokens=1))
        assert r3.status_code == r4.status_code == 200
        assert r3.json()["usage"]["input_tokens"] == r4.json()["usage"]["input_tokens"]


@pytest.mark.parametrize("patch, where", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0]"),
    ({"input": [{"type": "web_search_call", "id": "x"}]}, "input[0].type"),
    ({"tools": [{"type": "file_search", "vector_store_ids": []}]}, "tools[0].type"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools[0].type"),
    ({"text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}, "text.format.name"),
    ({"reasoning": {"effort": "huge"}}, "reasoning.effort"),
    ({"max_output_tokens": "many"}, "max_output_tokens"),
])
def test_errors_name_the_field(client, patch, where):
    body = dict({"model": MODEL, "input": "hi"}, **patch)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**body)
    assert e.value.status_code == 400 and where in e.value.message, e.value.message


def test_unknown_model_and_stored_response(client, http):
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="nope", input="hi")
    resp = http.get("/v1/responses/resp_123")
    assert resp.status_code == 404 and "stateless" in resp.json()["error"]["message"]
