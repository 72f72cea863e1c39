"""Synthetic agent-harness prompts and the long training rows built on them."""

from __future__ import annotations

import random

import jsonschema
import pytest

from openk3.chat_format import encode_request, render_training
from openk3.datasets.harness import harness_prose, harness_tools, long_conversations, wrap_request
from openk3.datasets.sft_data import eval_items


@pytest.fixture(scope="module")
def tok():
    from openk3.recipes import synthetic_document
    from openk3.train.tokenizer_train import train_tokenizer

    return train_tokenizer([synthetic_document(2, i) for i in range(40)], 700, split_digits=True)


def test_prose_and_tools_are_deterministic_sized_and_declarable(tok):
    a, b = harness_prose(random.Random(3), 20_000), harness_prose(random.Random(3), 20_000)
    assert a == b and 20_000 <= len(a) < 24_000 and harness_prose(random.Random(4), 20_000) != a
    assert a.count("# ") >= 5 and "<env>" in a and "user:" in a  # sections, environment, quoted examples
    tools = harness_tools(random.Random(3))
    assert 10 <= len(tools) <= 16 and len({t["function"]["name"] for t in tools}) == len(tools)
    for t in tools:
        jsonschema.Draft202012Validator.check_schema(t["function"]["parameters"])
    it = eval_items("tools", 0, 1)[0]
    req = wrap_request(it.request, a, tools)
    assert req["messages"][0] == {"role": "system", "content": a} and req["messages"][1:] == it.request["messages"]
    assert req["tools"][:len(tools)] == tools and req["tools"][len(tools):] == list(it.request.get("tools") or [])
    assert len(encode_request(req, tok).token_ids) > 5000  # renders as an ordinary request


def test_long_conversations_fit_their_rows(tok):
    convs = long_conversations(0, 12, 6000, tok)
    assert len(convs) >= 8
    lens = [len(render_training(c, tok).token_ids) for c in convs]
    assert all(2000 < n <= 6000 for n in lens), lens
    assert all(c["messages"][0]["role"] == "system" and len(c["messages"][0]["content"]) > 1000 for c in convs)
    assert long_conversations(0, 12, 6000, tok) == convs
    with pytest.raises(ValueError, match="max_tokens"):
        long_conversations(0, 1, 1500, tok)
