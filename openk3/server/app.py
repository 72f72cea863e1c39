"""The FastAPI application, its guards and error mapping, and ``openk3 serve``.

Routes (``../shared/spec/api.md`` §0.1): ``POST /v1/chat/completions``, ``POST /v1/responses``
(the OpenAI Responses API, stateless: :mod:`openk3.server.responses`), ``GET /v1/models``,
``GET /v1/models/{id}``, ``POST /v1/tokenizers/estimate-token-count``, ``POST /anthropic/v1/messages``,
``POST /anthropic/v1/messages/count_tokens``, ``GET /anthropic/v1/models`` and ``/{id}`` (Anthropic's
model objects), ``GET|HEAD /health``, ``GET /metrics``, and ``GET|HEAD`` on the roots ``/``, ``/v1``,
``/anthropic`` (reachability probes).

Guards, in order, as one ASGI middleware in front of the routes (api.md §11 validation order):
the API key (``Authorization: Bearer`` or ``x-api-key``, compared in constant time; only ``/v1`` and
``/anthropic`` are protected — ``/health``, ``/metrics`` and the bare roots stay open for probes and scrapers, and the
API description ``/openapi.json``, ``/docs``, ``/redoc`` for tooling such as the schemathesis run),
then the body size (``Content-Length`` first, then the bytes actually received) -> 413: the JSON
endpoints take up to ``Limits.max_body_bytes`` (32 MiB), every other path at most 64 KiB announced and never
reads or buffers a body; then, for a JSON body of 256 KiB or more, the body screen
(:mod:`openk3.server.screen`: structure, JSON, model, size bound, checked in a worker process so
that the server never parses a body it refuses).

Every error answers with the Kimi envelope ``{"error": {"message", "type"}}`` (the Anthropic one
under ``/anthropic``); unexpected exceptions are logged and answered 500 without internals.
A client that disconnects aborts its engine request (streaming: the response task is cancelled;
non-streaming: a watcher on the connection). SIGTERM and SIGINT (Ctrl-C) are handled in one place
(``main``'s server class): one line says the signal arrived and how many requests are in flight;
uvicorn stops accepting connections and waits for in-flight responses; the lifespan then drains
and stops the engine, and the process exits 0. A second SIGINT aborts what is still running. Each
request gets one access log line (:func:`access_line`: method, path, status, prompt / cached /
completion tokens, latency; never request or response text) unless ``--quiet``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import logging
import os
import errno
import signal
import socket
import sys
import time
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import Body, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from openk3.server import anthropic, responses
from openk3.server.metrics import CONTENT_TYPE, Metrics
from openk3.server.protocol import (
    AnthropicCountRequest,
    AnthropicMessagesRequest,
    APIError,
    ChatCompletion,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenCountResponse,
    field_path,
    first_error,
)
from openk3.server.request import ChatCompletionRequest, TokenCountRequest
from openk3.server.screen import BodyScreen, ScreenSpec, invalid_json_message, long_integer_message
from openk3.server.serving import ChatServing, Generation, ModelInfo
from openk3.server.validation import Limits

log = logging.getLogger("openk3.server")

_ENDPOINTS = {
    "/v1/chat/completions",
    "/v1/responses",
    "/v1/models",
    "/v1/tokenizers/estimate-token-count",
    "/anthropic/v1/messages",
    "/anthropic/v1/messages/count_tokens",
    "/anthropic/v1/models",
    "/health",
    "/metrics",
    "/",
    "/v1",
    "/anthropic",
}
_ROOTS = ("/", "/v1", "/v1/", "/anthropic", "/anthropic/")  # status only: open like /health
SMALL_BODY = 64 * 1024  # body bytes a request to a path without a JSON body may announce
CLIENT_CLOSED = 499  # nginx's "client closed request": counted for requests whose client left
_BODY_MODELS = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/responses": responses.ResponsesRequest,
    "/v1/tokenizers/estimate-token-count": TokenCountRequest,
    "/anthropic/v1/messages": AnthropicMessagesRequest,
    "/anthropic/v1/messages/count_tokens": AnthropicCountRequest,
}
_ERRORS = {
    400: {"model": ErrorResponse},
    401: {"model": ErrorResponse},
    404: {"model": ErrorResponse},
    413: {"model": ErrorResponse},
    429: {"model": ErrorResponse},
}
# A route takes its body as the JSON sent (``Body``): the surface's parser validates it against its
# wire model (_BODY_MODELS) and builds the ChatRequest, once; the OpenAPI document still shows
# the wire model as the body schema (:func:`_openapi`).
JSONBody = Annotated[Any, Body()]


def default_model_path() -> str | None:
    """The checkpoint served when ``openk3 serve`` gets no MODEL: the default model shipped in the
    package (``openk3-tiny``, :mod:`openk3.shipped`), served under its directory name. None when the
    package was installed without it."""
    from openk3.shipped import shipped_model_path

    try:
        return str(shipped_model_path())
    except FileNotFoundError:
        return None


def _error_response(path: str, err: APIError) -> JSONResponse:
    body = err.anthropic_body() if path.startswith("/anthropic") else err.kimi_body()
    return JSONResponse(body, status_code=err.status, headers=err.headers)


ACCESS = (
    "openk3.access"  # scope key: a dict the route fills with its Generation, for the access log
)
access_log = logging.getLogger("openk3.access")


def access_line(method: str, path: str, status: int, seconds: float, usage: dict | None) -> str:
    """One access-log line: method, path, status, the request's token counts (when it generated),
    latency. Never any request or response text.

    >>> access_line("POST", "/v1/chat/completions", 200, 1.5, {"prompt_tokens": 9, "cached_tokens": 0,
    ...             "completion_tokens": 4})
    'POST /v1/chat/completions 200 prompt=9 cached=0 completion=4 1.500s'
    """
    tokens = ""
    if usage is not None:
        tokens = (
            f" prompt={usage.get('prompt_tokens', 0)} cached={usage.get('cached_tokens', 0)} "
            f"completion={usage.get('completion_tokens', 0)}"
        )
    return f"{method} {path} {status}{tokens} {seconds:.3f}s"


class Guard:
    """ASGI middleware: request metrics, API key (401), body size (413), the access log line; see
    the module docstring."""

    def __init__(
        self,
        app: Any,
        api_key: str | None,
        max_body_bytes: int,
        metrics: Metrics,
        log_requests: bool = False,
        screen: BodyScreen | None = None,
        in_flight: dict | None = None,
    ):
        self.app = app
        self.api_key = api_key
        self.max_body = max_body_bytes
        self.metrics = metrics
        self.log_requests = log_requests
        self.screen = screen
        # {"requests": n}: requests not yet fully answered (what SIGTERM / Ctrl-C waits for; the
        # server's connection tasks outlive the last byte of a response for a moment)
        self.in_flight = in_flight if in_flight is not None else {"requests": 0}

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        given = headers.get(b"x-api-key", b"")
        auth = headers.get(b"authorization", b"")
        if auth[:7].lower() == b"bearer ":
            given = auth[7:].strip()
        return hmac.compare_digest(given, self.api_key.encode("utf-8"))

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        endpoint = path.rstrip("/") or "/"
        if endpoint not in _ENDPOINTS:
            endpoint = next(
                (
                    p + "/{id}"
                    for p in ("/v1/models", "/v1/responses", "/anthropic/v1/models")
                    if path.startswith(p + "/")
                ),
                "other",
            )
        status_box = [500]
        t0 = time.monotonic()
        scope[ACCESS] = access = {}

        answered = False
        self.in_flight["requests"] += 1

        def done() -> None:
            nonlocal answered
            if not answered:
                answered = True
                self.in_flight["requests"] -= 1

        async def send_tracked(message: dict) -> None:
            if message["type"] == "http.response.start":
                status_box[0] = message["status"]
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                done()  # before the last bytes leave: a client may act on them (SIGTERM) at once
            await send(message)

        try:
            unanswered = await self._guarded(scope, receive, send_tracked, path)
            if unanswered is not None:
                status_box[0] = unanswered
        finally:
            done()
            self.metrics.request(endpoint, status_box[0])
            if self.log_requests:
                gen = access.get("generation")
                usage = gen.usage_so_far() if gen is not None else None
                access_log.info(
                    access_line(scope["method"], path, status_box[0], time.monotonic() - t0, usage)
                )

    async def _guarded(self, scope: dict, receive: Any, send: Any, path: str) -> int | None:
        """Run the guards and the app; returns the status to count for a request that got no
        response (499: the client left while uploading its body), else None."""
        headers = dict(scope.get("headers") or [])
        if (
            self.api_key
            and path.startswith(("/v1", "/anthropic"))
            and path not in _ROOTS
            and not self._authorized(headers)
        ):
            return await _error_response(path, APIError(401, "Invalid Authentication"))(
                scope, receive, send
            )
        # Only the JSON endpoints take a body: for any other path (open probes, the API docs,
        # unknown paths) at most SMALL_BODY bytes are announced, and none is ever read or buffered.
        takes_body = path in _BODY_MODELS
        limit = self.max_body if takes_body else SMALL_BODY
        too_large = APIError(413, f"request body too large (limit {limit} bytes)")
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            return await _error_response(path, too_large)(scope, receive, send)
        if scope["method"] not in ("POST", "PUT", "PATCH") or not takes_body:
            return await self.app(scope, receive, send)
        chunks = []
        total = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return CLIENT_CLOSED
            chunk = message.get("body", b"")
            total += len(chunk)
            if total > self.max_body:
                return await _error_response(path, too_large)(scope, receive, send)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        if self.screen is not None and self.screen.applies(
            path, headers.get(b"content-type", b"").decode("latin-1"), total
        ):
            # large bodies: checked in a worker process, sent as received (joining tens of MiB
            # here would hold the event loop for a page-faulting copy)
            refused = await self.screen.check(path, chunks, total)
            if refused is not None:
                return await _error_response(path, refused)(scope, receive, send)
        replayed = False

        async def replay() -> dict:
            nonlocal replayed, chunks
            if not replayed:
                replayed = True
                body = b"".join(chunks)
                chunks = None
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
        return None


class _Stream(StreamingResponse):
    """A streaming response that always runs `on_close` (aborting the engine request) when the
    response ends for any reason, including a client disconnect that cancels it mid-stream."""

    def __init__(self, content: Any, on_close: Any, **kwargs: Any):
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._on_close()


async def _until_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


OUT_OF_MEMORY = "Internal server error: not enough memory to prepare this request"


async def _off_loop(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` in a worker thread (request preparation: parsing, rendering, tokenizing,
    image decoding). A failed allocation there (``MemoryError``, numpy's included) fails this
    request alone with a 500 in the platform envelope; as an :class:`APIError` it is answered like
    any other error, where an unhandled exception would also close the client's connection."""
    try:
        return await asyncio.to_thread(fn, *args)
    except MemoryError:
        log.warning("request preparation ran out of memory; the request is answered 500")
        raise APIError(500, OUT_OF_MEMORY) from None


async def _or_disconnect(request: Request, coro: Any) -> tuple[bool, Any]:
    """Await `coro` unless the client goes away first; returns ``(completed, result)``. On a
    disconnect `coro` is cancelled (``Generation`` cleanup then aborts the engine request)."""
    task = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        try:
            await task
        except (asyncio.CancelledError, Exception):
            pass
        return False, None
    return True, task.result()


def create_app(
    serving: ChatServing,
    *,
    api_key: str | None = None,
    engine_shutdown: Any = None,
    log_requests: bool = False,
    start_screen: bool = False,
) -> FastAPI:
    """The FastAPI app over a :class:`ChatServing`.

    Args:
        serving: the serving core (engine, tokenizer, model info, limits, metrics).
        api_key: when set, ``/v1`` and ``/anthropic`` require it.
        engine_shutdown: ``async (drain: bool) -> None`` run at shutdown (``AsyncEngine.shutdown``).
        log_requests: one :func:`access_line` per request on the ``openk3.access`` logger.
        start_screen: start the body-screening worker (:mod:`openk3.server.screen`) at startup
            instead of on the first large body (``openk3 serve`` does).
    """
    from openk3 import __version__

    screen = BodyScreen(
        ScreenSpec(
            serving.model.id,
            serving.model.context_length,
            serving.max_token_bytes(),
            max_messages=serving.limits.max_messages,
            tokenizer_dir=getattr(serving, "tokenizer_dir", None),
        )
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if start_screen:
            await screen.start()
        try:
            yield
        finally:
            await screen.close()
        if engine_shutdown is not None:
            await engine_shutdown(drain=True)

    app = FastAPI(title="openk3 Kimi-compatible API", version=__version__, lifespan=lifespan)
    app.state.serving = serving
    app.state.screen = screen
    app.state.in_flight = in_flight = {"requests": 0}  # maintained by Guard

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return _error_response(request.url.path, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        # FastAPI reads the JSON (routes take it as sent): a body that is not JSON, or none at all
        first = first_error(exc.errors())
        msg = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":  # loc is ("body", character position)
            pos = (first.get("loc") or ("body",))[-1]
            detail = (first.get("ctx") or {}).get("error") or msg
            return _error_response(
                request.url.path, APIError(400, invalid_json_message(detail, pos))
            )
        loc = field_path(first.get("loc", ()))
        if (
            not loc and first.get("type") == "missing"
        ):  # FastAPI reports an empty body as a missing one
            model = _BODY_MODELS.get(request.url.path)
            need = (
                [f.alias or n for n, f in model.model_fields.items() if f.is_required()]
                if model
                else []
            )
            msg = "the request body is empty" + (
                f"; a JSON object with {', '.join(need)} is required" if need else ""
            )
        return _error_response(
            request.url.path, APIError(400, f"Invalid request: {loc or 'body'}: {msg}")
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        status = exc.status_code
        message = {404: "Not found", 405: "Method not allowed"}.get(status, str(exc.detail))
        if isinstance(
            exc.__cause__, RecursionError
        ):  # FastAPI's body parse: json.loads recursed too deep
            message = "Invalid request: body: JSON nested too deeply to parse"
        elif isinstance(exc.__cause__, ValueError) and "integer string conversion" in str(
            exc.__cause__
        ):  # FastAPI's body parse: an integer longer than Python parses
            message = long_integer_message(await request.body())
        return _error_response(
            request.url.path, APIError(status, message, headers=getattr(exc, "headers", None))
        )

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        log.exception("internal error on %s", request.url.path)
        return _error_response(request.url.path, APIError(500, "Internal server error"))

    async def _run(request: Request, prep: Any, complete: Any, stream: Any) -> Response:
        gen = Generation(serving, prep)
        request.scope.get(ACCESS, {})["generation"] = gen  # its usage goes into the access log line
        started, _ = await _or_disconnect(request, gen.start())
        if not started:
            await gen.aclose()
            return Response(status_code=CLIENT_CLOSED)  # nobody is listening
        if prep.stream:
            headers = {
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
                "x-request-id": prep.id,
            }
            return _Stream(
                stream(prep, gen), gen.aclose, media_type="text/event-stream", headers=headers
            )
        done, result = await _or_disconnect(request, complete(prep, gen))
        if not done:
            await gen.aclose()
            return Response(status_code=CLIENT_CLOSED)
        return JSONResponse(result, headers={"x-request-id": prep.id})

    @app.post(
        "/v1/chat/completions",
        response_model=None,
        responses={200: {"model": ChatCompletion}, **_ERRORS},
    )
    async def chat_completions(request: Request, body: JSONBody) -> Response:
        # parsing, checks, rendering and grammar compilation are CPU work: keep them off the event loop
        prep = await _off_loop(lambda: serving.prepare(serving.parse(body)))
        return await _run(request, prep, serving.complete, serving.sse)

    @app.post("/v1/responses", response_model=None, responses=_ERRORS)
    async def create_response(request: Request, body: JSONBody) -> Response:
        prep, ctx = await _off_loop(responses.prepare, serving, body)
        return await _run(
            request,
            prep,
            lambda p, g: responses.complete(serving, p, ctx, g),
            lambda p, g: responses.sse(serving, p, ctx, g),
        )

    @app.get("/v1/responses/{response_id:path}", response_model=None, responses=_ERRORS)
    async def get_response(response_id: str) -> Response:
        raise APIError(
            404,
            f"Not found the response {response_id}: this server does not store responses "
            "(stateless, as with store: false)",
        )

    @app.post(
        "/v1/tokenizers/estimate-token-count", response_model=TokenCountResponse, responses=_ERRORS
    )
    async def estimate_token_count(body: JSONBody) -> dict:
        total = await _off_loop(lambda: serving.count_tokens(serving.parse(body, counting=True)))
        return {"data": {"total_tokens": total}}

    def _card() -> dict:
        m = serving.model
        return {
            "id": m.id,
            "object": "model",
            "created": m.created,
            "owned_by": m.owned_by,
            "context_length": m.context_length,
            "supports_image_in": m.supports_image_in,
            "supports_video_in": m.supports_video_in,
            "supports_reasoning": m.supports_reasoning,
        }

    @app.get("/v1/models", response_model=ModelList)
    async def list_models() -> dict:
        return {"object": "list", "data": [_card()]}

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=_ERRORS)
    async def get_model(model_id: str) -> dict:
        serving.check_model(model_id)
        return _card()

    def _anthropic_card() -> dict:
        m = serving.model
        created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(m.created))
        return {"type": "model", "id": m.id, "display_name": m.id, "created_at": created}

    @app.get("/anthropic/v1/models", response_model=None)
    async def anthropic_list_models() -> dict:
        """Anthropic's model list (``client.models.list()``): one page with the served model."""
        card = _anthropic_card()
        return {"data": [card], "has_more": False, "first_id": card["id"], "last_id": card["id"]}

    @app.get("/anthropic/v1/models/{model_id:path}", response_model=None, responses=_ERRORS)
    async def anthropic_get_model(model_id: str) -> dict:
        if model_id != serving.model.id:
            raise APIError(404, f"model: {model_id}")  # Anthropic's not_found_error text
        return _anthropic_card()

    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    @app.api_route("/v1", methods=["GET", "HEAD"], include_in_schema=False)
    @app.api_route("/anthropic", methods=["GET", "HEAD"], include_in_schema=False)
    async def root() -> Response:
        """Reachability probes (clients send ``HEAD`` to the base URL): 200, no model output."""
        return JSONResponse({"status": "ok"})

    @app.post("/anthropic/v1/messages", response_model=None, responses=_ERRORS)
    async def anthropic_messages(request: Request, body: JSONBody) -> Response:
        prep = await _off_loop(anthropic.prepare, serving, body)
        return await _run(
            request,
            prep,
            lambda p, g: anthropic.complete(serving, p, g),
            lambda p, g: anthropic.sse(serving, p, g),
        )

    @app.post("/anthropic/v1/messages/count_tokens", response_model=None, responses=_ERRORS)
    async def anthropic_count_tokens(body: JSONBody) -> dict:
        return await _off_loop(anthropic.count_tokens, serving, body)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        # 503 only while the engine cannot serve (its thread stopped on an unrecoverable error):
        # a failed request that the engine isolated leaves it healthy, so a supervisor restarts
        # the process exactly when it must.
        if not getattr(serving.engine, "healthy", True):
            return JSONResponse({"status": "error", "model": serving.model.id}, status_code=503)
        return JSONResponse({"status": "ok", "model": serving.model.id})

    @app.get("/metrics", response_class=Response)
    async def metrics() -> Response:
        return Response(serving.metrics.render(), media_type=CONTENT_TYPE)

    app.openapi = lambda: _openapi(app)
    app.add_middleware(
        Guard,
        api_key=api_key,
        max_body_bytes=serving.limits.max_body_bytes,
        metrics=serving.metrics,
        log_requests=log_requests,
        screen=screen,
        in_flight=in_flight,
    )
    if getattr(serving, "greedy", False):
        app.add_middleware(DecodingHeader)
    return app


def _openapi(app: FastAPI) -> dict:
    """The OpenAPI document, with each JSON endpoint's wire model as its request body schema (the
    routes take the JSON as sent, so FastAPI alone would document it as any value)."""
    if app.openapi_schema is None:
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for path, model in _BODY_MODELS.items():
            schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(schema.pop("$defs", {}))
            schemas[model.__name__] = schema
            body = doc["paths"][path]["post"]["requestBody"]
            body["content"] = {
                "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}
            }
        app.openapi_schema = doc
    return app.openapi_schema


class DecodingHeader:
    """ASGI middleware of ``openk3 serve --greedy``: every HTTP response carries
    ``x-openk3-decoding: greedy``, so a client (``openk3 eval``) can tell greedy numbers from
    sampled ones."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_marked(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = dict(
                    message,
                    headers=list(message.get("headers") or [])
                    + [(b"x-openk3-decoding", b"greedy")],
                )
            await send(message)

        await self.app(scope, receive, send_marked)


def build_serving(
    model_path: str,
    *,
    served_model_name: str | None = None,
    max_num_seqs: int = 16,
    cache_memory: int | None = None,
    enable_prefix_cache: bool = True,
    max_waiting: int | None = None,
    max_model_len: int | None = None,
    limits: Limits = Limits(),
    max_request_memory: int | None = None,
    device: Any = "cpu",
    dtype: Any = None,
    greedy: bool = False,
    compile: bool = False,
) -> tuple[ChatServing, Any]:
    """Load a checkpoint directory (config + safetensors + tokenizer files) onto `device` in `dtype`
    (None: float32; :mod:`openk3.runtime` resolves ``--device`` / ``--dtype``) and start its engine.
    A checkpoint with a vision tower (``K3ForConditionalGeneration``) serves image input
    (``supports_image_in``; preprocessing from its ``preprocessor_config.json`` when present).

    ``max_request_memory``: bytes one request's images may need in the engine (their pixels and
    features, and one image's tower work at a time: the estimate of
    :func:`openk3.vision.encoder.tower_activation_bytes`); None = an eighth of the memory available
    at start-up (``MemAvailable``): the engine encodes one image at a time, so this bounds what
    each request in flight holds, and eight requests at the limit still fit in what was free
    beside the cache pools and the weights. ``greedy``: decode every request greedily (temperature 0;
    evaluation only, the platform samples at its fixed temperature). ``compile``: decode steps run
    the static-shape step under ``torch.compile`` (``EngineConfig.compile``; each batch and
    block-table bucket compiles on its first step, minutes on a small CPU;
    ``OPENK3_DECODE_BACKEND=reference`` overrides it, see
    :func:`openk3.engine.decode_step.decode_backend`).

    Returns:
        ``(serving, async_engine)``.
    Raises:
        FileNotFoundError / ValueError: from the checkpoint or tokenizer loaders.
    """
    import torch

    from openk3.engine import AsyncEngine, Engine, EngineConfig
    from openk3.pretrained import available_memory, load_pretrained
    from openk3.server.images import image_config_for
    from openk3.tokenizer import load_tokenizer

    from openk3.shipped import resolve_model_path

    model_path = resolve_model_path(model_path)
    tokenizer = load_tokenizer(model_path)
    model = load_pretrained(model_path, device=device, dtype=dtype or torch.float32)
    kwargs: dict[str, Any] = {
        "max_num_seqs": max_num_seqs,
        "cache_memory": cache_memory,
        "enable_prefix_cache": enable_prefix_cache,
        "compile": compile,
    }
    if max_waiting is not None:
        kwargs["max_waiting"] = max_waiting
    if max_model_len is not None:
        kwargs["max_model_len"] = max_model_len
    engine = Engine(
        model,
        EngineConfig(**kwargs),
        detokenize=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
    )
    context = int(
        getattr(engine, "max_model_len", None)
        or max_model_len
        or model.config.max_position_embeddings
    )
    name = served_model_name or os.path.basename(os.path.normpath(model_path))
    image_config = image_config_for(model, model_path)  # None for a text-only model
    info = ModelInfo(
        id=name,
        context_length=context,
        supports_image_in=image_config is not None,
        created=int(time.time()),
    )
    async_engine = AsyncEngine(engine)
    activation_bytes = None
    vc = getattr(model, "vision_config", None)
    if vc is not None:
        from openk3.vision.encoder import tower_activation_bytes

        def activation_bytes(grids: list) -> int:
            return tower_activation_bytes(vc, grids, engine.dtype.itemsize)

    if max_request_memory is None:
        avail = available_memory("cpu")  # host RAM (MemAvailable), as before
        max_request_memory = avail // 8 if avail else None
    limits = dataclasses.replace(limits, max_request_memory=max_request_memory)
    serving = ChatServing(
        async_engine,
        tokenizer,
        info,
        Metrics(engine.stats),
        limits,
        image_config=image_config,
        activation_bytes=activation_bytes,
        greedy=greedy,
        tokenizer_dir=str(model_path),
    )
    return serving, async_engine


def listen_socket(host: str, port: int) -> socket.socket:
    """The server's listening TCP socket, bound to ``(host, port)`` before the model loads, so a
    busy port is reported at once instead of after the load. Bound as uvicorn binds it
    (``SO_REUSEADDR``; IPv6 when `host` contains ``:``); uvicorn starts listening on it.

    Created with ``proto=IPPROTO_TCP``: asyncio sets ``TCP_NODELAY`` only on accepted sockets whose
    ``proto`` says TCP, and a socket made with the default ``proto=0`` left Nagle on, so every
    response after the first on a keep-alive connection (headers and body are two writes) waited
    for the client's delayed ACK: ``GET /health`` took 42-46 ms instead of about 1 ms.

    Raises:
        OSError: the address cannot be bound (``errno.EADDRINUSE``: another process holds it).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def main(args: Any) -> int:
    """``openk3 serve``: load MODEL (or the shipped default), start the engine and serve HTTP until
    SIGINT / SIGTERM. Prints one startup line with the URL and model id, one access line per
    request (unless ``--quiet``) and one line when a signal arrives; it then stops accepting
    connections, lets in-flight requests finish (a second Ctrl-C aborts them) and drains the engine.
    Returns the exit status (0 after a drained SIGINT or SIGTERM)."""
    import uvicorn

    from openk3.runtime import setup
    from openk3.shipped import resolve_model_path

    path = resolve_model_path(args.model) if args.model else default_model_path()
    if path is None:
        print(
            "openk3 serve: no MODEL given and the shipped default model (openk3/shipped/openk3-tiny) "
            "is missing from this installation; run `openk3 serve CHECKPOINT_DIR` with a directory "
            "holding config.json, safetensors and the tokenizer files",
            file=sys.stderr,
        )
        return 2
    if not os.path.isdir(path):
        print(f"openk3 serve: {path!r} is not a checkpoint directory", file=sys.stderr)
        return 2
    api_key = args.api_key or os.environ.get("OPENK3_API_KEY") or None
    try:
        sock = listen_socket(args.host, args.port)
    except OSError as e:
        why = e.strerror or str(e)
        if e.errno == errno.EADDRINUSE:
            why += " (another server? --port N picks another port, --port 0 a free one)"
        print(f"openk3 serve: cannot listen on {args.host}:{args.port}: {why}", file=sys.stderr)
        return 2
    try:
        device, dtype = setup(args)
    except ValueError as e:  # --device / --dtype / --threads: the flag's own message
        sock.close()
        print(f"openk3 serve: {e}", file=sys.stderr)
        return 2
    try:
        serving, async_engine = build_serving(
            path,
            served_model_name=args.served_model_name,
            max_num_seqs=args.max_num_seqs,
            cache_memory=args.cache_memory,
            enable_prefix_cache=not args.no_prefix_cache,
            max_waiting=getattr(args, "max_waiting", None),
            max_model_len=getattr(args, "max_model_len", None),
            max_request_memory=getattr(args, "max_request_memory", None),
            device=device,
            dtype=dtype,
            greedy=bool(getattr(args, "greedy", False)),
            compile=bool(getattr(args, "compile", False)),
        )
    except (FileNotFoundError, ValueError) as e:
        sock.close()
        print(f"openk3 serve: cannot start with {path!r}: {e}", file=sys.stderr)
        return 2
    quiet = getattr(args, "quiet", False)
    if not quiet and not access_log.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", datefmt="%H:%M:%S"))
        access_log.addHandler(handler)
        access_log.setLevel(logging.INFO)
        access_log.propagate = False
    # start_screen: the body-screening worker imports while the server starts, not on the first big body
    app = create_app(
        serving,
        api_key=api_key,
        engine_shutdown=async_engine.shutdown,
        log_requests=not quiet,
        start_screen=True,
    )
    model_id = serving.model.id
    note = (
        "; --greedy: argmax decoding for evaluation, not the platform's sampling"
        if serving.greedy
        else ""
    )
    # Request preparation (validation, rendering, tokenizing, image decoding) runs in worker
    # threads; a thread running Python code holds the GIL for a whole switch interval each time
    # the event loop asks for it. 1 ms instead of 5 keeps /health and the other streams answered
    # while a large request is prepared.
    sys.setswitchinterval(0.001)
    where = f"{device}, {str(dtype).removeprefix('torch.')}"
    if async_engine.engine.runner.decode_step is not None:
        where += ", compiled decode step"

    class _Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            with super().capture_signals():
                try:
                    yield
                finally:
                    # SIGTERM is a supervisor's "stop", SIGINT a user's: once drained, exit 0 rather than
                    # re-raising them (-15 / 143 reads as a crash; SIGINT would be a KeyboardInterrupt
                    # traceback)
                    self._captured_signals = [
                        s
                        for s in self._captured_signals
                        if s not in (signal.SIGTERM, signal.SIGINT)
                    ]

        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if self.started and self.servers:
                host, port = self.servers[0].sockets[0].getsockname()[:2]
                print(
                    f"openk3 serve: model {model_id} at http://{host}:{port}/v1 "
                    f"(anthropic: http://{host}:{port}/anthropic; {where}{note})",
                    flush=True,
                )

        def handle_exit(self, sig: int, frame: Any) -> None:
            # SIGINT and SIGTERM: one line, then uvicorn's graceful shutdown (stop accepting, wait
            # for in-flight responses, then the lifespan drains the engine). A second SIGINT aborts.
            if not self.should_exit:
                n = app.state.in_flight["requests"]
                name = signal.Signals(sig).name
                drain = (
                    f"finishing {n} in-flight request{'s' if n != 1 else ''}"
                    if n
                    else "no request in flight"
                )
                more = "; Ctrl-C again to abort them" if n and sig == signal.SIGINT else ""
                print(
                    f"openk3 serve: {name}, stopping ({drain}{more})", file=sys.stderr, flush=True
                )
            elif sig == signal.SIGINT and not self.force_exit:
                print(
                    "openk3 serve: SIGINT again, aborting in-flight requests",
                    file=sys.stderr,
                    flush=True,
                )
            super().handle_exit(sig, frame)

    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level="warning",
        timeout_graceful_shutdown=getattr(args, "drain_timeout", None) or 600,
    )
    _Server(config).run(sockets=[sock])
    return 0
