"""The shipped default model through the real server and the official ``openai`` SDK (issue 8).

``openk3 serve`` with no MODEL must serve ``openk3-tiny`` from inside the package (no downloads) and
the model must actually do the four things the acceptance names: a streamed answer with
``reasoning_content`` before ``content``; a ``tool_choice: required`` call of the right tool with
schema-valid arguments; a valid ``json_schema`` object; ``OK`` for "Say 'OK' and nothing else.";
and (issue 9) an image question answered through an ``image_url`` data URL part.
The server samples at the platform's fixed temperature (1.0 with thinking, top_p 0.95), so each
request carries a ``seed`` to make the smoke reproducible. Quality is measured by ``openk3 eval``
(MODEL_CARD.md), not here: these are a handful of requests, and CI never retrains the model.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from openk3.shipped import DEFAULT_MODEL, shipped_model_path
from openk3.datasets.sft_tasks import TOOLS
from tests.server.conftest import ServerProcess

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "pet": {"type": "string"}},
          "required": ["name", "age", "pet"], "additionalProperties": False}


@pytest.fixture(scope="module")
def default_server(tmp_path_factory):
    srv = ServerProcess(None, log_dir=tmp_path_factory.mktemp("default-logs"))
    yield srv
    srv.stop()
    assert "Traceback" not in srv.output(), srv.output()


@pytest.fixture
def sdk(default_server):
    from openai import OpenAI

    with OpenAI(base_url=default_server.url, api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def test_the_shipped_model_is_complete_and_small():
    d = shipped_model_path()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "chat_template.jinja", "MODEL_CARD.md"):
        assert (d / name).is_file(), name
    assert sum(p.stat().st_size for p in d.iterdir()) <= 64 * 2**20


def test_load_pretrained_by_name_has_every_k3_component():
    from openk3.config import preset
    from openk3.pretrained import load_pretrained

    model = load_pretrained(DEFAULT_MODEL)
    cfg, ref = model.config, preset("openk3-tiny")
    for f in ("hidden_size", "num_hidden_layers", "layer_types", "n_routed_experts", "num_experts_per_tok",
              "n_shared_experts", "attn_res_block_size", "hidden_act", "first_k_dense_replace"):
        assert getattr(cfg, f) == getattr(ref, f), f
    assert "linear_attention" in cfg.layer_types and cfg.layer_types[-1] == "full_attention"
    assert cfg.use_attn_res


def test_serves_openk3_tiny_by_default(default_server, sdk):
    assert default_server.model == DEFAULT_MODEL
    models = sdk.models.list().data
    assert [m.id for m in models] == [DEFAULT_MODEL]
    assert models[0].model_extra["supports_image_in"] is True  # the tiny MoonViT ships with it
    declared = json.loads((shipped_model_path() / "config.json").read_text())["text_config"]["max_position_embeddings"]
    assert models[0].model_extra["context_length"] == declared >= 262_144  # real agent prompts fit


def test_image_question_answers(sdk):
    from openk3.datasets.vision_data import QUESTION_TYPES, eval_image_items

    # One held-out item per question type: each gets a finished, non-empty answer, and the
    # prompt's usage counts its 16 image tokens (112 px image, 14 px patches, 2x2 merge).
    items = eval_image_items(0, len(QUESTION_TYPES))
    texts = []
    for it in items:
        r = sdk.chat.completions.create(model=DEFAULT_MODEL, seed=0, max_tokens=200, messages=it.request["messages"],
                                        reasoning_effort="low")
        assert r.choices[0].finish_reason == "stop"
        texts.append(r.choices[0].message.content or "")
        assert r.usage.prompt_tokens > 16
    assert all(t.strip() for t in texts), texts


def test_streamed_reasoning_then_content(sdk):
    stream = sdk.chat.completions.create(model=DEFAULT_MODEL, seed=0, max_tokens=300, stream=True,
                                         messages=[{"role": "user", "content": "Compute 14 + 23."}])
    order, reasoning, content, finish = [], "", "", None
    for chunk in stream:
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        r = (d.model_extra or {}).get("reasoning_content")
        if r:
            reasoning += r
            order.append("r")
        if d.content:
            content += d.content
            order.append("c")
        finish = chunk.choices[0].finish_reason or finish
    assert reasoning.strip() and content.strip(), (reasoning, content)
    assert "c" in order and "r" not in order[order.index("c"):], order  # all reasoning before any content
    assert finish == "stop"


def test_required_tool_call_picks_the_right_tool_with_valid_arguments(sdk):
    tools = [TOOLS["get_weather"], TOOLS["convert_currency"], TOOLS["set_timer"]]
    r = sdk.chat.completions.create(model=DEFAULT_MODEL, seed=0, max_tokens=300, tools=tools, tool_choice="required",
                                    messages=[{"role": "user", "content": "What is the weather in Oslo?"}])
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), TOOLS["get_weather"]["function"]["parameters"])


def test_json_schema_answer_is_a_valid_object(sdk):
    r = sdk.chat.completions.create(
        model=DEFAULT_MODEL, seed=0, max_tokens=300,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
        messages=[{"role": "user", "content": "Mia is 30 years old and has a cat. Give the record as JSON."}])
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)


def test_say_ok(sdk):
    r = sdk.chat.completions.create(model=DEFAULT_MODEL, seed=0, max_tokens=200,
                                    messages=[{"role": "user", "content": "Say 'OK' and nothing else."}])
    assert r.choices[0].message.content == "OK"
    assert r.choices[0].finish_reason == "stop"


def test_no_tools_means_no_tool_calls(default_server):
    """Without tools the shipped model called a tool it invented on 4 of 8 seeds (Anthropic surface: 3
    of 8) for this request; with no tools channel in the grammar, the reply is always content."""
    import concurrent.futures

    import httpx

    msg = [{"role": "user", "content": "What is the weather in Paris?"}]

    def openai_(seed):
        r = httpx.post(default_server.url + "/chat/completions", timeout=300,
                       json={"model": DEFAULT_MODEL, "messages": msg, "max_tokens": 300, "seed": seed}).json()
        return r["choices"][0]["finish_reason"], "tool_calls" in r["choices"][0]["message"]

    def anthropic_(_):
        r = httpx.post(default_server.base + "/anthropic/v1/messages", timeout=300,
                       json={"model": DEFAULT_MODEL, "messages": msg, "max_tokens": 300}).json()  # no seed field here
        return r["stop_reason"], any(b["type"] == "tool_use" for b in r["content"])

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(openai_, range(8))) + list(pool.map(anthropic_, range(8)))
    assert all(reason not in ("tool_calls", "tool_use") and not has_calls for reason, has_calls in results), results


# Fixed held-out items (seed-0 eval sets, `openk3.eval.suite_items`) that the shipped weights answer
# correctly through `openk3 serve --greedy`, the way MODEL_CARD.md's table is measured: a
# multiplication, an addition and a subtraction (items 2-4); two tool requests whose arguments must be copied from
# the user's words (a calculator expression, a time zone); a name given in an earlier turn; an image
# colour. Items were picked from the first ones the weights get right (greedy and also at the
# platform's sampling), so a regression of the skill, the chat format or the server shows here.
SMOKE_ITEMS = {"arithmetic": (2, 3, 4), "tools": (18, 29), "recall": (0,)}
SMOKE_METRIC = {"arithmetic": "correct", "tools": "args_correct", "recall": "correct"}


@pytest.fixture(scope="module")
def greedy_server(tmp_path_factory):
    srv = ServerProcess(None, "--greedy", log_dir=tmp_path_factory.mktemp("greedy-logs"))
    yield srv
    srv.stop()
    assert "Traceback" not in srv.output(), srv.output()


def _greedy_message(server, request: dict, seed: int) -> dict:
    import httpx

    r = httpx.post(server.url + "/chat/completions", timeout=300,
                   json=dict(request, model=DEFAULT_MODEL, seed=seed, max_tokens=256))
    assert r.status_code == 200, r.text
    assert r.headers["x-openk3-decoding"] == "greedy"
    return r.json()["choices"][0]["message"]


@pytest.mark.parametrize("suite", sorted(SMOKE_ITEMS))
def test_fixed_held_out_items_are_answered_correctly(greedy_server, suite):
    from openk3.eval import SCORERS, suite_items

    items = suite_items(suite, 0, max(SMOKE_ITEMS[suite]) + 1)
    for i in SMOKE_ITEMS[suite]:
        it = items[i]
        msg = _greedy_message(greedy_server, it.request, i)
        assert SCORERS[suite](it, msg)[SMOKE_METRIC[suite]], (suite, i, it.expected, msg)
    if suite == "tools":  # the copied value really is the user's: it appears in the request text
        for i in SMOKE_ITEMS[suite]:
            for call in items[i].expected["calls"]:
                for v in call["arguments"].values():
                    assert str(v).lower() in items[i].request["messages"][-1]["content"].lower()


def test_fixed_held_out_image_colour(greedy_server):
    from openk3.datasets.vision_data import eval_image_items, score_image

    it = eval_image_items(0, 1)[0]
    assert it.expected["type"] == "color"
    msg = _greedy_message(greedy_server, it.request, 0)
    assert score_image(it, msg)["correct"], (it.expected, msg)
