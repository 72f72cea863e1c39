"""K3 output parser (spec k3-chat-format.md §11): round trips, truncation, markup safety, tolerance.

The round-trip partner is the renderer's ``render_assistant_output`` (the ids the model would
generate for a message); the expected message is computed from the generated message itself.
"""

from __future__ import annotations

import json

import pytest
import tiktoken
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from openk3.chat_format import render_assistant_output
from openk3.chat_format.output_grammar import MARKER_STRINGS, output_grammar
from openk3.chat_format.parser import (
    ContentDelta,
    MessageEnd,
    OutputParser,
    ReasoningDelta,
    ToolCallArgumentsDelta,
    ToolCallEnd,
    ToolCallStart,
)
from openk3.chat_format.tool_ids import make_tool_call_id, next_tool_call_index, parse_tool_call_id
from tests.conftest import kimi_tokenizer, shared_path

tok = kimi_tokenizer


def ids_of(*parts):
    """Ids of a hand-written output: marker spellings become the special ids, the rest plain text."""
    t, out = tok(), []
    for p in parts:
        out.extend([t.special_id(p)] if p in MARKER_STRINGS else t.encode_text(p))
    return out


O, C, S, E = MARKER_STRINGS


def run(ids, chunks=None, **kw):
    """Parse `ids` (one id per feed, or split at the `chunks` boundaries); returns (events, message)."""
    p = OutputParser(tok(), **kw)
    events = []
    if chunks is None:
        for i in ids:
            events += p.feed(i)
    else:
        bounds = [0, *chunks, len(ids)]
        for a, b in zip(bounds, bounds[1:]):
            events += p.feed(ids[a:b])
    events += p.finish()
    return events, p.message()


def replay(events):
    """Fields rebuilt from the event stream alone (what a streaming client sees)."""
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    calls, ended = {}, {}
    for e in events:
        if isinstance(e, ToolCallStart):
            assert e.index not in calls, "a call index was started twice"
            calls[e.index] = {"id": e.id, "name": e.name, "args": ""}
        elif isinstance(e, ToolCallArgumentsDelta):
            calls[e.index]["args"] += e.text
        elif isinstance(e, ToolCallEnd):
            assert calls[e.index]["args"] == e.arguments, "argument deltas do not add up to the final arguments"
            assert (calls[e.index]["id"], calls[e.index]["name"]) == (e.id, e.name)
            ended[e.index] = calls[e.index]
    ends = [e for e in events if isinstance(e, MessageEnd)]
    assert len(ends) == 1 and events[-1] is ends[0], "exactly one MessageEnd, last"
    return reasoning, content, [ended[i] for i in sorted(ended)]


def check_stream(events, msg):
    """The streaming contract: the deltas add up to the final message, field by field."""
    reasoning, content, calls = replay(events)
    assert reasoning == (msg.reasoning_content or "")
    assert content == (msg.content or "")
    assert [(c["id"], c["name"], c["args"]) for c in calls] == [
        (c["id"], c["function"]["name"], c["function"]["arguments"]) for c in msg.tool_calls]
    assert events[-1].finish_reason == msg.finish_reason


def fields(msg):
    yield from (msg.reasoning_content or "", msg.content or "")
    for c in msg.tool_calls:
        yield from (c["id"], c["function"]["name"], c["function"]["arguments"])


# ----------------------------------------------------------------------------- generators

_names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_.\-]{0,10}", fullmatch=True)
_leaf = (st.none() | st.booleans() | st.integers(-10**15, 10**15)
         | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=10))
_value = st.recursive(_leaf, lambda ch: st.lists(ch, max_size=3) | st.dictionaries(st.text(max_size=5), ch, max_size=3),
                      max_leaves=6)


def _is_json(s):
    try:
        json.loads(s)
        return True
    except ValueError:
        return False


_raw_args = st.text(min_size=1, max_size=16).filter(lambda s: s.strip() and not _is_json(s))
_arguments = st.dictionaries(st.text(max_size=8), _value, max_size=4).map(
    lambda d: json.dumps(d, ensure_ascii=False)) | _raw_args
_no_marker = st.text(max_size=24).filter(lambda s: not any(m in s for m in MARKER_STRINGS))


@st.composite
def assistant_messages(draw, max_calls=3):
    """(message dict, thinking, tool_index_start, expected parsed message dict)."""
    thinking = draw(st.booleans())
    reasoning = draw(_no_marker.filter(lambda s: s == "" or s.strip())) if thinking else None
    content = draw(_no_marker.filter(bool) | st.none())
    calls = draw(st.lists(st.tuples(_names, _arguments), max_size=max_calls))
    start = draw(st.integers(0, 50))
    msg = {"role": "assistant", "content": content}
    if thinking:
        msg["reasoning_content"] = reasoning
    expected = dict(msg)
    if calls:
        msg["tool_calls"] = [{"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": a}}
                             for i, (n, a) in enumerate(calls)]
        expected["tool_calls"] = [{"id": make_tool_call_id(n, start + i), "type": "function",
                                   "function": {"name": n, "arguments": a}} for i, (n, a) in enumerate(calls)]
    return msg, thinking, start, expected


def _render(msg, thinking):
    return render_assistant_output(msg, tok(), thinking=thinking)


def _kw(thinking, start):
    return {"start_channel": "think" if thinking else "response", "tool_index_start": start}


# ----------------------------------------------------------------------------- round trips

def test_worked_example():
    """Spec §14: the example continuation parses to the documented message, finish_reason stop."""
    r = "The user wants Berlin weather in °F; the tool returned 61 and overcast."
    c = "It's 61 °F and overcast in Berlin."
    ids = ids_of(r, C, "think", S, O, "response", S, c, C, "response", S, C, "message", S, E)
    events, msg = run(ids)
    assert msg.to_openai() == {"role": "assistant", "content": c, "reasoning_content": r}
    assert msg.finish_reason == "stop" and msg.ended
    check_stream(events, msg)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(assistant_messages())
def test_round_trip_token_by_token(case):
    msg, thinking, start, expected = case
    ids = _render(msg, thinking)
    events, parsed = run(ids, **_kw(thinking, start))
    assert parsed.to_openai() == expected
    assert parsed.finish_reason == ("tool_calls" if msg.get("tool_calls") else "stop")
    check_stream(events, parsed)
    # every delta is whole characters: no replacement char that the message itself lacks
    for e in events:
        if isinstance(e, (ReasoningDelta, ContentDelta)):
            assert "\ufffd" not in e.text or "\ufffd" in json.dumps(expected, ensure_ascii=False)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(assistant_messages(max_calls=2))
def test_round_trip_every_split(case):
    """Feeding the stream in two chunks, for every split point, gives the same events and message."""
    msg, thinking, start, expected = case
    ids = _render(msg, thinking)
    ref_events, _ = run(ids, **_kw(thinking, start))
    for k in range(len(ids) + 1):
        events, parsed = run(ids, chunks=[k], **_kw(thinking, start))
        assert parsed.to_openai() == expected, f"split at {k}"
        assert events == ref_events, f"split at {k}"


def test_round_trip_nested_unicode_three_calls():
    """A fixed, hard case: unicode everywhere, escapes in keys, nested values, a json block."""
    args1 = json.dumps({"q": "naïve \"quoted\" <|close|>argument<|sep|> \\ 日本", "k&\"ey": [1, 2.5, {"x": None}],
                        "flag": False, "n": -0.5, "lit &amp; &quot;": "&quot;", "deep": {"a": {"b": ["é", True]}}}, ensure_ascii=False)
    msg = {"role": "assistant", "reasoning_content": " 思考 🤔\n", "content": "Résultat: 😀",
           "tool_calls": [{"id": "x", "type": "function", "function": {"name": "web.search-v2_x", "arguments": args1}},
                          {"id": "y", "type": "function", "function": {"name": "ping", "arguments": "{}"}},
                          {"id": "z", "type": "function", "function": {"name": "raw", "arguments": "not json {"}}]}
    _, parsed = run(_render(msg, True), tool_index_start=7)
    out = parsed.to_openai()
    assert [c["id"] for c in out["tool_calls"]] == ["functions.web.search-v2_x:7", "functions.ping:8", "functions.raw:9"]
    assert [c["function"]["arguments"] for c in out["tool_calls"]] == [args1, "{}", "not json {"]
    assert (out["reasoning_content"], out["content"]) == (" 思考 🤔\n", "Résultat: 😀")


def test_literal_marker_text_is_text():
    """§11.3: markers are matched on ids; their spelling as ordinary text cannot close a channel."""
    ids = ids_of("a <|close|>think<|sep|> b", C, "think", S, O, "response", S, "<|end_of_msg|> ", C, "response", S)
    _, msg = run(ids)
    assert msg.reasoning_content == "a <|close|>think<|sep|> b" and msg.content == "<|end_of_msg|> "


# ----------------------------------------------------------------------------- markup safety

_TAG_WORDS = ["think", "response", "tools", "call", "argument", "json", "message", " think ", "bogus",
              ' tool="f.g-h"', ' index="1"', ' key="k"', ' type="string"', ' type="number"', ' type="object"',
              ' key="a&quot;b"', "=", '"']


@st.composite
def token_soup(draw):
    """Arbitrary mixtures of marker ids, tag words, other special ids and text without '|', so that a
    '|' in any output field can only come from a special id's spelling leaking."""
    t = tok()
    pieces = st.one_of(
        st.sampled_from([t.open_id, t.close_id, t.sep_id]).map(lambda i: [i]),
        st.sampled_from([t.end_of_msg_id, t.eos_id, t.media_pad_id, t.special_id("[BOS]"),
                         t.special_id("<|reserved_token_163700|>")]).map(lambda i: [i]),
        st.sampled_from(_TAG_WORDS).map(t.encode_text),
        st.text(st.characters(blacklist_characters="|"), max_size=8).map(t.encode_text),
        st.integers(0, t.vocab_size - 257).filter(lambda i: b"|" not in t.decode_bytes([i])).map(lambda i: [i]),
    )
    return [i for p in draw(st.lists(pieces, max_size=40)) for i in p]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(token_soup(), st.booleans(), st.integers(0, 40))
def test_never_emits_markup(ids, thinking, cut):
    events, msg = run(ids, start_channel="think" if thinking else "response")
    for f in fields(msg):
        assert "|" not in f.replace("functions.", ""), f"special-token text leaked: {f!r}"
    for e in events:
        assert "|" not in getattr(e, "text", ""), e
    check_stream(events, msg)
    assert len({c["id"] for c in msg.tool_calls}) == len(msg.tool_calls)
    # chunking never changes the result
    events2, msg2 = run(ids, chunks=[min(cut, len(ids))], start_channel="think" if thinking else "response")
    assert events2 == events and msg2 == msg


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(assistant_messages(max_calls=2))
def test_truncated_at_every_prefix(case):
    """Max tokens at any point: no exception, no markup, only complete parts in the final message."""
    msg, thinking, start, expected = case
    ids = _render(msg, thinking)
    t = tok()
    close_call = [t.close_id, *t.encode_text("call"), t.sep_id]
    close_think = [t.close_id, *t.encode_text("think"), t.sep_id]
    close_msg = [t.close_id, *t.encode_text("message"), t.sep_id]
    want_r, want_c = expected.get("reasoning_content"), expected["content"] or ""
    want_calls = expected.get("tool_calls", [])

    def count(sub, seq):
        return sum(seq[i:i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))

    for k in range(len(ids) + 1):
        prefix = ids[:k]
        events, parsed = run(prefix, **_kw(thinking, start))
        check_stream(events, parsed)
        for f in fields(parsed):
            assert not any(m in f for m in MARKER_STRINGS)
        if thinking:
            assert want_r.startswith(parsed.reasoning_content)
            if count(close_think, prefix):
                assert parsed.reasoning_content == want_r
            else:
                assert parsed.content is None
        assert want_c.startswith(parsed.content or "")
        n_done = count(close_call, prefix)
        assert parsed.tool_calls == want_calls[:n_done], f"prefix {k}"
        ended = count(close_msg, prefix) > 0
        assert parsed.ended == ended
        assert parsed.finish_reason == ("tool_calls" if n_done else "stop" if ended else "length")


# ----------------------------------------------------------------------------- tolerance and edge cases

def test_whitespace_tolerance_around_markers():
    """Whitespace inside tags and between structural elements is ignored; bodies stay verbatim."""
    ids = ids_of("why", C, " think\n", S, "\n", O, "\nresponse ", S, " Hi \n", C, "response", S, "\n\n",
                 O, "tools", S, "\n", O, 'call  tool = "a.b-c_d"   index="1" ', S, "\n  ",
                 O, 'argument key="n" type="number"', S, " 42\n", C, "argument ", S, "\n",
                 O, 'argument\tkey="s"\ttype=" string "', S, "  raw  ", C, "argument", S, " ",
                 C, " call", S, "\n", C, "tools", S, "\n", C, "message\n", S, " ", E)
    events, msg = run(ids, tool_index_start=2)
    assert msg.reasoning_content == "why" and msg.content == " Hi \n"
    assert msg.tool_calls == [{"id": "functions.a.b-c_d:2", "type": "function",
                               "function": {"name": "a.b-c_d", "arguments": '{"n": 42, "s": "  raw  "}'}}]
    assert msg.ended and msg.finish_reason == "tool_calls"
    check_stream(events, msg)


def test_lenient_structure():
    """§11.1: tools right after the think close; a response ended by the tools opener; the think
    opener repeated; text after the think close with no response opener; text after the end ignored."""
    call = [O, 'call tool="f" index="1"', S, C, "call", S]
    _, m = run(ids_of(O, "think", S, "r", C, "think", S, O, "tools", S, *call, C, "tools", S, C, "message", S, E))
    assert (m.reasoning_content, m.content, len(m.tool_calls)) == ("r", None, 1)
    _, m = run(ids_of("r", C, "think", S, O, "response", S, "c", O, "tools", S, *call, C, "tools", S, C, "message", S))
    assert (m.content, m.tool_calls[0]["function"]["arguments"], m.ended) == ("c", "{}", True)
    _, m = run(ids_of("r", C, "think", S, "\n  answer ", C, "message", S, E, "ignored", O, "tools", S))
    assert (m.content, m.finish_reason) == ("answer ", "stop")
    _, m = run(ids_of("r", O, "bogus x=\"1\"", S, "s", C, "think", S, "  ", C, "message", S))
    assert (m.reasoning_content, m.content) == ("rs", None)


def test_argument_typing():
    """§11.3: string bodies raw, other types JSON-decoded, undecodable or non-finite bodies kept as text."""
    args = [("s", "string", " 1 "), ("n", "number", " 5 "), ("f", "number", "0.75"), ("b", "boolean", "true"),
            ("z", "null", "null"), ("o", "object", '{"a": [1,2]}'), ("bad", "number", "abc"),
            ("nan", "number", "NaN"), ("big", "number", "1e400"), ("notype", None, "[true]")]
    parts = []
    for k, ty, body in args:
        attr = f' key="{k}"' + (f' type="{ty}"' if ty else "")
        parts += [O, "argument" + attr, S, body, C, "argument", S]
    _, m = run(ids_of("", C, "think", S, O, "tools", S, O, 'call tool="t"', S, *parts, C, "call", S))
    got = json.loads(m.tool_calls[0]["function"]["arguments"])
    assert got == {"s": " 1 ", "n": 5, "f": 0.75, "b": True, "z": None, "o": {"a": [1, 2]}, "bad": "abc",
                   "nan": "NaN", "big": "1e400", "notype": [True]}


def test_malformed_calls():
    """A call without a name and an argument without a key are dropped; a json block after
    argument tags is ignored; a call interrupted by the next call is closed implicitly."""
    ids = ids_of("", C, "think", S, O, "tools", S,
                 O, 'call index="1"', S, O, 'argument key="a" type="string"', S, "x", C, "argument", S, C, "call", S,
                 O, 'call tool="g"', S, O, 'argument type="string"', S, "lost", C, "argument", S,
                 O, 'argument key="k" type="string"', S, "v", C, "argument", S,
                 O, 'json type="object"', S, "{ignored}", C, "json", S,
                 O, 'call tool="h"', S, O, "json", S, " {raw} ", C, "json", S,
                 C, "tools", S, C, "message", S)
    events, m = run(ids)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in m.tool_calls] == [
        ("g", '{"k": "v"}'), ("h", " {raw} ")]
    assert [c["id"] for c in m.tool_calls] == ["functions.g:0", "functions.h:1"]
    check_stream(events, m)


def test_utf8_split_across_tokens():
    """A character spread over several byte tokens appears whole in one delta, never as U+FFFD."""
    t = tok()
    text = "a🤔b𝔘c"
    byte_ids = [i for i in range(t.vocab_size - 256) if len(t.decode_bytes([i])) == 1]
    by_byte = {t.decode_bytes([i])[0]: i for i in byte_ids}
    ids = [by_byte[b] for b in text.encode()]
    events, m = run(ids + ids_of(C, "think", S), start_channel="think")
    deltas = [e.text for e in events if isinstance(e, ReasoningDelta)]
    assert "".join(deltas) == text and all("\ufffd" not in d for d in deltas)
    assert "🤔" in deltas and "𝔘" in deltas
    # a truncated character is dropped, not turned into U+FFFD
    _, m = run(ids[:2], start_channel="think")
    assert m.reasoning_content == "a"


def test_finish_reason_and_options():
    call = [O, "tools", S, O, 'call tool="f"', S, O, 'argument key="a" type="number"', S, "1", C, "argument", S,
            C, "call", S]
    full = ids_of("r", C, "think", S, *call, C, "tools", S, C, "message", S, E)
    _, m = run(full)
    assert m.finish_reason == "tool_calls"
    _, m = run(ids_of("r", C, "think", S, *call))  # complete call, then max tokens: still tool_calls (§11.2)
    assert m.finish_reason == "tool_calls" and not m.ended
    _, m = run(ids_of("r", C, "think", S, O, "response", S, "x"))
    assert m.finish_reason == "length" and m.content == "x"
    events, m = run(full, tools_enabled=False)
    assert m.tool_calls == [] and m.finish_reason == "stop"
    assert not any(isinstance(e, (ToolCallStart, ToolCallArgumentsDelta, ToolCallEnd)) for e in events)
    # without streaming, a call's events come together, and an unfinished call produces none
    events, _ = run(full, stream_tool_arguments=False)
    kinds = [type(e).__name__ for e in events if "ToolCall" in type(e).__name__]
    assert kinds == ["ToolCallStart", "ToolCallArgumentsDelta", "ToolCallArgumentsDelta", "ToolCallArgumentsDelta",
                     "ToolCallEnd"]
    events, _ = run(full[:-12], stream_tool_arguments=False)
    assert not any(isinstance(e, ToolCallStart) for e in events)


def test_custom_vocabulary_ids():
    """Marker ids come from the tokenizer: a byte-level vocab with markers at 300..303 parses the same,
    and the official marker ids are unknown to it."""
    enc = tiktoken.Encoding("tiny", pat_str=r"\S+|\s+", mergeable_ranks={bytes([i]): i for i in range(256)},
                            special_tokens={"<|end_of_msg|>": 300, "<|open|>": 301, "<|close|>": 302, "<|sep|>": 303,
                                            "<|media_pad|>": 304})
    ids = enc.encode("é r<|close|>think<|sep|><|open|>response<|sep|>ok<|media_pad|><|close|>response<|sep|>"
                     "<|close|>message<|sep|><|end_of_msg|>", allowed_special="all")
    p = OutputParser(enc)
    p.feed(ids)
    p.finish()
    assert (p.message().reasoning_content, p.message().content) == ("é r", "ok")
    with pytest.raises(ValueError, match="token_ids"):
        OutputParser(enc).feed([163587])


def test_bad_input():
    with pytest.raises(ValueError, match="token_ids"):
        OutputParser(tok()).feed([-1])
    with pytest.raises(ValueError, match="token_ids"):
        OutputParser(tok()).feed(["a"])
    # Not an id and not a sequence of ids: a ValueError naming the argument, never a TypeError.
    for bad in (1.5, None, "12", b"\x01", True, object(), [1, 2.0], [True], {1: 2}):
        with pytest.raises(ValueError, match="token_ids"):
            OutputParser(tok()).feed(bad)
    with pytest.raises(ValueError, match="decode"):
        OutputParser(tok()).feed([tok().vocab_size])
    with pytest.raises(ValueError, match="start_channel"):
        OutputParser(tok(), start_channel="tools")
    with pytest.raises(ValueError, match="tool_index_start"):
        OutputParser(tok(), tool_index_start=-1)
    with pytest.raises(ValueError, match="tokenizer"):
        OutputParser(object())


def test_tool_ids():
    assert make_tool_call_id("get-weather.v2_x", 3) == "functions.get-weather.v2_x:3"
    for name in ("a", "a:b", "x.y-z_", "日本"):
        assert parse_tool_call_id(make_tool_call_id(name, 12)) == (name, 12)
    assert parse_tool_call_id("functions.glob: 1") == ("glob", 1)
    assert parse_tool_call_id("call_abc") is None
    history = [{"role": "user", "content": "x"},
               {"role": "assistant", "tool_calls": [{"id": "call_a"}, {"id": "call_b"}]},
               {"role": "assistant", "tool_calls": [{"id": "functions.f:9"}]}]
    assert next_tool_call_index(history) == 10
    assert next_tool_call_index(history[:2]) == 2
    with pytest.raises(ValueError, match="name"):
        make_tool_call_id("", 0)
    with pytest.raises(ValueError, match="index"):
        make_tool_call_id("f", -1)


def test_output_grammar_matches_tokenizer():
    g = output_grammar(tok())
    t = tok()
    assert (g.marker_ids.open, g.marker_ids.close, g.marker_ids.sep, g.marker_ids.end_of_msg) == (
        t.open_id, t.close_id, t.sep_id, t.end_of_msg_id) == (163587, 163588, 163589, 163586)
    assert g.tags["call"] == ("tool", "index") and g.tags["argument"] == ("key", "type")
    assert output_grammar(start_channel="response").ebnf.startswith('output ::= text "<|close|>" "response"')
