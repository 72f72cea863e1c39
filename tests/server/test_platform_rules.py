"""What the renderer accepts (it renders what the official template renders) and the Kimi platform
refuses stays a 400 with the server's message, unchanged: the server parses with ``strict=True``
(PLATFORM_RULES in openk3/chat_format/request.py says why for each case). A tool result whose id
answers no call is refused earlier, by the tool-history check, with the platform's message."""

from __future__ import annotations

import pytest

from openk3.server import ChatServing, ModelInfo
from openk3.server.metrics import Metrics
from openk3.tokenizer import load_tokenizer

U = {"role": "user", "content": "hi"}


def _calls(args="{}"):
    return {"role": "assistant", "content": "", "reasoning_content": "t",
            "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": args}}]}


CASES = {
    "unmatched_tool_call_id": (
        [U, _calls(), {"role": "tool", "tool_call_id": "call_X", "content": "r"}], None,
        "messages[1].tool_calls: tool call id 'call_1' has no tool result message (each tool call must be answered "
        "by a tool message before the next user or assistant message)"),
    "array_arguments": (
        [U, _calls("[1, 2]"), {"role": "tool", "tool_call_id": "call_1", "content": "r"}], None,
        "Invalid request: messages[1].tool_calls[0].function.arguments: must encode a JSON object, got JSON list"),
    "function_role": (
        [U, {"role": "function", "name": "f", "content": "r"}, {"role": "user", "content": "go"}], None,
        "Invalid request: messages[1].role: unknown role 'function' (system, user, assistant, tool, developer)"),
    "input_text_part": (
        [{"role": "user", "content": [{"type": "input_text", "text": "hello"}]}], None,
        "Invalid request: messages[0].content[0].type: unsupported content part type 'input_text' "
        "(text, image_url, image)"),
    "text_part_without_text": (
        [{"role": "user", "content": [{"type": "text"}, {"type": "text", "text": "a"}]}], None,
        "Invalid request: messages[0].content[0].text: text part needs a string 'text'"),
    "json_schema_without_schema": (
        [U], {"type": "json_schema", "json_schema": {"name": "x"}},
        "Invalid request: response_format.json_schema.schema: missing (shape: {'name': ..., 'schema': {...}})"),
    "json_schema_missing": (
        [U], {"type": "json_schema"},
        "Invalid request: response_format.json_schema: required for type 'json_schema' "
        "(shape: {'name': ..., 'schema': {...}})"),
}


@pytest.fixture(scope="module")
def serving():
    return ChatServing(None, load_tokenizer("openk3-tiny"), ModelInfo("kimi-k3", 4096), Metrics())


@pytest.mark.parametrize("case", list(CASES))
def test_platform_refusals_keep_their_status_and_message(serving, case):
    from openk3.server.protocol import APIError

    messages, response_format, message = CASES[case]
    body = {"model": "kimi-k3", "messages": messages}
    if response_format is not None:
        body["response_format"] = response_format
    with pytest.raises(APIError) as e:
        serving.prepare(serving.parse(body))
    assert e.value.status == 400
    assert e.value.message == message
