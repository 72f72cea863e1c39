"""Prometheus metrics of the server (``GET /metrics``), on a private registry per app.

Server-side series (updated by the serving core):

* ``openk3_requests_total{endpoint, status}`` — HTTP requests by route and status code;
* ``openk3_overloaded_total`` — requests refused with 429 (waiting queue full);
* ``openk3_prompt_tokens_total``, ``openk3_cached_tokens_total``, ``openk3_completion_tokens_total``
  — usage of finished generations (what ``openk3 cost --url`` prices);
* ``openk3_time_to_first_token_seconds``, ``openk3_inter_token_latency_seconds``,
  ``openk3_request_latency_seconds`` — histograms (TTFT counts from the moment the request was
  accepted; inter-token latency is per generated token).

Engine series (read from ``engine.stats()`` at scrape time): ``openk3_requests_running``,
``openk3_requests_waiting``, ``openk3_prefix_cache_queries_total{pool}``,
``openk3_prefix_cache_hits_total{pool}`` (from ``prefix_cache.<pool>.queries / hits``) and
``openk3_engine_stat{key}`` for every numeric entry of the stats dict (pool usage: used / free /
cached blocks, slots, snapshots), keys joined by dots.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


def _flatten(d: Any, prefix: str = "") -> Iterable[tuple[str, float]]:
    if isinstance(d, dict):
        for k, v in d.items():
            yield from _flatten(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(d, (int, float)) and not isinstance(d, bool):
        yield prefix, float(d)


class _EngineCollector:
    """Turns ``engine.stats()`` into gauges/counters at scrape time (no background polling)."""

    def __init__(self, stats: Callable[[], dict]):
        self.stats = stats

    def describe(self):
        return []

    def collect(self):
        try:
            stats = self.stats() or {}
        except Exception:  # a scrape must never fail because the engine is busy or shutting down
            stats = {}
        flat = dict(_flatten(stats))
        running = GaugeMetricFamily(
            "openk3_requests_running", "requests being decoded or prefilled"
        )
        waiting = GaugeMetricFamily("openk3_requests_waiting", "requests in the admission queue")
        running.add_metric([], flat.get("running", 0.0))
        waiting.add_metric([], flat.get("waiting", 0.0))
        yield running
        yield waiting
        queries = CounterMetricFamily(
            "openk3_prefix_cache_queries", "prefix-cache lookups (tokens) per pool", labels=["pool"]
        )
        hits = CounterMetricFamily(
            "openk3_prefix_cache_hits", "prefix-cache hits (tokens) per pool", labels=["pool"]
        )
        other = GaugeMetricFamily(
            "openk3_engine_stat", "numeric entries of engine.stats()", labels=["key"]
        )
        for key, value in flat.items():
            parts = key.split(".")
            if len(parts) >= 2 and parts[-1] in ("queries", "hits"):
                (queries if parts[-1] == "queries" else hits).add_metric([parts[-2]], value)
            other.add_metric([key], value)
        yield queries
        yield hits
        yield other


class Metrics:
    """The server's metric set. ``stats`` is ``engine.stats`` (or None)."""

    def __init__(self, stats: Callable[[], dict] | None = None):
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "openk3_requests", "HTTP requests", ["endpoint", "status"], registry=r
        )
        self.overloads = Counter(
            "openk3_overloaded", "requests refused with 429 (queue full)", registry=r
        )
        self.prompt_tokens = Counter(
            "openk3_prompt_tokens", "prompt tokens of finished requests", registry=r
        )
        self.cached_tokens = Counter(
            "openk3_cached_tokens", "prompt tokens served from the prefix cache", registry=r
        )
        self.completion_tokens = Counter("openk3_completion_tokens", "generated tokens", registry=r)
        self.ttft = Histogram(
            "openk3_time_to_first_token_seconds",
            "time to first generated token",
            buckets=_LATENCY_BUCKETS + (120.0,),
            registry=r,
        )
        self.itl = Histogram(
            "openk3_inter_token_latency_seconds",
            "time between generated tokens",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "openk3_request_latency_seconds",
            "request latency, accepted to finished",
            buckets=_E2E_BUCKETS,
            registry=r,
        )
        if stats is not None:
            r.register(_EngineCollector(stats))

    def request(self, endpoint: str, status: int) -> None:
        """Count one HTTP request by route and status."""
        self.requests.labels(endpoint, str(status)).inc()

    def overloaded(self) -> None:
        """Count one 429 (waiting queue full)."""
        self.overloads.inc()

    def first_token(self, seconds: float) -> None:
        """Observe a time to first token."""
        self.ttft.observe(seconds)

    def inter_token(self, seconds: float, n_tokens: int = 1) -> None:
        """Observe the gap before `n_tokens` new tokens, split evenly between them."""
        per = seconds / max(n_tokens, 1)
        for _ in range(max(n_tokens, 1)):
            self.itl.observe(per)

    def finished(self, prep: Any, usage: dict, seconds: float) -> None:
        """Record a finished generation's usage and latency."""
        self.prompt_tokens.inc(usage["prompt_tokens"])
        self.cached_tokens.inc(usage["cached_tokens"])
        self.completion_tokens.inc(usage["completion_tokens"])
        self.e2e.observe(seconds)

    def render(self) -> bytes:
        """The Prometheus text exposition."""
        return generate_latest(self.registry)
