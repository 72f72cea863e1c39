"""Long context as served: the shipped model's declared context, the default output budget capped by
what the prompt leaves, and ``--max-model-len`` honoured up to what ``--cache-memory`` holds for one
sequence (beyond it: a start-up error naming both numbers, never a silent cap)."""

from __future__ import annotations

import asyncio
import json

import pytest

from openk3.cli import main as cli
from openk3.shipped import shipped_model_path


def _serving(context: int):
    from openk3.server import ChatServing, ModelInfo
    from openk3.server.metrics import Metrics
    from openk3.tokenizer import load_tokenizer

    return ChatServing(None, load_tokenizer("openk3-tiny"), ModelInfo("m", context), Metrics())


@pytest.mark.parametrize("context", [4096, 200_000, 1 << 20])
def test_default_output_budget_is_the_platforms_capped_by_the_room_left(context):
    from openk3.server.request import parse_request

    serving = _serving(context)
    body = {"model": "m", "messages": [{"role": "user", "content": "Hello there"}]}
    prep = serving.prepare(parse_request(body))
    assert prep.params.max_tokens == min(131_072, context - len(prep.prompt_ids))
    explicit = dict(body, max_completion_tokens=32_000)  # Claude Code's and the vendor verifier's sizes
    if context - len(prep.prompt_ids) >= 32_000:
        assert serving.prepare(parse_request(explicit)).params.max_tokens == 32_000


def test_the_shipped_model_declares_a_long_context():
    cfg = json.loads((shipped_model_path() / "config.json").read_text())
    assert cfg["text_config"]["max_position_embeddings"] >= 262_144


def test_serve_refuses_a_max_model_len_the_cache_cannot_hold(capsys):
    # 64 MiB of cache holds ~131K tokens of the shipped model's fp32 latents (384 B/token) next to
    # its snapshot share; 300,000 tokens do not fit and the server does not start.
    assert cli(["serve", "--cache-memory", "64M", "--max-model-len", "300000"]) == 2
    err = capsys.readouterr().err
    assert "max_model_len=300000: cache_memory=67108864 bytes holds" in err, err
    assert "holds sequences of up to" in err and "raise cache_memory or lower max_model_len" in err
    assert cli(["serve", "--max-model-len", str((1 << 20) + 1)]) == 2
    err = capsys.readouterr().err
    assert f"max_model_len={(1 << 20) + 1}: exceeds the model's context (max_position_embeddings=1048576)" in err


def test_models_endpoint_reports_the_served_context():
    from openk3.server.app import build_serving

    serving, engine = build_serving(str(shipped_model_path()), max_model_len=300_000, cache_memory=256 << 20)
    try:
        assert serving.model.context_length == 300_000 == engine.engine.max_model_len
    finally:
        asyncio.run(engine.shutdown())
    serving, engine = build_serving(str(shipped_model_path()))
    try:  # the default: the model's whole declared context
        cfg = json.loads((shipped_model_path() / "config.json").read_text())
        assert serving.model.context_length == cfg["text_config"]["max_position_embeddings"]
    finally:
        asyncio.run(engine.shutdown())
