"""K3 renderer (spec k3-chat-format.md §2-§12): the fixture cases exactly, option precedence,
partial prefill, images, markup safety, malformed requests, the training loss mask."""

from __future__ import annotations

import copy
import json
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from openk3.chat_format import (
    OutputParser, encode_request, render_assistant_output, render_template, render_training,
    template_variables,
)
from openk3.chat_format.request import parse_messages, parse_options
from tests.chat.prompt_form import prompt_form
from tests.conftest import kimi_tokenizer, shared_cases, shared_params, shared_path

tok = kimi_tokenizer


def _cases():
    path = shared_path("fixtures", "k3-chat-format", "cases.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


CASES, NO_SHARED = shared_cases(_cases)  # without ../shared the parametrized tests skip with its reason


@pytest.fixture(scope="module")
def kimi():
    return tok()


def _case(case_id):
    return next(c for c in CASES if c["id"] == case_id)


# ----------------------------------------------------------------------------- fixture parity

@pytest.mark.parametrize("case", shared_params(CASES, NO_SHARED, id=lambda c: c["id"]))
def test_fixture_case(kimi, case):
    """The fixture exactly, under the §12 prompt rule (``prompt_form``: 14 of the 56 cases lose an
    empty response channel before a tool call)."""
    p = encode_request(copy.deepcopy(case["request"]), kimi)
    want = prompt_form(case, kimi)
    assert p.text == want["text"]
    assert p.token_ids == want["token_ids"] and p.num_tokens == case["num_tokens"] - 6 * want["removed"]
    assert p.pending_tokens == case["pending_tokens"]
    assert p.prompt_tokens == want["prompt_tokens"]
    assert p.image_slots == case["image_slots"]
    assert all(p.token_ids[i] == kimi.media_pad_id for i in p.image_slots)
    stub = case["generation_stub"]
    assert (p.channel if p.pending_tokens else None) == (None if stub is None else stub[8:-7])
    if case["image_slots"]:
        assert p.prompt_tokens_excluding_images == case["prompt_tokens_excluding_images"]
    else:
        # Every markup id in the prompt corresponds to a markup spelling; user text contributes none.
        assert kimi.decode(p.token_ids) == p.text


def test_fixture_file_present():
    assert len(_cases()) == 56
    assert sum(prompt_form(c, tok())["removed"] > 0 for c in CASES) == 14


def test_kvv_anchors(kimi):
    """Spec §12: the prompt rule (no empty response channel beside a tool call in history) gives
    both Moonshot counts: the verifier README's example 99 (its history message has content, so its
    empty think channel counts) and the verifier's groundtruth payload 539 (the template rendering
    counts 545), also with ``reasoning_content: ""`` on its tool-call turn, as preserved thinking
    requires. Both requests come from the shared fixtures."""
    assert encode_request(_case("assistant_only_hello")["request"], kimi).prompt_tokens == 99
    req = copy.deepcopy(_case("kvv_groundtruth_539")["request"])
    assert encode_request(req, kimi).prompt_tokens == 539
    call_turn = next(m for m in req["messages"] if m.get("tool_calls"))
    call_turn["reasoning_content"] = ""
    assert encode_request(req, kimi).prompt_tokens == 539
    # training keeps the channel the model generates: six ids more than the prompt
    assert len(render_training(req, kimi).token_ids) == len(encode_request(req, kimi,
                                                                          add_generation_prompt=False).token_ids) + 6


# ----------------------------------------------------------------------------- options

def _effort_line(p):
    marker = "Now the system is invoked with `thinking_effort="
    return p.text.split(marker)[1].split("`")[0] if marker in p.text else None


@pytest.mark.parametrize("extra, thinking, effort", [
    ({}, True, "max"),
    ({"reasoning_effort": "low"}, True, "low"),
    ({"reasoning_effort": "low", "thinking": {"type": "enabled", "effort": "high"}}, True, "high"),
    ({"thinking": {"effort": "high"}, "chat_template_kwargs": {"thinking_effort": "medium"}}, True, "medium"),
    ({"reasoning_effort": "none"}, False, None),
    ({"thinking": {"type": "disabled"}, "reasoning_effort": "high"}, False, None),
    ({"chat_template_kwargs": {"thinking": False}}, False, None),
])
def test_thinking_and_effort_precedence(kimi, extra, thinking, effort):
    p = encode_request({"messages": [{"role": "user", "content": "hi"}], **extra}, kimi)
    assert p.thinking is thinking and p.thinking_effort == effort and _effort_line(p) == effort
    assert p.channel == ("think" if thinking else "response")
    assert p.token_ids[-3:] == [kimi.open_id, kimi.encode_text("think" if thinking else "response")[0], kimi.sep_id]


def test_named_tool_choice_renders_as_absent(kimi):
    """The platform ignores the named form (§9): the prompt is the one without tool_choice."""
    named = {"messages": [_U], "tools": _TOOLS, "tool_choice": {"type": "function", "function": {"name": "f"}}}
    plain = {"messages": [_U], "tools": _TOOLS}
    assert encode_request(named, kimi).token_ids == encode_request(plain, kimi).token_ids
    assert render_template(template_variables(named)) == encode_request(plain, kimi).text


def test_tool_choice_needs_a_tool(kimi):
    """§9: none/required render only with a declared tool (request-level or dynamic)."""
    msgs = [{"role": "user", "content": "hi"}]
    assert "tool-choice" not in encode_request({"messages": msgs, "tool_choice": "none"}, kimi).text
    dyn = [{"role": "system", "content": "", "tools": [{"type": "function", "function": {"name": "f"}}]}] + msgs
    p = encode_request({"messages": dyn, "tool_choice": "none"}, kimi)
    assert "MUST NOT call any tools" in p.text and p.tool_choice == "none" and p.tool_names == ("f",)


def test_canonical_json_key_order(kimi):
    """§7: code-point key order at every depth (uppercase first, `maxItems` before `maximum`)."""
    params = {"type": "object", "properties": {"alpha": {"maximum": 3, "maxItems": 2}, "Zeta": {}}}
    p = encode_request({"messages": [{"role": "user", "content": "x"}],
                        "tools": [{"type": "function", "function": {"name": "f", "parameters": params}}]}, kimi)
    assert '"properties":{"Zeta":{},"alpha":{"maxItems":2,"maximum":3}}' in p.text


def test_arguments_string_and_object_render_identically(kimi):
    def req(args):
        return {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": args}}]}]}
    obj = {"b": [1, {"z": None}], "a": "line\n\"q\"", "n": -0.5, "t": True}
    a = encode_request(req(json.dumps(obj)), kimi)
    assert a.token_ids == encode_request(req(obj), kimi).token_ids
    assert ('<|open|>argument key="b" type="array"<|sep|>[1, {"z": null}]<|close|>argument<|sep|>'
            '<|open|>argument key="a" type="string"<|sep|>line\n"q"<|close|>argument<|sep|>'
            '<|open|>argument key="n" type="number"<|sep|>-0.5<|close|>argument<|sep|>'
            '<|open|>argument key="t" type="boolean"<|sep|>true<|close|>argument<|sep|>') in a.text
    for empty in ("", "  ", "{}", None):
        assert '<|open|>call tool="f" index="1"<|sep|><|close|>call<|sep|>' in encode_request(req(empty), kimi).text


# ----------------------------------------------------------------------------- partial prefill, images

def test_partial_variants(kimi):
    base = [{"role": "user", "content": "go"}]
    think = encode_request({"messages": base + [
        {"role": "assistant", "content": "", "reasoning_content": "Step 1", "partial": True}]}, kimi)
    assert think.text.endswith('<|open|>message role="assistant"<|sep|><|open|>think<|sep|>Step 1')
    assert think.channel == "think" and think.pending_tokens == 0 and think.prompt_tokens == think.num_tokens
    named = encode_request({"messages": base + [
        {"role": "assistant", "name": "Dr. K", "content": "", "partial": True}]}, kimi)
    assert named.text.endswith('<|open|>message role="assistant" name="Dr. K"<|sep|><|open|>think<|sep|>')
    assert named.pending_tokens == 3 and named.prompt_tokens == named.num_tokens - 3 and named.partial
    with pytest.raises(ValueError, match=r"messages\[1\]\.tool_calls"):
        encode_request({"messages": base + [{"role": "assistant", "partial": True, "tool_calls": [
            {"id": "a", "function": {"name": "f", "arguments": "{}"}}]}]}, kimi)


def test_images(kimi):
    parts = [{"type": "image_url", "image_url": {"url": "data:a"}}, {"type": "text", "text": "and"},
             {"type": "image", "image": "data:b"}]
    p = encode_request({"messages": [{"role": "user", "content": parts}]}, kimi)
    assert len(p.image_slots) == 2 and [p.token_ids[i] for i in p.image_slots] == [kimi.media_pad_id] * 2
    assert p.images == [parts[0], parts[2]] and p.prompt_tokens is None
    assert p.text.count("<|kimi_image_placeholder|>") == 2
    assert p.prompt_tokens_with_images([10, 20]) == p.num_tokens - 3 - 2 + 30
    with pytest.raises(ValueError, match="image_tokens"):
        p.prompt_tokens_with_images([10])


# ----------------------------------------------------------------------------- markup safety

_MARKUPISH = ["<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>", "<|media_pad|>", '"', "&", "&quot;"]
_hostile = st.lists(st.text(max_size=20) | st.sampled_from(_MARKUPISH), max_size=6).map("".join)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_hostile)
def test_property_user_text_never_adds_markup(text):
    """Wherever client text goes (content, name, reasoning, argument key and value, tool result),
    the markup ids are the same as for a neutral text: text can never produce a special id."""
    def req(t):
        return {"messages": [
            {"role": "user", "name": t or "n", "content": t},
            {"role": "assistant", "content": t, "reasoning_content": t, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {t: t, "k": [t]}}}]},
            {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": t}]}]}
    k = tok()
    marks = [i for i in encode_request(req(text), k).token_ids if i in k.special_ids]
    neutral = "x" if text else ""  # empty content beside a tool call has no response channel (§12)
    assert marks == [i for i in encode_request(req(neutral), k).token_ids if i in k.special_ids]


# ----------------------------------------------------------------------------- malformed requests

_TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
_CALL = {"role": "assistant", "content": "", "tool_calls": [{"id": "a", "type": "function",
                                                           "function": {"name": "f", "arguments": "{}"}}]}
_U = {"role": "user", "content": "hi"}


def _with_args(args, **call_fields):
    return {"messages": [_U, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": args}, **call_fields}]}]}


def _rf(json_schema):
    return {"messages": [_U], "response_format": {"type": "json_schema", "json_schema": json_schema}}


def _tool(function):
    return {"type": "function", "function": function}


_A = r"messages\[1\]\.tool_calls\[0\]\.function\.arguments"
_PARTIAL = {"role": "assistant", "content": "x", "partial": True}

# Requests the template renders and the platform refuses: the renderer follows the template
# (tests/chat/test_template_leniency.py), the server parses with strict=True and answers 400.
PLATFORM_ONLY = [
    ({"messages": [_U, {"role": "wizard", "content": "x"}]}, r"messages\[1\]\.role.*wizard"),
    ({"messages": [_U, {"role": "assistant", "tool_calls": [{"id": "a", "function": {"name": "f",
                                                                                    "arguments": "[1]"}}]}]},
     r"messages\[1\]\.tool_calls\[0\]\.function\.arguments"),
    ({"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": "v"}]}]},
     r"messages\[0\]\.content\[0\]\.type"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, r"messages\[0\]\.content\[0\]\.text"),
    ({"messages": [_U], "response_format": {"type": "json_schema"}}, r"^response_format\.json_schema: required"),
    (_rf(None), r"^response_format\.json_schema: required"),
    (_rf("{}"), r"^response_format\.json_schema: must be an object"),
    (_rf({"name": "w", "strict": True}), r"^response_format\.json_schema\.schema: missing"),
    (_rf({}), r"^response_format\.json_schema\.schema: missing"),
    (_rf({"name": "w", "schema": None}), r"^response_format\.json_schema\.schema: the schema must be a JSON object"),
    (_rf({"name": "w", "schema": True}), r"^response_format\.json_schema\.schema: .*JSON object"),
    (_rf({"name": "w", "schema": "{}"}), r"^response_format\.json_schema\.schema: .*JSON object"),
    (_rf({"json_schema": [1]}), r"^response_format\.json_schema\.json_schema: .*JSON object"),
]

def _cyclic() -> dict:
    d: dict = {"a": 1}
    d["self"] = d
    return d


def _deep(levels: int) -> dict:
    d: dict = {}
    for _ in range(levels - 1):  # far beyond the recursion limit: the check itself must not recurse
        d = {"k": d}
    return d


MALFORMED = [
    ({"messages": [_U, {"role": "tool", "content": "r"}]}, r"messages\[1\]\.tool_call_id"),
    ({"messages": [{"content": "x"}]}, r"messages\[0\]\.role"),
    ({"messages": [_U, {"role": "assistant", "tool_calls": [{"id": "a", "function": {"arguments": "{}"}}]}]},
     r"messages\[1\]\.tool_calls\[0\]\.function\.name"),
    ({"messages": [_U, {"role": "assistant", "tool_calls": [{"id": "a", "function": {"name": "f", "arguments": 5}}]}]},
     r"messages\[1\]\.tool_calls\[0\]\.function\.arguments"),
    ({"messages": [_U, {"role": "assistant", "tool_calls": {"id": "a"}}]}, r"messages\[1\]\.tool_calls"),
    ({"messages": [_U], "reasoning_effort": "extreme"}, r"reasoning_effort.*extreme"),
    ({"messages": [_U], "thinking": {"effort": "huge"}}, r"thinking\.effort.*huge"),
    ({"messages": [_U], "thinking": True}, r"^thinking"),
    ({"messages": [_U], "thinking": {"type": "sometimes"}}, r"thinking\.type"),
    ({"messages": [_U], "tool_choice": "always"}, r"tool_choice.*always"),
    ({"messages": [_U], "response_format": {"type": "yaml"}}, r"response_format\.type"),
    ({"messages": [_U], "tools": _TOOLS + _TOOLS}, r"tools.*duplicate"),
    ({"messages": [_U], "tools": {"f": 1}}, r"^tools"),
    ({"messages": [{"role": "user", "content": 7}]}, r"messages\[0\]\.content"),
    ({"messages": [{"role": "user", "name": 3, "content": "x"}]}, r"messages\[0\]\.name"),
    ({"messages": [_U, {"role": "assistant", "content": "", "reasoning_content": ["x"]}]},
     r"messages\[1\]\.reasoning_content"),
    ({"messages": ["hello"]}, r"messages\[0\]"),
    ({"messages": []}, r"^messages"),
    ({}, r"^messages"),
    # wrong container types at every level
    ([_U], r"^request: must be a JSON object"),
    ("hi", r"^request: must be a JSON object"),
    ({"messages": _U}, r"^messages: must be a non-empty list"),
    ({"messages": [_U, {"role": "assistant", "tool_calls": ["f"]}]}, r"messages\[1\]\.tool_calls\[0\]: tool call"),
    ({"messages": [_U, {"role": "assistant", "tool_calls": [{"id": "a", "function": "f"}]}]},
     r"messages\[1\]\.tool_calls\[0\]\.function: must be an object"),
    (_with_args("{}", id=["a"]), r"messages\[1\]\.tool_calls\[0\]\.id"),
    ({"messages": [_U, _CALL, {"role": "tool", "tool_call_id": {"id": "a"}, "content": "r"}]},
     r"messages\[2\]\.tool_call_id"),
    ({"messages": [_U, {"role": "tool", "tool": 7, "content": "r"}]}, r"messages\[1\]\.tool\b"),
    ({"messages": [_U, {"role": "assistant", "content": "", "reasoning_content": 0, "reasoning": "r"}]},
     r"messages\[1\]\.reasoning_content"),
    ({"messages": [_U, {"role": "assistant", "content": "", "reasoning": 5}]}, r"messages\[1\]\.reasoning\b"),
    ({"messages": [_U, {"role": "assistant", "content": {"text": "x"}}]}, r"messages\[1\]\.content"),
    ({"messages": [{"role": "user", "content": ["x"]}]}, r"messages\[0\]\.content\[0\]"),
    ({"messages": [_U], "tools": [_tool({"name": "f"}), "g"]}, r"^tools\[1\]: must be an object"),
    ({"messages": [_U], "tools": [{"type": "function", "function": "f"}]}, r"^tools\[0\]\.function: must be"),
    ({"messages": [_U], "chat_template_kwargs": ["thinking"]}, r"^chat_template_kwargs"),
    ({"messages": [_U], "response_format": "json_object"}, r"^response_format: must be an object"),
    # arguments objects holding non-JSON data (Python callers: training data)
    (_with_args({"s": {1, 2}}), _A + r'\["s"\]: set'),
    (_with_args({"x": [1, float("nan")]}), _A + r'\["x"\]\[1\]: nan'),
    (_with_args({"x": {"y": float("inf")}}), _A + r'\["x"\]\["y"\]: inf'),
    (_with_args({1: "one"}), _A + r": object key 1"),
    (_with_args({"x": {(1, 2): "pair"}}), _A + r'\["x"\]: object key \(1, 2\)'),
    (_with_args({"x": object()}), _A + r'\["x"\]: object'),
    (_with_args(_cyclic()), _A + r'\["self"\]: not JSON data \(Circular reference detected\)'),
    (_with_args(_deep(10_000)), _A + r": not JSON data \(nested more than 500 levels deep\)"),
    # partial: a JSON boolean, true only on the final message, which is an assistant message
    ({"messages": [_U, {"role": "assistant", "content": "x", "partial": "false"}]},
     r"messages\[1\]\.partial: must be a boolean"),
    ({"messages": [_U, {"role": "assistant", "content": "x", "partial": 1}]}, r"messages\[1\]\.partial"),
    ({"messages": [_U, _PARTIAL, _U]}, r"messages\[1\]\.partial: only the final message"),
    ({"messages": [{"role": "user", "content": "x", "partial": True}]}, r"messages\[0\]\.partial: .*user"),
    ({"messages": [{"role": "system", "content": "s", "partial": True}, _U]}, r"messages\[0\]\.partial"),
    ({"messages": [_U, _CALL, {"role": "tool", "tool_call_id": "a", "content": "r", "partial": True}]},
     r"messages\[2\]\.partial"),
    # a schema must be JSON data (it is rendered as canonical JSON)
    (_rf({"schema": {"maximum": float("nan")}}), r'^response_format\.json_schema\.schema\["maximum"\]: nan'),
    # tools need a non-empty string name; request-level and dynamic declarations alike
    ({"messages": [_U], "tools": [_tool({"parameters": {}})]}, r"^tools\[0\]\.function\.name"),
    ({"messages": [_U], "tools": [_tool({"name": "f"}), _tool({"name": 5})]}, r"^tools\[1\]\.function\.name.*5"),
    ({"messages": [_U], "tools": [_tool({"name": ""})]}, r"^tools\[0\]\.function\.name"),
    ({"messages": [_U], "tools": [{"type": "function", "name": None}]}, r"^tools\[0\]\.name"),
    ({"messages": [_U], "tools": [_tool({"name": "f", "parameters": {"enum": {1}}})]},
     r'^tools\[0\]\["function"\]\["parameters"\]\["enum"\]: set'),
    ({"messages": [{"role": "system", "tools": [_tool({"name": 5})]}, _U]},
     r"messages\[0\]\.tools\[0\]\.function\.name"),
    ({"messages": [{"role": "system", "tools": [_tool({"description": "d"})]}, _U]},
     r"messages\[0\]\.tools\[0\]\.function\.name"),
    ({"messages": [{"role": "system", "tools": "f"}, _U]}, r"messages\[0\]\.tools: must be a list"),
    ({"messages": [{"role": "system", "tools": [7]}, _U]}, r"messages\[0\]\.tools\[0\]: must be an object"),
]


@pytest.mark.parametrize("request_, field", MALFORMED)
def test_malformed_requests(kimi, request_, field):
    with pytest.raises(ValueError, match=field):
        encode_request(request_, kimi)


@pytest.mark.parametrize("request_, field", MALFORMED)
def test_malformed_requests_template_path(request_, field):
    """The template path rejects every malformed request: ``template_variables`` with the renderer's
    checks and field names, except tool-result resolution, which the template itself checks."""
    try:
        variables = template_variables(request_)
    except ValueError as e:
        assert re.search(field, str(e)), str(e)
        return
    assert field.endswith(r"\.tool_call_id")
    with pytest.raises(ValueError, match="chat template: tool result"):
        render_template(variables)


def test_a_value_shared_twice_is_json_data(kimi):
    """The same object twice in one argument value (not a cycle) is ordinary JSON data."""
    shared = {"city": "Paris"}
    twice = encode_request(_with_args({"a": shared, "b": [shared, shared]}), kimi)
    copies = encode_request(_with_args({"a": dict(shared), "b": [dict(shared), dict(shared)]}), kimi)
    assert twice.token_ids == copies.token_ids


@pytest.mark.parametrize("request_, field", PLATFORM_ONLY)
def test_platform_only_refusals(kimi, request_, field):
    """Rendered as the template renders them (the shipped template agrees), refused under strict=True."""
    prompt = encode_request(copy.deepcopy(request_), kimi)
    assert render_template(template_variables(copy.deepcopy(request_))) == prompt.text
    with pytest.raises(ValueError, match=field):
        parse_options(request_, parse_messages(request_, strict=True), strict=True)


def test_partial_false_and_null_are_plain_messages(kimi):
    """``partial: false`` / ``null`` anywhere is the same as no ``partial`` key."""
    history = {"role": "assistant", "content": "x"}
    plain = encode_request({"messages": [_U, history, _U]}, kimi)
    for value in (False, None):
        msgs = [dict(_U, partial=value), dict(history, partial=value), dict(_U, partial=value)]
        assert encode_request({"messages": msgs}, kimi).token_ids == plain.token_ids
    last = encode_request({"messages": [_U, dict(history, partial=False)]}, kimi)
    assert not last.partial and last.pending_tokens == 3 and last.channel == "think"


def test_json_schema_forms(kimi):
    """§5.4 lookup order: ``json_schema.schema``, then ``json_schema.json_schema``, then the wrapper
    itself when it is the schema; all three render the same schema text."""
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    texts = {encode_request(_rf(w), kimi).text for w in
             ({"name": "n", "strict": True, "schema": schema}, {"json_schema": schema}, schema)}
    assert len(texts) == 1
    assert '```json\n{"properties":{"a":{"type":"string"}},"type":"object"}\n```' in texts.pop()


@pytest.mark.parametrize("raw", ['{"a": NaN}', '{"a": -Infinity, "b": 1}', '{"a": 1e400}'])
def test_non_standard_json_arguments_are_a_raw_block(kimi, raw):
    """NaN / Infinity / overflowing numbers are not JSON (§6 "does not parse as JSON"): the string is
    rendered verbatim as a json block, never as a ``number`` argument, and the parser reads such a
    block back to the same arguments string, so the model's own output replays unchanged."""
    p = encode_request(_with_args(raw), kimi)
    assert f'<|open|>json type="object"<|sep|>{raw}<|close|>json<|sep|>' in p.text
    assert 'type="number"' not in p.text
    msg = {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": raw}}]}
    parser = OutputParser(kimi)
    parser.feed(render_assistant_output(msg, kimi))
    parser.finish()
    assert [c["function"]["arguments"] for c in parser.message().tool_calls] == [raw]


# ----------------------------------------------------------------------------- training and output

def _reference_mask(tk, ids):
    """Independent scan: after each assistant message opening (a tag that decodes to
    `message role="assistant"...`) and its 3-id channel stub, mark through the next <|end_of_msg|>."""
    mask, i = [0] * len(ids), 0
    while i < len(ids):
        if ids[i] == tk.open_id:
            j = ids.index(tk.sep_id, i)
            if tk.decode(ids[i + 1:j]).startswith('message role="assistant"'):
                assert ids[j + 1] == tk.open_id and ids[j + 3] == tk.sep_id
                end = ids.index(tk.end_of_msg_id, j + 4)
                mask[j + 4:end + 1] = [1] * (end - j - 3)
                i = end
        i += 1
    return mask


TRAIN_CASES = [c for c in CASES if c["server_convention"] is None]


@pytest.mark.parametrize("case", shared_params(TRAIN_CASES, NO_SHARED, id=lambda c: c["id"]))
def test_training_mask(kimi, case):
    req = copy.deepcopy(case["request"])
    ex = render_training(req, kimi)
    assert ex.token_ids == case["token_ids"][:-10]  # minus the assistant opening (7) and the stub (3)
    # the prompt differs only by the §12 rule (the empty response channel beside a tool call)
    want = prompt_form(dict(case, token_ids=ex.token_ids, rendered_text=ex.text), kimi)
    assert encode_request(req, kimi, add_generation_prompt=False).token_ids == want["token_ids"]
    assert ex.loss_mask == _reference_mask(kimi, ex.token_ids)
    # Each masked span is exactly what the model generates for that assistant message.
    thinking = encode_request(req, kimi).thinking
    spans, start = [], None
    for i, m in enumerate(ex.loss_mask + [0]):
        if m and start is None:
            start = i
        if not m and start is not None:
            spans.append(ex.token_ids[start:i])
            start = None
    assistants = [m for m in req["messages"] if m["role"] == "assistant"]
    assert spans == [render_assistant_output(m, kimi, thinking=thinking) for m in assistants]
    last = render_training(req, kimi, train_on="last").loss_mask
    assert sum(last) == (len(spans[-1]) if spans else 0) and all(a >= b for a, b in zip(ex.loss_mask, last))


def test_training_rejects(kimi):
    with pytest.raises(ValueError, match="train_on"):
        render_training([_U], kimi, train_on="first")
    with pytest.raises(ValueError, match=r"messages\[1\]\.partial"):
        render_training([_U, {"role": "assistant", "content": "x", "partial": True}], kimi)


def test_render_assistant_output_shape(kimi):
    msg = {"role": "assistant", "reasoning_content": "r", "content": "c", "tool_calls": [
        {"id": "x", "type": "function", "function": {"name": "a.b-c_d", "arguments": '{"k": 1}'}}]}
    on = render_assistant_output(msg, kimi)
    off = render_assistant_output(msg, kimi, thinking=False)
    assert kimi.decode(on) == ('r<|close|>think<|sep|><|open|>response<|sep|>c<|close|>response<|sep|>'
                               '<|open|>tools<|sep|><|open|>call tool="a.b-c_d" index="1"<|sep|>'
                               '<|open|>argument key="k" type="number"<|sep|>1<|close|>argument<|sep|>'
                               '<|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>')
    assert kimi.decode(off) == kimi.decode(on).split("<|open|>response<|sep|>", 1)[1]
    with pytest.raises(ValueError, match=r"message\.role"):
        render_assistant_output({"role": "user", "content": "x"}, kimi)
    with pytest.raises(ValueError, match=r"message\.tool_calls\[0\]\.function\.name"):
        render_assistant_output({"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}, kimi)
