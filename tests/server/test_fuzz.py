"""Schemathesis fuzz run over the server's own OpenAPI document (positive and negative cases):
no request may produce a 5xx, every 4xx carries an error envelope, and the server survives.

Bounded by example count per operation; output lengths are clamped to a few tokens so that valid
generation requests stay cheap (the cases are otherwise as generated).
"""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from tests.server.conftest import API_KEY

schema = schemathesis.pytest.from_fixture("api_schema")


@pytest.fixture(scope="module")
def api_schema(server):
    return schemathesis.openapi.from_url(server.base + "/openapi.json")


def _clamp(body) -> None:
    if not isinstance(body, dict):
        return
    for key in ("max_completion_tokens", "max_tokens"):
        v = body.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v > 2:
            body[key] = 2
    if "messages" in body and "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_completion_tokens"] = 2


@schema.parametrize()
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_server_errors(case, server):
    _clamp(case.body)
    response = case.call(headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    assert response.status_code < 500, (case.method, case.path, case.body, response.text)
    if response.status_code >= 400:
        body = response.json()
        assert "error" in body and isinstance(body["error"].get("message"), str), body


def test_server_still_healthy_after_fuzzing(server):
    assert httpx.get(server.base + "/health", timeout=10).json()["status"] == "ok"
