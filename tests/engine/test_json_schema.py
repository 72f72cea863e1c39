"""JSON Schemas as the grammar compiles them (openk3/engine/json_schema.py): annotations and vacuous
keywords out, numbers bounded, unenforceable keywords named per strictness."""

from __future__ import annotations

import json
import math

import jsonschema
import numpy as np
import pytest

from openk3.chat_format import OutputParser
from openk3.engine.constraints import make_constraint
from openk3.engine.json_schema import (
    ANY_DEF, NUMBER_BOUND, SchemaNotEnforceable, bound_schema, prepare_schema, remove_keywords,
    unenforceable_keywords,
)


def test_keywords_are_only_removed_where_they_are_keywords():
    schema = {"type": "object", "title": "T", "$id": "#user", "properties": {
        "title": {"type": "string", "description": "a property named title"},
        "not": {"enum": [1, 2], "default": 1}}, "propertyNames": {"type": "string"}, "required": ["title"]}
    out = bound_schema(schema)
    assert set(out["properties"]) == {"title", "not"} and "title" not in out and "$id" not in out
    assert "propertyNames" not in out and out["properties"]["not"] == {"enum": [1, 2]}  # pinned values: no bound
    assert out["properties"]["title"] == {"type": "string"}
    assert schema["properties"]["title"]["description"] == "a property named title"  # the input is not modified
    assert remove_keywords({"properties": {"not": {"not": {}}}}, {"not"}) == {"properties": {"not": {}}}


def test_numbers_and_any_values_are_bounded():
    out = bound_schema({"type": "object", "properties": {"n": {"type": "integer", "minimum": 3}, "x": {}}})
    assert out["properties"]["n"] == {"type": "integer", "minimum": 3, "maximum": NUMBER_BOUND}
    assert out["properties"]["x"] == {"$ref": f"#/$defs/{ANY_DEF}"}
    assert out["additionalProperties"] == {"$ref": f"#/$defs/{ANY_DEF}"}
    number = next(b for b in out["$defs"][ANY_DEF]["anyOf"] if b.get("type") == "number")
    assert (number["minimum"], number["maximum"]) == (-NUMBER_BOUND, NUMBER_BOUND)
    assert bound_schema(out) == out  # preparing twice changes nothing
    # inside `not` a bound would change the meaning: left alone
    assert bound_schema({"not": {"type": "number"}})["not"] == {"type": "number"}


def test_strictness():
    unique = {"type": "object", "properties": {"t": {"type": "array", "uniqueItems": True}}}
    assert unenforceable_keywords(bound_schema(unique)) == (["uniqueItems"], "")
    with pytest.raises(SchemaNotEnforceable, match=r'tool \'x\'\): JSON Schema keyword\(s\) "uniqueItems"'):
        prepare_schema(unique, "tools[0].function.parameters (tool 'x')", strict=True)
    grammar, dropped = prepare_schema(unique, "w", strict=False)
    assert dropped == ["uniqueItems"] and "uniqueItems" not in json.dumps(grammar)
    lookaround = {"type": "object", "properties": {"a": {"type": "string", "pattern": "(?=x)"}}}
    with pytest.raises(SchemaNotEnforceable, match="look-around"):
        prepare_schema(lookaround, "w", strict=True)
    grammar, dropped = prepare_schema(lookaround, "w", strict=False)
    assert dropped == ["*"] and grammar["type"] == "object"  # the platform's non-strict floor: a JSON object


def test_random_outputs_hold_only_finite_numbers():
    """A uniform random walk over the grammar of an any-value argument: every number it writes is
    plain decimal within the bound, so it decodes finite and the arguments stay an object."""
    from openk3.tokenizer import load_tokenizer

    tok = load_tokenizer("openk3-tiny")
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"v": {}}, "required": ["v"]}}}
    seen = []
    for seed in range(6):
        c = make_constraint(tok, "text", tools=[tool], tool_choice="required", thinking=False, text_max_chars=0,
                            max_tool_calls=1)
        rng, ids = np.random.default_rng(seed), []
        while not c.is_finished() and len(ids) < 3000:
            tid = int(rng.choice(np.flatnonzero(c.allowed_tokens().numpy())))
            assert c.accept(tid)
            ids.append(tid)
        if not c.is_finished():
            continue  # a walk lost in a long string: nothing to check
        p = OutputParser(tok, start_channel="response")
        p.feed(ids)
        p.finish()
        calls = p.message().tool_calls
        assert calls, "a finished walk holds a call (tool_choice required)"
        for call in calls:
            args = json.loads(call["function"]["arguments"], parse_constant=lambda x: pytest.fail(x))
            assert isinstance(args, dict)

            def walk(v):
                if isinstance(v, float) or isinstance(v, int) and not isinstance(v, bool):
                    assert math.isfinite(v) and abs(v) <= NUMBER_BOUND, v
                for x in (v.values() if isinstance(v, dict) else v if isinstance(v, list) else ()):
                    walk(x)
            walk(args)
            jsonschema.validate(args, tool["function"]["parameters"])
            seen.append(call["function"]["arguments"])
    assert len(seen) >= 3 and any(any(ch.isdigit() for ch in a) for a in seen), seen  # numbers were exercised
