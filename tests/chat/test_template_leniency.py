"""The renderer renders what the official K3 template renders (k3-chat-format.md §4.1, §4.4-§4.5,
§5.4, §6): its fallbacks, not the platform's refusals. Those are the server's decision, applied
with ``strict=True`` (:data:`openk3.chat_format.request.PLATFORM_RULES`;
tests/server/test_platform_rules.py keeps the server's statuses and messages)."""

from __future__ import annotations

import copy

import pytest

from openk3.chat_format import encode_request, render_template, template_variables
from openk3.chat_format.request import parse_messages, parse_options
from tests.conftest import kimi_tokenizer

U = {"role": "user", "content": "hi"}
U2 = {"role": "user", "content": "go on"}


def _calls(*pairs, args="{}"):
    return {"role": "assistant", "content": "", "reasoning_content": "t",
            "tool_calls": [{"id": i, "type": "function", "function": {"name": n, "arguments": args}} for i, n in pairs]}


def _tool(call_id, text):
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def _result(name, index, text):
    return f'<|open|>message role="tool" tool="{name}" index="{index}"<|sep|>{text}<|close|>message<|sep|><|end_of_msg|>'


# (request, text the template renders into the prompt, the strict (platform) error or None)
CASES = {
    # §4.4 unresolved run: an id matching no call -> the results in their given order, running index,
    # name of the call at that position (the platform refuses such a history in the server).
    "tool_result_id_matches_no_call": (
        {"messages": [U, _calls(("a", "f"), ("b", "g")), _tool("b", "B"), _tool("zzz", "Z")]},
        _result("f", 1, "B") + _result("g", 2, "Z"), None),
    # §6: valid JSON that is not an object stays a string -> a json block.
    "json_array_arguments": (
        {"messages": [U, _calls(("a", "f"), args="[1, 2]"), _tool("a", "r")]},
        '<|open|>call tool="f" index="1"<|sep|><|open|>json type="object"<|sep|>[1, 2]<|close|>json<|sep|>'
        '<|close|>call<|sep|>', r"messages\[1\]\.tool_calls\[0\]\.function\.arguments: must encode a JSON object"),
    # §4.5: no branch for other roles: the message renders nothing.
    "legacy_function_role": (
        {"messages": [U, {"role": "function", "name": "f", "content": "r"}, U2]},
        '<|open|>message role="user"<|sep|>hi<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="user"<|sep|>go on<|close|>message',
        r"messages\[1\]\.role: unknown role 'function'"),
    # §4.1: any part that is not an image renders its text.
    "input_text_part": (
        {"messages": [{"role": "user", "content": [{"type": "input_text", "text": "hello"},
                                                   {"type": "text", "text": " world"}]}]},
        '<|open|>message role="user"<|sep|>hello world<|close|>message',
        r"messages\[0\]\.content\[0\]\.type: unsupported content part type 'input_text'"),
    "part_without_text": (
        {"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "v"}}, {"type": "text"},
                                                   {"type": "text", "text": "a"}]}]},
        '<|open|>message role="user"<|sep|>a<|close|>message', r"messages\[0\]\.content\[0\]\.type"),
    # §5.4: no `schema` key -> the json_schema object itself; no json_schema -> null.
    "json_schema_without_schema": (
        {"messages": [U], "response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": True}}},
        '```json\n{"name":"x","strict":true}\n```', r"response_format\.json_schema\.schema: missing"),
    "json_schema_missing": (
        {"messages": [U], "response_format": {"type": "json_schema"}},
        "```json\nnull\n```", r"response_format\.json_schema: required"),
}


@pytest.fixture(scope="module")
def kimi():
    return kimi_tokenizer()


@pytest.mark.parametrize("case", list(CASES))
def test_renders_what_the_template_renders(kimi, case):
    request, text, _ = CASES[case]
    prompt = encode_request(copy.deepcopy(request), kimi)
    assert text in prompt.text
    assert render_template(template_variables(copy.deepcopy(request))) == prompt.text  # the shipped template agrees


@pytest.mark.parametrize("case", [c for c in CASES if CASES[c][2]])
def test_strict_parsing_refuses_what_the_platform_refuses(case):
    request, _, error = CASES[case]
    with pytest.raises(ValueError, match=error):
        parse_options(request, parse_messages(request, strict=True), strict=True)
    parse_options(request, parse_messages(request))  # lenient: accepted


def test_a_skipped_message_still_ends_a_tool_run(kimi):
    """The template finds a run by the raw previous message's role, so a skipped message between
    two results makes two runs: each resolved on its own, numbered by the running counter."""
    request = {"messages": [U, _calls(("a", "f"), ("b", "g")), _tool("b", "B"),
                            {"role": "function", "name": "g", "content": "x"}, _tool("a", "A")]}
    text = encode_request(request, kimi).text
    assert _result("g", 1, "B") + _result("f", 2, "A") in text
    merged = encode_request({"messages": [U, request["messages"][1], _tool("b", "B"), _tool("a", "A")]}, kimi).text
    assert _result("f", 1, "A") + _result("g", 2, "B") in merged  # one run: call order
    assert render_template(template_variables(copy.deepcopy(request))) == text
