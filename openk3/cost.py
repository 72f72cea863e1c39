"""``openk3 cost``: what a workload would cost on the Kimi platform's price list.

Pricing is per million tokens in three classes (``../shared/spec/api.md`` §5.2): cache-hit input,
cache-miss input, output. K3's list prices are the default: $0.30 / $3.00 / $15.00. Output tokens
include reasoning tokens; cache-hit tokens are the ``cached_tokens`` part of ``prompt_tokens``.

Sources of token counts (summed):

* files of chat-completions responses, SSE-free usage objects or Anthropic usage objects, as JSON
  (one object or a list) or JSONL (one per line) — ``usage`` is taken from a response when present;
* a running openk3 server (``--url``): its recorded totals from ``/metrics``
  (``openk3_prompt_tokens_total``, ``openk3_cached_tokens_total``, ``openk3_completion_tokens_total``);
* explicit ``--prompt-tokens / --cached-tokens / --completion-tokens``.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass
from typing import Any, Iterable

PER = 1_000_000


@dataclass(frozen=True)
class Prices:
    """USD per million tokens."""

    cache_hit: float = 0.30
    input: float = 3.00
    output: float = 15.00


@dataclass
class TokenTotals:
    """Summed usage. ``cached_tokens`` is part of ``prompt_tokens`` (Kimi / OpenAI convention)."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    requests: int = 0

    def add_usage(self, usage: dict) -> None:
        """Add one usage object: Kimi/OpenAI (``prompt_tokens``, ``cached_tokens`` or
        ``prompt_tokens_details.cached_tokens``, ``completion_tokens``) or Anthropic
        (``input_tokens`` + ``cache_read_input_tokens`` + ``cache_creation_input_tokens``,
        ``output_tokens``).

        Raises:
            ValueError: neither shape, or negative / inconsistent counts.
        """
        if "prompt_tokens" in usage:
            prompt = int(usage["prompt_tokens"])
            details = usage.get("prompt_tokens_details") or {}
            cached = int(usage.get("cached_tokens", details.get("cached_tokens", 0)) or 0)
            completion = int(usage.get("completion_tokens", 0) or 0)
        elif "input_tokens" in usage:
            cached = int(usage.get("cache_read_input_tokens", 0) or 0)
            prompt = (
                int(usage["input_tokens"])
                + cached
                + int(usage.get("cache_creation_input_tokens", 0) or 0)
            )
            completion = int(usage.get("output_tokens", 0) or 0)
        else:
            raise ValueError(
                f"usage: not a usage object (no prompt_tokens / input_tokens): {usage!r}"
            )
        if min(prompt, cached, completion) < 0 or cached > prompt:
            raise ValueError(f"usage: inconsistent counts {usage!r}")
        self.prompt_tokens += prompt
        self.cached_tokens += cached
        self.completion_tokens += completion
        self.requests += 1

    def merge(self, other: "TokenTotals") -> None:
        """Add another set of totals."""
        self.prompt_tokens += other.prompt_tokens
        self.cached_tokens += other.cached_tokens
        self.completion_tokens += other.completion_tokens
        self.requests += other.requests


@dataclass(frozen=True)
class Cost:
    """A priced workload, USD."""

    cache_hit_tokens: int
    cache_miss_tokens: int
    output_tokens: int
    cache_hit_usd: float
    cache_miss_usd: float
    output_usd: float

    @property
    def total_usd(self) -> float:
        """Sum of the three classes."""
        return self.cache_hit_usd + self.cache_miss_usd + self.output_usd


def compute_cost(totals: TokenTotals, prices: Prices = Prices()) -> Cost:
    """Price `totals`: cache-hit input, cache-miss input (prompt - cached) and output tokens."""
    miss = totals.prompt_tokens - totals.cached_tokens
    return Cost(
        totals.cached_tokens,
        miss,
        totals.completion_tokens,
        totals.cached_tokens * prices.cache_hit / PER,
        miss * prices.input / PER,
        totals.completion_tokens * prices.output / PER,
    )


def _records(text: str) -> Iterable[Any]:
    text = text.strip()
    if not text:
        return []
    try:
        value = json.loads(text)
        return value if isinstance(value, list) else [value]
    except json.JSONDecodeError:
        return [json.loads(line) for line in text.splitlines() if line.strip()]


def add_records(totals: TokenTotals, text: str) -> None:
    """Add every response / usage object found in JSON or JSONL `text`.

    Raises:
        ValueError: malformed JSON or a record without usage.
    """
    for rec in _records(text):
        if not isinstance(rec, dict):
            raise ValueError(f"record: expected an object, got {type(rec).__name__}")
        totals.add_usage(rec["usage"] if isinstance(rec.get("usage"), dict) else rec)


def parse_metrics(text: str) -> TokenTotals:
    """Recorded usage from a Prometheus exposition of an openk3 server.

    Raises:
        ValueError: the usage counters are missing (not an openk3 server).
    """
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, _, value = line.rpartition(" ")
        values[name.strip()] = float(value)
    keys = (
        "openk3_prompt_tokens_total",
        "openk3_cached_tokens_total",
        "openk3_completion_tokens_total",
    )
    if not all(k in values for k in keys):
        raise ValueError("metrics: no openk3 usage counters found (is this an openk3 server?)")
    requests = sum(
        v for k, v in values.items() if k.startswith("openk3_request_latency_seconds_count")
    )
    return TokenTotals(
        int(values[keys[0]]), int(values[keys[1]]), int(values[keys[2]]), int(requests)
    )


def fetch_server_usage(url: str, api_key: str | None = None, timeout: float = 10.0) -> TokenTotals:
    """Recorded usage of a running server (``GET {url}/metrics``; `url` may end in ``/v1``)."""
    import httpx

    base = url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(base + "/metrics", headers=headers, timeout=timeout)
    r.raise_for_status()
    return parse_metrics(r.text)


def load_prices(
    path: str | None, cache_hit: float | None, input: float | None, output: float | None
) -> Prices:
    """K3 list prices, overridden by a JSON file (keys ``cache_hit``, ``input``, ``output``) and then
    by explicit values.

    Raises:
        ValueError: unknown keys or negative prices.
    """
    values = asdict(Prices())
    if path:
        with open(path, encoding="utf-8") as f:
            table = json.load(f)
        unknown = set(table) - set(values)
        if unknown:
            raise ValueError(f"prices: unknown keys {sorted(unknown)} (cache_hit, input, output)")
        values.update({k: float(v) for k, v in table.items()})
    for key, v in (("cache_hit", cache_hit), ("input", input), ("output", output)):
        if v is not None:
            values[key] = float(v)
    if min(values.values()) < 0:
        raise ValueError(f"prices: must be >= 0, got {values}")
    return Prices(**values)


def main(args: Any) -> int:
    """``openk3 cost`` (arguments from :mod:`openk3.cli`). Returns the exit status."""
    try:
        prices = load_prices(args.prices, args.price_cache_hit, args.price_input, args.price_output)
        totals = TokenTotals()
        for path in args.files:
            text = sys.stdin.read() if path == "-" else open(path, encoding="utf-8").read()
            add_records(totals, text)
        if args.url:
            totals.merge(fetch_server_usage(args.url))
        if args.prompt_tokens or args.completion_tokens or args.cached_tokens:
            totals.add_usage(
                {
                    "prompt_tokens": args.prompt_tokens,
                    "cached_tokens": args.cached_tokens,
                    "completion_tokens": args.completion_tokens,
                }
            )
    except (OSError, ValueError, KeyError) as e:
        print(f"openk3 cost: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # network errors from --url
        print(f"openk3 cost: cannot read usage: {e}", file=sys.stderr)
        return 2
    cost = compute_cost(totals, prices)
    if args.json:
        print(
            json.dumps(
                {
                    "prices_per_million": asdict(prices),
                    "requests": totals.requests,
                    "tokens": {
                        "cache_hit": cost.cache_hit_tokens,
                        "cache_miss": cost.cache_miss_tokens,
                        "output": cost.output_tokens,
                    },
                    "usd": {
                        "cache_hit": cost.cache_hit_usd,
                        "cache_miss": cost.cache_miss_usd,
                        "output": cost.output_usd,
                        "total": cost.total_usd,
                    },
                },
                indent=2,
            )
        )
        return 0
    rows = [
        ("cache-hit input", cost.cache_hit_tokens, prices.cache_hit, cost.cache_hit_usd),
        ("cache-miss input", cost.cache_miss_tokens, prices.input, cost.cache_miss_usd),
        ("output", cost.output_tokens, prices.output, cost.output_usd),
    ]
    print(f"{'class':<18}{'tokens':>16}{'$/1M':>10}{'USD':>14}")
    for name, n, p, usd in rows:
        print(f"{name:<18}{n:>16,}{p:>10.2f}{usd:>14.6f}")
    print(f"{'total':<18}{sum(r[1] for r in rows):>16,}{'':>10}{cost.total_usd:>14.6f}")
    return 0
