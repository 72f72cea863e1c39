"""SFT mixture of the default model: seeded, disjoint from the held-out sets (by value and by
prompt), covering every behaviour the eval suites test, worked arithmetic that is right, and
rendered with assistant-only loss through the K3 chat format."""

from __future__ import annotations

import json
import random
import re
from collections import Counter

import jsonschema
import pytest

from openk3.chat_format import encode_request, render_assistant_output, render_training
from openk3.train.data import chat_document
from openk3.datasets.pools import POOLS, UNSPLIT, draw, is_held_out_value, pool, pool_sizes, split
from openk3.datasets.sft_data import (
    EFFORTS, EVAL_SUITES, MIXTURE, column_add, column_mul, column_sub, eval_items, gen_arith, is_held_out, item_key,
    sft_conversations, sft_items, work,
)
from openk3.datasets.sft_tasks import TOOLS


@pytest.fixture(scope="module")
def tok():
    from openk3.recipes import synthetic_document
    from openk3.train.tokenizer_train import train_tokenizer

    return train_tokenizer([synthetic_document(1, i) for i in range(40)], 640, split_digits=True)


@pytest.fixture(scope="module")
def items():
    return sft_items(0, 1500)


def test_pools_are_large_and_split_by_value():
    sizes = pool_sizes()
    assert set(sizes) == set(POOLS)
    for name in ("first_name", "city", "surname", "email", "symbol", "song", "pet_name"):
        train, held = sizes[name]
        assert train >= 1000 and held >= 100, (name, sizes[name])  # memorising cannot pass
        assert not set(split(name, False)) & set(split(name, True))
        assert all(is_held_out_value(name, v) for v in split(name, True))
    for name in UNSPLIT:  # enum-like pools: whole in both (the schema declares every value)
        assert split(name, True) == split(name, False) == pool(name)
    rng = random.Random(0)
    assert all(draw(rng, "city", True) in split("city", True) for _ in range(50))


def test_seeded_and_disjoint_from_held_out(items):
    assert [it.conversation() for it in sft_items(0, 40)] == [it.conversation() for it in items[:40]]
    assert sft_conversations(1, 40) != sft_conversations(0, 40)
    train_keys = {item_key(it) for it in items}
    assert not any(is_held_out(it) for it in items if it.suite != "chat")
    train_text = json.dumps([it.conversation() for it in items])
    for suite in EVAL_SUITES:
        ev = eval_items(suite, 0, 24)
        assert all(is_held_out(it) for it in ev) and not train_keys & {item_key(it) for it in ev}
        assert len({item_key(it) for it in ev}) == (24 // len(EFFORTS) if suite == "reasoning" else 24)
    # Values: a held-out city / name of an eval item never occurs in the training data.
    for it in eval_items("tools", 0, 40):
        for call in it.expected["calls"]:
            for k, v in call["arguments"].items():
                if k in ("city", "origin", "destination", "name", "to"):
                    assert v not in train_text, (k, v)
    assert Counter(it.request["reasoning_effort"] for it in eval_items("effort", 0, 16)) == {e: 4 for e in EFFORTS}
    arith = eval_items("arithmetic", 0, 30)
    assert Counter(it.expected["op"] for it in arith) == {"+": 10, "-": 10, "*": 10}
    assert {it.request["reasoning_effort"] for it in arith} == {"max"}
    with pytest.raises(ValueError, match="suite"):
        eval_items("poetry", 0, 2)
    with pytest.raises(ValueError, match="n="):
        sft_items(0, 0)


def _result_from_lines(lines: list[str]) -> int:
    return int(re.findall(r"-?\d+", lines[-1])[-1])


@pytest.mark.parametrize("seed", range(300))
def test_column_arithmetic_is_right(seed):
    rng = random.Random(seed)
    a, b = rng.randint(0, 999), rng.randint(0, 999)
    d = rng.randint(0, 9)
    # The written digits of each column, read top position first, spell the result.
    add = column_add(a, b)
    top = re.findall(r"write (\d+)", add[-1])[0]
    assert int(top + "".join(re.findall(r"write (\d)", line)[0] for line in reversed(add[:-1]))) == a + b
    hi, lo = max(a, b), min(a, b)
    sub = column_sub(hi, lo)
    assert int("".join(re.findall(r"= (\d+)$", line)[0] for line in reversed(sub))) == hi - lo
    mul = column_mul(a, d)
    top = re.findall(r"write (\d+)", mul[-1])[0]
    assert int(top + "".join(re.findall(r"write (\d)", line)[0] for line in reversed(mul[:-1]))) == a * d
    for op in "+-*":
        x, y = (a, b) if op != "*" else (a, d)
        lines, value = work(x, op, y)
        assert value == eval(f"{x} {op} {y}")


def test_arithmetic_reasoning_length_follows_effort_and_ends_with_the_answer():
    for seed in range(60):
        lens = {}
        for e in EFFORTS:
            it = gen_arith(random.Random(seed), e)
            r = it.reference["reasoning_content"]
            lens[e] = len(r)
            assert _result_from_lines(r.split("\n")) == it.expected["answer"]  # the reasoning reaches it
            assert it.reference["content"] == f"The answer is {it.expected['answer']}."
        assert lens["low"] < lens["medium"] <= lens["high"] < lens["max"]
    off = gen_arith(random.Random(0), None)
    assert "reasoning_content" not in off.reference and off.request["thinking"] == {"type": "disabled"}


def test_mixture_covers_every_behaviour(items, tok):
    suites = Counter(it.suite for it in items)
    assert set(suites) == {k for k, v in MIXTURE.items() if v > 0}
    tools = [it for it in items if it.suite == "tools"]
    assert any(it.request.get("tool_choice") == "required" for it in tools)
    assert any("tools" in it.request["messages"][0] for it in tools)  # dynamic tools in a system message
    assert any(len(it.reference["tool_calls"]) == 2 for it in tools)  # several calls in one turn
    assert any(it.follow_up and it.follow_up[0]["role"] == "tool" for it in tools)  # uses the result
    assert len({c["name"] for it in tools for c in it.expected["calls"]}) == len(TOOLS)
    assert all(it.request["tool_choice"] == "none" and not it.reference.get("tool_calls")
               for it in items if it.suite == "tools_none")
    kinds = {it.request["response_format"]["type"] for it in items if it.suite == "json"}
    assert kinds == {"json_object", "json_schema"}
    assert any(it.reference["content"] == "OK" and "'OK' and nothing else" in it.request["messages"][-1]["content"]
               for it in items if it.suite == "chat")
    multi = next(it for it in items if it.suite == "multi_turn" and "reasoning_effort" in it.request)
    first_reasoning = multi.request["messages"][1]["reasoning_content"]
    assert first_reasoning in render_training(multi.conversation(), tok).text  # history keeps reasoning
    for it in (it for it in items if it.suite == "recall"):
        earlier = " ".join(m["content"] for m in it.request["messages"][:-1] if m["role"] == "user")
        assert str(it.expected["value"]) in earlier and str(it.expected["value"]) in it.reference["content"]
    for it in (it for it in items if it.suite == "tool_result"):
        assert it.request["messages"][-1]["role"] == "tool"
        assert all(v in it.reference["content"] for v in it.expected["values"])
    assert all(not it.reference.get("tool_calls") for it in items if it.suite == "out_of_scope")


def test_tool_arguments_come_from_the_users_words_and_fit_the_schema(items):
    for it in (it for it in items if it.suite in ("tools", "tools_two")):
        user = it.request["messages"][-1]["content"]
        for call in it.expected["calls"]:
            jsonschema.validate(call["arguments"], it.expected["schemas"][call["name"]])
            for v in call["arguments"].values():
                assert (json.dumps(v) if isinstance(v, (int, float)) else str(v)) in user, (v, user)


def test_json_references_are_valid_and_hold_the_stated_facts(items):
    for it in (it for it in items if it.suite == "json"):
        value = json.loads(it.reference["content"])
        jsonschema.validate(value, it.expected["schema"])
        assert value == it.expected["fields"]
        assert all(str(v) in it.request["messages"][0]["content"] for v in value.values())


def test_rendered_with_assistant_only_loss(items, tok):
    for it in items[:150]:
        conv = it.conversation()
        doc = chat_document(conv, tok)
        targets = [int(t) for t in doc.labels if t != -100]
        assert targets, it.suite
        text = tok.decode(targets)
        ref = it.reference
        if it.suite != "partial":
            assert (ref.get("content") or "") in text and (ref.get("reasoning_content") or "") in text
        # Exactly the assistant outputs carry loss: as many targets as their generated ids.
        thinking = conv.get("thinking") != {"type": "disabled"}
        outputs = [render_assistant_output(m, tok, thinking=thinking) for m in conv["messages"]
                   if m["role"] == "assistant"]
        assert len(targets) == sum(len(o) for o in outputs)
        assert targets[-len(outputs[-1]):] == outputs[-1]


def test_partial_items_continue_the_prefix(items, tok):
    for it in (it for it in items if it.suite == "partial"):
        prompt = encode_request(it.request, tok)
        assert prompt.partial and prompt.text.endswith(it.expected["prefix"])
        full = it.conversation()["messages"][-1]["content"]
        assert full == f"The answer is {it.expected['answer']}." and "partial" not in it.conversation()["messages"][-1]


def test_copy_and_lookup_tasks():
    from openk3.datasets.sft_tasks import gen_copy, gen_lookup

    for seed in range(30):
        it = gen_copy(random.Random(seed), "high")
        text = it.reference["content"]
        assert it.request["messages"][0]["content"].endswith(": " + text) and 3 <= len(text.split()) <= 40
        assert text in it.reference["reasoning_content"] and it.expected == {"content": text}
        lk = gen_lookup(random.Random(seed), "max")
        lines = lk.request["messages"][0]["content"].split("\n")
        key = re.search(r"(?:for|does|up) (.+?)(?: have)?[?.]$", lines[-1]).group(1)
        assert f"{key}: {lk.reference['content']}" in lines
    assert "reasoning_content" not in gen_copy(random.Random(0), None).reference


def test_one_call_tool_requests_are_also_asked_as_questions():
    """A share of one-call requests is a direct question ("What is the weather in Paris?") whose
    reasoning restates what it wants with the user's values, and whose call copies them."""
    import random as _random

    from openk3.datasets.sft_tasks import QUESTION_SHARE, gen_tool_call

    rng = _random.Random(11)
    items = [gen_tool_call(rng, "high", n_calls=1) for _ in range(600)]
    asked = [it for it in items if it.request["messages"][-1]["content"].endswith("?")
             and not it.request["messages"][-1]["content"].startswith(("Can you", "Could you"))]
    assert 0.5 * QUESTION_SHARE * 0.5 < len(asked) / len(items) < QUESTION_SHARE  # tools with a question form
    names = {it.reference["tool_calls"][0]["function"]["name"] for it in asked}
    assert names == {"get_weather", "get_time", "convert_currency", "lookup_contact", "get_stock_price",
                     "translate_text", "get_directions"}
    for it in asked:
        q = it.request["messages"][-1]["content"]
        call = it.reference["tool_calls"][0]["function"]
        args = json.loads(call["arguments"])
        first = it.reference["reasoning_content"].split("\n")[0]
        assert first.startswith("The user wants ") and first.endswith(f"; I will call {call['name']}.")
        for v in args.values():  # every argument is the user's own value, restated in the reasoning
            text = json.dumps(v) if isinstance(v, (int, float)) else v
            assert text in q and text in first, (q, first, args)
    weather = [it.request["messages"][-1]["content"] for it in asked
               if it.reference["tool_calls"][0]["function"]["name"] == "get_weather"]
    assert any(w.startswith("What is the weather in ") for w in weather)


def test_tool_reasoning_styles_change_only_the_call_turns_reasoning():
    # the same seed draws the same conversations in every style; only tool-call reasoning differs
    styles = {s: sft_items(3, 400, tool_reasoning=s) for s in ("restate", "args", "name")}
    for a, b, c in zip(styles["restate"], styles["args"], styles["name"]):
        assert a.suite == b.suite == c.suite and a.expected == b.expected == c.expected
        if a.suite not in ("tools", "tools_two", "tool_result"):
            assert a.conversation() == b.conversation() == c.conversation()
            continue
        calls = a.reference.get("tool_calls") or []
        assert [tc["function"] for tc in calls] == [
            tc["function"] for tc in (b.reference.get("tool_calls") or [])
        ]
        if a.suite == "tool_result" or a.reference.get("reasoning_content") is None:
            continue
        user = a.request["messages"][-1]["content"]
        r_args, r_name = b.reference["reasoning_content"], c.reference["reasoning_content"]
        assert r_name.startswith(
            f"I will call {' and '.join(tc['function']['name'] for tc in calls)}."
        )
        first = calls[0]["function"]
        assert r_args.startswith(f"I will call {first['name']} with {first['arguments']}.")
        # "name" never restates a value; "restate" (the shipped data) restates the request
        for v in json.loads(first["arguments"]).values():
            s = json.dumps(v) if isinstance(v, (int, float)) else str(v)
            assert s not in r_name and s in user and s in r_args
        assert a.reference["reasoning_content"].startswith("The user wants ")
    # a call turn kept in tool_result history carries the style too
    hist = [
        it
        for it in styles["name"]
        if it.suite == "tool_result" and it.request.get("reasoning_effort")
    ]
    call = next(m for m in hist[0].request["messages"] if m.get("tool_calls"))
    assert call["reasoning_content"].startswith("I will call ")
    with pytest.raises(ValueError, match="tool_reasoning='prose'"):
        sft_items(3, 5, tool_reasoning="prose")


def test_tool_reasoning_default_is_the_shipped_models_data():
    from openk3.datasets.sft_tasks import gen_tool_call

    it = gen_tool_call(random.Random(5), "max", n_calls=2)
    assert it.reference["reasoning_content"] == (
        "The user wants order 8 soup, then put on Golden Winter; I will call order_food and play_music.\n"
        'order_food arguments: {"dish": "soup", "quantity": 8}\n'
        'play_music arguments: {"song": "Golden Winter"}\n'
        "The arguments come from the user's words and fit the schema."
    )
    assert sft_conversations(2, 60) == sft_conversations(2, 60, tool_reasoning="restate")
