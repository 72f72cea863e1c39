"""``/anthropic/v1/messages`` through the official ``anthropic`` SDK: blocks, the standard event
sequence, tool use with preserved thinking blocks, usage, errors."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import pytest

from openk3.chat_format import encode_request
from tests.server.conftest import API_KEY, MODEL

SYSTEM = "You are a weather assistant."
TOOL = {"name": "get_weather", "description": "Weather for a city.",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture
def ac(server):
    with anthropic.Anthropic(base_url=server.base + "/anthropic", api_key=API_KEY, max_retries=0, timeout=60) as c:
        yield c


def test_message_blocks_and_usage(ac, tokenizer):
    msgs = [{"role": "user", "content": [{"type": "text", "text": "Weather in Oslo?"}]}]
    m = ac.messages.create(model=MODEL, max_tokens=6, system=SYSTEM, messages=msgs)
    assert m.type == "message" and m.role == "assistant" and m.model == MODEL and m.id.startswith("msg_")
    assert m.content[0].type == "thinking" and m.content[0].signature
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 6
    chat = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": [
        {"type": "text", "text": "Weather in Oslo?"}]}]}
    p = encode_request(chat, tokenizer)
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == len(p.token_ids) - p.pending_tokens
    assert m.usage.cache_creation_input_tokens == 0
    counted = ac.messages.count_tokens(model=MODEL, system=SYSTEM, messages=msgs)
    assert counted.input_tokens == len(p.token_ids) - p.pending_tokens


def test_stream_event_sequence_with_tool_use(ac):
    with ac.messages.stream(model=MODEL, max_tokens=250, tools=[TOOL], tool_choice={"type": "any"},
                            messages=[{"role": "user", "content": "Weather in Lima?"}]) as s:
        events = list(s)
        final = s.get_final_message()
    kinds = [e.type for e in events if e.type in ("message_start", "content_block_start", "content_block_stop",
                                                  "message_delta", "message_stop")]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    starts = [e for e in events if e.type == "content_block_start"]
    assert starts[0].content_block.type == "thinking"
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == len(final.content)
    deltas = {e.delta.type for e in events if e.type == "content_block_delta"}
    assert {"signature_delta", "input_json_delta"} <= deltas
    assert final.stop_reason == "tool_use"
    uses = [b for b in final.content if b.type == "tool_use"]
    assert uses and uses[0].name == "get_weather" and uses[0].id == "functions.get_weather:0"
    jsonschema.validate(uses[0].input, TOOL["input_schema"])
    partial = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta"
                      and e.delta.type == "input_json_delta" and e.index == final.content.index(uses[0]))
    assert json.loads(partial) == uses[0].input
    md = next(e for e in events if e.type == "message_delta")
    assert md.usage.output_tokens == final.usage.output_tokens > 0


def test_tool_result_turn_preserves_thinking(ac, server):
    import httpx

    first = ac.messages.create(model=MODEL, max_tokens=250, tools=[TOOL], tool_choice={"type": "any"},
                               messages=[{"role": "user", "content": "Weather in Lima?"}])
    use = next(b for b in first.content if b.type == "tool_use")
    history = [{"role": "user", "content": "Weather in Lima?"},
               {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]}]
    second = ac.messages.create(model=MODEL, max_tokens=4, tools=[TOOL], messages=history)
    assert second.stop_reason in ("max_tokens", "end_turn", "tool_use")

    def count(thinking: str) -> int:
        h = [history[0], {"role": "assistant", "content": [{"type": "thinking", "thinking": thinking, "signature": "s"},
                                                          *history[1]["content"][1:]]}, history[2]]
        return ac.messages.count_tokens(model=MODEL, tools=[TOOL], messages=h).input_tokens

    assert count("I should call the weather tool.") > count("")  # the thinking text reaches the prompt

    no_thinking = [history[0], {"role": "assistant", "content": [b for b in history[1]["content"]
                                                                 if b["type"] != "thinking"]}, history[2]]
    r = httpx.post(server.base + "/anthropic/v1/messages", headers={"x-api-key": API_KEY},
                   json={"model": MODEL, "max_tokens": 4, "tools": [TOOL], "messages": no_thinking})
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "invalid_request_error" and "thinking" in r.json()["error"]["message"]


def test_prefill_and_text_stream(ac):
    with ac.messages.stream(model=MODEL, max_tokens=5, messages=[
            {"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi"}]) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    # the prefill continues the answer: no thinking block, the text continues after "Hi"
    assert [b.type for b in final.content] in (["text"], [])
    assert text == "".join(b.text for b in final.content if b.type == "text")


def test_errors_use_the_anthropic_envelope(ac):
    with pytest.raises(anthropic.NotFoundError) as e:
        ac.messages.create(model="gpt-x", max_tokens=1, messages=[{"role": "user", "content": "x"}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "not_found_error"
    assert e.value.body["error"]["message"] == "model: gpt-x"
    with pytest.raises(anthropic.BadRequestError):
        ac.messages.create(model=MODEL, max_tokens=1, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}])


def test_url_image_source_is_named_in_anthropic_terms(ac):
    with pytest.raises(anthropic.BadRequestError) as e:
        ac.messages.create(model=MODEL, max_tokens=1, messages=[{"role": "user", "content": [
            {"type": "text", "text": "what is it?"},
            {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]}])
    msg = e.value.body["error"]["message"]
    assert msg.startswith("messages[0].content[1].source: http(s) image URLs are not supported; use a base64 source")


@pytest.mark.parametrize("field,value", [("temperature", 1.5), ("temperature", -0.1), ("top_p", 2.0),
                                         ("top_k", -1)])
def test_sampling_out_of_anthropic_range_is_400(ac, field, value):
    with pytest.raises(anthropic.BadRequestError) as e:
        ac.messages.create(model=MODEL, max_tokens=1, messages=[{"role": "user", "content": "x"}],
                           extra_body={field: value})  # this SDK version no longer types the sampling fields
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert e.value.body["error"]["message"].startswith(f"{field}: must be")


def test_sampling_in_range_is_accepted_and_ignored(ac):
    kw = dict(model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "x"}])
    a = ac.messages.create(**kw, extra_body={"temperature": 0.0, "top_p": 0.5, "top_k": 5})
    b = ac.messages.create(**kw, extra_body={"temperature": 1.0})
    assert a.usage.output_tokens == b.usage.output_tokens == 3


def test_anthropic_field_names_in_errors(ac):
    msg = [{"role": "user", "content": "x"}]
    with pytest.raises(anthropic.BadRequestError) as e:
        ac.messages.create(model=MODEL, max_tokens=1, messages=msg, tools=[dict(TOOL, name="bad name")])
    assert "tools[0].name" in e.value.body["error"]["message"], e.value.body
    with pytest.raises(anthropic.BadRequestError) as e:
        ac.messages.create(model=MODEL, max_tokens=1, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": 5}}]}])
    assert e.value.body["error"]["message"] == "messages[0].content[0].source.data: must be a base64 string, got int"


@pytest.mark.parametrize("claude_id", ["claude-opus-4-8[1m]", "claude-haiku-4-5-20251001"])
def test_claude_model_ids_are_answered_by_the_served_model(ac, claude_id):
    """Claude Code's own default ids (its main model and the small one for side tasks) reach the served
    model; the reply names the id asked for (Claude Code strips the signed thinking blocks of history
    turns whose ``model`` is another id, and its next tool-loop request is then a 400); the count
    endpoint agrees with the served id's count."""
    msgs = [{"role": "user", "content": "say hi"}]
    m = ac.messages.create(model=claude_id, max_tokens=3, messages=msgs)
    assert m.model == claude_id and m.usage.output_tokens == 3
    assert (ac.messages.count_tokens(model=claude_id, messages=msgs).input_tokens
            == ac.messages.count_tokens(model=MODEL, messages=msgs).input_tokens)
    with ac.messages.stream(model=claude_id, max_tokens=2, messages=msgs) as s:
        final = s.get_final_message()
    assert final.model == claude_id and final.usage.output_tokens == 2
    assert ac.messages.create(model=MODEL, max_tokens=1, messages=msgs).model == MODEL
