"""One engine request seen as typed events: :class:`Generation`, with its input :class:`Prepared`,
its last event :class:`Finished` and the usage accounting (:func:`usage_dict`).

:class:`Generation` drives the engine and the :class:`~openk3.chat_format.OutputParser` for one
request prepared by :meth:`openk3.server.serving.ChatServing.prepare`, applies stop strings to the
reasoning and content text, and reports metrics; the response formats (OpenAI in
:mod:`openk3.server.serving`, Anthropic in :mod:`openk3.server.anthropic`) are built over its events.

Decisions (``../shared/spec/api.md`` §11 leaves the choice):

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

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator

from openk3.chat_format import OutputParser
from openk3.chat_format.parser import (
    ContentDelta,
    ReasoningDelta,
    ToolCallArgumentsDelta,
    ToolCallEnd,
    ToolCallStart,
)
from openk3.server.protocol import APIError, bad_request
from openk3.server.stops import StopFilter

if TYPE_CHECKING:  # annotations only: the server imports torch (the engine) when it generates
    from openk3.chat_format import Prompt
    from openk3.engine.constraints import Constraint
    from openk3.engine.mm import ImageInput
    from openk3.engine.sampling import SamplingParams
    from openk3.server.serving import ChatServing

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

    def __init__(self, serving: "ChatServing", prep: Prepared):
        self.s, self.prep = serving, prep
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
