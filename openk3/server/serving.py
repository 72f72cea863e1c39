"""The serving core: a chat request -> prompt ids -> engine -> parsed events -> responses.

One :class:`ChatServing` per server. A body is parsed once into a
:class:`~openk3.server.request.ChatRequest` (:meth:`ChatServing.parse` for chat completions and
token counting; :mod:`openk3.server.anthropic` for Anthropic messages); :meth:`ChatServing.prepare`
checks it in the platform's order (``../shared/spec/api.md`` §11: model 404 -> size bound ->
schema depth -> effort / keep -> fixed sampling parameters §1.5 -> tools / tool_choice §1.7 ->
messages, reasoning_content in tool-call history §3 -> images -> tool-call history -> stops ->
rendering -> image URLs -> token window §1.4), renders it with :func:`openk3.chat_format.render` and
builds the engine request (:meth:`~openk3.server.request.ChatRequest.to_sampling_params` and the
output constraint). :class:`Generation` drives the engine and the output parser for one :class:`Prepared` request
and yields typed events (its last one :class:`Finished`, with the usage of :func:`usage_dict`); the
OpenAI response / SSE formatting is at the bottom of this file, the Anthropic one in
:mod:`openk3.server.anthropic`, both over the same events.

Decisions (documented where the specs leave a choice; the request-contract ones are in
:mod:`openk3.server.validation`):

* Thinking is on by default; ``thinking.type: "disabled"`` / ``chat_template_kwargs.thinking:
  false`` switch to instant mode as the open template and vLLM do (the hosted K3 never disables
  it); ``reasoning_effort: "none"`` is a 400 as on the hosted K3. Effort precedence is the chat-format spec's (§8:
  ``thinking.effort`` beats ``reasoning_effort``, as the vendor verifier checks); ``medium`` is
  accepted (the template supports it).
* Images count in ``usage.prompt_tokens`` with their expanded blocks (:mod:`openk3.server.images`).
* A prompt whose text certainly exceeds the context is refused before any work that grows with
  its size beyond the parse (:meth:`ChatServing.check_text_size`; the bound covers every rendered
  field: messages, tool calls, tool and dynamic-tool declarations, the response schema); the
  token-count endpoints refuse it too, with a ``request:`` 400, instead of counting megabytes
  (:meth:`ChatServing.count_tokens`). Under that bound the count in tokens is exact and stops at
  the context (:meth:`ChatServing.render_within_context` / :meth:`ChatServing.check_tokens`,
  which the body screen's worker process runs on large bodies, so the server never tokenizes a
  body that cannot fit).
* Every request is grammar-constrained (:meth:`ChatServing._constraint`): with no tool declared (or
  ``tool_choice: "none"``) the tools channel is unreachable, so the reply is content, never calls.
* ``usage.prompt_tokens`` follows the chat-format spec §12 (the 3-token generation stub is not
  counted); ``cached_tokens`` comes from the engine's prefix cache, capped at ``prompt_tokens`` and
  reported in whole 256-token blocks (:func:`usage_dict`).
* Stop strings are applied to the reasoning and the content text; the text from the match on is
  never sent (held back while it could still become a match).
* A tool call cut by ``max_tokens`` gives ``finish_reason: "length"`` (``tool_calls`` only when every
  call ended); streamed, its start and argument deltas have been sent, so the non-streaming
  response returns it too, with the arguments generated so far (OpenAI's behaviour for a
  truncated call).
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

from openk3.chat_format import OutputParser, render
from openk3.chat_format.parser import (
    ContentDelta,
    ReasoningDelta,
    ToolCallArgumentsDelta,
    ToolCallEnd,
    ToolCallStart,
)
from openk3.chat_format.request import AssistantMessage
from openk3.chat_format.tool_ids import next_index_after
from openk3.server.images import expand_images
from openk3.server.protocol import APIError, bad_request, show_int
from openk3.server.request import (
    ChatCompletionRequest,
    ChatRequest,
    TokenCountRequest,
    parse_request,
)
from openk3.server.stops import StopFilter
from openk3.server.validation import (
    Limits,
    check_effort,
    check_image_parts,
    check_image_roles,
    check_keep,
    check_logprobs,
    check_max_tokens,
    check_message_count,
    check_messages,
    check_sampling,
    check_schema_depths,
    check_stops,
    check_tool_history,
    check_tools,
    rendered_chars,
)

if TYPE_CHECKING:  # annotations only: the server imports torch (the engine) when it generates
    from openk3.chat_format import Prompt
    from openk3.engine.constraints import Constraint
    from openk3.engine.mm import ImageInput
    from openk3.engine.sampling import SamplingParams

_SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


# ------------------------------------------------------------------ one engine request
OVERLOADED = "The engine is currently overloaded, please try again later"  # api.md §6.1
# 500 for a request whose engine work raised (finish_reason "error"); the cause is in the server log
ENGINE_FAILED = "Internal server error: the engine failed while computing this request"


@dataclass
class Prepared:
    """A validated request, ready for the engine."""

    id: str
    created: int
    model: str
    prompt: Prompt
    prompt_tokens: int  # usage.prompt_tokens (§12)
    params: SamplingParams
    constraint: Constraint | None  # None: free output
    tool_index_start: int
    tools_enabled: bool
    stops: list[str]
    stream: bool = False
    include_usage: bool = False
    t0: float = field(default_factory=time.monotonic)
    prompt_ids: list[int] | None = (
        None  # the engine's prompt: prompt.token_ids with images expanded
    )
    mm_inputs: list[ImageInput] | None = None  # one per image (None: no images)


@dataclass(frozen=True)
class Finished:
    """Last event of a generation. ``finish_reason``: stop | length | tool_calls | abort | error
    (the engine failed the request: the surfaces answer 500 / an SSE error event)."""

    finish_reason: str
    usage: dict
    stop_sequence: str | None = None


CACHE_REPORT_BLOCK = 256  # api.md §11: reported cache hits are whole 256-token blocks


def usage_dict(prompt_tokens: int, cached: int, completion: int) -> dict:
    """Kimi usage: ``cached_tokens`` top level and in ``prompt_tokens_details`` (api.md §11).

    The one place reported cache hits are decided (every surface, the metrics and so ``openk3
    cost`` read this dict): the engine's reused length, capped at ``prompt_tokens`` and rounded
    down to a multiple of :data:`CACHE_REPORT_BLOCK`, as the platform reports them (api.md §5 /
    §11: 256-token alignment, no minimum beyond one block). The engine may reuse more (its blocks
    are smaller); the difference is billed as a miss, the conservative side.
    """
    cached = max(0, min(int(cached), prompt_tokens)) // CACHE_REPORT_BLOCK * CACHE_REPORT_BLOCK
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "cached_tokens": cached,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _is_overloaded(exc: BaseException) -> bool:
    """True for the engine's full-queue refusal (answered 429)."""
    from openk3.engine import EngineOverloaded  # torch: imported only once an engine has answered

    return isinstance(exc, EngineOverloaded)


class Generation:
    """One engine request seen as parser events.

    :meth:`start` submits the request and waits for its first output, so that admission errors
    (429 overloaded, 400 from the engine) surface before any response byte is sent. :meth:`events`
    then yields ``ReasoningDelta`` / ``ContentDelta`` (stop-filtered), ``ToolCallStart`` /
    ``ToolCallArgumentsDelta`` / ``ToolCallEnd`` and finally one :class:`Finished`. Leaving the
    iteration early (client disconnect) aborts the engine request, which frees its cache.
    """

    def __init__(self, serving: ChatServing, prep: Prepared):
        self.s = serving
        self.prep = prep
        self.parser = OutputParser(
            serving.tokenizer,
            start_channel=prep.prompt.channel or "think",
            tool_index_start=prep.tool_index_start,
            tools_enabled=prep.tools_enabled,
        )
        self.thinking_output = (prep.prompt.channel or "think") == "think"
        self._filters = {
            ReasoningDelta: StopFilter(prep.stops),
            ContentDelta: StopFilter(prep.stops),
        }
        self._agen: Any = None
        self._pending: Any = None
        self._closed = False
        self._engine_done = False
        self._last_token_t: float | None = None
        self.stop_hit: str | None = None
        self.n_calls = 0
        self.open_calls: set[int] = (
            set()
        )  # calls started and not yet ended (cut by max_tokens: "length")
        self.engine_reason: str | None = None
        self.usage: Any = None
        self.logprobs: list[Any] = []
        self.reasoning_tokens = (
            0  # generated ids read in the think channel (the Responses API reports them)
        )

    async def start(self) -> None:
        """Submit to the engine and wait for the first output.

        Raises:
            APIError: 429 (waiting queue full, with ``Retry-After``), 400 (engine refused the input)
                or 500 (the engine failed the request before its first token).
        """
        prep = self.prep
        ids = prep.prompt_ids if prep.prompt_ids is not None else prep.prompt.token_ids
        extra = {"mm_inputs": prep.mm_inputs} if prep.mm_inputs else {}
        self._agen = self.s.engine.generate(
            ids, prep.params, prep.constraint, request_id=prep.id, **extra
        ).__aiter__()
        prep.mm_inputs = (
            None  # the engine owns the pixels now (and drops them once the prompt is computed)
        )
        try:
            self._pending = await self._agen.__anext__()
        except StopAsyncIteration:
            self._pending = None
        except ValueError as e:
            await self.aclose()
            raise bad_request(f"Invalid request: {e}") from None
        except Exception as e:
            await self.aclose()
            if _is_overloaded(e):
                self.s.metrics.overloaded()
                raise APIError(
                    429, OVERLOADED, headers={"Retry-After": str(self.s.limits.retry_after_s)}
                ) from None
            if isinstance(e, RuntimeError) and "shutting down" in str(e):
                raise APIError(503, "the server is shutting down") from None
            raise
        if self._pending is not None and self._pending.finish_reason == "error":
            self._engine_done = True  # failed before any token: answer 500 before a response starts
            await self.aclose()
            raise APIError(500, ENGINE_FAILED)

    def usage_so_far(self) -> dict:
        """Usage as of the latest engine output (after :meth:`start`: prompt and cache hits known)."""
        u = self.usage if self.usage is not None else getattr(self._pending, "usage", None)
        cached = int(getattr(u, "cached_tokens", 0) or 0)
        return usage_dict(
            self.prep.prompt_tokens, cached, int(getattr(u, "completion_tokens", 0) or 0)
        )

    async def events(self) -> AsyncIterator[Any]:
        try:
            out = self._pending
            while out is not None:
                for ev in self._on_output(out):
                    yield ev
                if self.stop_hit is not None or out.finished:
                    break
                try:
                    out = await self._agen.__anext__()
                except StopAsyncIteration:
                    out = None
            for ev in self._flush():
                yield ev
            yield self._finish()
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        """Abort the engine request (if unfinished) and close its stream; idempotent."""
        if self._closed:
            return
        self._closed = True
        if not self._engine_done:
            self.s.engine.abort(self.prep.id)
        if self._agen is not None and hasattr(self._agen, "aclose"):
            try:
                await self._agen.aclose()
            except (
                Exception
            ):  # the stream may already be finished or broken; the abort above is what matters
                pass

    def _on_output(self, out: Any) -> list[Any]:
        now = time.monotonic()
        events: list[Any] = []
        if out.new_token_ids:
            if self._last_token_t is None:
                self.s.metrics.first_token(now - self.prep.t0)
            else:
                self.s.metrics.inter_token(now - self._last_token_t, len(out.new_token_ids))
            self._last_token_t = now
            for tid in out.new_token_ids:
                self.reasoning_tokens += self.parser.in_reasoning
                events += self.parser.feed(tid)
        self.usage = out.usage
        if out.logprobs:
            self.logprobs.extend(out.logprobs)
        if out.finished:
            self._engine_done = True
            self.engine_reason = out.finish_reason
            events += self.parser.finish()
        result: list[Any] = []
        for ev in events:
            kind = type(ev)
            if kind in self._filters:
                other = self._filters[ContentDelta if kind is ReasoningDelta else ReasoningDelta]
                held, hit = other.flush()
                if held:
                    result.append(
                        (ContentDelta if kind is ReasoningDelta else ReasoningDelta)(held)
                    )
                if hit is not None:
                    self.stop_hit = hit
                    return result
                text, hit = self._filters[kind].feed(ev.text)
                if text:
                    result.append(kind(text))
                if hit is not None:
                    self.stop_hit = hit
                    return result
            elif kind in (ToolCallStart, ToolCallArgumentsDelta, ToolCallEnd):
                result.extend(self._flush())
                if self.stop_hit is not None:
                    return result
                if kind is ToolCallStart:
                    self.open_calls.add(ev.index)
                elif kind is ToolCallEnd:
                    self.n_calls += 1
                    self.open_calls.discard(ev.index)
                result.append(ev)
        return result

    def _flush(self) -> list[Any]:
        if self.stop_hit is not None:
            return []
        out = []
        for kind, f in self._filters.items():
            held, hit = f.flush()
            if held:
                out.append(kind(held))
            if hit is not None:
                self.stop_hit = hit
                break
        return out

    def _finish(self) -> Finished:
        if self.engine_reason == "error":
            reason = "error"
        elif self.open_calls and self.stop_hit is None and self.engine_reason == "length":
            reason = "length"  # max_tokens cut a call: returned as far as it got, in both modes
        elif self.n_calls:
            reason = "tool_calls"
        elif self.stop_hit is not None:
            reason = "stop"
        else:
            reason = self.engine_reason or "abort"
        u = self.usage
        completion = int(getattr(u, "completion_tokens", 0) or 0)
        cached = int(getattr(u, "cached_tokens", 0) or 0)
        usage = usage_dict(self.prep.prompt_tokens, cached, completion)
        self.s.metrics.finished(self.prep, usage, time.monotonic() - self.prep.t0)
        return Finished(reason, usage, self.stop_hit)


# ------------------------------------------------------------------ the serving core
@dataclass(frozen=True)
class ModelInfo:
    """What ``/v1/models`` reports and what validation needs about the served model."""

    id: str
    context_length: int
    supports_image_in: bool = False
    supports_video_in: bool = False
    supports_reasoning: bool = True
    created: int = 0
    owned_by: str = "openk3"


class ChatServing:
    """Validation, rendering and generation over one engine and tokenizer.

    Args:
        engine: an ``openk3.engine.AsyncEngine`` (or any object with ``generate`` / ``abort``).
        tokenizer: the model's :class:`~openk3.tokenizer.Tokenizer`.
        model: :class:`ModelInfo` of the served model.
        metrics: a :class:`~openk3.server.metrics.Metrics`.
        limits: :class:`Limits`.
        image_config: :class:`openk3.vision.ImageProcessorConfig` of a vision model (default: the
            released preprocessing; only used when ``model.supports_image_in``).
        make_constraint: constraint factory (default ``openk3.engine.constraints.make_constraint``).
        activation_bytes: ``(grids) -> bytes`` peak activation memory of the vision tower for a
            request's image grids (``(1, gh, gw)`` each); with ``limits.max_request_memory`` a
            request above it is refused before its images are decoded.
        greedy: decode every request at temperature 0 (``openk3 serve --greedy``, an evaluation
            switch; the platform samples at its fixed temperature).
        max_token_bytes: bytes of the tokenizer's longest token when already known; default:
            computed from `tokenizer` on first use.
        tokenizer_dir: the directory `tokenizer` was loaded from, when it was (the body screen's
            worker process loads it from there to count tokens).
    """

    def __init__(
        self,
        engine: Any,
        tokenizer: Any,
        model: ModelInfo,
        metrics: Any,
        limits: Limits = Limits(),
        *,
        make_constraint: Callable | None = None,
        image_config: Any = None,
        activation_bytes: Callable | None = None,
        greedy: bool = False,
        max_token_bytes: int | None = None,
        tokenizer_dir: str | None = None,
    ):
        self.tokenizer_dir = tokenizer_dir
        self.engine = engine
        self.tokenizer = tokenizer
        self.model = model
        self.metrics = metrics
        self.limits = limits
        # ``openk3 serve --greedy`` (evaluation only): temperature 0 instead of the platform's fixed sampling.
        self.greedy = greedy
        self.image_config = image_config
        self.activation_bytes = activation_bytes
        if max_token_bytes is not None:
            self._max_token_bytes = max_token_bytes
        self._make_constraint = make_constraint
        # Whether prompt counts here are the platform's (the Kimi BPE): only then is a completion
        # budget that overshoots the context by a few tokens the platform's 400 (see prepare).
        self.platform_counts = getattr(tokenizer, "backend", None) == "tiktoken"

    # ------------------------------------------------------------------ validation
    def check_model(self, model: Any) -> None:
        """Raises APIError 404 for a model id other than the served one (api.md §6.1)."""
        if model != self.model.id:
            raise APIError(
                404,
                f"Not found the model {model} or Permission denied",
                anthropic_message=f"model: {model}",
            )

    def max_token_bytes(self) -> int:
        """Bytes of the tokenizer's longest token (computed once; 0 when the tokenizer cannot say)."""
        cached = getattr(self, "_max_token_bytes", None)
        if cached is None:
            tok = self.tokenizer
            try:
                cached = max(len(tok.decode_bytes([i])) for i in range(tok.vocab_size))
            except (AttributeError, TypeError, ValueError):
                cached = 0
            self._max_token_bytes = cached
        return cached

    def _over_context(self, req: Any, thinking: bool = False) -> tuple[int, int] | None:
        """``(chars, at_least_tokens)`` when the text to render certainly exceeds the context, else None.

        Soundness: :func:`~openk3.server.validation.rendered_chars` counts only text the prompt
        contains verbatim (messages, tool calls, tool declarations, the response schema; reasoning
        when ``thinking``), a character is at least one UTF-8 byte and a token at most
        :meth:`max_token_bytes` bytes, so ``chars > context_length * max_token_bytes`` implies more
        than ``context_length`` tokens. One pass over the request, no tokenization.
        """
        per_token = self.max_token_bytes()
        if per_token <= 0:
            return None
        chars = rendered_chars(req, thinking)
        if chars > self.model.context_length * per_token:
            return chars, -(-chars // per_token)
        return None

    def check_text_size(
        self, req: Any, thinking: bool | None = None, counting: bool = False
    ) -> None:
        """Reject a prompt that certainly exceeds the context before any work proportional to its
        size (schema compilation, rendering, tokenizing: megabytes of that hold the GIL for seconds
        and freeze the server); the bound is :meth:`_over_context`'s, over every rendered field:
        first without the history's reasoning, then, with thinking on, with it.

        Args:
            req: the parsed request (a :class:`~openk3.chat_format.request.Conversation`).
            thinking: count the reasoning (default: when the request has thinking on).
        Raises:
            APIError: 400 with the platform's context-length message (api.md §6.1); for the
                token-count endpoints (``counting``) a ``request:`` message saying nothing was counted.
        """
        thinking = req.options.thinking if thinking is None else thinking
        over = self._over_context(req) or (self._over_context(req, True) if thinking else None)
        if over is None:
            return
        chars, at_least = over
        raise self._too_long(
            at_least, counting, f"{chars} characters of messages, tools and schemas, "
        )

    def _too_long(self, at_least: int, counting: bool, what: str = "") -> APIError:
        """The 400 for a prompt of at least `at_least` tokens, over the context (api.md §6.1), with
        Anthropic's wording for the Anthropic surface (clients parse its numbers to compact and
        retry); for the token-count endpoints a ``request:`` message saying nothing was counted."""
        ctx = self.model.context_length
        if counting:
            return bad_request(
                f"request: the text to render ({what}at least {at_least} tokens) exceeds the model "
                f"token limit of {ctx}; not counted"
            )
        return APIError(
            400,
            f"Your request exceeded model token limit: {ctx} (requested: at least {at_least})",
            anthropic_message=f"prompt is too long: {at_least} tokens > {ctx - 1} maximum",
        )

    def render_within_context(self, req: Any, *, counting: bool = False) -> Any:
        """:meth:`render` with an exact token bound: the renderer's text is tokenized piece by
        piece (the pieces of spec §1.2, :meth:`~openk3.tokenizer.Tokenizer.iter_encode_text`) and
        rendering stops at the first piece that brings the prompt to the context (``n >=
        context_length``, as :meth:`prepare` refuses it), so a prompt of any size costs at most
        about the context's worth of tokenizing. Image slots count one token each here (their
        expansion only adds).

        Returns:
            the rendered prompt, within the context.
        Raises:
            APIError: 400 :meth:`_too_long` (``at least N`` tokens, N >= context_length); the 400s of :meth:`render`.
        """
        try:
            return self.render(req, _ContextBudget(self.tokenizer, self.model.context_length - 1))
        except _OverContext as over:
            raise self._too_long(over.tokens, counting) from None

    def check_tokens(self, req: Any, *, counting: bool = False) -> None:
        """The context bound in tokens (:meth:`render_within_context`) as a check: raises its 400
        for a prompt that reaches the context and nothing else (what else rendering finds is left to
        the route, in its order). Used by the body screen's worker process, after
        :meth:`check_size`, so that a large body over the context is refused there, exactly,
        without the server ever tokenizing it. A serving without a tokenizer checks nothing.

        Raises:
            APIError: 400 :meth:`_too_long`.
        """
        if self.tokenizer is None:
            return
        try:
            render(req, _ContextBudget(self.tokenizer, self.model.context_length - 1))
        except _OverContext as over:
            raise self._too_long(over.tokens, counting) from None
        except (ValueError, TypeError, RecursionError, KeyError, AttributeError, RuntimeError):
            return  # what else rendering finds is the route's to answer, in its order

    def check_memory(self, grids: list) -> None:
        """Refuse images whose vision-tower activations exceed ``limits.max_request_memory``.

        Raises:
            APIError: 400 naming the estimate and the limit (``--max-request-memory``).
        """
        limit = self.limits.max_request_memory
        if not grids or limit is None or self.activation_bytes is None:
            return
        need = self.activation_bytes(grids)
        if need > limit:
            raise bad_request(
                f"messages: the images need about {need / 2**20:.0f} MiB of activation memory in the "
                f"vision tower, above this server's per-request limit of {limit / 2**20:.0f} MiB "
                "(--max-request-memory); send fewer or smaller images"
            )

    def parse(self, body: Any, *, counting: bool = False) -> ChatRequest:
        """A chat-completions body (``counting``: a token-count body) as a :class:`ChatRequest`
        (:func:`~openk3.server.request.parse_request`), after the model id: an unknown model is a
        404 before any 400, as on the platform.

        Raises:
            APIError: 404 unknown model, 400 naming the field.
        """
        if isinstance(body, dict) and isinstance(body.get("model"), str):
            self.check_model(body["model"])
        req = parse_request(body, TokenCountRequest if counting else ChatCompletionRequest)
        self.check_model(req.model)
        return req

    def check_size(self, req: ChatRequest, *, counting: bool = False) -> None:
        """The first checks of :meth:`prepare` / :meth:`count_tokens`, whose cost does not grow with
        the request beyond one pass: the message count, then the size bound over every rendered
        field (:meth:`check_text_size`). The body screen (:mod:`openk3.server.screen`) runs exactly
        these, after :meth:`parse`, on large bodies.

        Raises:
            APIError: 400 for too many messages or text over the context.
        """
        check_message_count(req, self.limits)
        self.check_text_size(req, counting=counting)

    def render(self, req: ChatRequest, tokenizer: Any = None) -> Any:
        """Render the request (:func:`openk3.chat_format.render`; with `tokenizer` instead of the
        served one when given) and check its image parts.

        Raises:
            APIError: 400 for what only rendering finds (named by the renderer's message) and for
                unsupported image input.
        """
        try:
            prompt = render(req, tokenizer or self.tokenizer)
        except (ValueError, TypeError, RecursionError) as e:
            raise bad_request(f"Invalid request: {e}") from None
        check_image_parts(prompt, self.model.supports_image_in)
        return prompt

    def prepare(self, req: ChatRequest) -> Prepared:
        """Check and render a parsed request (api.md §11 order) into a :class:`Prepared`.

        Raises:
            APIError: 404 unknown model, 400 for every contract violation (message names the field).
        """
        self.check_model(req.model)
        self.check_size(req)  # first: every later check costs work proportional to the request
        check_schema_depths(req)
        check_effort(req)
        check_keep(req)
        check_sampling(req)
        tools = check_tools(req, self.limits)
        check_messages(req)
        check_image_roles(req)
        check_tool_history(req)
        check_stops(req, self.limits)
        check_logprobs(req)
        prompt = self.render(req)
        check_max_tokens(req)
        ctx = self.model.context_length
        asked = req.max_tokens

        def check(n_ids: int, grids: list) -> None:  # runs before any image is decoded
            if n_ids >= ctx or (
                asked is not None and n_ids + asked > ctx and not self._clamps(asked)
            ):
                err = bad_request(
                    f"Your request exceeded model token limit: {ctx} "
                    f"(requested: {show_int(n_ids + (asked or 1))})"
                )
                # Anthropic's wording: Claude Code and other Anthropic clients parse these numbers
                # to shrink max_tokens or compact the conversation, and retry
                err.anthropic_message = (
                    f"prompt is too long: {n_ids} tokens > {ctx - 1} maximum"
                    if n_ids >= ctx
                    else f"input length and `max_tokens` exceed context limit: {n_ids} + {show_int(asked)} > {ctx}, "
                    "decrease input length or `max_tokens` and try again"
                )
                raise err
            self.check_memory(grids)

        expanded = self._expand(prompt, pixels=True, check=check)
        n_ids = len(expanded.token_ids)
        max_tokens = min(
            asked if asked is not None else self.limits.default_max_tokens, ctx - n_ids
        )
        constraint = self._constraint(req, tools, prompt)
        params = req.to_sampling_params(
            max_tokens=max_tokens, stop_token_ids=self.tokenizer.stop_token_ids
        )
        if self.greedy:
            params = dataclasses.replace(params, temperature=0.0)
        history_ids = [
            c.id for m in req.messages if isinstance(m, AssistantMessage) for c in m.calls
        ]
        return Prepared(
            id=f"chatcmpl-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=self.model.id,
            prompt=prompt,
            prompt_tokens=expanded.prompt_tokens,
            params=params,
            constraint=constraint,
            tool_index_start=next_index_after(history_ids),
            tools_enabled=bool(tools) and req.options.tool_choice != "none",
            stops=list(req.stop),
            stream=req.stream,
            include_usage=req.include_usage,
            prompt_ids=expanded.token_ids,
            mm_inputs=expanded.mm_inputs or None,
        )

    def _clamps(self, asked: int) -> bool:
        """Whether a completion budget ``asked`` that, with the prompt, overshoots the context is
        served as "at most what is left" instead of the platform's 400.

        The platform refuses ``prompt_tokens + max_completion_tokens > context_length``
        (``../shared/spec/api.md`` §1.4), counting the prompt with the Kimi BPE. Clients derive the
        budget from that count: Kimi CLI sends the context minus its own estimate of the prompt
        (about four characters a token) minus a 1,024-token margin, which the Kimi BPE never
        exceeds on its prompts. A model with its own tokenizer (the shipped one's ~1k-id BPE)
        counts more tokens for the same text, so the same request would overshoot here while it
        fits on the platform. Hence: with the Kimi BPE, the platform's rule exactly; with another
        tokenizer, a budget below the context is capped at what the prompt leaves (the reply ends
        with ``finish_reason: "length"`` there). A budget of the whole context or more cannot fit
        any prompt on the platform either and stays a 400.
        """
        return not self.platform_counts and asked < self.model.context_length

    def _constraint(self, req: ChatRequest, tools: list[dict], prompt: Any) -> Any:
        """The output constraint, on every request: the K3 output grammar with the response as
        free text or JSON (response_format json_object / strict json_schema) and a tools channel
        only when a tool is declared and ``tool_choice`` is not ``none`` (arguments valid under each
        tool's prepared schema; ``parallel_tool_calls: false`` allows one call). Without a tool the
        grammar has no tools channel, so a model that would open one writes its answer as content.

        Raises:
            APIError: 400 for a schema the grammar cannot enforce, or a partial prefix the
                constraint cannot continue.
        """
        from openk3.engine.json_schema import SchemaNotEnforceable, prepare_schema

        opts = req.options
        kind = opts.response_format  # None | json_object | json_schema
        schema = opts.response_schema if kind == "json_schema" else None
        if kind == "json_schema":
            if not isinstance(schema, dict):
                raise bad_request(f"{req.schema_where}: a JSON schema object is required")
            name = req.schema_name
            # OpenAI's rule for the schema name (Kimi documents the same field): clients reuse it as
            # an identifier, so a malformed one is rejected rather than silently accepted.
            if name is not None and (not isinstance(name, str) or not _SCHEMA_NAME.fullmatch(name)):
                raise bad_request(
                    f"response_format.json_schema.name: must be 1-64 characters of a-z, A-Z, 0-9, "
                    f"'_' or '-', got {name!r}"
                )
            if req.schema_strict is False:  # non-strict: any JSON object (api.md §1.6)
                kind = "json_object"
                schema = None
            else:
                try:
                    schema, _ = prepare_schema(schema, req.schema_where, strict=True)
                except SchemaNotEnforceable as e:
                    raise bad_request(str(e)) from None
        use_tools = tools if tools and opts.tool_choice != "none" else None
        make = self._make_constraint
        if make is None:
            from openk3.engine.constraints import make_constraint as make
        extra = {}
        if use_tools is not None and req.parallel_tool_calls is False:
            extra["max_tool_calls"] = 1  # OpenAI's meaning: at most one tool call in the reply
        try:
            constraint = make(
                self.tokenizer,
                kind or "text",
                schema=schema,
                tools=use_tools,
                tool_choice=opts.tool_choice if use_tools else "none",
                thinking=opts.thinking,
                **extra,
            )
        except ValueError as e:
            raise bad_request(f"Invalid request: {e}") from None
        if prompt.partial:
            for tid in self._partial_tail(prompt, opts.thinking):
                if not constraint.accept(tid):
                    raise bad_request(
                        "messages: the partial assistant prefix does not match the requested "
                        "response_format / tool schema"
                    )
        return constraint

    def _partial_tail(self, prompt: Any, thinking: bool) -> list[int]:
        """Prompt ids after the first channel opener of the continued assistant message: what the
        constraint must consume before generation (it starts inside that channel)."""
        tok = self.tokenizer
        name = tok.encode_text("think" if thinking else "response")
        pattern = [tok.open_id, *name, tok.sep_id]
        ids = prompt.token_ids
        for i in range(len(ids) - len(pattern), -1, -1):
            if ids[i : i + len(pattern)] == pattern:
                return ids[i + len(pattern) :]
        return []

    def _expand(self, prompt: Any, *, pixels: bool, check: Any = None) -> Any:
        """Images expanded, then decoded (:func:`openk3.server.images.expand_images`; ``check``
        runs in between); APIError 400s."""
        config = self.image_config
        if config is None and prompt.image_slots:
            from openk3.vision.preprocess import DEFAULT_CONFIG as config
        return expand_images(prompt, self.tokenizer, config, pixels=pixels, check=check)

    def count_tokens(self, req: ChatRequest) -> int:
        """``prompt_tokens`` of a request rendered as completions would (api.md §6.2), images
        included (sized from their headers; no pixel is decoded).

        A request whose text to render (messages, tool calls, tools, schemas) certainly exceeds the
        served context (``context_length``, the engine's ``--max-model-len``; bound of
        :meth:`_over_context`) is refused before anything is tokenized, and one whose tokens reach
        the context is refused as soon as the count does (:meth:`render_within_context`): no
        request that large can be served, and counting megabytes would stall the server.

        Raises:
            APIError: 400 ``request: ...`` for text over the context; the 400s of :meth:`render` and
                of the image expansion otherwise.
        """
        self.check_size(req, counting=True)
        return self._expand(
            self.render_within_context(req, counting=True), pixels=False
        ).prompt_tokens

    # ------------------------------------------------------------------ OpenAI surface
    async def complete(self, prep: Prepared, gen: Generation) -> dict:
        """Run to the end and build the ``chat.completion`` object (api.md §2.1).

        Raises:
            APIError: 503 if the engine aborted the request (server shutting down), 500 if the
                engine failed it.
        """
        reasoning = []
        content = []
        calls = {}
        fin: Finished | None = None
        async for ev in gen.events():
            if isinstance(ev, ReasoningDelta):
                reasoning.append(ev.text)
            elif isinstance(ev, ContentDelta):
                content.append(ev.text)
            elif isinstance(
                ev, ToolCallStart
            ):  # built from the deltas: a call cut by max_tokens is
                calls[ev.index] = {
                    "id": ev.id,
                    "type": "function",  # returned as streamed (finish "length")
                    "function": {"name": ev.name, "arguments": ""},
                }
            elif isinstance(ev, ToolCallArgumentsDelta):
                calls[ev.index]["function"]["arguments"] += ev.text
            elif isinstance(ev, ToolCallEnd):
                calls[ev.index]["function"]["arguments"] = ev.arguments
            elif isinstance(ev, Finished):
                fin = ev
        if fin is not None and fin.finish_reason == "error":
            raise APIError(500, ENGINE_FAILED)
        if fin is None or fin.finish_reason == "abort":
            raise APIError(503, "the request was aborted (server shutting down)")
        message: dict[str, Any] = {"role": "assistant", "content": "".join(content) or None}
        if gen.thinking_output:
            message["reasoning_content"] = "".join(reasoning)
        if calls:
            message["tool_calls"] = [calls[k] for k in sorted(calls)]
        logprobs = self._logprobs(gen.logprobs) if prep.params.logprobs is not None else None
        return {
            "id": prep.id,
            "object": "chat.completion",
            "created": prep.created,
            "model": prep.model,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "finish_reason": fin.finish_reason,
                    "logprobs": logprobs,
                }
            ],
            "usage": fin.usage,
        }

    def _logprobs(self, entries: list[Any]) -> dict:
        """OpenAI ``choices[].logprobs``: one entry per generated token (markup tokens included,
        spelled as their special strings), with ``top_logprobs`` alternatives."""
        tok = self.tokenizer

        def item(tid: int, lp: float) -> dict:
            raw = tok.decode_bytes([tid])
            return {
                "token": raw.decode("utf-8", errors="replace"),
                "logprob": float(lp),
                "bytes": list(raw),
            }

        return {
            "content": [
                dict(item(e.token_id, e.logprob), top_logprobs=[item(t, lp) for t, lp in e.top])
                for e in entries
            ]
        }

    async def sse(self, prep: Prepared, gen: Generation) -> AsyncIterator[str]:
        """``chat.completion.chunk`` SSE events (api.md §2.2): role chunk, reasoning / content /
        tool-call deltas (with ``logprobs`` of the tokens since the previous chunk when requested),
        the final chunk with ``usage`` in the choice and at the top level, the
        ``include_usage`` chunk, ``[DONE]``; an error event (no ``[DONE]``) if the request is
        aborted or the engine failed it."""
        want_logprobs = getattr(prep.params, "logprobs", None) is not None
        sent = 0

        def chunk(delta: dict, finish: str | None = None, usage: dict | None = None) -> str:
            nonlocal sent
            choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish}
            if want_logprobs:  # the tokens generated since the previous chunk (OpenAI stream shape)
                new = gen.logprobs[sent:]
                sent += len(new)
                choice["logprobs"] = self._logprobs(new) if new else None
            body: dict[str, Any] = {
                "id": prep.id,
                "object": "chat.completion.chunk",
                "created": prep.created,
                "model": prep.model,
                "choices": [choice],
            }
            if usage is not None:
                choice["usage"] = usage
                body["usage"] = usage
            elif prep.include_usage:
                body["usage"] = None
            return "data: " + json.dumps(body, ensure_ascii=False) + "\n\n"

        yield chunk({"role": "assistant", "content": ""})
        async for ev in gen.events():
            if isinstance(ev, ReasoningDelta):
                yield chunk({"reasoning_content": ev.text})
            elif isinstance(ev, ContentDelta):
                yield chunk({"content": ev.text})
            elif isinstance(ev, ToolCallStart):
                yield chunk(
                    {
                        "tool_calls": [
                            {
                                "index": ev.index,
                                "id": ev.id,
                                "type": "function",
                                "function": {"name": ev.name, "arguments": ""},
                            }
                        ]
                    }
                )
            elif isinstance(ev, ToolCallArgumentsDelta):
                yield chunk(
                    {"tool_calls": [{"index": ev.index, "function": {"arguments": ev.text}}]}
                )
            elif isinstance(ev, Finished):
                if ev.finish_reason in ("abort", "error"):
                    err = (
                        APIError(500, ENGINE_FAILED)
                        if ev.finish_reason == "error"
                        else APIError(503, "the request was aborted (server shutting down)")
                    ).kimi_body()
                    yield "data: " + json.dumps(err) + "\n\n"
                    return
                yield chunk({}, ev.finish_reason, ev.usage)
                if prep.include_usage:
                    yield (
                        "data: "
                        + json.dumps(
                            {
                                "id": prep.id,
                                "object": "chat.completion.chunk",
                                "created": prep.created,
                                "model": prep.model,
                                "choices": [],
                                "usage": ev.usage,
                            }
                        )
                        + "\n\n"
                    )
        yield "data: [DONE]\n\n"


class _OverContext(Exception):
    """Raised by :class:`_ContextBudget` once the tokens counted pass its limit."""

    def __init__(self, tokens: int):
        super().__init__(tokens)
        self.tokens = tokens


class _ContextBudget:
    """A tokenizer for the renderer that counts the ids it encodes and raises
    :class:`_OverContext` at the first piece that takes the count past `limit` (the rest of that
    text is never tokenized); every other attribute is the wrapped tokenizer's. Markup ids the
    renderer adds itself are not counted, so the count is a lower bound of the prompt's length."""

    def __init__(self, tokenizer: Any, limit: int):
        self._tok = tokenizer
        self.limit = limit
        self.count = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tok, name)

    def encode_text(self, text: str) -> list[int]:
        out: list[int] = []
        for ids in self._tok.iter_encode_text(text):
            out.extend(ids)
            if self.count + len(out) > self.limit:
                raise _OverContext(self.count + len(out))
        self.count += len(out)
        return out
