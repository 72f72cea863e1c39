"""``POST /anthropic/v1/messages`` on the same serving core as chat completions.

Source: ``../shared/spec/api.md`` §7 (Kimi's Anthropic-compatible surface; beyond the fields listed
there, standard Anthropic Messages behaviour) and §3 (thinking blocks are preserved into the prompt).

A Messages body is parsed straight into the server's :class:`~openk3.server.request.ChatRequest`
(:func:`parse_request`: the K3 messages and options, no chat-completions body in between) and goes
through :meth:`ChatServing.prepare` (same checks, rendering, constraints and engine); the parser
events are then written as Anthropic content blocks / SSE events. Mapping:

* ``system`` (string or text blocks) -> a leading system message; a ``role: "system"`` turn inside
  ``messages`` (Claude Code sends one) -> a system message at its position (K3 allows one anywhere);
* user ``text`` / ``image`` (base64 source -> data URL) blocks -> content parts; ``tool_result``
  blocks -> tool results (in block order, before the rest of that user turn);
* assistant ``thinking`` blocks -> the reasoning (concatenated), ``text`` -> content, ``tool_use``
  -> tool calls (``input`` as the arguments object); a final assistant message is a prefill and
  is continued (partial mode, api.md §1.8);
* ``tools`` (``input_schema``, ``strict``) -> function tools, non-strict unless ``strict: true``
  (Anthropic's default: a keyword the grammar cannot enforce is then left out of the grammar);
  ``tool_choice`` auto / any / none -> auto / required / none, the named ``tool`` form -> auto
  (accepted and ignored, as the platform treats OpenAI's named form);
  ``disable_parallel_tool_use: true`` -> one call per reply (``parallel_tool_calls: false``);
* ``thinking: {"type": "disabled"}`` -> instant mode; ``{"type": "enabled"}`` needs
  ``budget_tokens``, an integer >= 1024 and below ``max_tokens`` (Anthropic's rule; otherwise a 400
  naming ``thinking.budget_tokens``), which is then ignored (api.md §7: Kimi is not known to enforce
  it); ``adaptive`` / ``between_tools`` are thinking on; ``temperature`` / ``top_p`` / ``top_k``
  accepted within Anthropic's ranges ([0, 1], [0, 1], >= 0; outside: 400) and ignored (K3 samples
  at fixed values);
* image blocks are accepted where Anthropic accepts them, in user turns and inside ``tool_result``
  content; in assistant turns and in ``system`` they are a 400 naming the block;
* errors: the shared checks name messages by their position in the K3 conversation and use the
  chat-completions field names translated to Anthropic's (:func:`anthropic_names`); the
  context-limit 400s use Anthropic's wording (``prompt is too long: ...``, ``input length and
  `max_tokens` exceed context limit: I + O > N, ...``), which Anthropic clients parse to retry;
* usage: ``input_tokens`` = prompt tokens not served from cache, ``cache_read_input_tokens`` = cached,
  ``cache_creation_input_tokens`` = 0 (Anthropic semantics: the three add up to the prompt).
"""

from __future__ import annotations

import hashlib
import json
import uuid
from typing import Any, AsyncIterator

from pydantic import ValidationError

from openk3.chat_format.parser import (
    ContentDelta,
    ReasoningDelta,
    ToolCallArgumentsDelta,
    ToolCallEnd,
    ToolCallStart,
)
from openk3.chat_format.request import (
    AssistantMessage,
    ImageSlot,
    Message,
    TextMessage,
    ToolCall,
    ToolResult,
    check_json,
    make_options,
)
from openk3.server.protocol import (
    AnthropicCountRequest,
    AnthropicMessagesRequest,
    APIError,
    bad_request,
    check_unicode,
    invalid_body,
    show_int,
)
from openk3.server.request import ChatRequest
from openk3.server.serving import ENGINE_FAILED, ChatServing, Finished, Generation, Prepared

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def _signature(thinking: str) -> str:
    """An opaque signature for a thinking block (clients send it back unchanged; it is not checked)."""
    return "openk3-" + hashlib.sha256(thinking.encode("utf-8")).hexdigest()[:32]


def _image_part(block: dict, where: str) -> ImageSlot:
    # the slot keeps the client's block path: image errors name the block as the client sent it
    src = block.get("source")
    if not isinstance(src, dict):
        raise bad_request(
            f"{where}.source: must be an object (type base64 with media_type and data), "
            f"got {type(src).__name__}"
        )
    if src.get("type") == "base64" and not isinstance(src.get("data"), str):
        raise bad_request(
            f"{where}.source.data: must be a base64 string, got {type(src.get('data')).__name__}"
        )
    if src.get("type") == "base64":
        url = f"data:{src.get('media_type', 'image/png')};base64,{src.get('data', '')}"
        return ImageSlot({"type": "image_url", "image_url": {"url": url}}, where)
    if src.get("type") == "url":
        return ImageSlot(
            {"type": "image_url", "image_url": {"url": str(src.get("url", ""))}}, where + ".source"
        )
    raise bad_request(f"{where}.source.type: unsupported image source {src.get('type')!r} (base64)")


IMAGE_PLACES = "image blocks are only allowed in user messages and in tool_result content"


def _text_of(blocks: Any, where: str) -> str:
    if isinstance(blocks, str):
        return blocks
    out = []
    for j, b in enumerate(blocks or []):
        if b.get("type") == "image":
            raise bad_request(f"{where}[{j}]: {IMAGE_PLACES}, not in {where}")
        if b.get("type") != "text":
            raise bad_request(f"{where}[{j}].type: only text blocks are allowed here")
        out.append(b.get("text") or "")
    return "".join(out)


def _text(s: str) -> list:
    return [s] if s else []


def _tool_result_parts(block: dict, where: str) -> list:
    content = block.get("content")
    if content is None or isinstance(content, str):
        return [content or ("(error)" if block.get("is_error") else "(empty)")]
    if not content:
        return ["(empty)"]
    parts: list = []
    for j, b in enumerate(content):
        if b.get("type") == "text":
            parts += _text(b.get("text") or "")
        elif b.get("type") == "image":
            parts.append(_image_part(b, f"{where}.content[{j}]"))
        else:
            raise bad_request(
                f"{where}.content[{j}].type: unsupported block type {b.get('type')!r}"
            )
    return parts


def _tool_call(b: dict, where: str) -> ToolCall:
    name = b.get("name")
    if not isinstance(name, str) or not name:
        raise bad_request(
            f"Invalid request: {where}.name: tool_use needs a non-empty string name, got {name!r}"
        )
    args = b.get("input") or {}
    if not isinstance(args, dict):
        raise bad_request(
            f"Invalid request: {where}.input: must be an object, got {type(args).__name__}"
        )
    try:
        check_json(args, f"{where}.input")
    except ValueError as e:
        raise bad_request(f"Invalid request: {e}") from None
    return ToolCall(name=name, id=b.get("id"), arguments=args)


def _messages(req: dict, thinking_on: bool) -> list[Message]:
    """The K3 messages of a Messages body; each message's ``index`` is its position in the K3
    conversation (what the shared checks name)."""
    messages: list[Message] = []

    def add(m: Message) -> None:
        m.index = len(messages)
        messages.append(m)

    system = req.get("system")
    if system:
        add(TextMessage(0, "system", None, _text(_text_of(system, "system"))))
    turns = req.get("messages") or []
    for i, m in enumerate(turns):
        where = f"messages[{i}]"
        role = m.get("role")
        content = m.get("content")
        if (
            role == "system"
        ):  # a system turn inside messages (Claude Code sends one): K3 allows it anywhere
            add(TextMessage(0, "system", None, _text(_text_of(content, f"{where}.content"))))
            continue
        if isinstance(content, str):
            add(
                TextMessage(0, "user", None, _text(content))
                if role == "user"
                else AssistantMessage(0, None, None, _text(content))
            )
            continue
        if role == "user":
            parts: list = []
            blocks = 0  # text and image blocks: a turn of only tool results adds no user message
            for j, b in enumerate(content):
                kind = b.get("type")
                if kind == "text":
                    blocks += 1
                    parts += _text(b.get("text") or "")
                elif kind == "image":
                    blocks += 1
                    parts.append(_image_part(b, f"{where}.content[{j}]"))
                elif kind == "tool_result":
                    add(
                        ToolResult(
                            0,
                            b.get("tool_use_id"),
                            None,
                            _tool_result_parts(b, f"{where}.content[{j}]"),
                        )
                    )
                else:
                    raise bad_request(f"{where}.content[{j}].type: unsupported block type {kind!r}")
            if blocks:
                add(TextMessage(0, "user", None, parts))
            continue
        text = []
        reasoning = []
        calls = []
        saw_thinking = False
        for j, b in enumerate(content):
            kind = b.get("type")
            if kind == "text":
                text.append(b.get("text") or "")
            elif kind == "thinking":
                saw_thinking = True
                reasoning.append(b.get("thinking") or "")
            elif kind == "redacted_thinking":
                saw_thinking = True
            elif kind == "image":
                raise bad_request(
                    f"{where}.content[{j}]: {IMAGE_PLACES}, not in assistant messages"
                )
            elif kind == "tool_use":
                calls.append(_tool_call(b, f"{where}.content[{j}]"))
            else:
                raise bad_request(f"{where}.content[{j}].type: unsupported block type {kind!r}")
        if thinking_on and calls and not saw_thinking:
            raise bad_request(
                f"thinking is enabled but the thinking block is missing in assistant tool_use message "
                f"at index {i}"
            )
        add(
            AssistantMessage(
                0, None, "".join(reasoning) if saw_thinking else None, _text("".join(text)), calls
            )
        )
    if turns and turns[-1].get("role") == "assistant":
        messages[-1].partial = True  # Anthropic prefill: the final assistant turn is continued
    return messages


def to_chat_request(req: dict, thinking_on: bool = True) -> ChatRequest:
    """An Anthropic Messages body (validated by its wire model) as a :class:`ChatRequest` (see the
    module docstring).

    Raises:
        APIError: 400 for an unsupported block, tool or tool_choice, an image block outside user
            turns and tool_result content, an assistant ``tool_use`` turn without its thinking
            block while thinking is on (api.md §3, Anthropic surface), a malformed tool.
    """
    messages = _messages(req, thinking_on)
    for j, t in enumerate(req.get("tools") or ()):
        if t.get("type") not in (
            None,
            "custom",
        ):  # server tools (web_search_..., bash_..., ...) run nowhere here
            raise bad_request(
                f"tools[{j}].type: unsupported tool type {t.get('type')!r}; only client tools "
                "(name, description, input_schema) are supported"
            )
    choice = "auto"
    parallel = None
    tc = req.get("tool_choice")
    if tc:
        kind = tc.get("type")
        if kind not in ("auto", "any", "none", "tool"):
            raise bad_request(
                f"tool_choice.type: unsupported value {kind!r} (auto, any, tool, none)"
            )
        if kind == "tool" and not isinstance(tc.get("name"), str):
            raise bad_request("tool_choice.name: required for tool_choice.type 'tool'")
        # the named form is accepted and ignored, as the platform treats OpenAI's named tool_choice
        choice = {"auto": "auto", "any": "required", "none": "none", "tool": "auto"}[kind]
        dp = tc.get("disable_parallel_tool_use")
        if dp is not None and not isinstance(dp, bool):
            raise bad_request(
                f"tool_choice.disable_parallel_tool_use: must be a boolean, got {dp!r}"
            )
        if dp:  # Anthropic's name for parallel_tool_calls: false
            parallel = False
    tools = [_function_tool(t) for t in req["tools"]] if req.get("tools") else None
    try:
        options = make_options(messages, thinking=thinking_on, tools=tools, tool_choice=choice)
    except ValueError as e:
        raise bad_request(anthropic_names(f"Invalid request: {e}")) from None
    return ChatRequest(
        messages,
        options,
        model=req.get("model"),
        max_tokens=req.get("max_tokens"),
        stop=list(req.get("stop_sequences") or ()),
        stream=bool(req.get("stream")),
        parallel_tool_calls=parallel,
        tool_images=True,
        strict_tools=False,
    )


def _function_tool(t: dict) -> dict:
    """An Anthropic client tool as a function tool (``strict`` kept when sent)."""
    fn: dict[str, Any] = {
        "name": t.get("name"),
        "description": t.get("description"),
        "parameters": t.get("input_schema") or {"type": "object"},
    }
    if isinstance(t.get("strict"), bool):
        fn["strict"] = t["strict"]
    return {"type": "function", "function": fn}


# chat-completions field names in shared validation messages -> the Anthropic request's names
_NAMES = (
    ("max_completion_tokens", "max_tokens"),
    ("tool_choice: 'required'", "tool_choice: 'any'"),
    ("'required' needs", "'any' needs"),
    ("stop: ", "stop_sequences: "),
    ("stop strings", "stop sequences"),
    ("function.parameters", "input_schema"),
    ("].function.name", "].name"),
    ("].function.description", "].description"),
)


def anthropic_names(message: str) -> str:
    """A serving-core error message with the Anthropic surface's field names."""
    for chat, anth in _NAMES:
        message = message.replace(chat, anth)
    return message


# Anthropic's documented ranges. K3 samples at fixed values, so valid values are ignored, but a
# value the real API would reject is still a 400 (clients rely on that to catch their own bugs).
_RANGES = {"temperature": (0.0, 1.0), "top_p": (0.0, 1.0)}


def check_sampling_ranges(req: dict) -> None:
    """``temperature`` and ``top_p`` in [0, 1], ``top_k`` >= 0 (Anthropic Messages API ranges).

    Raises:
        APIError: 400 naming the field and value (type errors are left to the body model).
    """
    for name, (lo, hi) in _RANGES.items():
        v = req.get(name)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and not (lo <= v <= hi):
            raise bad_request(f"{name}: must be between {lo:g} and {hi:g}, got {v!r}")
    k = req.get("top_k")
    if isinstance(k, int) and not isinstance(k, bool) and k < 0:
        raise bad_request(f"top_k: must be >= 0, got {k!r}")


MIN_THINKING_BUDGET = 1024  # Anthropic: budget_tokens >= 1024


def check_thinking(req: dict) -> bool:
    """Anthropic ``thinking`` rules beyond the body model's types (which already require ``type``
    to be enabled / disabled / adaptive / between_tools and ``budget_tokens`` to be an integer):
    ``enabled`` needs ``budget_tokens`` >= 1024 and, when the request has ``max_tokens`` (the
    messages route; count_tokens has none), less than it. Returns whether thinking is on (anything
    but ``disabled``; no ``thinking``: on, K3's default).

    Raises:
        APIError: 400 naming ``thinking.budget_tokens`` (or ``thinking`` / ``thinking.type`` for a
            body that skipped the model's validation).
    """
    thinking = req.get("thinking")
    if thinking is None:
        return True
    if not isinstance(thinking, dict):
        raise bad_request(f"thinking: must be an object, got {type(thinking).__name__}")
    kind = thinking.get("type")
    if kind == "enabled":
        budget = thinking.get("budget_tokens")
        if budget is None:
            raise bad_request("thinking.budget_tokens: required when thinking.type is 'enabled'")
        if not isinstance(budget, int) or isinstance(budget, bool):
            raise bad_request(f"thinking.budget_tokens: must be an integer, got {budget!r}")
        if budget < MIN_THINKING_BUDGET:
            raise bad_request(
                f"thinking.budget_tokens: must be >= {MIN_THINKING_BUDGET}, got {show_int(budget)}"
            )
        max_tokens = req.get("max_tokens")
        if (
            isinstance(max_tokens, int)
            and not isinstance(max_tokens, bool)
            and budget >= max_tokens
        ):
            raise bad_request(
                f"thinking.budget_tokens: must be less than max_tokens ({show_int(max_tokens)}), got {show_int(budget)}"
            )
    elif kind not in ("disabled", "adaptive", "between_tools"):
        raise bad_request(
            f"thinking.type: unsupported value {kind!r} (enabled, disabled, adaptive, between_tools)"
        )
    return kind != "disabled"


def parse_request(body: Any, *, counting: bool = False) -> ChatRequest:
    """Parse a Messages body (``counting``: a count_tokens body) into a :class:`ChatRequest`:
    unpaired surrogates anywhere (the client's field named), the wire model's types, Anthropic's
    sampling ranges and thinking rules, then the translation (:func:`to_chat_request`). The model
    id is the caller's to check first.

    Raises:
        APIError: 400 naming the field.
    """
    check_unicode(body)
    try:
        (AnthropicCountRequest if counting else AnthropicMessagesRequest).model_validate(
            body, from_attributes=True
        )
    except ValidationError as e:
        raise invalid_body(e.errors()) from None
    if not counting:
        check_sampling_ranges(body)
    # count_tokens has no max_tokens: the budget's upper bound is not checked there
    return to_chat_request(body, check_thinking(body))


CLAUDE_MODEL_PREFIX = "claude-"


def _check_model(serving: ChatServing, body: Any) -> Any:
    """The body with its ``model`` resolved to the served model, or APIError 404 (before any 400).

    A ``claude-*`` id is answered by the served model: Anthropic clients send their own default
    model ids (Claude Code asks for e.g. ``claude-opus-4-8[1m]`` and a ``claude-*-haiku`` for side
    tasks) unless configured otherwise, and Moonshot's Anthropic gateway for Kimi Code is reached by
    Claude Code with only a base URL and a key. The reply's ``model`` is the id asked for
    (:func:`prepare`). Any other unknown id stays a 404, as on the platform.
    """
    if isinstance(body, dict) and isinstance(body.get("model"), str):
        if body["model"].startswith(CLAUDE_MODEL_PREFIX) and body["model"] != serving.model.id:
            return {**body, "model": serving.model.id}
        try:
            serving.check_model(body["model"])
        except APIError as e:  # Anthropic's wording (``model: X``), as the surface's other errors
            e.message = e.anthropic_message or e.message
            raise
    return body


def parse_sized(serving: ChatServing, body: Any, *, counting: bool = False) -> ChatRequest:
    """The first checks of :func:`prepare` (``counting``: of :func:`count_tokens`), in their order
    and wording, none of whose cost grows with the body beyond one pass: the model id, the parse
    (:func:`parse_request`), the message count and the size bound over every rendered field. The
    body screen (:mod:`openk3.server.screen`) runs exactly this on large bodies.

    Raises:
        APIError: 404 unknown model, 400 naming the field, too many messages or text over the context.
    """
    body = _check_model(serving, body)
    req = parse_request(body, counting=counting)
    if counting:
        serving.check_size(req, counting=True)
        return req
    try:
        serving.check_text_size(
            req, thinking=False
        )  # before the checks whose work grows with the request
        serving.check_size(
            req
        )  # what serving.prepare checks first (history reasoning counted when thinking)
    except APIError as e:
        e.message = e.anthropic_message or anthropic_names(e.message)
        raise
    return req


def prepare(serving: ChatServing, body: Any) -> Prepared:
    """Parse and check an Anthropic body and prepare its generation.

    Raises:
        APIError: 404 unknown model, 400 invalid request (in Anthropic's field names and wording).
    """
    req = parse_sized(serving, body)
    try:
        prep = serving.prepare(req)
    except APIError as e:
        e.message = e.anthropic_message or anthropic_names(e.message)
        raise
    prep.id = "msg_" + uuid.uuid4().hex
    asked = body.get("model") if isinstance(body, dict) else None
    if isinstance(asked, str) and asked.startswith(CLAUDE_MODEL_PREFIX):
        # The reply names the id asked for, as Anthropic's API does. Claude Code drops the signed
        # thinking blocks of history turns whose `model` differs from the request's, and a tool
        # turn without its thinking block is then the 400 below on the next request.
        prep.model = asked
    return prep


def count_tokens(serving: ChatServing, body: Any) -> dict:
    """``{"input_tokens": N}`` for ``/anthropic/v1/messages/count_tokens``.

    Raises:
        APIError: 404 unknown model, 400 invalid request.
    """
    return {"input_tokens": serving.count_tokens(parse_sized(serving, body, counting=True))}


def _usage(usage: dict) -> dict:
    cached = usage["cached_tokens"]
    return {
        "input_tokens": usage["prompt_tokens"] - cached,
        "output_tokens": usage["completion_tokens"],
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    }


def _stop_reason(fin: Finished) -> str:
    if fin.stop_sequence is not None and fin.finish_reason == "stop":
        return "stop_sequence"
    return STOP_REASONS.get(fin.finish_reason, "end_turn")


def _tool_input(arguments: str) -> Any:
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {"_raw_arguments": arguments}
    return value if isinstance(value, dict) else {"_value": value}


def partial_input(text: str) -> dict:
    """The object a truncated ``input_json_delta`` sequence stands for, read as a streaming client
    reads accumulated ``partial_json``: complete members and elements are kept, an unfinished
    string, number or literal (and the key it belongs to) is dropped, open brackets are closed;
    ``{}`` when nothing is complete. One pass over `text`, then one ``json.loads``.

    Example: ``{"city": "Paris", "days": [1, 2`` -> ``{"city": "Paris", "days": [1]}``.
    """
    stack: list[str] = []  # closers of the open containers
    best: tuple[int, str] | None = None  # (end of the last complete value, closers there)
    in_str = esc = False
    key = False  # the string being read is an object key
    scalar = False  # inside a number / literal
    for i, ch in enumerate(text):
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
                if not key:
                    best = (i + 1, "".join(reversed(stack)))
            continue
        if scalar and (ch in ",]} \t\r\n"):
            scalar = False
            best = (i, "".join(reversed(stack)))
        if ch == '"':
            in_str = True
            key = bool(stack) and stack[-1] == "}" and _expects_key(text, i)
        elif ch in "{[":
            stack.append("}" if ch == "{" else "]")
            best = (i + 1, "".join(reversed(stack)))
        elif ch in "}]":
            if stack:
                stack.pop()
            best = (i + 1, "".join(reversed(stack)))
        elif ch not in ",: \t\r\n":
            scalar = True
    if best is None:
        return {}
    end, closers = best
    try:
        value = json.loads(text[:end].rstrip().rstrip(",") + closers)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _expects_key(text: str, i: int) -> bool:
    """Whether the string opening at `i` (inside an object) is a key: the last non-blank character
    before it is ``{`` or ``,``."""
    j = i - 1
    while j >= 0 and text[j] in " \t\r\n":
        j -= 1
    return j >= 0 and text[j] in "{,"


async def complete(serving: ChatServing, prep: Prepared, gen: Generation) -> dict:
    """Run to the end and build the Anthropic ``message`` object.

    Raises:
        APIError: 503 if the engine aborted the request, 500 if the engine failed it.
    """
    reasoning = []
    text = []
    blocks = {}
    partial = {}
    fin: Finished | None = None
    async for ev in gen.events():
        if isinstance(ev, ReasoningDelta):
            reasoning.append(ev.text)
        elif isinstance(ev, ContentDelta):
            text.append(ev.text)
        elif isinstance(
            ev, ToolCallStart
        ):  # a block cut by max_tokens is returned as the stream showed it
            blocks[ev.index] = {"type": "tool_use", "id": ev.id, "name": ev.name, "input": {}}
            partial[ev.index] = []
        elif isinstance(ev, ToolCallArgumentsDelta):
            partial[ev.index].append(ev.text)
        elif isinstance(ev, ToolCallEnd):
            blocks[ev.index]["input"] = _tool_input(ev.arguments)
            partial.pop(ev.index, None)
        elif isinstance(ev, Finished):
            fin = ev
    if fin is not None and fin.finish_reason == "error":
        raise APIError(500, ENGINE_FAILED)
    for k, parts in partial.items():
        blocks[k]["input"] = partial_input("".join(parts))
    if fin is None or fin.finish_reason == "abort":
        raise APIError(503, "the request was aborted (server shutting down)")
    content: list[dict] = []
    if gen.thinking_output:
        thought = "".join(reasoning)
        content.append({"type": "thinking", "thinking": thought, "signature": _signature(thought)})
    if text:
        content.append({"type": "text", "text": "".join(text)})
    content.extend(blocks[k] for k in sorted(blocks))
    return {
        "id": prep.id,
        "type": "message",
        "role": "assistant",
        "model": prep.model,
        "content": content,
        "stop_reason": _stop_reason(fin),
        "stop_sequence": fin.stop_sequence,
        "usage": _usage(fin.usage),
    }


def _event(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


async def sse(serving: ChatServing, prep: Prepared, gen: Generation) -> AsyncIterator[str]:
    """The standard Messages event sequence: message_start, ping, per block content_block_start /
    content_block_delta (thinking_delta + signature_delta, text_delta, input_json_delta) /
    content_block_stop, message_delta (stop_reason, usage), message_stop."""
    start_usage = dict(_usage(gen.usage_so_far()), output_tokens=0)
    yield _event(
        "message_start",
        {
            "type": "message_start",
            "message": {
                "id": prep.id,
                "type": "message",
                "role": "assistant",
                "model": prep.model,
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": start_usage,
            },
        },
    )
    yield _event("ping", {"type": "ping"})
    index = -1
    open_kind = None
    thought = []

    def close() -> list[str]:
        nonlocal open_kind
        out = []
        if open_kind == "thinking":
            out.append(
                _event(
                    "content_block_delta",
                    {
                        "type": "content_block_delta",
                        "index": index,
                        "delta": {
                            "type": "signature_delta",
                            "signature": _signature("".join(thought)),
                        },
                    },
                )
            )
        if open_kind is not None:
            out.append(_event("content_block_stop", {"type": "content_block_stop", "index": index}))
        open_kind = None
        return out

    def open_block(kind: str, block: dict) -> list[str]:
        nonlocal index, open_kind
        out = close()
        index += 1
        open_kind = kind
        out.append(
            _event(
                "content_block_start",
                {"type": "content_block_start", "index": index, "content_block": block},
            )
        )
        return out

    async for ev in gen.events():
        pieces: list[str] = []
        if gen.thinking_output and index < 0 and not isinstance(ev, ReasoningDelta):
            pieces += open_block("thinking", {"type": "thinking", "thinking": "", "signature": ""})
        if isinstance(ev, ReasoningDelta):
            if open_kind != "thinking":
                pieces += open_block(
                    "thinking", {"type": "thinking", "thinking": "", "signature": ""}
                )
            thought.append(ev.text)
            pieces.append(
                _event(
                    "content_block_delta",
                    {
                        "type": "content_block_delta",
                        "index": index,
                        "delta": {"type": "thinking_delta", "thinking": ev.text},
                    },
                )
            )
        elif isinstance(ev, ContentDelta):
            if open_kind != "text":
                pieces += open_block("text", {"type": "text", "text": ""})
            pieces.append(
                _event(
                    "content_block_delta",
                    {
                        "type": "content_block_delta",
                        "index": index,
                        "delta": {"type": "text_delta", "text": ev.text},
                    },
                )
            )
        elif isinstance(ev, ToolCallStart):
            pieces += open_block(
                "tool_use", {"type": "tool_use", "id": ev.id, "name": ev.name, "input": {}}
            )
        elif isinstance(ev, ToolCallArgumentsDelta):
            pieces.append(
                _event(
                    "content_block_delta",
                    {
                        "type": "content_block_delta",
                        "index": index,
                        "delta": {"type": "input_json_delta", "partial_json": ev.text},
                    },
                )
            )
        elif isinstance(ev, ToolCallEnd):
            pieces += close()
        elif isinstance(ev, Finished):
            if ev.finish_reason in ("abort", "error"):
                err = (
                    APIError(500, ENGINE_FAILED)
                    if ev.finish_reason == "error"
                    else APIError(503, "the request was aborted (server shutting down)")
                ).anthropic_body()
                yield "".join(pieces) + _event("error", err)
                return
            pieces += close()
            pieces.append(
                _event(
                    "message_delta",
                    {
                        "type": "message_delta",
                        "delta": {
                            "stop_reason": _stop_reason(ev),
                            "stop_sequence": ev.stop_sequence,
                        },
                        "usage": _usage(ev.usage),
                    },
                )
            )
            pieces.append(_event("message_stop", {"type": "message_stop"}))
        if pieces:
            yield "".join(pieces)
