"""``/v1/tokenizers/estimate-token-count`` with the official Kimi tokenizer reproduces the reference
``prompt_tokens`` of every shared chat-format fixture case (Moonshot-derived counts, chat-format spec
§12). In-process app: counting needs no engine."""

from __future__ import annotations

import asyncio
import json
import re

import httpx

from openk3.server import ChatServing, ModelInfo, create_app
from openk3.server.metrics import Metrics
from tests.chat.prompt_form import prompt_form
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
        want = prompt_form(case, kimi_tokenizer())["prompt_tokens"]  # the fixture under the §12 prompt rule
        assert r.json() == {"data": {"total_tokens": want}}, case["id"]


def test_oversized_text_is_refused_before_tokenizing(monkeypatch):
    """Both token-count endpoints answer 400 (``request: ...``) for text that certainly exceeds the
    served context (chars > context_length * longest-token bytes), without tokenizing any of it;
    text exactly at the bound is tokenized, and refused as soon as its tokens reach the context."""
    tok = kimi_tokenizer()
    ctx = 64
    serving = ChatServing(None, tok, ModelInfo("kimi-k3", ctx), Metrics())
    per_token = max(len(tok.decode_bytes([i])) for i in range(tok.vocab_size))
    assert serving.max_token_bytes() == per_token
    bound = ctx * per_token
    over = ("hello " * (bound // 6 + 2))[:bound + 1]
    at_bound = over[:-1]
    encoded: list[int] = []
    real_encode = tok.encode_text

    def spy(text: str) -> list[int]:
        encoded.append(len(text))
        return real_encode(text)

    monkeypatch.setattr(tok, "encode_text", spy)
    app = create_app(serving)
    # split over a user and an assistant message: the bound counts every rendered message text
    messages = [{"role": "user", "content": over[:100]},
                {"role": "assistant", "content": [{"type": "text", "text": over[100:]}]},
                {"role": "user", "content": "?"}]

    async def run():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            kimi = await c.post("/v1/tokenizers/estimate-token-count",
                                json={"model": "kimi-k3", "messages": messages})
            anth = await c.post("/anthropic/v1/messages/count_tokens", json={
                "model": "kimi-k3", "system": over, "messages": [{"role": "user", "content": "?"}]})
            seen = len(encoded)
            ok = await c.post("/v1/tokenizers/estimate-token-count",
                              json={"model": "kimi-k3", "messages": [{"role": "user", "content": at_bound}]})
            return kimi, anth, seen, ok

    kimi, anth, seen, ok = asyncio.run(run())
    n_chars = bound + 1 + 1  # the trailing "?" message counts too
    expected = (f"request: the text to render ({n_chars} characters of messages, tools and schemas, at least "
                f"{-(-n_chars // per_token)} tokens) exceeds the model token limit of {ctx}; not counted")
    assert kimi.status_code == 400, kimi.text
    assert kimi.json() == {"error": {"message": expected, "type": "invalid_request_error"}}
    assert anth.status_code == 400, anth.text
    assert anth.json() == {"type": "error", "error": {"type": "invalid_request_error", "message": expected}}
    assert seen == 0  # nothing was tokenized for the two refused requests
    # at the bound the text is tokenized, and refused as soon as its count reaches the context
    # (exactly: the same serving with a large context counts more than ctx tokens)
    assert ok.status_code == 400, ok.text
    message = ok.json()["error"]["message"]
    at_least = int(re.fullmatch(rf"request: the text to render \(at least (\d+) tokens\) exceeds the model token "
                                rf"limit of {ctx}; not counted", message).group(1))
    assert max(encoded) <= 64  # the long text counted piece by piece (iter_encode_text), never encoded whole
    monkeypatch.setattr(tok, "encode_text", real_encode)
    big = ChatServing(None, tok, ModelInfo("kimi-k3", 1_048_576), Metrics())
    exact = big.count_tokens(big.parse({"model": "kimi-k3", "messages": [{"role": "user", "content": at_bound}]},
                                        counting=True))
    assert ctx <= at_least <= exact


# The vendor verifier's two response_format bodies (MoonshotAI/Kimi-Vendor-Verifier
# tests/k3_features/test_response_format.py): Moonshot's tokenism counts 36 prompt tokens without
# the schema and 119 with it.
_VERIFIER_QUESTION = "请用 JSON 格式回答：北京是中国的首都吗？答案需要包含键 capital。"
_VERIFIER_SCHEMA = {"type": "json_schema", "json_schema": {
    "name": "capital_answer",
    "schema": {"type": "object", "properties": {"capital": {"type": "boolean"}}, "required": ["capital"],
               "additionalProperties": False}}}


def test_verifier_response_format_groundtruths_with_the_kimi_bpe():
    """``usage.prompt_tokens`` (what :meth:`ChatServing.prepare` counts) for the verifier's two
    response_format requests equals Moonshot's counts with the Kimi BPE: 36 and 119 (the live verifier
    run on the shipped model, which has its own BPE, cannot check these)."""
    serving = ChatServing(None, kimi_tokenizer(), ModelInfo("kimi-k3", 1_048_576), Metrics(),
                          make_constraint=lambda *a, **k: None)
    base = {"model": "kimi-k3", "messages": [{"role": "user", "content": _VERIFIER_QUESTION}],
            "thinking": {"type": "disabled"}}
    for body, want in ((base, 36), (dict(base, response_format=_VERIFIER_SCHEMA), 119)):
        assert serving.prepare(serving.parse(body)).prompt_tokens == want
