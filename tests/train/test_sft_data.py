"""SFT mixture of the default model: seeded, disjoint from the held-out sets, covering every
behaviour issue 8 lists, and rendered with assistant-only loss through the K3 chat format."""

from __future__ import annotations

import json
import random
from collections import Counter

import jsonschema
import pytest

from openk3.chat_format import encode_request, render_assistant_output, render_training
from openk3.train.data import chat_document
from openk3.train.sft_data import (
    EFFORTS, EVAL_SUITES, eval_items, gen_problem, is_held_out, item_key, sft_conversations, sft_items,
)


@pytest.fixture(scope="module")
def tok():
    from openk3.train.recipes import synthetic_document
    from openk3.train.tokenizer_train import train_tokenizer

    return train_tokenizer([synthetic_document(1, i) for i in range(40)], 640)


@pytest.fixture(scope="module")
def items():
    return sft_items(0, 600)


def test_seeded_and_disjoint_from_held_out(items):
    assert [it.conversation() for it in sft_items(0, 40)] == [it.conversation() for it in items[:40]]
    assert sft_conversations(1, 40) != sft_conversations(0, 40)
    train_keys = {item_key(it) for it in items}
    assert not any(is_held_out(it) for it in items)
    for suite in EVAL_SUITES:
        ev = eval_items(suite, 0, 16)
        assert all(is_held_out(it) for it in ev) and not train_keys & {item_key(it) for it in ev}
        assert len({item_key(it) for it in ev}) == 16
    assert Counter(it.request["reasoning_effort"] for it in eval_items("effort", 0, 16)) == {e: 4 for e in EFFORTS}
    with pytest.raises(ValueError, match="suite"):
        eval_items("poetry", 0, 2)
    with pytest.raises(ValueError, match="n="):
        sft_items(0, 0)


def test_problem_reasoning_length_follows_effort():
    for seed in range(40):
        lens = {e: len(gen_problem(random.Random(seed), e).reference["reasoning_content"]) for e in EFFORTS}
        assert lens["low"] <= lens["medium"] <= lens["high"] < lens["max"] and lens["low"] < lens["high"]
        assert lens["low"] < 60  # a line
    off = gen_problem(random.Random(0), None)
    assert "reasoning_content" not in off.reference and off.request["thinking"] == {"type": "disabled"}


def test_mixture_covers_every_behaviour(items, tok):
    suites = Counter(it.suite for it in items)
    assert set(suites) == {"problems", "tools", "tools_none", "json", "chat", "effort", "partial", "multi_turn"}
    tools = [it for it in items if it.suite == "tools"]
    assert any(it.request.get("tool_choice") == "required" for it in tools)
    assert any("tools" in it.request["messages"][0] for it in tools)  # dynamic tools in a system message
    assert any(len(it.reference["tool_calls"]) == 2 for it in tools)  # several calls in one turn
    assert any(it.follow_up and it.follow_up[0]["role"] == "tool" for it in tools)  # uses the result
    assert all(it.request["tool_choice"] == "none" and not it.reference.get("tool_calls")
               for it in items if it.suite == "tools_none")
    kinds = {it.request["response_format"]["type"] for it in items if it.suite == "json"}
    assert kinds == {"json_object", "json_schema"}
    assert any(it.reference["content"] == "OK" and "'OK' and nothing else" in it.request["messages"][-1]["content"]
               for it in items if it.suite == "chat")
    multi = next(it for it in items if it.suite == "multi_turn" and "reasoning_effort" in it.request)
    first_reasoning = multi.request["messages"][1]["reasoning_content"]
    assert first_reasoning in render_training(multi.conversation(), tok).text  # history keeps reasoning


def test_tool_arguments_come_from_the_users_words_and_fit_the_schema(items):
    for it in (it for it in items if it.suite == "tools"):
        user = it.request["messages"][-1]["content"].lower()
        for call in it.expected["calls"]:
            jsonschema.validate(call["arguments"], it.expected["schemas"][call["name"]])
            for v in call["arguments"].values():
                assert str(v).lower() in user, (v, user)


def test_json_references_are_valid_and_hold_the_stated_facts(items):
    for it in (it for it in items if it.suite == "json"):
        value = json.loads(it.reference["content"])
        jsonschema.validate(value, it.expected["schema"])
        assert value == it.expected["fields"]
        assert all(str(v) in it.request["messages"][0]["content"] for v in value.values())


def test_rendered_with_assistant_only_loss(items, tok):
    for it in items[:120]:
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


def test_copy_task_and_zero_share_keeps_the_default_draws():
    from openk3.train.sft_data import MIXTURE, normalise_mixture
    from openk3.train.sft_tasks import gen_copy

    # MIXTURE lists copy last with weight 0: the default draws equal those of the mixture without it
    assert MIXTURE["copy"] == 0.0 and list(MIXTURE)[-1] == "copy"
    without = {k: v for k, v in MIXTURE.items() if k != "copy"}
    assert sft_conversations(5, 120) == sft_conversations(5, 120, mixture=without)
    for seed in range(30):
        it = gen_copy(random.Random(seed), "high")
        text = it.reference["content"]
        assert it.request["messages"][0]["content"].endswith(": " + text) and 3 <= len(text.split()) <= 40
        assert text in it.reference["reasoning_content"] and it.expected == {"content": text}
    assert "reasoning_content" not in gen_copy(random.Random(0), None).reference
    mixed = Counter(it.suite for it in sft_items(0, 400, mixture=normalise_mixture({"copy": 0.5})))
    assert 0.2 < mixed["copy"] / 400 < 0.45 and not any(is_held_out(it) for it in sft_items(0, 50, mixture={"copy": 1}))
