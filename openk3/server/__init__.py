"""The Kimi-compatible API server (``openk3 serve``).

* :mod:`openk3.server.protocol` — :class:`~openk3.server.protocol.APIError`, shared body checks,
  response and Anthropic wire models (pydantic);
* :mod:`openk3.server.request` — the chat-completions wire models, :class:`~openk3.server.request.
  ChatRequest` (one parsed request, whatever the surface) and :func:`~openk3.server.request.parse_request`;
* :mod:`openk3.server.validation` — the platform's request contract, checked on the ChatRequest (400s
  before rendering);
* :mod:`openk3.server.serving` — check order, rendering, one engine request as parser events
  (stop strings, usage), OpenAI responses / SSE;
* :mod:`openk3.server.anthropic` — ``/anthropic/v1/messages`` over the same core;
* :mod:`openk3.server.metrics` — Prometheus metrics;
* :mod:`openk3.server.app` — FastAPI app, guards, error mapping, ``main`` for the CLI.

Contract: ``../shared/spec/api.md`` (with its §11 decisions) and ``../shared/spec/k3-chat-format.md``.
"""

from openk3.server.app import build_serving, create_app, default_model_path, main
from openk3.server.serving import ChatServing, ModelInfo
from openk3.server.validation import Limits

__all__ = [
    "ChatServing",
    "Limits",
    "ModelInfo",
    "build_serving",
    "create_app",
    "default_model_path",
    "main",
]
