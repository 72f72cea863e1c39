"""The project's chat template (openk3/chat_format/template.jinja): rendered with jinja2 it equals
the renderer on every fixture case and on random conversations; it ships via save_pretrained."""

from __future__ import annotations

import copy
import json

import jinja2
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from openk3.chat_format import chat_template, encode_request, render_template, template_variables
from tests.chat.prompt_form import prompt_form
from tests.conftest import kimi_tokenizer, shared_cases, shared_params, shared_path

tok = kimi_tokenizer


CASES, NO_SHARED = shared_cases(lambda: [json.loads(s) for s in shared_path(
    "fixtures", "k3-chat-format", "cases.jsonl").read_text().splitlines()])
PARAMS = shared_params(CASES, NO_SHARED, id=lambda c: c["id"])  # without ../shared: skipped with its reason


@pytest.fixture(scope="module")
def kimi():
    return tok()


@pytest.mark.parametrize("case", PARAMS)
def test_template_equals_renderer(kimi, case):
    """Our request -> variables mapping, then the template, gives the renderer's text (= the fixture
    text under the §12 prompt rule)."""
    assert render_template(template_variables(copy.deepcopy(case["request"]))) == prompt_form(case, tok())["text"]


@pytest.mark.parametrize("case", PARAMS)
def test_template_with_fixture_variables(case):
    """The fixture's own template variables (partial message removed, server text appended)."""
    text = render_template(copy.deepcopy(case["template_vars"]))
    if case["server_convention"]:
        text += case["server_convention"]["text_appended_after_template_output"]
    assert text == prompt_form(case, tok())["text"]


def test_template_in_plain_jinja_environment():
    """No reliance on trim_blocks / lstrip_blocks / sandbox / loopcontrols: a bare Environment with
    a json.dumps-style tojson renders the same text."""
    env = jinja2.Environment()
    env.filters["tojson"] = lambda v, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        v, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals["raise_exception"] = lambda msg: (_ for _ in ()).throw(ValueError(msg))
    template = env.from_string(chat_template())
    for case in CASES:
        text = template.render(**template_variables(copy.deepcopy(case["request"])))
        assert text == prompt_form(case, tok())["text"], case["id"]


def test_template_with_transformers():
    """transformers' own chat-template renderer (what vLLM / SGLang use) gives the same text."""
    utils = pytest.importorskip("transformers.utils.chat_template_utils")
    source = chat_template()
    for case in CASES:
        v = template_variables(copy.deepcopy(case["request"]))
        messages, tools, agp = v.pop("messages"), v.pop("tools", None), v.pop("add_generation_prompt")
        out, _ = utils.render_jinja_template([messages], tools=tools, chat_template=source,
                                             add_generation_prompt=agp, **v)
        assert out[0] == prompt_form(case, tok())["text"], case["id"]


def test_save_pretrained_writes_template(kimi, tmp_path):
    kimi.save_pretrained(tmp_path)
    written = (tmp_path / "chat_template.jinja").read_text(encoding="utf-8")
    assert written == chat_template()
    case = next(c for c in CASES if c["id"] == "kvv_groundtruth_539")
    assert render_template(template_variables(case["request"]), source=written) == prompt_form(case, kimi)["text"]


def test_template_raises_like_renderer(kimi):
    # An unresolved run (the id matches no call) falls back to order; its second result has neither
    # an id-matched call nor a name, and there is no second call: both renderers fail.
    req = {"messages": [{"role": "user", "content": "q"},
                        {"role": "assistant", "tool_calls": [{"id": "a", "function": {"name": "f", "arguments": {}}}]},
                        {"role": "tool", "tool_call_id": "nope", "content": "r"},
                        {"role": "tool", "content": "s"}]}
    with pytest.raises(ValueError, match=r"messages\[3\]\.tool_call_id"):
        encode_request(req, kimi)
    with pytest.raises(ValueError, match="no resolvable tool name"):
        render_template(template_variables(req))
    with pytest.raises(ValueError, match="thinking_effort"):
        render_template({"messages": req["messages"][:1], "thinking_effort": "extreme"})


# ----------------------------------------------------------------------------- random conversations

_text = st.text(max_size=12) | st.sampled_from(["<|open|>", '"&amp;"', "  ", "\n", "🍜 你好", "x"])
_scalar = (st.none() | st.booleans() | st.integers(-10**6, 10**6)
           | st.floats(allow_nan=False, allow_infinity=False) | _text)
_json = st.recursive(_scalar, lambda c: st.lists(c, max_size=3) | st.dictionaries(_text, c, max_size=3), max_leaves=6)
_names = st.sampled_from(["get_weather", "a.b-c", "f_1"])
_schema = {"type": "object", "properties": {"Zeta": {"type": "string"}, "alpha": {"maxItems": 1, "maximum": 2}}}


def _content(draw):
    kind = draw(st.sampled_from(["str", "none", "parts", "missing"]))
    if kind == "str":
        return {"content": draw(_text)}
    if kind == "none":
        return {"content": None}
    if kind == "missing":
        return {}
    parts = draw(st.lists(st.one_of(_text.map(lambda t: {"type": "text", "text": t}),
                                    st.just({"type": "image_url", "image_url": {"url": "data:x"}})), max_size=3))
    return {"content": parts}


def _arguments(draw):
    obj = draw(st.dictionaries(_text, _json, max_size=3))
    return draw(st.sampled_from([obj, json.dumps(obj), json.dumps(obj, ensure_ascii=False), "{bad json", "", None]))


@st.composite
def requests(draw):
    msgs, n_dyn = [], 0
    for _ in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(["user", "system", "developer", "assistant", "dynamic"]))
        name = draw(st.none() | st.sampled_from(["", "alice", 'R&D "team"']))
        if kind == "dynamic":
            n_dyn += 1
            msgs.append({"role": "system", "content": "", "tools": [
                {"type": "function", "function": {"name": f"dyn{n_dyn}", "parameters": _schema}}]})
        elif kind != "assistant":
            msgs.append({"role": kind, **({"name": name} if name is not None else {}), **_content(draw)})
        else:
            m = {"role": "assistant", **_content(draw)}
            key = draw(st.sampled_from(["reasoning_content", "reasoning", None]))
            if key:
                m[key] = draw(_text)
            calls = [{"id": draw(st.sampled_from([f"c{j}", f"c{j}", None])), "type": "function",
                      "function": {"name": draw(_names), "arguments": _arguments(draw)}}
                     for j in range(draw(st.integers(0, 3)))]
            if calls or draw(st.booleans()):
                m["tool_calls"] = calls
            msgs.append(m)
            ids = [c["id"] for c in calls]
            for k in draw(st.permutations(range(len(calls)))) if calls else []:
                if draw(st.booleans()):
                    r = {"role": "tool", "content": draw(_text)}
                    if ids[k] is not None and draw(st.integers(0, 4)):
                        r["tool_call_id"] = draw(st.sampled_from([ids[k]] * 6 + ["zzz"]))  # zzz: rejected
                    elif draw(st.booleans()):
                        r["name"] = draw(_names)
                    msgs.append(r)
    if draw(st.booleans()):
        msgs.append({"role": "assistant", "partial": True, **_content(draw),
                     **({"reasoning_content": draw(_text)} if draw(st.booleans()) else {})})
    req = {"messages": msgs}
    if draw(st.booleans()):
        req["tools"] = [{"type": "function", "function": {"name": "req_tool", "parameters": _schema}}]
    req.update(draw(st.sampled_from([{}, {"reasoning_effort": "low"}, {"thinking": {"type": "disabled"}},
                                     {"thinking": {"effort": "high"}, "reasoning_effort": "low"},
                                     {"chat_template_kwargs": {"thinking": False}}, {"reasoning_effort": "medium"}])))
    req["tool_choice"] = draw(st.sampled_from([None, "auto", "none", "required"]))
    req["response_format"] = draw(st.sampled_from([
        None, {"type": "text"}, {"type": "json_object"},
        {"type": "json_schema", "json_schema": {"name": "s", "schema": _schema}},
        {"type": "json_schema", "json_schema": {"json_schema": _schema}},
        {"type": "json_schema", "json_schema": {"name": "bare"}}, {"type": "json_schema"}]))
    return req


def _outcome(fn):
    try:
        return fn()
    except ValueError:
        return ValueError


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests())
def test_property_template_equals_renderer(req):
    """On random conversations (names, parts, images, reasoning, 0-3 calls with every argument form,
    results reordered / partial / without ids, dynamic tools, partial prefill, every option), the
    template and the renderer agree: same text, or both reject the request."""
    want = _outcome(lambda: encode_request(copy.deepcopy(req), tok()).text)
    got = _outcome(lambda: render_template(template_variables(copy.deepcopy(req))))
    assert got == want
