"""Chat completions through the official ``openai`` SDK against a real ``openk3 serve`` process.

The model is random (steered to terminate, see ``checkpoint.py``), so content is gibberish: the tests
check structure, the prompt accounting against an independent rendering, stream / non-stream
equality under a fixed seed, constraints (JSON validity), stop strings, partial mode and the
prefix cache.
"""

from __future__ import annotations

import json

import pytest

from openk3.chat_format import encode_request
from tests.server.conftest import MODEL, user

LONG_SYSTEM = " ".join(f"Rule {i}: answer briefly and cite the weather station number {i * 7}." for i in range(60))


def _prompt_tokens(tokenizer, body: dict) -> int:
    """Independent count (chat-format spec §12): rendered ids minus the 3-token generation stub."""
    p = encode_request(body, tokenizer)
    return len(p.token_ids) - p.pending_tokens


def test_models_endpoint(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    card = models.data[0]
    assert card.context_length == 4096 and card.supports_reasoning is True and card.supports_image_in is False
    assert client.models.retrieve(MODEL).id == MODEL


def test_non_stream_structure_and_usage(client, tokenizer):
    messages = user()
    r = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=8, user="u-1",
                                       extra_body={"prompt_cache_key": "session-1", "unknown_field": {"x": 1}})
    assert r.object == "chat.completion" and r.model == MODEL and r.id.startswith("chatcmpl-")
    choice = r.choices[0]
    assert choice.finish_reason in ("length", "stop")
    assert isinstance(choice.message.reasoning_content, str)  # thinking is on by default
    u = r.usage
    assert u.prompt_tokens == _prompt_tokens(tokenizer, {"messages": messages})
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert 1 <= u.completion_tokens <= 8
    assert u.cached_tokens == u.prompt_tokens_details.cached_tokens <= u.prompt_tokens


@pytest.mark.parametrize("effort", ["low", "medium", "high", "max"])
def test_reasoning_effort(client, tokenizer, effort):
    messages = user("Think about it.")
    r = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=2,
                                       reasoning_effort=effort)
    expected = _prompt_tokens(tokenizer, {"messages": messages, "reasoning_effort": effort})
    assert r.usage.prompt_tokens == expected
    # the thinking object carries the same effort (K3: thinking.effort)
    r2 = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=2,
                                        extra_body={"thinking": {"type": "enabled", "effort": effort}})
    assert r2.usage.prompt_tokens == expected


def test_effort_changes_the_prompt(client, tokenizer):
    counts = {e: client.chat.completions.create(model=MODEL, messages=user(), max_completion_tokens=1,
                                                reasoning_effort=e).usage.prompt_tokens for e in ("low", "max")}
    n = {e: len(tokenizer.encode_text(f"Now the system is invoked with `thinking_effort={e}`."))
         for e in ("low", "max")}
    assert counts["max"] - counts["low"] == n["max"] - n["low"]


def test_estimate_token_count_matches_usage(client, http):
    body = {"model": MODEL, "messages": user("Count me."), "reasoning_effort": "high"}
    est = http.post("/v1/tokenizers/estimate-token-count", json=body).json()["data"]["total_tokens"]
    r = client.chat.completions.create(model=MODEL, messages=body["messages"], max_completion_tokens=1,
                                       reasoning_effort="high")
    assert est == r.usage.prompt_tokens


def _collect(stream):
    chunks = list(stream)
    order, reasoning, content, finals, usage_chunks = [], [], [], [], []
    for c in chunks:
        if not c.choices:
            usage_chunks.append(c)
            continue
        d = c.choices[0].delta
        rc = getattr(d, "reasoning_content", None)
        if rc:
            reasoning.append(rc)
            order.append("r")
        if d.content:
            content.append(d.content)
            order.append("c")
        if c.choices[0].finish_reason:
            finals.append(c)
    return chunks, "".join(order), "".join(reasoning), "".join(content), finals, usage_chunks


def test_stream_reasoning_before_content_and_usage(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=user("Reply in JSON."), max_completion_tokens=250, stream=True,
        stream_options={"include_usage": True}, response_format={"type": "json_object"}, seed=7)
    chunks, order, reasoning, content, finals, usage_chunks = _collect(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "c" in order and "r" not in order[order.index("c"):], order  # all reasoning precedes content
    assert isinstance(json.loads(content), dict)
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "stop"
    final = finals[0]
    in_choice = final.choices[0].model_extra["usage"]  # Kimi: usage inside the final choice, and top level
    top = final.usage
    assert (top.prompt_tokens, top.completion_tokens, top.total_tokens, top.model_extra["cached_tokens"]) == (
        in_choice["prompt_tokens"], in_choice["completion_tokens"], in_choice["total_tokens"], in_choice["cached_tokens"])
    assert len(usage_chunks) == 1 and usage_chunks[0].usage.total_tokens == in_choice["total_tokens"]
    assert all(c.usage is None for c in chunks[:-2])  # include_usage: earlier chunks carry usage: null


def test_stream_and_non_stream_agree(client):
    kwargs = dict(model=MODEL, messages=user("Same seed, same answer?"), max_completion_tokens=40, seed=1234,
                  response_format={"type": "json_object"})
    full = client.chat.completions.create(**kwargs)
    _, _, reasoning, content, finals, _ = _collect(client.chat.completions.create(stream=True, **kwargs))
    assert reasoning == full.choices[0].message.reasoning_content
    assert content == (full.choices[0].message.content or "")
    assert finals[0].choices[0].finish_reason == full.choices[0].finish_reason
    u_stream = finals[0].usage
    assert (u_stream.prompt_tokens, u_stream.completion_tokens) == (full.usage.prompt_tokens,
                                                                    full.usage.completion_tokens)


def test_usage_chunk_only_with_include_usage(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=user(), max_completion_tokens=3, stream=True))
    assert all(c.choices for c in chunks)  # no empty-choices usage chunk
    final = chunks[-1]
    assert final.choices[0].finish_reason == "length" and final.usage.completion_tokens == 3


def test_json_schema_strict_output_validates(client):
    import jsonschema

    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "tag": {"enum": ["a", "b"]}},
              "required": ["n", "tag"], "additionalProperties": False}
    r = client.chat.completions.create(
        model=MODEL, messages=user("Give n and tag."), max_completion_tokens=250,
        response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": schema}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_json_schema_non_strict_is_any_object(client):
    r = client.chat.completions.create(
        model=MODEL, messages=user(), max_completion_tokens=250,
        response_format={"type": "json_schema", "json_schema": {"name": "t", "strict": False, "schema": {
            "type": "object", "required": ["never_forced"]}}})
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].message.content), dict)


def test_partial_mode_continues_prefix(client, tokenizer):
    prefix = '{"answer": "'
    messages = user("Answer in JSON.") + [{"role": "assistant", "content": prefix, "partial": True}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=200,
                                       response_format={"type": "json_object"})
    content = r.choices[0].message.content or ""
    assert not content.startswith(prefix)  # the prefix is not echoed
    assert "answer" in json.loads(prefix + content)  # the continuation completes the prefixed object
    assert getattr(r.choices[0].message, "reasoning_content", None) is None  # continued in the response channel
    # partial prefill: nothing is subtracted from the prompt count (chat-format §12)
    p = encode_request({"messages": messages, "response_format": {"type": "json_object"}}, tokenizer)
    assert r.usage.prompt_tokens == len(p.token_ids)


def test_stop_string_cuts_output(client):
    # Under the JSON grammar the think channel is plain text up to its close marker, so the engine's
    # text and the visible reasoning agree on where a stop string first occurs.
    for seed in range(20):
        kwargs = dict(model=MODEL, messages=user("Ramble, then JSON."), max_completion_tokens=250, seed=seed,
                      response_format={"type": "json_object"})
        text = client.chat.completions.create(**kwargs).choices[0].message.reasoning_content
        k = len(text) // 2
        if len(text) >= 6 and text.find(text[k:k + 2]) == k:
            break
    else:
        pytest.fail("no seed gave a usable reasoning text")
    stop = text[k:k + 2]
    r = client.chat.completions.create(stop=[stop], **kwargs)
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.reasoning_content == text[:k] and r.choices[0].message.content is None


def test_cached_tokens_on_shared_long_prefix(client):
    msgs = lambda q: [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": q}]  # noqa: E731
    first = client.chat.completions.create(model=MODEL, messages=msgs("First question?"), max_completion_tokens=1)
    second = client.chat.completions.create(model=MODEL, messages=msgs("A different question!"),
                                            max_completion_tokens=1)
    assert first.usage.prompt_tokens > 600
    assert 0 < second.usage.cached_tokens < second.usage.prompt_tokens
    assert second.usage.cached_tokens % 256 == 0  # whole 256-token blocks (api.md §11)
    assert second.usage.prompt_tokens_details.cached_tokens == second.usage.cached_tokens


def test_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=user(), max_completion_tokens=4, logprobs=True,
                                       top_logprobs=3)
    entries = r.choices[0].logprobs.content
    assert len(entries) == 4
    for e in entries:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        assert e.top_logprobs[0].logprob >= e.logprob - 1e-6
