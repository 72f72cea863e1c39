"""The common agent SDKs, unchanged, against ``openk3 serve`` of the shipped model: one chat and one
tool loop each (the SDK runs the tool and sends its result back), with the real packages from the
test extras: the ``openai`` SDK (chat completions and responses), the ``anthropic`` SDK,
``openai-agents`` (its chat-completions and its responses model), ``pydantic-ai`` (its MoonshotAI
provider) and ``instructor`` (its default TOOLS mode and JSON_SCHEMA mode).

One server for the module, started ``--greedy`` so every reply is reproducible (the platform samples
at its fixed temperature and these SDKs cannot all send a ``seed``), served as ``kimi-k3``: the id
the SDKs' Kimi profiles know. The assertions are about the wire, not the tiny model's answers:
every request gets a 2xx (the SDKs raise on anything else), the SDK parses every reply into its own
types, a tool is called with arguments valid under its schema, and the tool result goes back.
Thinking is on (the platform's default), so every tool loop also carries the reasoning back, which
the platform requires (``thinking is enabled but reasoning_content is missing ...`` otherwise).
"""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.server.conftest import ServerProcess

MODEL = "kimi-k3"
KEY = "sk-sdk-test"
ASK = "What is the weather in Paris?"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
           "additionalProperties": False}


@pytest.fixture(scope="module")
def shipped(tmp_path_factory):
    srv = ServerProcess(None, "--served-model-name", MODEL, "--api-key", KEY, "--greedy",
                        log_dir=tmp_path_factory.mktemp("sdk-logs"))
    yield srv
    code = srv.stop()
    assert "Traceback" not in srv.output(), srv.output()
    assert code == 0, srv.output()


def _requests(srv) -> list[tuple[str, int]]:
    """(path, status) of every request the server logged so far."""
    out = []
    for line in srv.output().splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[1] in ("GET", "POST", "HEAD"):
            out.append((parts[2], int(parts[3])))
    return out


@pytest.fixture
def only_2xx(shipped):
    """Every request made during the test was answered 2xx, and at least one was made."""
    before = len(_requests(shipped))
    yield
    made = _requests(shipped)[before:]
    assert made and all(200 <= status < 300 for _, status in made), made


def _weather(city: str) -> str:
    return f"Sunny, 21 C in {city}"


# ---------------------------------------------------------------------------------------- openai
def test_openai_chat_and_tool_loop(shipped, only_2xx):
    from openai import OpenAI

    tool = {"type": "function", "function": {"name": "get_weather", "description": "Current weather for a city.",
                                             "parameters": WEATHER}}
    with OpenAI(base_url=shipped.url, api_key=KEY, max_retries=0, timeout=300) as c:
        r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say OK."}],
                                      max_completion_tokens=300)
        assert r.model == MODEL and r.choices[0].message.content and r.choices[0].finish_reason == "stop"
        messages = [{"role": "user", "content": ASK}]
        r1 = c.chat.completions.create(model=MODEL, messages=messages, tools=[tool], tool_choice="required",
                                       max_completion_tokens=400)
        msg = r1.choices[0].message
        assert r1.choices[0].finish_reason == "tool_calls" and msg.tool_calls
        call = msg.tool_calls[0]
        args = json.loads(call.function.arguments)
        assert call.function.name == "get_weather" and isinstance(args["city"], str)
        reasoning = (msg.model_extra or {}).get("reasoning_content")
        assert isinstance(reasoning, str)
        messages += [{"role": "assistant", "content": msg.content, "reasoning_content": reasoning,
                      "tool_calls": [call.model_dump(exclude_none=True)]},
                     {"role": "tool", "tool_call_id": call.id, "content": _weather(args["city"])}]
        r2 = c.chat.completions.create(model=MODEL, messages=messages, tools=[tool], max_completion_tokens=400)
        assert r2.choices[0].finish_reason in ("stop", "tool_calls")
        assert r2.usage.prompt_tokens > r1.usage.prompt_tokens


def test_openai_responses_chat_and_tool_loop(shipped, only_2xx):
    from openai import OpenAI

    tool = {"type": "function", "name": "get_weather", "description": "Current weather for a city.",
            "parameters": WEATHER, "strict": True}
    with OpenAI(base_url=shipped.url, api_key=KEY, max_retries=0, timeout=300) as c:
        r = c.responses.create(model=MODEL, input="Say OK.", max_output_tokens=300)
        assert r.status == "completed" and r.output_text
        r1 = c.responses.create(model=MODEL, input=ASK, tools=[tool], tool_choice="required", max_output_tokens=400)
        calls = [item for item in r1.output if item.type == "function_call"]
        assert calls and calls[0].name == "get_weather"
        city = json.loads(calls[0].arguments)["city"]
        back = [{"role": "user", "content": ASK}, *[item.model_dump(exclude_none=True) for item in r1.output],
                {"type": "function_call_output", "call_id": calls[0].call_id, "output": _weather(city)}]
        r2 = c.responses.create(model=MODEL, input=back, tools=[tool], max_output_tokens=400)
        assert r2.status == "completed" and r2.usage.input_tokens > r1.usage.input_tokens


# ------------------------------------------------------------------------------------- anthropic
def test_anthropic_chat_and_tool_loop(shipped, only_2xx):
    import anthropic

    tool = {"name": "get_weather", "description": "Current weather for a city.", "input_schema": WEATHER}
    with anthropic.Anthropic(base_url=shipped.base + "/anthropic", api_key=KEY, max_retries=0, timeout=300) as c:
        m = c.messages.create(model=MODEL, max_tokens=300, messages=[{"role": "user", "content": "Say OK."}])
        assert m.stop_reason == "end_turn" and any(b.type == "text" and b.text for b in m.content)
        history = [{"role": "user", "content": ASK}]
        m1 = c.messages.create(model=MODEL, max_tokens=400, tools=[tool], tool_choice={"type": "any"},
                               messages=history)
        uses = [b for b in m1.content if b.type == "tool_use"]
        assert m1.stop_reason == "tool_use" and uses and uses[0].name == "get_weather"
        assert any(b.type == "thinking" for b in m1.content)
        history += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m1.content]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                                  "content": _weather(uses[0].input["city"])}]}]
        m2 = c.messages.create(model=MODEL, max_tokens=400, tools=[tool], messages=history)
        # Anthropic's input_tokens excludes the prompt tokens read from the cache: compare whole prompts
        prompt = lambda u: u.input_tokens + (u.cache_read_input_tokens or 0) + (u.cache_creation_input_tokens or 0)  # noqa: E731
        assert m2.stop_reason in ("end_turn", "tool_use") and prompt(m2.usage) > prompt(m1.usage)


# --------------------------------------------------------------------------------- openai-agents
@pytest.mark.parametrize("surface", ["chat_completions", "responses"])
def test_openai_agents_chat_and_tool_loop(shipped, only_2xx, surface):
    from agents import (
        Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner, function_tool,
        set_tracing_disabled,
    )
    from agents.exceptions import MaxTurnsExceeded
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Current weather for a city."""
        calls.append(city)
        return _weather(city)

    async def run():
        client = AsyncOpenAI(base_url=shipped.url, api_key=KEY, max_retries=0, timeout=300)
        if surface == "chat_completions":
            # the SDK replays reasoning_content only for DeepSeek by default; the platform needs it back
            model = OpenAIChatCompletionsModel(model=MODEL, openai_client=client,
                                               should_replay_reasoning_content=lambda ctx: True)
        else:
            model = OpenAIResponsesModel(model=MODEL, openai_client=client)
        settings = ModelSettings(max_tokens=400)
        chat = await Runner.run(Agent(name="chat", instructions="Be brief.", model=model, model_settings=settings),
                                "Say OK.")
        assert isinstance(chat.final_output, str) and chat.final_output
        agent = Agent(name="tools", instructions="Use the tools.", model=model, tools=[get_weather],
                      model_settings=ModelSettings(max_tokens=400, tool_choice="required"))
        try:  # after the call, tool_choice is reset to auto: the model answers or calls again
            result = await Runner.run(agent, ASK, max_turns=3)
            assert isinstance(result.final_output, str) and len(result.raw_responses) >= 2
        except MaxTurnsExceeded:
            pass
        await client.close()

    asyncio.run(run())
    assert calls and all(isinstance(city, str) for city in calls)


# ------------------------------------------------------------------------------------ pydantic-ai
def test_pydantic_ai_chat_and_tool_loop(shipped, only_2xx):
    from openai import AsyncOpenAI
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.moonshotai import MoonshotAIProvider

    calls: list[str] = []

    async def run():
        client = AsyncOpenAI(base_url=shipped.url, api_key=KEY, max_retries=0, timeout=300)
        model = OpenAIChatModel(MODEL, provider=MoonshotAIProvider(openai_client=client))
        chat = await Agent(model, instructions="Be brief.", model_settings={"max_tokens": 400}).run("Say OK.")
        assert isinstance(chat.output, str) and chat.output
        agent = Agent(model, instructions="Use the tools.", model_settings={"max_tokens": 400})

        @agent.tool_plain
        def get_weather(city: str) -> str:
            """Current weather for a city."""
            calls.append(city)
            return _weather(city)

        result = await agent.run(ASK)
        kinds = [part.part_kind for msg in result.all_messages() for part in msg.parts]
        assert "tool-call" in kinds and "tool-return" in kinds and "thinking" in kinds, kinds
        await client.close()

    asyncio.run(run())
    assert calls


# ------------------------------------------------------------------------------------- instructor
def test_instructor_tools_and_json_schema(shipped, only_2xx):
    import instructor
    from openai import OpenAI
    from pydantic import BaseModel, ConfigDict

    class Weather(BaseModel):
        city: str
        celsius: int

    ask = [{"role": "user", "content": "It is 21 degrees in Paris. Extract the weather."}]
    with OpenAI(base_url=shipped.url, api_key=KEY, max_retries=0, timeout=300) as c:
        # default mode: a tool whose arguments are the object, named in tool_choice (which the
        # platform accepts and ignores; the grammar keeps the arguments valid when it is called)
        tools = instructor.from_openai(c)
        assert tools.mode == instructor.Mode.TOOLS
        w = tools.chat.completions.create(model=MODEL, response_model=Weather, messages=ask, max_tokens=400,
                                          max_retries=2)
        assert isinstance(w, Weather)
        # response_format json_schema, instant mode: the grammar makes the reply the object. The
        # schema forbids extra keys (additionalProperties false) so that the grammar closes the
        # object after its two fields: with extra keys allowed, the tiny model can keep adding keys
        # until max_tokens, which tests the model, not the client path
        class StrictWeather(Weather):
            model_config = ConfigDict(extra="forbid")

        js = instructor.from_openai(c, mode=instructor.Mode.JSON_SCHEMA)
        w, completion = js.chat.completions.create_with_completion(
            model=MODEL, response_model=StrictWeather, messages=ask, max_tokens=400, max_retries=0,
            extra_body={"thinking": {"type": "disabled"}})
        assert isinstance(w, StrictWeather) and completion.choices[0].finish_reason == "stop"
        assert json.loads(completion.choices[0].message.content) == w.model_dump()


# ----------------------------------------------------------------------------------------- kosong
def _kosong_records() -> list[dict]:
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "data" / "kosong" / "requests.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_kosong_recorded_requests(shipped, only_2xx):
    """kosong 0.56's recorded bodies (``tests/data/kosong``; it needs Python >= 3.13, so they are
    replayed, not re-sent by kosong): every one a 200 with a well-formed reply."""
    import httpx

    records = _kosong_records()
    assert {r["scenario"] for r in records} >= {"no_tools_stream", "no_tools_non_stream", "thinking_off",
                                                 "thinking_high_budget", "tool_loop_turn1", "tool_loop_turn2"}
    assert all(r["body"]["tools"] == [] for r in records if r["scenario"].startswith(("no_tools", "thinking")))
    with httpx.Client(base_url=shipped.base, headers={"Authorization": f"Bearer {KEY}"}, timeout=300) as http:
        for rec in records:
            body = rec["body"]
            assert rec["path"] == "/v1/chat/completions" and body["model"] == MODEL, rec
            r = http.post(rec["path"], json=body)
            assert r.status_code == 200, (rec["scenario"], r.text)
            if not rec["stream"]:
                reply = r.json()
                choice = reply["choices"][0]
                assert choice["message"]["role"] == "assistant" and choice["finish_reason"] in ("stop", "length")
                assert reply["usage"]["prompt_tokens"] > 0
                continue
            lines = [line for line in r.text.split("\n") if line]
            assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]", rec["scenario"]
            chunks = [json.loads(line[6:]) for line in lines[:-1]]
            assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
            assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0  # include_usage
            finish = [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch.get("finish_reason")]
            assert len(finish) == 1, (rec["scenario"], finish)
            if "max_completion_tokens" in body:
                assert chunks[-1]["usage"]["completion_tokens"] <= body["max_completion_tokens"]
            deltas = [ch["delta"] for c in chunks for ch in c["choices"]]
            if rec["scenario"].startswith("thinking_off"):
                assert not any(d.get("reasoning_content") for d in deltas)
            calls = [tc for d in deltas for tc in d.get("tool_calls") or []]
            if finish[0] == "tool_calls":
                assert calls and all(tc["function"]["name"] == "get_weather" for tc in calls if "id" in tc)
                args = "".join(tc["function"].get("arguments", "") for tc in calls)
                assert isinstance(json.loads(args)["city"], str)
            else:
                assert not calls
