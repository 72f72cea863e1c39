"""The platform's request contract, checked on the parsed :class:`~openk3.server.request.ChatRequest`
before rendering (``../shared/spec/api.md``).

Each check raises :class:`~openk3.server.protocol.APIError` 400 with the platform's message where
one is documented (§1.5 fixed sampling, §3 reasoning_content in history, §1.7 tool_choice) and a
field-named message otherwise. Order of use: :meth:`openk3.server.serving.ChatServing.prepare`.
Every surface (chat completions, Anthropic messages) is checked by the same functions, on the same
object.

Decisions recorded here (api.md §11 and the release notes leave a choice):

* Fixed sampling (§1.5; release notes §2): ``top_p`` 0.95, ``n`` 1, penalties 0; temperature 0.6
  without thinking and, with thinking, 1.0 — the vendor verifier also expects 0.6 and 0.0 to be
  accepted there. Accepted values are not applied: the server always samples at the fixed values.
* ``reasoning_content`` in history: K3 preserves all thinking (keep=all), so key presence is what
  counts (``""`` is accepted, §11); a tool-call turn without the key is a 400. An explicit
  ``thinking.keep: "all"`` extends the check to every assistant message (§3).
* Images: only base64 ``data:`` URLs (§1.2; http(s) URLs are a 400, the strict choice of §11), and
  only in user messages (OpenAI's rule; the Anthropic surface also allows them in tool results).
* Tools (:func:`check_tools`): ``tools: []`` declares nothing; the named ``tool_choice`` form is
  accepted and ignored; a tool needs ``type: "function"``; a strict tool (``strict`` true or absent,
  the platform's default) is a 400 for a schema keyword the grammar cannot enforce, a non-strict one
  is compiled without it (:mod:`openk3.engine.json_schema`). ``reasoning_effort: "none"`` is a 400.
* Malformed text and schemas are refused up front with the field named: a lone UTF-16 surrogate
  anywhere in the body (:func:`openk3.server.protocol.check_unicode`, when the body is parsed), a
  JSON Schema nested deeper than ``MAX_SCHEMA_DEPTH`` (64) levels (:func:`check_schema_depths`).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

from openk3.chat_format.request import (
    AssistantMessage,
    Conversation,
    DynamicTools,
    ImageSlot,
    Message,
    TextMessage,
    ToolResult,
)
from openk3.server.protocol import bad_request, show_int
from openk3.server.request import ChatRequest

TOOL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_-]{0,255}$")  # api.md §1.1


@dataclass(frozen=True)
class Limits:
    """Request limits (api.md §1.1: ≤128 tools, ≤5 stop strings of ≤32 bytes; K3 default output
    budget 131,072); ``max_request_memory`` is ``openk3 serve --max-request-memory``."""

    max_body_bytes: int = 32 * 2**20
    max_messages: int = 10_000
    max_tools: int = 128
    max_stop: int = 5
    max_stop_bytes: int = 32
    default_max_tokens: int = 131_072
    retry_after_s: int = 1
    max_request_memory: int | None = (
        None  # bytes of activations one request may need; None: unbounded
    )


def _fmt(v: float) -> str:
    return f"{v:g}"


def check_message_count(req: Conversation, limits: Limits) -> None:
    """At most ``limits.max_messages`` messages.

    Raises:
        APIError: 400 naming ``messages``.
    """
    if len(req.messages) > limits.max_messages:
        raise bad_request(f"messages: at most {limits.max_messages} messages are allowed")


def check_sampling(req: ChatRequest) -> None:
    """The immutable sampling contract (api.md §1.5, release notes §2).

    Raises:
        APIError: 400 ``invalid <param>: only <value> is allowed for this model``.
    """
    temps = (1.0, 0.6, 0.0) if req.thinking else (0.6,)
    fixed = [
        ("temperature", req.temperature, temps),
        ("top_p", req.top_p, (0.95,)),
        ("n", req.n, (1,)),
        ("presence_penalty", req.presence_penalty, (0.0,)),
        ("frequency_penalty", req.frequency_penalty, (0.0,)),
    ]
    for name, value, allowed in fixed:
        if value is None:
            continue
        if not math.isfinite(value) or not any(abs(value - a) <= 1e-9 for a in allowed):
            raise bad_request(f"invalid {name}: only {_fmt(allowed[0])} is allowed for this model")


def check_effort(req: ChatRequest) -> None:
    """``reasoning_effort`` is one of low, medium, high, max: ``"none"`` (which the open template's
    servers map to instant mode) is a 400 as on the hosted K3; instant mode is ``thinking: {"type":
    "disabled"}``.

    Raises:
        APIError: 400 naming ``reasoning_effort`` and the accepted values.
    """
    if req.reasoning_effort == "none":
        raise bad_request(
            "reasoning_effort: unsupported value 'none' (low, medium, high, max); "
            'for instant mode send thinking: {"type": "disabled"}'
        )


def check_keep(req: Conversation) -> None:
    """``thinking.keep`` is null or ``"all"`` (api.md §1.3 table: K3-class models preserve all
    thinking; other values are an error there).

    Raises:
        APIError: 400 naming ``thinking.keep`` and the value.
    """
    keep = req.options.keep
    if keep is not None and keep != "all":
        raise bad_request(
            f"thinking.keep: only null or 'all' is allowed for this model, got {keep!r}"
        )


def _role(m: Message) -> str:
    """The role as the client sent it (``developer`` included)."""
    if isinstance(m, TextMessage):
        return "developer" if m.developer else m.role
    if isinstance(m, AssistantMessage):
        return "assistant"
    return "tool" if isinstance(m, ToolResult) else "system"


def check_messages(req: Conversation) -> None:
    """Per-message platform rules (api.md §1.2, §3; release notes §2 "Tools").

    Raises:
        APIError: 400 naming the message index.
    """
    thinking = req.options.thinking
    keep = req.options.keep
    for m in req.messages:
        i = m.index
        if getattr(m, "stray_tools", False):
            raise bad_request(
                f"messages[{i}].tools: dynamic tools are only allowed in system messages"
            )
        if isinstance(m, DynamicTools):
            if m.parts:
                raise bad_request(
                    f"messages[{i}].content: a system message with tools must have empty content"
                )
            continue
        if isinstance(m, (TextMessage, ToolResult)) and not m.parts:
            raise bad_request(
                f"messages[{i}].content: content must not be empty for {_role(m)} messages"
            )
        if isinstance(m, ToolResult) and not m.by_name and (m.id_key != "tool_call_id" or not m.id):
            raise bad_request(f"messages[{i}].tool_call_id: required for tool messages")
        if isinstance(m, AssistantMessage) and thinking and not m.partial:
            if m.reasoning is not None:
                continue
            if keep == "all":
                raise bad_request(
                    "preserved thinking (thinking.keep=all) requires reasoning_content on every "
                    f"assistant message, but assistant message at index {i} is missing reasoning_content"
                )
            if m.calls:
                raise bad_request(
                    "thinking is enabled but reasoning_content is missing in assistant tool call "
                    f"message at index {i}"
                )


def check_image_roles(req: ChatRequest) -> None:
    """Image parts only in user messages (OpenAI's chat-completions rule: system / developer,
    assistant and tool content is text only; Kimi's OpenAPI document shares one content schema
    across roles and says nothing either way, so the stricter rule is kept); with
    ``req.tool_images`` (the Anthropic surface, whose ``tool_result`` content may hold image
    blocks) also in tool results.

    Raises:
        APIError: 400 naming the part, ``messages[i].content[j]``.
    """
    allowed = ("user", "tool") if req.tool_images else ("user",)
    for m in req.messages:
        role = _role(m)
        if role in allowed or isinstance(m, DynamicTools):
            continue
        for part in getattr(m, "parts", ()):
            if isinstance(part, ImageSlot):
                raise bad_request(
                    f"{part.where}: image parts are only allowed in user messages, not in {role} messages"
                )


def check_tool_history(req: Conversation) -> None:
    """Tool-call structure of the history (api.md §4): every call of an assistant message is
    ``type: "function"`` with an id unique in the conversation, and every id gets a ``tool``
    result before the next user / assistant message. A platform rule (OpenAI and Kimi answer 400),
    not a chat-format one: the renderer accepts any sequence.

    Raises:
        APIError: 400 naming the message index and the tool-call id.
    """
    msgs = req.messages
    seen: set = set()
    pending: dict = {}

    def unanswered() -> None:
        if pending:
            cid, at = next(iter(pending.items()))
            raise bad_request(
                f"messages[{at}].tool_calls: tool call id {cid!r} has no tool result message "
                "(each tool call must be answered by a tool message before the next user or "
                "assistant message)"
            )

    for m in msgs:
        if isinstance(m, ToolResult):
            pending.pop(m.id, None)
            continue
        if not (
            isinstance(m, AssistantMessage) or (isinstance(m, TextMessage) and m.role == "user")
        ):
            continue
        unanswered()
        if not isinstance(m, AssistantMessage) or not m.calls or m.partial:
            continue
        for k, call in enumerate(m.calls):
            if call.type is not None and call.type != "function":
                raise bad_request(
                    f"messages[{m.index}].tool_calls[{k}].type: only 'function' is supported, "
                    f"got {call.type!r}"
                )
            if call.id is None:
                continue
            if call.id in seen:
                raise bad_request(
                    f"messages[{m.index}].tool_calls[{k}].id: duplicate tool call id {call.id!r}"
                )
            seen.add(call.id)
            pending[call.id] = m.index
    unanswered()


def _strings(value: Any, keys: bool = True) -> int:
    """Characters of every string in a JSON value (object keys too when ``keys``); iterative."""
    total = 0
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            total += len(v)
        elif isinstance(v, (dict, list)):
            if isinstance(v, dict):
                total += sum(len(k) for k in v if type(k) is str) if keys else 0
                v = v.values()
            # strings counted here in C-speed passes: a 1M-value enum must not cost 1M loop turns
            strs = [x for x in v if type(x) is str]
            total += sum(map(len, strs))
            if len(strs) < len(v):
                stack.extend(x for x in v if isinstance(x, (dict, list)))
    return total


def rendered_chars(req: Conversation, thinking: bool = False) -> int:
    """A lower bound on the characters the renderer will tokenize for a request, in one cheap pass
    (no tokenizer, no JSON encoding): every string that reaches the prompt verbatim — text parts,
    tool-call names and argument keys / values (or the text of a json block), and with `thinking`
    the assistant reasoning (instant mode drops it) — and, since tool declarations and the
    response schema are rendered as their canonical JSON (chat-format §5, §7), every key and
    string value of the request-level and dynamic tool declarations and of the response schema.
    Image parts and fields rendered only in some cases (``name``) or never (ids, roles, ``model``,
    ``stop``) are not counted, so the count never exceeds what is rendered (escaping only adds)."""
    total = 0
    for m in req.messages:
        if isinstance(m, DynamicTools):
            total += _strings(m.tools)
            continue
        total += sum(len(p) for p in getattr(m, "parts", ()) if isinstance(p, str))
        if isinstance(m, AssistantMessage):
            if thinking and m.reasoning:
                total += len(m.reasoning)
            for call in m.calls:
                total += len(call.name)
                total += (
                    _strings(call.arguments)
                    if call.arguments is not None
                    else len(call.raw_json or "")
                )
    total += _strings(req.options.tools)
    if req.options.response_format == "json_schema":
        total += _strings(req.options.response_schema)
    return total


def _declarations(req: Conversation) -> list[tuple[str, Any]]:
    """``(where, tool)`` for every declared tool: request-level ``tools[j]``, then the dynamic
    ``messages[i].tools[j]`` (system messages only)."""
    out = [(f"tools[{j}]", t) for j, t in enumerate(req.options.tools)]
    for m in req.messages:
        if isinstance(m, DynamicTools):
            out += [(f"messages[{m.index}].tools[{j}]", t) for j, t in enumerate(m.tools)]
    return out


def check_tool_choice(choice: Any) -> None:
    """The named form ``{"type": "function", "function": {"name": ...}}`` is accepted and, as on the
    platform, ignored (treated as no tool_choice: the vendor verifier skips its rejection test
    "current behavior silently ignores named-function tool_choice"); other objects are a 400.

    Raises:
        APIError: 400 naming ``tool_choice``.
    """
    if isinstance(choice, dict) and choice.get("type") != "function":
        raise bad_request(
            f"tool_choice: unsupported value {json.dumps(choice)[:80]} (auto, none, required, or "
            "{'type': 'function', 'function': {'name': ...}})"
        )


def check_tools(req: ChatRequest, limits: Limits) -> list[dict]:
    """Tools and tool_choice rules (api.md §1.7, release notes §2 "Tools"); returns every declared
    tool (request-level, then dynamic) as the constraint compiles it: the same tool objects with
    ``function.parameters`` replaced by :func:`openk3.engine.json_schema.prepare_schema`'s schema.

    * ``tools: []`` declares nothing (kosong sends it on every tool-less call); ``required`` still
      needs a tool;
    * every tool has ``type: "function"`` (platform.kimi.ai Tool Use: "each tool in the list must
      include a type"; the vendor verifier's ``test_dynamic_tool_missing_required_field_rejected``),
      a name matching :data:`TOOL_NAME`, and an object root schema;
    * strictness: ``function.strict`` when it is a boolean, else ``req.strict_tools`` (the
      platform's default is true; the Anthropic surface passes false, Anthropic's own default). A
      strict tool whose schema uses a keyword the grammar cannot enforce is a 400 naming the tool
      and keyword; a non-strict one is accepted and the keyword left out of the grammar.

    Raises:
        APIError: 400 naming the tool (``tools[j]`` or ``messages[i].tools[j]``) for a missing or
            non-function ``type``, a bad name, a non-object root, an unenforceable strict schema;
            too many tools; ``required`` without any tool.
    """
    from openk3.engine.json_schema import SchemaNotEnforceable, prepare_schema

    check_tool_choice(req.named_tool_choice)
    found = _declarations(req)
    if len(found) > limits.max_tools:
        raise bad_request(f"tools: at most {limits.max_tools} tools are allowed, got {len(found)}")
    declared: list[dict] = []
    for where, t in found:
        if not isinstance(t, dict):
            raise bad_request(f"{where}: must be a tool object, got {type(t).__name__}")
        if "type" not in t:
            raise bad_request(f"{where}.type: required (only 'function' tools are supported)")
        if t["type"] != "function":
            raise bad_request(
                f"{where}.type: only 'function' tools are supported, got {t['type']!r}"
            )
        fn = t.get("function") if isinstance(t.get("function"), dict) else None
        name = fn.get("name") if fn else None
        if not isinstance(name, str) or not TOOL_NAME.match(name):
            raise bad_request(f"{where}.function.name: {name!r} does not match {TOOL_NAME.pattern}")
        params = fn.get("parameters")
        if params is not None and not (
            isinstance(params, dict) and params.get("type", "object") == "object"
        ):
            raise bad_request(f"{where}.function.parameters: the root must be an object schema")
        strict = fn.get("strict") if isinstance(fn.get("strict"), bool) else req.strict_tools
        if params:
            try:
                params, _ = prepare_schema(
                    params, f"{where}.function.parameters (tool {name!r})", strict
                )
            except SchemaNotEnforceable as e:
                raise bad_request(str(e)) from None
            t = dict(t, function=dict(fn, parameters=params))
        declared.append(t)
    if req.options.tool_choice == "required" and not declared:
        raise bad_request("tool_choice: 'required' needs at least one tool")
    return declared


def _tool_schemas(tools: Any, where: str) -> list[tuple[Any, str]]:
    out = []
    for j, t in enumerate(tools if isinstance(tools, list) else ()):
        fn = t.get("function", t) if isinstance(t, dict) else None
        if isinstance(fn, dict) and "parameters" in fn:
            out.append(
                (fn["parameters"], f"{where}[{j}].{'function.' if fn is not t else ''}parameters")
            )
    return out


def check_schema_depths(req: ChatRequest) -> None:
    """Every JSON Schema of a request (the response schema, request-level and dynamic tool
    ``parameters``) nests at most :data:`~openk3.engine.constraints.MAX_SCHEMA_DEPTH` levels.
    Runs before every schema check, without recursion: the later schema checks, the renderer and
    the constraint compiler all recurse.

    Raises:
        APIError: 400 naming the field.
    """
    from openk3.engine.constraints import check_schema_depth

    found = _tool_schemas(req.options.tools, "tools")
    if req.options.response_format == "json_schema":
        found.append((req.options.response_schema, req.schema_where))
    for m in req.messages:
        if isinstance(m, DynamicTools):
            found += _tool_schemas(m.tools, f"messages[{m.index}].tools")
    for schema, where in found:
        try:
            check_schema_depth(schema, where)
        except ValueError as e:
            raise bad_request(str(e)) from None


def check_stops(req: ChatRequest, limits: Limits) -> None:
    """``stop`` (api.md §1.1: at most 5 strings of at most 32 bytes).

    Raises:
        APIError: 400 for too many, empty or too long stop strings.
    """
    if len(req.stop) > limits.max_stop:
        raise bad_request(
            f"stop: at most {limits.max_stop} stop strings are allowed, got {len(req.stop)}"
        )
    for s in req.stop:
        if not s or len(s.encode("utf-8")) > limits.max_stop_bytes:
            raise bad_request(
                f"stop: each stop string must be 1 to {limits.max_stop_bytes} bytes, got {s!r}"
            )


def check_logprobs(req: ChatRequest) -> None:
    """``top_logprobs`` is 0-20 and needs ``logprobs: true`` (OpenAI's rule).

    Raises:
        APIError: 400 naming ``top_logprobs``.
    """
    if req.top_logprobs is not None and (not req.logprobs or not 0 <= req.top_logprobs <= 20):
        raise bad_request("top_logprobs: must be 0-20 and requires logprobs: true")


def check_max_tokens(req: ChatRequest) -> None:
    """An output budget, when given, of at least one token.

    Raises:
        APIError: 400 naming ``max_completion_tokens``.
    """
    if req.max_tokens is not None and req.max_tokens < 1:
        raise bad_request(f"max_completion_tokens: must be >= 1, got {show_int(req.max_tokens)}")


def check_image_parts(prompt: Any, supports_image_in: bool) -> None:
    """Images must be base64 data URLs (api.md §1.2, §11: http(s) URLs are a 400), and the model
    must have a vision tower.

    Args:
        prompt: the rendered :class:`~openk3.chat_format.Prompt`; errors name each image where the
            client wrote it (``Prompt.image_locations``: ``messages[i].content[j]``, or for the
            Anthropic surface the block's ``source``, e.g. ``messages[0].content[1].source``).
    Raises:
        APIError: 400 naming the part.
    """
    for part, where in zip(prompt.images, prompt.image_locations or [""] * len(prompt.images)):
        anthropic = bool(where) and where.endswith(".source")
        field = (
            (where or "image_url")
            if anthropic
            else (f"{where}.image_url.url" if where else "image_url.url")
        )
        ref = part.get("image_url", part.get("image"))
        url = ref.get("url") if isinstance(ref, dict) else ref
        if not isinstance(url, str):
            raise bad_request(f"{field}: missing image URL")
        if url.startswith(("http://", "https://")):
            hint = (
                "use a base64 source"
                if anthropic
                else "send the image as a base64 data URL (data:image/png;base64,...)"
            )
            raise bad_request(f"{field}: http(s) image URLs are not supported; {hint}")
        if not url.startswith("data:") or ";base64," not in url:
            raise bad_request(f"{field}: must be a base64 data URL (data:image/<type>;base64,...)")
    if prompt.images and not supports_image_in:
        raise bad_request("model does not support image input")
