"""``/v1/tokenizers/estimate-token-count`` with the official Kimi tokenizer reproduces the reference
``prompt_tokens`` of every shared chat-format fixture case (Moonshot-derived counts, chat-format spec
§12). In-process app: counting needs no engine."""

from __future__ import annotations

import asyncio
import json

import httpx

from openk3.server import ChatServing, ModelInfo, create_app
from openk3.server.metrics import Metrics
from tests.conftest import kimi_tokenizer, shared_path


def test_estimate_token_count_matches_fixture_cases():
    cases = [json.loads(line) for line in shared_path("fixtures", "k3-chat-format", "cases.jsonl").open()]
    cases = [c for c in cases if c["prompt_tokens"] is not None]
    assert len(cases) >= 40
    app = create_app(ChatServing(None, kimi_tokenizer(), ModelInfo("kimi-k3", 1_048_576), Metrics()))

    async def run():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return [await c.post("/v1/tokenizers/estimate-token-count", json=dict(case["request"], model="kimi-k3"))
                    for case in cases]

    for case, r in zip(cases, asyncio.run(run())):
        assert r.status_code == 200, (case["id"], r.text)
        assert r.json() == {"data": {"total_tokens": case["prompt_tokens"]}}, case["id"]
