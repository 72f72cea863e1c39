"""``openk3 cost``: pricing arithmetic, input shapes, price overrides, a running server's usage."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from openk3.cli import main as cli
from openk3.cost import Prices, TokenTotals, compute_cost, parse_metrics
from tests.server.conftest import MODEL, user


def test_default_prices_are_k3_list_prices():
    assert Prices() == Prices(cache_hit=0.30, input=3.00, output=15.00)
    t = TokenTotals(prompt_tokens=3_000_000, cached_tokens=1_000_000, completion_tokens=1_000_000)
    c = compute_cost(t)
    assert (c.cache_hit_tokens, c.cache_miss_tokens, c.output_tokens) == (1_000_000, 2_000_000, 1_000_000)
    assert c.total_usd == pytest.approx(0.30 + 2 * 3.00 + 15.00)


def test_usage_shapes():
    t = TokenTotals()
    t.add_usage({"prompt_tokens": 100, "completion_tokens": 10, "cached_tokens": 64})  # Kimi
    t.add_usage({"prompt_tokens": 50, "completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": 16}})  # OpenAI
    t.add_usage({"input_tokens": 20, "output_tokens": 7, "cache_read_input_tokens": 30,
                 "cache_creation_input_tokens": 0})  # Anthropic: input excludes cache reads
    assert (t.prompt_tokens, t.cached_tokens, t.completion_tokens, t.requests) == (200, 110, 22, 3)
    with pytest.raises(ValueError, match="usage"):
        t.add_usage({"tokens": 3})
    with pytest.raises(ValueError, match="inconsistent"):
        t.add_usage({"prompt_tokens": 10, "cached_tokens": 11, "completion_tokens": 0})


def test_cli_files_and_price_overrides(tmp_path, capsys):
    rows = [{"id": "a", "usage": {"prompt_tokens": 1_000_000, "completion_tokens": 200_000, "cached_tokens": 400_000}},
            {"usage": {"input_tokens": 100_000, "output_tokens": 0, "cache_read_input_tokens": 0}}]
    f = tmp_path / "usage.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in rows))
    prices = tmp_path / "prices.json"
    prices.write_text(json.dumps({"output": 10.0}))
    assert cli(["cost", str(f), "--prices", str(prices), "--price-input", "2.0", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prices_per_million"] == {"cache_hit": 0.30, "input": 2.0, "output": 10.0}
    assert out["tokens"] == {"cache_hit": 400_000, "cache_miss": 700_000, "output": 200_000}
    assert out["usd"]["total"] == pytest.approx(0.4 * 0.30 + 0.7 * 2.0 + 0.2 * 10.0)
    assert cli(["cost", "--prompt-tokens", "1000000", "--completion-tokens", "1000000"]) == 0
    assert "18.000000" in capsys.readouterr().out  # 3.00 + 15.00
    bad = tmp_path / "bad.json"
    bad.write_text('{"nope": 1}')
    assert cli(["cost", str(bad)]) == 2
    assert cli(["cost", "--prices", str(prices), "--price-output", "-1"]) == 2


def test_cost_of_a_running_server(server, client, capsys):
    client.chat.completions.create(model=MODEL, messages=user(), max_completion_tokens=2)
    text = httpx.get(server.base + "/metrics").text
    totals = parse_metrics(text)
    counter = lambda name: float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))  # noqa: E731
    assert totals.prompt_tokens == counter("openk3_prompt_tokens_total") > 0
    assert totals.completion_tokens == counter("openk3_completion_tokens_total") > 0
    assert cli(["cost", "--url", server.url, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tokens"]["output"] >= totals.completion_tokens
    assert out["usd"]["total"] == pytest.approx(
        (out["tokens"]["cache_hit"] * 0.30 + out["tokens"]["cache_miss"] * 3.0 + out["tokens"]["output"] * 15.0) / 1e6)
    with pytest.raises(ValueError, match="openk3"):
        parse_metrics("# nothing here\nother_metric 1\n")


def test_cost_without_input_prints_usage_and_exits_2(tmp_path, capsys):
    assert cli(["cost"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: openk3 cost") and "nothing to price" in err
    assert cli(["cost", "--json"]) == 2 and "nothing to price" in capsys.readouterr().err
    assert cli(["cost", "--price-output", "-1"]) == 2 and "must be >= 0" in capsys.readouterr().err
