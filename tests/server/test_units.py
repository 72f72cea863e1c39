"""Server pieces without a server: stop-string filtering, the Anthropic -> chat mapping, metrics."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from openk3.server.anthropic import to_chat_request
from openk3.server.metrics import Metrics
from openk3.server.protocol import APIError
from openk3.server.request import parse_request
from openk3.server.serving import StopFilter


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="abc", max_size=30), stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=3),
                                                                  max_size=3),
       cuts=st.lists(st.integers(0, 30), max_size=6))
def test_stop_filter_matches_a_one_shot_search(text, stops, cuts):
    """However the text is split into deltas, the emitted text is the prefix before the earliest
    stop string (reference: a plain search over the whole text), and the match is reported."""
    f = StopFilter(stops)
    bounds = sorted({0, len(text), *[min(c, len(text)) for c in cuts]})
    out, hit = [], None
    for a, b in zip(bounds, bounds[1:]):
        piece, hit = f.feed(text[a:b])
        out.append(piece)
        if hit is not None:
            break
    if hit is None:
        piece, hit = f.flush()
        out.append(piece)
    found = [(text.find(s), s) for s in stops if s in text]
    if found:
        pos = min(p for p, _ in found)
        assert "".join(out) == text[:pos]
        assert hit is not None and text.find(hit) == pos
    else:
        assert "".join(out) == text and hit is None


def test_anthropic_mapping(tokenizer):
    from openk3.chat_format import encode_request, render

    req = {"model": "m", "max_tokens": 9, "system": [{"type": "text", "text": "Be brief."}],
           "tools": [{"name": "t", "input_schema": {"type": "object"}}], "tool_choice": {"type": "any"},
           "stop_sequences": ["END"], "messages": [
               {"role": "user", "content": "hi"},
               {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                                 {"type": "text", "text": "ok"},
                                                 {"type": "tool_use", "id": "functions.t:0", "name": "t",
                                                  "input": {"a": 1}}]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "functions.t:0", "content": "42"},
                                            {"type": "text", "text": "thanks"}]}]}
    chat = {"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "ok", "reasoning_content": "hm", "tool_calls": [
            {"id": "functions.t:0", "type": "function", "function": {"name": "t", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "functions.t:0", "content": "42"},
        {"role": "user", "content": [{"type": "text", "text": "thanks"}]}],
        "tools": [{"type": "function", "function": {"name": "t", "description": None,
                                                    "parameters": {"type": "object"}}}],
        "tool_choice": "required"}
    got = to_chat_request(req)  # the K3 request itself: it renders as the chat-completions body does
    assert render(got, tokenizer) == encode_request(chat, tokenizer)
    assert [m.index for m in got.messages] == list(range(5)) and got.messages[3].id == "functions.t:0"
    assert got.options.tool_choice == "required" and got.stop == ["END"] and got.max_tokens == 9
    assert got.options.tools[0]["function"]["parameters"] == {"type": "object"}
    assert got.tool_images and not got.strict_tools and got.model == "m"
    prefill = to_chat_request({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "x"},
                                                                          {"role": "assistant", "content": "Sure"}]})
    assert prefill.messages[-1].partial and prefill.messages[-1].parts == ["Sure"]
    assert render(prefill, tokenizer) == encode_request({"messages": [
        {"role": "user", "content": "x"}, {"role": "assistant", "content": "Sure", "partial": True}]}, tokenizer)
    no_thinking = dict(req, messages=[req["messages"][0], {"role": "assistant", "content": [
        req["messages"][1]["content"][2]]}])
    with pytest.raises(APIError, match="thinking block is missing"):
        to_chat_request(no_thinking)
    assert to_chat_request(no_thinking, thinking_on=False).messages[2].reasoning is None


def test_metrics_read_engine_stats():
    stats = {"running": 2, "waiting": 5, "mla_blocks": {"used": 7, "free": 3},
             "prefix_cache": {"enabled": True, "mla": {"queries": 40, "hits": 16},
                              "kda": {"queries": 4, "hits": 1, "hit_tokens": 512}}}
    m = Metrics(lambda: stats)
    m.finished(None, {"prompt_tokens": 10, "cached_tokens": 4, "completion_tokens": 3}, 0.5)
    text = m.render().decode()

    def value(pattern: str) -> float:
        return float(re.search(rf"^{pattern} (\S+)$", text, re.M).group(1))

    assert value("openk3_requests_running") == 2 and value("openk3_requests_waiting") == 5
    assert value(r'openk3_prefix_cache_hits_total\{pool="mla"\}') == 16
    assert value(r'openk3_prefix_cache_queries_total\{pool="kda"\}') == 4
    assert value(r'openk3_engine_stat\{key="mla_blocks.used"\}') == 7
    assert value("openk3_prompt_tokens_total") == 10 and value("openk3_cached_tokens_total") == 4
    broken = Metrics(lambda: 1 / 0).render().decode()  # a failing stats call never breaks a scrape
    assert "openk3_requests_running 0.0" in broken


def test_min_p_reaches_the_sampling_params():
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    params = parse_request(dict(body, min_p=0.3)).to_sampling_params(max_tokens=4, stop_token_ids=[1])
    assert params.min_p == 0.3 and params.top_p == 0.95  # on top of the fixed sampling
    assert parse_request(body).to_sampling_params(max_tokens=4, stop_token_ids=[1]).min_p == 0.0


def test_responses_output_without_call_id_is_a_named_tool_result(tokenizer):
    """Codex sends context it injects as a ``function_call_output`` that answers no call and
    carries ``name`` (and ``namespace``) instead of ``call_id``: it renders as a tool result of
    that name after the run's answers; with neither ``call_id`` nor ``name`` it stays a 400."""
    from openk3.chat_format import encode_request, render
    from openk3.server.protocol import APIError
    from openk3.server.responses import parse_request

    tool = {"type": "function", "name": "make_goal", "parameters": {"type": "object"}}
    call = {"type": "function_call", "name": "make_goal", "arguments": '{"objective": "tidy"}',
            "call_id": "functions.make_goal:0"}
    answer = {"type": "function_call_output", "call_id": "functions.make_goal:0", "output": "created"}
    named = {"type": "function_call_output", "id": "fco_1", "name": "goal_objective", "namespace": "agent",
             "output": "tidy"}
    body = {"model": "m", "tools": [tool], "input": [{"role": "user", "content": "Set a goal: tidy"},
                                                     {"type": "reasoning", "summary": [], "content": []},
                                                     call, answer, named]}
    got, _ = parse_request(body)
    chat = {"messages": [
        {"role": "user", "content": "Set a goal: tidy"},
        {"role": "assistant", "content": "", "reasoning_content": "", "tool_calls": [
            {"id": "functions.make_goal:0", "type": "function",
             "function": {"name": "make_goal", "arguments": '{"objective": "tidy"}'}}]},
        {"role": "tool", "tool_call_id": "functions.make_goal:0", "content": "created"},
        {"role": "tool", "name": "goal_objective", "content": "tidy"}],
        "tools": [{"type": "function", "function": {"name": "make_goal", "parameters": {"type": "object"}}}]}
    prompt = render(got, tokenizer)
    assert prompt == encode_request(chat, tokenizer)
    text = tokenizer.decode(prompt.token_ids)
    assert text.index('tool="make_goal" index="1"') < text.index('tool="goal_objective" index="2"')
    with pytest.raises(APIError, match=r"input\[1\]\.call_id: a non-empty string is required"):
        parse_request({"model": "m", "input": [call, {"type": "function_call_output", "output": "x"}]})
