"""Record the exact chat-completions bodies kosong (Moonshot's agent SDK, Kimi CLI's LLM layer) sends.

Needs Python >= 3.13 and ``pip install kosong==0.56.0``; run against a live server:

    python tests/data/kosong/record.py http://127.0.0.1:8000/v1 kimi-k3 tests/data/kosong/requests.jsonl

Each scenario drives kosong's own ``Kimi`` provider through ``kosong.generate`` / ``kosong.step``;
every request leaving its ``httpx`` client is written as one JSON line ``{"scenario", "path",
"stream", "body", "status"}`` (the body byte-for-byte as kosong serialised it, parsed once). The
tool loop sends the tool's result back the way Kimi CLI does: the step's assistant message, then a
``tool`` message per call.
"""

from __future__ import annotations

import asyncio
import json
import sys

import httpx
import kosong
from kosong.chat_provider.kimi import Kimi
from kosong.message import Message
from kosong.tooling import CallableTool2, ToolOk, ToolReturnValue
from kosong.tooling.simple import SimpleToolset
from pydantic import BaseModel

RECORDS: list[dict] = []
_scenario = ["?"]
_send = httpx.AsyncClient.send


async def _recording_send(self, request, **kw):
    response = await _send(self, request, **kw)
    body = json.loads(request.content) if request.content else None
    RECORDS.append({"scenario": _scenario[0], "path": request.url.path, "stream": bool(body and body.get("stream")),
                    "body": body, "status": response.status_code})
    return response


httpx.AsyncClient.send = _recording_send


class WeatherParams(BaseModel):
    city: str


class GetWeather(CallableTool2[WeatherParams]):
    name: str = "get_weather"
    description: str = "Current weather for a city."
    params: type[WeatherParams] = WeatherParams

    async def __call__(self, params: WeatherParams) -> ToolReturnValue:
        return ToolOk(output=f"Sunny, 21 C in {params.city}")


async def main(base_url: str, model: str) -> None:
    kimi = Kimi(base_url=base_url, api_key="sk-kosong", model=model)
    hi = [Message(role="user", content="Say hi.")]
    system = "You are a helpful assistant."

    async def generate(name: str, provider: Kimi, history=hi):
        _scenario[0] = name
        await kosong.generate(provider, system, [], history)

    await generate("no_tools_stream", kimi)
    await generate("no_tools_non_stream", Kimi(base_url=base_url, api_key="sk-kosong", model=model, stream=False))
    await generate("thinking_off", kimi.with_thinking("off"))
    await generate("thinking_high_budget", kimi.with_thinking("high").with_generation_kwargs(
        max_completion_tokens=256, prompt_cache_key="kosong-session-1"))

    toolset = SimpleToolset()
    toolset += GetWeather()
    history = [Message(role="user", content="What is the weather in Paris?")]
    for turn in range(2):
        _scenario[0] = f"tool_loop_turn{turn + 1}"
        result = await kosong.step(kimi.with_generation_kwargs(max_completion_tokens=512), system, toolset, history)
        history.append(result.message)
        for tr in await result.tool_results():
            history.append(Message(role="tool", content=tr.return_value.output, tool_call_id=tr.tool_call_id))
        if not result.tool_calls:
            break


if __name__ == "__main__":
    base, model, out = sys.argv[1:4]
    asyncio.run(main(base, model))
    with open(out, "w") as f:
        for rec in RECORDS:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    print(f"{len(RECORDS)} requests, statuses {[r['status'] for r in RECORDS]} -> {out}")
