"""Constrained decoding (issue 4 item 6): llguidance masks over the whole K3 output.

Outputs are produced by a "random model": at every step a token drawn uniformly (seeded) from the
constraint's mask, so every corner the grammar allows is eventually exercised. Each output is then
judged by independent code: the chat-format ``OutputParser`` (it must parse cleanly, with the
message ended), ``jsonschema`` (response content and tool arguments, numbers parsed as exact
decimals), and the renderer (``render_assistant_output`` of the parsed message must be accepted
again: the grammar admits the canonical form of everything it generates). A tiny random openk3
model with the full Kimi vocabulary drives the same checks through real logits.
"""

from __future__ import annotations

import json
from decimal import Decimal

import jsonschema
import numpy as np
import pytest
import torch

from openk3.chat_format import OutputParser, render_assistant_output
from openk3.engine.constraints import GrammarConstraint, check_json_schema, ll_tokenizer, make_constraint
from openk3.tokenizer import K3_SPECIAL_TOKENS, Tokenizer, load_tokenizer
from tests.conftest import shared_path

WS = r"[ \n]{1,2}"  # bounded JSON whitespace keeps random outputs short


@pytest.fixture(scope="module")
def kimi() -> Tokenizer:
    return load_tokenizer(shared_path("kimi-tokenizer"))


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Tokenizer:
    """A small byte-level BPE carrying the K3 special strings at its own ids."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    bpe = HFTokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=list(K3_SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(['{"name": "x", "id": 12, "tags": ["a", "b"]} weather city 你好'] * 30, trainer)
    d = tmp_path_factory.mktemp("bpe")
    Tokenizer.from_bpe(bpe).save_pretrained(d)
    return load_tokenizer(d)


# ----------------------------------------------------------------------------- helpers

def sample_uniform(c: GrammarConstraint, seed: int, cap: int = 4000, prefer: np.ndarray | None = None) -> list[int]:
    """Random model: a uniform draw from the mask at every step until the grammar is finished.

    With `prefer` (bool [V]) the draw is from mask & prefer whenever that is non-empty.
    """
    rng = np.random.default_rng(seed)
    ids: list[int] = []
    while not c.is_finished() and len(ids) < cap:
        mask = c.allowed_tokens().numpy()
        allowed = np.flatnonzero(mask)
        assert allowed.size, f"empty mask after {len(ids)} tokens: {c.error()}"
        if prefer is not None and (mask & prefer).any():
            allowed = np.flatnonzero(mask & prefer)
        tid = int(allowed[rng.integers(allowed.size)])
        assert c.accept(tid)
        ids.append(tid)
    return ids


def parse(tok, ids: list[int], thinking: bool, tools_enabled: bool = True):
    p = OutputParser(tok, start_channel="think" if thinking else "response", tools_enabled=tools_enabled)
    p.feed(ids)
    p.finish()
    return p.message()


def replay(c: GrammarConstraint, ids: list[int]) -> tuple[int, bool]:
    """(number of ids accepted before the first rejection, finished)."""
    for n, tid in enumerate(ids):
        if not c.accept(tid):
            return n, False
    return len(ids), c.is_finished()


def exact(text: str):
    return json.loads(text, parse_float=Decimal)


def assert_canonical_accepted(tok, make, msg, thinking: bool) -> None:
    """The renderer's ids for the parsed message are accepted by a fresh constraint and finish it."""
    ids = render_assistant_output(msg.to_openai(), tok, thinking=thinking)
    n, done = replay(make(), ids)
    assert (n, done) == (len(ids), True), f"canonical rendering rejected at {n}: {tok.decode(ids[max(0, n - 8):n + 1])!r}"


# ----------------------------------------------------------------------------- JSON Schema

SCHEMAS = {
    "nested": {"type": "object", "additionalProperties": False, "required": ["user", "active"], "properties": {
        "user": {"type": "object", "additionalProperties": False, "required": ["name", "id"], "properties": {
            "name": {"type": "string", "maxLength": 6}, "id": {"type": "integer", "minimum": 1, "maximum": 999},
            "email": {"type": "string", "maxLength": 4}}},
        "active": {"type": "boolean"}}},
    "arrays": {"type": "object", "additionalProperties": False, "required": ["xs"], "properties": {
        "xs": {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 1, "maxItems": 4},
        "pairs": {"type": "array", "maxItems": 2, "items": {
            "type": "array", "prefixItems": [{"type": "string", "maxLength": 2}, {"type": "boolean"}], "items": False,
            "minItems": 2}}}},
    "enums": {"type": "object", "additionalProperties": False, "required": ["color", "size", "kind"], "properties": {
        "color": {"enum": ["red", "green", "blue"]}, "size": {"enum": [1, 2.5, "XL", None]}, "kind": {"const": "fixed"},
        "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"}}},
    "anyof": {"type": "object", "additionalProperties": False, "required": ["v", "w"], "properties": {
        "v": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "string", "maxLength": 3},
                        {"type": "null"}]},
        "w": {"anyOf": [{"type": "object", "additionalProperties": False, "required": ["k"],
                         "properties": {"k": {"type": "boolean"}}}, {"type": "array", "maxItems": 2,
                                                                   "items": {"type": "null"}}]}}},
    "refs": {"$defs": {
        "pt": {"type": "object", "additionalProperties": False, "required": ["x", "y"],
               "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 99},
                              "y": {"type": "integer", "minimum": 0, "maximum": 99}}},
        "node": {"type": "object", "additionalProperties": False, "required": ["v"],
                 "properties": {"v": {"$ref": "#/$defs/pt"}, "next": {"$ref": "#/$defs/node"}}}},
        "type": "object", "additionalProperties": False, "required": ["a", "chain"],
        "properties": {"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}, "chain": {"$ref": "#/$defs/node"}}},
    "numbers": {"type": "object", "additionalProperties": False, "required": ["p", "t", "n"], "properties": {
        "p": {"type": "number", "minimum": 0, "maximum": 1},
        "t": {"type": "number", "exclusiveMinimum": -10, "exclusiveMaximum": 10},
        "n": {"type": "integer", "minimum": 100, "maximum": 200},
        "m": {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 50}}},
}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_random_outputs_validate(kimi, name):
    """Issue 4 acceptance: 100% of random-model outputs under a JSON Schema validate."""
    schema = SCHEMAS[name]
    for seed in range(4):
        thinking = seed % 2 == 0
        make = lambda: make_constraint(kimi, "json_schema", schema, thinking=thinking,  # noqa: E731
                                       think_max_chars=12, json_whitespace=WS)
        ids = sample_uniform(make(), seed)
        msg = parse(kimi, ids, thinking)
        assert msg.ended and msg.tool_calls == [] and msg.finish_reason == "stop", kimi.decode(ids)
        assert (msg.reasoning_content is not None) == thinking
        jsonschema.validate(exact(msg.content), schema)
        assert_canonical_accepted(kimi, make, msg, thinking)


def test_json_object_random_outputs_are_objects(kimi):
    """json_object: any JSON object. Uniform draws over the whole vocabulary make free strings
    endless, so this random model speaks the single-byte ASCII tokens (still only from the mask)."""
    ascii1 = np.array([i < 163584 and len(kimi.decode_bytes([i])) == 1 and kimi.decode_bytes([i])[0] < 128
                       for i in range(kimi.vocab_size)])
    with_keys = 0
    for seed in range(12):
        c = make_constraint(kimi, "json_object", thinking=seed % 2 == 0, think_max_chars=4, json_whitespace=WS)
        ids = sample_uniform(c, seed, prefer=ascii1)
        msg = parse(kimi, ids, thinking=seed % 2 == 0)
        assert c.is_finished() and msg.ended
        obj = json.loads(msg.content)
        assert isinstance(obj, dict)
        with_keys += bool(obj)
    assert with_keys >= 2


def test_json_constraint_rejects_invalid_content(kimi):
    schema = SCHEMAS["nested"]

    def run(content: str, kind="json_schema") -> bool:
        c = make_constraint(kimi, kind, schema if kind == "json_schema" else None, thinking=True)
        ids = render_assistant_output({"role": "assistant", "reasoning_content": "ok", "content": content}, kimi)
        n, done = replay(c, ids)
        return n == len(ids) and done

    assert run('{"user": {"name": "ann", "id": 7}, "active": true}')
    assert run('{"user":{"name":"ann","id":7,"email":"a@b"},"active":false}')
    assert not run('{"user": {"name": "ann", "id": 0}, "active": true}')       # below minimum
    assert not run('{"user": {"name": "annabella", "id": 7}, "active": true}')  # maxLength
    assert not run('{"user": {"name": "ann"}, "active": true}')                 # required id
    assert not run('{"user": {"name": "ann", "id": 7}, "active": true, "x": 1}')  # additionalProperties
    assert not run('{"user": {"name": "ann", "id": 7}, "active": true} trailing')
    assert run('{"a": [1, {"b": null}]}', "json_object")
    assert not run("[1, 2]", "json_object") and not run('"text"', "json_object")


# ----------------------------------------------------------------------------- tool calls

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city.", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["city", "unit"], "properties": {
            "city": {"type": "string", "maxLength": 6},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
            "day": {"type": "string", "format": "date"},
            "when": {"anyOf": [{"type": "null"}, {"type": "number", "minimum": 0, "maximum": 1},
                               {"type": "string", "pattern": "^[a-z]{1,3}$"}]}}}}},
    {"type": "function", "function": {"name": "search", "parameters": {
        "$defs": {"filter": {"type": "object", "additionalProperties": False, "required": ["site"],
                             "properties": {"site": {"enum": ["docs", "web"]}, "recent": {"type": "boolean"}}}},
        "type": "object", "additionalProperties": False, "required": ["q"], "properties": {
            "q": {"type": "string", "minLength": 1, "maxLength": 5},
            "filter": {"$ref": "#/$defs/filter"},
            "ids": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3}}}}},
    {"type": "function", "function": {"name": "ping"}},
]
TOOL_SCHEMAS = {t["function"]["name"]: t["function"].get("parameters", {"type": "object", "properties": {},
                                                                        "additionalProperties": False})
                for t in TOOLS}


@pytest.mark.parametrize("tool_choice", ["required", "auto", "none"])
def test_tool_calls_random_outputs(kimi, tool_choice):
    """Random outputs parse, call only declared tools, and their arguments validate; ``required``
    yields >= 1 call, ``none`` never a tools channel."""
    make = lambda: make_constraint(kimi, "text", tools=TOOLS, tool_choice=tool_choice,  # noqa: E731
                                   think_max_chars=8, text_max_chars=8, json_whitespace=WS)
    n_calls, no_calls, seen_forms = 0, 0, set()
    for seed in range(8):
        ids = sample_uniform(make(), seed)
        msg = parse(kimi, ids, thinking=True)
        assert msg.ended, kimi.decode(ids)
        if tool_choice == "none":
            assert b"<|open|>tools" not in kimi.decode_bytes(ids)  # not even a call the parser would drop
            assert msg.finish_reason == "stop"
        if tool_choice == "required":
            assert msg.tool_calls and msg.finish_reason == "tool_calls"
        for call in msg.tool_calls:
            name = call["function"]["name"]
            jsonschema.validate(exact(call["function"]["arguments"]), TOOL_SCHEMAS[name])
        text = kimi.decode(ids)
        seen_forms |= {f for f in ("argument key=", "json type=") if f in text}
        n_calls += len(msg.tool_calls)
        no_calls += not msg.tool_calls
        assert_canonical_accepted(kimi, make, msg, thinking=True)
    if tool_choice == "required":
        assert n_calls >= 8 and seen_forms == {"argument key=", "json type="}
    if tool_choice == "auto":
        assert n_calls >= 1 and no_calls >= 1


def test_tool_calls_with_json_response_format(kimi):
    """A JSON response format plus tools: either a JSON answer, or calls with an empty response."""
    schema = {"type": "object", "additionalProperties": False, "required": ["ok"], "properties": {"ok": {"type": "boolean"}}}
    kinds = set()
    for seed in range(6):
        c = make_constraint(kimi, "json_schema", schema, tools=TOOLS, tool_choice="auto", thinking=False,
                            json_whitespace=WS)
        msg = parse(kimi, sample_uniform(c, seed), thinking=False)
        assert msg.ended
        if msg.tool_calls:
            assert msg.content is None
            kinds.add("calls")
        else:
            jsonschema.validate(json.loads(msg.content), schema)
            kinds.add("json")
    assert kinds == {"calls", "json"}


def _weather_msg(args: str, name: str = "get_weather", content: str = "") -> dict:
    return {"role": "assistant", "reasoning_content": "Need the weather.", "content": content,
            "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": name, "arguments": args}}]}


def test_canonical_tool_messages_accepted_and_violations_rejected(kimi):
    def ok(message: dict, tool_choice="required", tools=TOOLS) -> bool:
        c = make_constraint(kimi, "text", tools=tools, tool_choice=tool_choice)
        ids = render_assistant_output(message, kimi)
        n, done = replay(c, ids)
        return n == len(ids) and done

    good = _weather_msg('{"city": "Berlin", "unit": "fahrenheit"}')  # spec §14 worked example
    assert ok(good) and ok(good, "auto") and not ok(good, "none")
    assert ok(_weather_msg('{"city": "Oslo", "unit": "celsius", "days": 3, "day": "2026-01-31", "when": null}'))
    assert ok(_weather_msg('{"city": "Oslo", "unit": "celsius", "when": 0.25}'))
    assert ok(_weather_msg('{"q": "k3", "filter": {"site": "docs", "recent": true}, "ids": [1, 2]}', "search"))
    assert ok(_weather_msg("{}", "ping"))
    assert not ok(_weather_msg('{"city": "Berlin", "unit": "kelvin"}'))         # enum
    assert not ok(_weather_msg('{"city": "Berlin"}'))                           # required unit
    assert not ok(_weather_msg('{"unit": "celsius", "city": "Berlin"}'))        # declared order
    assert not ok(_weather_msg('{"city": "Berlin", "unit": "celsius", "days": 9}'))  # maximum
    assert not ok(_weather_msg('{"city": "Berlin", "unit": "celsius", "x": 1}'))    # additionalProperties
    assert not ok(_weather_msg('{"q": "k3"}', "fetch"))                         # unknown tool
    assert not ok({"role": "assistant", "content": "hi"})                       # required: no call
    assert ok({"role": "assistant", "content": "hi"}, "auto") and ok({"role": "assistant", "content": "hi"}, "none")
    # call indices must count 1, 2, ...: render two calls, then swap the second index to 3
    two = _weather_msg("{}", "ping")
    two["tool_calls"].append({"id": "call_2", "type": "function", "function": {"name": "ping", "arguments": "{}"}})
    ids = render_assistant_output(two, kimi)
    assert ok(two)
    bad = kimi.encode_text('call tool="ping" index="3"')
    good_seg = kimi.encode_text('call tool="ping" index="2"')
    i = next(j for j in range(len(ids)) if ids[j:j + len(good_seg)] == good_seg)
    c = make_constraint(kimi, "text", tools=TOOLS, tool_choice="required")
    assert replay(c, ids[:i] + bad + ids[i + len(good_seg):]) != (len(ids) - len(good_seg) + len(bad), True)


def test_max_tool_calls_limits_calls_per_message(kimi):
    """max_tool_calls=1 (the server's ``parallel_tool_calls: false``) accepts one call and rejects
    a second; the default accepts both."""
    one = _weather_msg("{}", "ping")
    two = _weather_msg("{}", "ping")
    two["tool_calls"].append({"id": "call_2", "type": "function", "function": {"name": "ping", "arguments": "{}"}})

    def ok(message: dict, **kw) -> bool:
        ids = render_assistant_output(message, kimi)
        n, done = replay(make_constraint(kimi, "text", tools=TOOLS, tool_choice="auto", **kw), ids)
        return n == len(ids) and done

    assert ok(one, max_tool_calls=1) and ok(two) and ok(one)
    assert not ok(two, max_tool_calls=1)


def test_additional_properties_in_typed_arguments(kimi):
    """Undeclared keys, allowed by the schema, render as typed tags after the declared ones."""
    tools = [{"type": "function", "function": {"name": "kv", "parameters": {
        "type": "object", "required": ["a"], "properties": {"a": {"type": "integer"}},
        "additionalProperties": {"type": "string"}}}}]
    c = lambda: make_constraint(kimi, "text", tools=tools, tool_choice="required")  # noqa: E731
    for args, want in (('{"a": 1, "b&\\"": "x"}', True), ('{"a": 1, "b": 2}', False), ('{"a": 1, "a": "x"}', False)):
        ids = render_assistant_output(_weather_msg(args, "kv"), kimi)
        n, done = replay(c(), ids)
        assert (n == len(ids) and done) == want, args


# ----------------------------------------------------------------------------- the Constraint object

def test_mask_matches_llguidance_and_pads_vocab(kimi):
    c = make_constraint(kimi, "json_schema", SCHEMAS["enums"], thinking=False, vocab_size=kimi.vocab_size + 64)
    mask = c.allowed_tokens()
    assert mask.dtype == torch.bool and mask.shape == (kimi.vocab_size + 64,)
    assert not mask[kimi.vocab_size:].any()
    words = c.bitmask().numpy().astype(np.int64) & 0xFFFFFFFF
    probe = np.random.default_rng(0).integers(0, kimi.vocab_size, 2000).tolist() + np.flatnonzero(mask.numpy()).tolist()
    for tid in probe:  # independent unpacking of llguidance's words, and llguidance's own check
        assert bool(mask[tid]) == bool((int(words[tid // 32]) >> (tid % 32)) & 1) == (c._m.validate_tokens([tid]) == 1)
    firsts = [kimi.decode_bytes([int(t)]) for t in np.flatnonzero(mask.numpy())]
    assert firsts and all(b.startswith(b"{") for b in firsts)  # thinking off: the JSON object opens at once
    assert not c.accept(kimi.vocab_size + 3)


def test_accept_reject_copy_rollback_finish(kimi):
    c = make_constraint(kimi, "json_object", thinking=False)
    hello = kimi.encode_text("hello")[0]
    assert not c.accept(hello) and not c.is_error()  # a rejected token leaves the state usable
    body = kimi.encode_text('{"a": 1}')
    for t in body:
        assert c.accept(t)
    d = c.copy()
    tail = [kimi.close_id, *kimi.encode_text("response"), kimi.sep_id, kimi.close_id, *kimi.encode_text("message"),
            kimi.sep_id]
    for t in tail:
        assert c.accept(t)
    assert not c.is_finished() and c.accept(kimi.end_of_msg_id) and c.is_finished()
    assert not d.is_finished() and d.accept(kimi.encode_text("}")[0]) is False  # copy kept its own state
    assert d.rollback(len(body)) and d.accept(kimi.encode_text("{")[0])
    assert not c.accept(kimi.encode_text("x")[0])


def test_trained_tokenizer(trained):
    """Project-trained BPE: markers at other ids, a 400-token vocabulary."""
    assert trained.open_id != 163587
    schema = SCHEMAS["enums"]
    for seed in range(3):
        ids = sample_uniform(make_constraint(trained, "json_schema", schema, think_max_chars=6, json_whitespace=WS), seed)
        msg = parse(trained, ids, thinking=True)
        assert msg.ended
        jsonschema.validate(exact(msg.content), schema)
    ids = sample_uniform(make_constraint(trained, "text", tools=TOOLS, tool_choice="required", think_max_chars=4,
                                         text_max_chars=4, json_whitespace=WS), 0)
    msg = parse(trained, ids, thinking=True)
    assert msg.tool_calls
    for call in msg.tool_calls:
        jsonschema.validate(exact(call["function"]["arguments"]), TOOL_SCHEMAS[call["function"]["name"]])
    assert ll_tokenizer(trained).vocab_size == trained.vocab_size


@pytest.mark.parametrize("kwargs, field", [
    (dict(kind="json_schema", schema={"type": "foo"}), "schema"),
    (dict(kind="json_schema", schema={"type": "object", "properties": {"a": {"minimum": "x"}}}), "schema"),
    (dict(kind="json_schema", schema="object"), "schema"),
    (dict(kind="json_schema", schema=None), "schema"),
    (dict(kind="json_schema", schema={"$ref": "#/$defs/missing"}), "schema"),
    (dict(kind="yaml"), "kind"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]), "tools[0]"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                                 "required": "a"}}}]), "tools[0]"),
    (dict(tools=[{"type": "function", "function": {"parameters": {}}}]), "tools[0].function.name"),
    (dict(tools=TOOLS + TOOLS[:1]), "duplicate"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=TOOLS, tool_choice="sometimes"), "tool_choice"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
])
def test_invalid_requests_raise_value_error(kimi, kwargs, field):
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        make_constraint(kimi, **kwargs)


def test_named_tool_choice_forces_that_tool(kimi):
    c = make_constraint(kimi, "text", tools=TOOLS, tool_choice={"type": "function", "function": {"name": "ping"}},
                        think_max_chars=4, text_max_chars=4)
    msg = parse(kimi, sample_uniform(c, 1), thinking=True)
    assert msg.tool_calls and {call["function"]["name"] for call in msg.tool_calls} == {"ping"}


def test_unknown_format_is_an_annotation(kimi):
    """A ``format`` llguidance does not implement asserts nothing (JSON Schema 2020-12 §7.2.1): tool
    and response schemas holding one compile, every other keyword still enforced."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "required": ["u"], "properties": {"u": {"type": "string", "format": "uri-reference",
                                                                  "maxLength": 3}}}}}]
    c = make_constraint(kimi, "text", tools=tools, tool_choice="required", think_max_chars=4, text_max_chars=4,
                        json_whitespace=WS, lenient_tools=False)
    msg = parse(kimi, sample_uniform(c, 0), thinking=True)
    for call in msg.tool_calls:
        assert len(json.loads(call["function"]["arguments"])["u"]) <= 3
    schema = {"type": "object", "required": ["s"], "additionalProperties": False, "properties": {"s": {
        "type": "string", "format": "no-such-format", "maxLength": 2}}}
    ids = sample_uniform(make_constraint(kimi, "json_schema", schema, thinking=False, json_whitespace=WS), 1)
    jsonschema.validate(exact(parse(kimi, ids, thinking=False).content), schema)


def test_tool_schemas_are_lenient_by_default(kimi):
    """A keyword llguidance does not implement in a tool schema is ignored by default (the server
    decides strictness before, openk3/engine/json_schema.py); ``lenient_tools=False`` refuses it."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"t": {"type": "array", "items": {"type": "null"}, "maxItems": 2,
                                               "uniqueItems": True}}}}}]
    c = make_constraint(kimi, "text", tools=tools, tool_choice="required", think_max_chars=4, text_max_chars=4,
                        json_whitespace=WS)
    msg = parse(kimi, sample_uniform(c, 0), thinking=True)
    for call in msg.tool_calls:
        assert len(json.loads(call["function"]["arguments"]).get("t", [])) <= 2
    with pytest.raises(ValueError, match="tools"):
        make_constraint(kimi, "text", tools=tools, tool_choice="required", lenient_tools=False)


def test_check_json_schema():
    check_json_schema({"type": "object", "properties": {"a": {"type": "integer"}}})
    with pytest.raises(ValueError, match=r"schema\['properties'\]"):
        check_json_schema({"type": "object", "properties": {"a": {"type": 3}}})


# ----------------------------------------------------------------------------- a real (random) model

def test_random_openk3_model_under_constraints(kimi):
    """A randomly initialised openk3 model (full Kimi vocabulary + padding) sampled through the masks
    (torch runs single-threaded here: tests/engine/conftest.py)."""
    from openk3.cache import HybridCache
    from openk3.config import preset
    from openk3.pretrained import build_model

    cfg = preset("k3-test-tiny").replace(vocab_size=kimi.vocab_size + 128, bos_token_id=kimi.bos_id,
                                         eos_token_id=kimi.end_of_msg_id, pad_token_id=kimi.pad_id,
                                         media_placeholder_token_id=kimi.media_pad_id)
    model = build_model(cfg, seed=0).eval()
    cases = [("json_schema", dict(schema=SCHEMAS["refs"])), ("text", dict(tools=TOOLS[:1], tool_choice="required"))]
    for seed, (kind, kw) in enumerate(cases):
        c = make_constraint(kimi, kind, thinking=True, vocab_size=cfg.vocab_size, think_max_chars=10,
                            text_max_chars=6, json_whitespace=WS, **kw)
        gen = torch.Generator().manual_seed(seed)
        cache = HybridCache.empty(cfg, 1, 512)
        step_in = torch.tensor([[kimi.open_id, *kimi.encode_text("think"), kimi.sep_id]])
        ids: list[int] = []
        with torch.no_grad():
            while not c.is_finished() and len(ids) < 400:
                logits = model(step_in, cache).logits[0, -1].float()
                logits = logits.masked_fill(~c.allowed_tokens(), float("-inf"))
                tid = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
                assert c.accept(tid)
                ids.append(tid)
                step_in = torch.tensor([[tid]])
        msg = parse(kimi, ids, thinking=True)
        assert c.is_finished() and msg.ended
        if kind == "json_schema":
            jsonschema.validate(exact(msg.content), SCHEMAS["refs"])
        else:
            assert msg.tool_calls
            for call in msg.tool_calls:
                jsonschema.validate(exact(call["function"]["arguments"]), TOOL_SCHEMAS["get_weather"])
