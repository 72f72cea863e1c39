"""``POST /v1/responses``: the OpenAI Responses API on the same serving core, stateless.

Source: OpenAI's Responses API reference (request, response and streaming-event shapes, as the
official ``openai`` SDK types them); the K3 side is ``../shared/spec/api.md`` and
``../shared/spec/k3-chat-format.md`` as for chat completions. The Kimi platform has no Responses
API, so every mapping below is openk3's decision; Codex CLI, the OpenAI Agents SDK and the
``openai`` SDK's ``client.responses`` speak it.

A body is parsed straight into the server's :class:`~openk3.server.request.ChatRequest`
(:func:`parse_request`; same K3 messages, options, checks, rendering and engine as the other
surfaces) and the parser events are written as Responses output items / SSE events. Mapping:

* ``instructions`` -> a leading system message; ``input`` (a string: one user message; or items):
  ``message`` items (``type`` may be left out) of role user / system / developer / assistant, with
  ``input_text`` / ``output_text`` / ``refusal`` parts as text and ``input_image`` (a data URL) as an
  image; ``reasoning`` items (their ``content`` text, else the ``encrypted_content`` openk3 wrote,
  else the ``summary`` text), assistant messages, ``function_call`` and ``custom_tool_call`` items
  in a row -> one K3 assistant message (reasoning, content, tool calls); ``function_call_output``
  / ``custom_tool_call_output`` -> tool results (an empty output is sent as ``(empty)``, as the
  Anthropic adapter does). An assistant turn with tool calls but no reasoning item is rendered with
  empty reasoning (the chat surface's 400 for it is a Kimi platform rule with no Responses
  counterpart). Any other item type (``item_reference``, ``web_search_call``, ...) is a 400
  naming the item.
* ``tools``: ``function`` tools as K3 function tools (non-strict unless ``strict: true``: the
  Responses API falls back to non-strict validation when ``strict`` is omitted); ``custom``
  (free-form) tools, which Codex declares for ``apply_patch``, as K3 tools with one string argument
  ``input`` (a grammar ``format`` is appended to the description: the argument grammar cannot
  enforce Lark) whose calls come back as ``custom_tool_call`` items; ``namespace`` tools (Codex
  0.171 groups its sub-agent tools in one) flattened into their function / custom tools, whose
  calls carry ``namespace``; ``web_search`` accepted and ignored (Codex declares it on every
  request; the model is not offered it); every other hosted tool (``file_search``,
  ``code_interpreter``, ``mcp``, ...) is a 400 naming the tool: nothing here can run them.
* ``tool_choice`` auto / none / required as on chat; the named forms (``{"type": "function" |
  "custom", "name"}``) are accepted and ignored, as the platform treats chat's named form;
  ``{"type": "allowed_tools", "mode"}`` uses its mode. ``parallel_tool_calls: false`` allows one
  call per reply.
* ``text.format`` text / json_object / json_schema (``name``, ``schema``, ``strict``) -> the
  response format; ``reasoning.effort`` -> K3's effort (``minimal`` -> low, ``xhigh`` -> max,
  ``none`` -> instant mode, thinking off); ``reasoning.summary`` is accepted (the output carries
  the whole reasoning as ``reasoning_text`` content, no separate summary); ``max_output_tokens`` ->
  the output budget; ``temperature`` / ``top_p`` follow K3's fixed-sampling contract as on chat.
* Stateless: nothing is stored (``store`` is accepted and the response says ``store: false``);
  ``previous_response_id``, ``conversation``, ``background`` and stored ``prompt`` templates are
  400s. Reasoning goes back to the client in each reasoning item's ``content`` and in an
  ``encrypted_content`` that is only an encoding of it (clients that drop raw reasoning, such as
  Codex, keep ``encrypted_content``), and comes back in the next request's input.
* Output: ``reasoning`` (thinking on), ``message`` (``output_text``), then ``function_call`` /
  ``custom_tool_call`` items with the K3 ids (``functions.NAME:IDX``) as ``call_id``. Usage:
  ``input_tokens`` (with ``input_tokens_details.cached_tokens``), ``output_tokens`` (with
  ``output_tokens_details.reasoning_tokens``: ids generated in the think channel), ``total_tokens``.
  A reply cut by ``max_output_tokens`` is ``status: "incomplete"``.
* Streaming: ``response.created``, ``response.in_progress``, per item ``response.output_item.added``
  -> deltas (``response.reasoning_text.delta``; ``response.content_part.added`` +
  ``response.output_text.delta``; ``response.function_call_arguments.delta``;
  ``response.custom_tool_call_input.delta``) -> their ``.done`` events ->
  ``response.output_item.done``; then ``response.completed`` (or ``response.incomplete``) with the
  final response and usage; ``response.failed`` if the engine fails or the server shuts down.
* Errors: the shared checks' field names are the Responses ones (``input[3]``, ``tools[0].name``,
  ``text.format.schema``, ``max_output_tokens``).
"""

from __future__ import annotations

import base64
import json
import re
import time
import uuid
from typing import Any, AsyncIterator, Literal, Union

from pydantic import Field, StrictBool, StrictInt, ValidationError

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
    make_options,
    parse_arguments,
)
from openk3.server.protocol import (
    APIError,
    OpenModel,
    StrictFloat,
    bad_request,
    check_unicode,
    invalid_body,
)
from openk3.server.request import ChatRequest
from openk3.server.serving import ENGINE_FAILED, ChatServing, Finished, Generation, Prepared

EFFORTS = {
    "none": None,
    "minimal": "low",
    "low": "low",
    "medium": "medium",
    "high": "high",
    "xhigh": "max",
    "max": "max",
}
IGNORED_TOOLS = (
    "web_search",
)  # hosted, but Codex declares it by default: accepted, not offered to the model
HOSTED_TOOLS = (
    "web_search_preview",
    "file_search",
    "code_interpreter",
    "computer_use_preview",
    "computer",
    "image_generation",
    "mcp",
    "local_shell",
    "shell",
    "apply_patch",
)
CUSTOM_ARGUMENT = "input"  # the one string argument a custom tool's K3 declaration takes
_ENCRYPTED = (
    "openk3.reasoning.v1:"  # prefix of the encrypted_content openk3 writes (base64 of the text)
)


# ------------------------------------------------------------------------------ wire model


class TextFormat(OpenModel):
    """``text.format``: ``{"type": "text" | "json_object" | "json_schema", "name", "schema", "strict"}``."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None
    description: str | None = None


class TextConfig(OpenModel):
    """``text``: the output format (and ``verbosity``, accepted and ignored)."""

    format: TextFormat | None = None
    verbosity: str | None = None


class ReasoningConfig(OpenModel):
    """``reasoning``: ``effort`` (none, minimal, low, medium, high, xhigh) and ``summary``."""

    effort: str | None = None
    summary: str | None = None


class ResponsesRequest(OpenModel):
    """``POST /v1/responses`` body (the fields openk3 reads; others are accepted and ignored)."""

    model: str
    input: Union[str, list[dict[str, Any]]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: StrictBool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: StrictInt | None = None
    stream: StrictBool | None = None
    store: StrictBool | None = None
    previous_response_id: str | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    include: list[str] | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    background: StrictBool | None = None


# ------------------------------------------------------------------------------ parsing


def _text(s: str) -> list:
    return [s] if s else []


def _content_parts(content: Any, where: str) -> list:
    """A message's ``content`` (a string or parts) as K3 parts."""
    if isinstance(content, str):
        return _text(content)
    if not isinstance(content, list):
        raise bad_request(
            f"{where}: must be a string or a list of content parts, got {type(content).__name__}"
        )
    parts: list = []
    for j, part in enumerate(content):
        pw = f"{where}[{j}]"
        if not isinstance(part, dict):
            raise bad_request(f"{pw}: must be a content part object, got {type(part).__name__}")
        kind = part.get("type")
        if kind in ("input_text", "output_text", "text", "summary_text", "reasoning_text"):
            if not isinstance(part.get("text"), str):
                raise bad_request(f"{pw}.text: must be a string")
            parts += _text(part["text"])
        elif kind == "refusal":
            parts += _text(part.get("refusal") if isinstance(part.get("refusal"), str) else "")
        elif kind == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str):
                raise bad_request(
                    f"{pw}.image_url: an image URL (a base64 data URL) is required; file_id images "
                    "need stored files, which this server does not have"
                )
            parts.append(ImageSlot({"type": "image_url", "image_url": {"url": url}}, pw))
        else:
            raise bad_request(
                f"{pw}.type: unsupported content part type {kind!r} (input_text, output_text, "
                "refusal, input_image)"
            )
    return parts


def _reasoning_text(item: dict, where: str) -> str:
    """The reasoning a ``reasoning`` item carries: its ``content`` text, else the
    ``encrypted_content`` openk3 wrote, else its ``summary`` text."""
    for key in ("content", "summary"):
        value = item.get(key)
        if value is not None and not isinstance(value, list):
            raise bad_request(f"{where}.{key}: must be a list, got {type(value).__name__}")
    text = "".join(p.get("text", "") for p in item.get("content") or () if isinstance(p, dict))
    enc = item.get("encrypted_content")
    if not text and isinstance(enc, str) and enc.startswith(_ENCRYPTED):
        try:
            text = base64.b64decode(enc[len(_ENCRYPTED) :], validate=True).decode("utf-8")
        except ValueError:
            raise bad_request(
                f"{where}.encrypted_content: not an encrypted_content this server wrote"
            ) from None
    if not text:
        text = "\n\n".join(
            p.get("text", "") for p in item.get("summary") or () if isinstance(p, dict)
        )
    return text


def _output_text(output: Any, where: str) -> list:
    """A tool output (a string or content parts) as K3 parts; ``(empty)`` for an empty one."""
    parts = _content_parts(output if output is not None else "", where)
    return parts or ["(empty)"]


class _Conversation:
    """K3 messages built from Responses items, with where each came from (for error messages)."""

    def __init__(self) -> None:
        self.messages: list[Message] = []
        self.origin: dict[int, str] = {}  # K3 message index -> client path
        self.call_origin: dict[tuple[int, int], str] = {}  # (message, call) -> client path
        self.turn: AssistantMessage | None = None  # the assistant message being assembled

    def add(self, m: Message, where: str) -> None:
        self.close()
        m.index = len(self.messages)
        self.origin[m.index] = where
        self.messages.append(m)

    def assistant(self, where: str, *, fresh: bool = False) -> AssistantMessage:
        if self.turn is None or fresh:
            self.close()
            self.turn = AssistantMessage(len(self.messages), None, None, [])
            self.origin[self.turn.index] = where
        return self.turn

    def close(self) -> None:
        if self.turn is not None:
            if self.turn.reasoning is None:
                self.turn.reasoning = ""  # no reasoning item sent back: rendered as empty reasoning
            self.messages.append(self.turn)
            self.turn = None


def _items(body: dict) -> _Conversation:
    conv = _Conversation()
    if body.get("instructions"):
        conv.add(TextMessage(0, "system", None, _text(body["instructions"])), "instructions")
    items = body.get("input")
    if isinstance(items, str):
        conv.add(TextMessage(0, "user", None, _text(items)), "input")
        return conv
    for k, item in enumerate(items):
        where = f"input[{k}]"
        kind = item.get("type") or ("message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(
                    f"{where}.role: unsupported role {role!r} (user, system, developer, assistant)"
                )
            parts = _content_parts(item.get("content"), f"{where}.content")
            if role == "assistant":
                turn = conv.assistant(where)
                if turn.parts or turn.calls:  # a second answer: a new assistant message
                    turn = conv.assistant(where, fresh=True)
                turn.parts = parts
            else:
                conv.add(
                    TextMessage(
                        0,
                        "system" if role != "user" else "user",
                        None,
                        parts,
                        developer=role == "developer",
                    ),
                    where,
                )
        elif kind == "reasoning":
            turn = conv.assistant(where)
            if (
                turn.parts or turn.calls
            ):  # reasoning after an answer or a call: a new assistant message
                turn = conv.assistant(where, fresh=True)
            text = _reasoning_text(item, where)
            turn.reasoning = (turn.reasoning or "") + text
        elif kind in ("function_call", "custom_tool_call"):
            name = item.get("name")
            call_id = item.get("call_id")
            if not isinstance(name, str) or not name:
                raise bad_request(f"{where}.name: a non-empty string is required")
            if not isinstance(call_id, str) or not call_id:
                raise bad_request(f"{where}.call_id: a non-empty string is required")
            if kind == "function_call":
                try:
                    args, raw = parse_arguments(
                        item.get("arguments"), f"{where}.arguments", strict=True
                    )
                except ValueError as e:
                    raise bad_request(f"Invalid request: {e}") from None
            else:
                if not isinstance(item.get("input"), str):
                    raise bad_request(f"{where}.input: must be a string")
                args = {CUSTOM_ARGUMENT: item["input"]}
                raw = None
            turn = conv.assistant(where)
            conv.call_origin[(turn.index, len(turn.calls))] = where
            turn.calls.append(ToolCall(name=name, id=call_id, arguments=args, raw_json=raw))
        elif kind in ("function_call_output", "custom_tool_call_output"):
            call_id = item.get("call_id")
            output = _output_text(item.get("output"), f"{where}.output")
            if call_id is None and isinstance(item.get("name"), str) and item["name"]:
                # Codex sends context it injects (e.g. its goal's objective) as an output that
                # answers no call, named instead: {"type": "function_call_output", "name":
                # "goal_objective", "namespace": "agent", "output": "..."}. Rendered as a tool
                # result of that name after the run's answers.
                conv.add(ToolResult(0, None, item["name"], output, by_name=True), where)
                continue
            if not isinstance(call_id, str) or not call_id:
                raise bad_request(
                    f"{where}.call_id: a non-empty string is required (or, for an output "
                    "that answers no call, a non-empty name)"
                )
            conv.add(ToolResult(0, call_id, None, output), where)
        elif kind == "item_reference":
            raise bad_request(
                f"{where}: item_reference needs stored responses; this server is stateless "
                "(send the item itself)"
            )
        else:
            raise bad_request(
                f"{where}.type: unsupported input item type {kind!r} (message, reasoning, "
                "function_call, function_call_output, custom_tool_call, custom_tool_call_output)"
            )
    conv.close()
    return conv


def _custom_tool(t: dict, description: str) -> dict:
    """A ``custom`` (free-form) tool as a K3 function tool with one string argument (a grammar
    ``format`` is shown in the description: the argument grammar cannot enforce Lark)."""
    fmt = t.get("format") if isinstance(t.get("format"), dict) else {}
    if fmt.get("type") == "grammar" and isinstance(fmt.get("definition"), str):
        description += (
            f"\n\nThe `{CUSTOM_ARGUMENT}` argument must follow this {fmt.get('syntax', 'lark')} "
            f"grammar:\n{fmt['definition']}"
        )
    return {
        "type": "function",
        "function": {
            "name": t.get("name"),
            "description": description.strip(),
            "strict": True,
            "parameters": {
                "type": "object",
                "properties": {CUSTOM_ARGUMENT: {"type": "string"}},
                "required": [CUSTOM_ARGUMENT],
                "additionalProperties": False,
            },
        },
    }


def _function_tool(t: dict, description: str | None) -> dict:
    fn = {k: t[k] for k in ("name", "parameters", "strict") if t.get(k) is not None}
    if description:
        fn["description"] = description
    return {"type": "function", "function": fn}


def _tools(tools: list[dict]) -> tuple[list[dict], set[str], dict[str, str]]:
    """K3 function tools for the Responses ``tools``, the names of the custom ones, and the
    namespace of each namespaced tool.

    ``namespace`` tools (Codex groups its sub-agent tools in one) are flattened: each inner tool is
    a K3 tool under its own name, its description prefixed with the namespace's, and its calls come
    back with ``namespace`` set. ``web_search`` is accepted and ignored (Codex declares it by default;
    the model is not told of it); every other hosted tool is a 400 naming it.
    """
    out = []
    custom = set()
    namespaces = {}
    for j, t in enumerate(tools):
        if not isinstance(t, dict):
            raise bad_request(f"tools[{j}]: must be a tool object, got {type(t).__name__}")
        kind = t.get("type")
        if kind == "function":
            out.append(_function_tool(t, t.get("description")))
        elif kind == "custom":
            custom.add(t.get("name"))
            out.append(_custom_tool(t, t.get("description") or ""))
        elif kind == "namespace":
            ns = t.get("name")
            inner = t.get("tools")
            if not isinstance(ns, str) or not ns:
                raise bad_request(f"tools[{j}].name: a non-empty string is required")
            if not isinstance(inner, list):
                raise bad_request(f"tools[{j}].tools: must be a list of function or custom tools")
            head = t.get("description") if isinstance(t.get("description"), str) else ""
            for k, it in enumerate(inner):
                if not isinstance(it, dict) or it.get("type") not in ("function", "custom"):
                    got = it.get("type") if isinstance(it, dict) else type(it).__name__
                    raise bad_request(
                        f"tools[{j}].tools[{k}].type: unsupported tool type {got!r} in a namespace "
                        "(function, custom)"
                    )
                text = (
                    f"[{ns}: {head}] {it.get('description') or ''}".strip()
                    if head
                    else it.get("description")
                )
                namespaces[it.get("name")] = ns
                if it["type"] == "custom":
                    custom.add(it.get("name"))
                    out.append(_custom_tool(it, text or ""))
                else:
                    out.append(_function_tool(it, text))
        elif kind in IGNORED_TOOLS:
            continue
        elif kind in HOSTED_TOOLS or (
            isinstance(kind, str) and kind.startswith(("web_search", "computer"))
        ):
            raise bad_request(
                f"tools[{j}].type: hosted tool {kind!r} is not available on this server "
                "(only function, custom and namespace tools, which the client runs)"
            )
        else:
            raise bad_request(
                f"tools[{j}].type: unsupported tool type {kind!r} (function, custom, namespace)"
            )
    return out, custom, namespaces


def _tool_choice(choice: Any) -> str:
    if choice is None:
        return "auto"
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise bad_request(f"tool_choice: unsupported value {choice!r} (auto, none, required)")
        return choice
    if not isinstance(choice, dict):
        raise bad_request(
            f"tool_choice: must be a string or an object, got {type(choice).__name__}"
        )
    kind = choice.get("type")
    if kind in ("function", "custom"):
        return (
            "auto"  # the named form: accepted and ignored, as the platform treats chat's named form
        )
    if kind == "allowed_tools":
        mode = choice.get("mode", "auto")
        if mode not in ("auto", "required"):
            raise bad_request(f"tool_choice.mode: unsupported value {mode!r} (auto, required)")
        return mode
    raise bad_request(
        f"tool_choice.type: unsupported value {kind!r} (function, custom, allowed_tools)"
    )


def parse_request(body: Any) -> tuple[ChatRequest, dict]:
    """Parse a Responses body into a :class:`ChatRequest` (see the module docstring); returns it
    and the context the response echoes (``custom`` tool names, where each K3 message came from).
    The model id is the caller's to check first.

    Raises:
        APIError: 400 naming the field or the input item.
    """
    check_unicode(body)
    try:
        sent = ResponsesRequest.model_validate(body, from_attributes=True)
    except ValidationError as e:
        raise invalid_body(e.errors()) from None
    for key, why in (
        (
            "previous_response_id",
            "this server does not store responses (stateless, as with store: "
            "false); send the conversation so far in input",
        ),
        ("conversation", "this server does not store conversations; send them in input"),
        ("prompt", "stored prompt templates are not available on this server"),
    ):
        if body.get(key) is not None:
            raise bad_request(f"{key}: not supported: {why}")
    if sent.background:
        raise bad_request("background: not supported: this server does not store responses")
    conv = _items(body)
    effort = sent.reasoning.effort if sent.reasoning else None
    if effort is not None and effort not in EFFORTS:
        raise bad_request(f"reasoning.effort: unsupported value {effort!r} ({', '.join(EFFORTS)})")
    thinking = effort != "none"
    if body.get("tools") is not None and not isinstance(body.get("tools"), list):
        raise bad_request("tools: must be a list of tools")
    tools, custom, namespaces = _tools(body.get("tools") or [])
    fmt = sent.text.format if sent.text and sent.text.format else None
    rf = fmt.type if fmt is not None and fmt.type != "text" else None
    if rf == "json_schema" and fmt.name is None:
        raise bad_request("text.format.name: required for type 'json_schema'")
    if rf == "json_schema" and not isinstance(fmt.schema_, dict):
        raise bad_request(
            "text.format.schema: required for type 'json_schema' (a JSON Schema object)"
        )
    try:
        options = make_options(
            conv.messages,
            thinking=thinking,
            thinking_effort=EFFORTS.get(effort),
            tools=tools or None,
            tool_choice=_tool_choice(sent.tool_choice),
            response_format=rf,
            response_schema=fmt.schema_ if rf == "json_schema" else None,
        )
    except ValueError as e:
        raise bad_request(_names(f"Invalid request: {e}", conv)) from None
    req = ChatRequest(
        conv.messages,
        options,
        model=sent.model,
        max_tokens=sent.max_output_tokens,
        temperature=sent.temperature,
        top_p=sent.top_p,
        stream=bool(sent.stream),
        parallel_tool_calls=sent.parallel_tool_calls,
        schema_name=fmt.name if rf == "json_schema" else None,
        schema_strict=fmt.strict if rf == "json_schema" else None,
        schema_where="text.format.schema",
        # a tool without `strict`: Responses "attempts strict validation when the schema is compatible,
        # and falls back to non-strict validation otherwise" (the openai SDK's tool types)
        strict_tools=False,
    )
    return req, {"custom": custom, "namespaces": namespaces, "conversation": conv, "sent": sent}


# shared checks' chat-completions field names -> the Responses request's
_NAMES = (
    ("max_completion_tokens", "max_output_tokens"),
    ("response_format.json_schema.name", "text.format.name"),
    ("].function.parameters", "].parameters"),
    ("].function.name", "].name"),
    ("].function.description", "].description"),
)


def _names(message: str, conv: _Conversation) -> str:
    """A serving-core message with the Responses field names and input paths."""
    message = re.sub(
        r"messages\[(\d+)\]\.tool_calls\[(\d+)\]",
        lambda m: conv.call_origin.get((int(m[1]), int(m[2])), m[0]),
        message,
    )
    message = re.sub(r"messages\[(\d+)\]", lambda m: conv.origin.get(int(m[1]), m[0]), message)
    for chat, resp in _NAMES:
        message = message.replace(chat, resp)
    return message


def parse_sized(serving: ChatServing, body: Any) -> tuple[ChatRequest, dict]:
    """The first checks of :func:`prepare`, in its order and wording, none of whose cost grows with
    the body beyond one pass: the model id, the parse (:func:`parse_request`), the message count
    and the size bound over every rendered field (``ChatServing.check_size``). The body screen
    (:mod:`openk3.server.screen`) runs exactly this on large bodies.

    Raises:
        APIError: 404 unknown model, 400 naming the field, too many messages or text over the context.
    """
    if isinstance(body, dict) and isinstance(body.get("model"), str):
        serving.check_model(body["model"])  # an unknown model is a 404 before any 400
    req, ctx = parse_request(body)
    try:
        serving.check_size(req)
    except APIError as e:
        e.message = _names(e.message, ctx["conversation"])
        raise
    return req, ctx


def prepare(serving: ChatServing, body: Any) -> tuple[Prepared, dict]:
    """Parse and check a Responses body and prepare its generation; returns the prepared request
    and the echo context for :func:`complete` / :func:`sse`.

    Raises:
        APIError: 404 unknown model, 400 invalid request (named in the Responses request's terms).
    """
    req, ctx = parse_sized(serving, body)
    try:
        prep = serving.prepare(req)
    except APIError as e:
        e.message = _names(e.message, ctx["conversation"])
        raise
    prep.id = "resp_" + uuid.uuid4().hex
    ctx["request"] = req
    return prep, ctx


# ------------------------------------------------------------------------------ responses


def _usage(usage: dict, reasoning_tokens: int) -> dict:
    return {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": usage["cached_tokens"]},
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {
            "reasoning_tokens": min(reasoning_tokens, usage["completion_tokens"])
        },
        "total_tokens": usage["total_tokens"],
    }


def _response(prep: Prepared, ctx: dict, status: str, output: list, usage: dict | None) -> dict:
    """The ``response`` object (the request's settings echoed, ``store: false``)."""
    sent = ctx["sent"]
    req = ctx["request"]
    fmt = {"type": "text"}
    if req.options.response_format == "json_object":
        fmt = {"type": "json_object"}
    elif req.options.response_format == "json_schema":
        fmt = {
            "type": "json_schema",
            "name": req.schema_name,
            "schema": req.options.response_schema,
            "strict": req.schema_strict is not False,
        }
    out = {
        "id": prep.id,
        "object": "response",
        "created_at": prep.created,
        "status": status,
        "completed_at": int(time.time()) if status in ("completed", "incomplete") else None,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": sent.instructions,
        "max_output_tokens": sent.max_output_tokens,
        "model": prep.model,
        "output": output,
        "parallel_tool_calls": sent.parallel_tool_calls is not False,
        "previous_response_id": None,
        "reasoning": {
            "effort": sent.reasoning.effort if sent.reasoning else None,
            "summary": sent.reasoning.summary if sent.reasoning else None,
        },
        "store": False,
        "temperature": sent.temperature,
        "text": {"format": fmt},
        "tool_choice": sent.tool_choice if sent.tool_choice is not None else "auto",
        "tools": sent.tools or [],
        "top_p": sent.top_p,
        "truncation": "disabled",
        "usage": usage,
        "user": sent.user,
        "metadata": sent.metadata or {},
    }
    return out


def _encrypted(reasoning: str) -> str:
    return _ENCRYPTED + base64.b64encode(reasoning.encode("utf-8")).decode("ascii")


def _reasoning_item(item_id: str, text: str, status: str = "completed") -> dict:
    return {
        "type": "reasoning",
        "id": item_id,
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "encrypted_content": _encrypted(text),
        "status": status,
    }


def _message_item(item_id: str, text: str, status: str = "completed") -> dict:
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


def _call_item(
    item_id: str, call_id: str, name: str, arguments: str, ctx: dict, status: str = "completed"
) -> dict:
    """A ``function_call`` item, or a ``custom_tool_call`` one (its input: the one string argument)
    for a custom tool; ``namespace`` set for a tool declared inside one."""
    if name in ctx["custom"]:
        obj = _loads(arguments)
        text = obj.get(CUSTOM_ARGUMENT) if isinstance(obj, dict) else None
        item = {
            "type": "custom_tool_call",
            "id": item_id,
            "call_id": call_id,
            "name": name,
            "input": text if isinstance(text, str) else arguments,
            "status": status,
        }
    else:
        item = {
            "type": "function_call",
            "id": item_id,
            "call_id": call_id,
            "name": name,
            "arguments": arguments,
            "status": status,
        }
    if name in ctx["namespaces"]:
        item["namespace"] = ctx["namespaces"][name]
    return item


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _failed(fin: Finished | None) -> APIError:
    return (
        APIError(500, ENGINE_FAILED)
        if fin is not None and fin.finish_reason == "error"
        else APIError(503, "the request was aborted (server shutting down)")
    )


async def complete(serving: ChatServing, prep: Prepared, ctx: dict, gen: Generation) -> dict:
    """Run to the end and build the ``response`` object.

    Raises:
        APIError: 503 if the engine aborted the request, 500 if the engine failed it.
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
        elif isinstance(ev, ToolCallStart):
            calls[ev.index] = [ev.id, ev.name, []]
        elif isinstance(ev, ToolCallArgumentsDelta):
            calls[ev.index][2].append(ev.text)
        elif isinstance(ev, ToolCallEnd):
            calls[ev.index][2] = [ev.arguments]
        elif isinstance(ev, Finished):
            fin = ev
    if fin is None or fin.finish_reason in ("abort", "error"):
        raise _failed(fin)
    status = "incomplete" if fin.finish_reason == "length" else "completed"
    output = []
    if gen.thinking_output:
        output.append(_reasoning_item(_item_id("rs"), "".join(reasoning)))
    if content:
        output.append(_message_item(_item_id("msg"), "".join(content), status))
    for k in sorted(calls):
        call_id, name, args = calls[k]
        output.append(_call_item(_item_id("fc"), call_id, name, "".join(args), ctx))
    return _response(prep, ctx, status, output, _usage(fin.usage, gen.reasoning_tokens))


def _event(kind: str, seq: int, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps(dict({'type': kind, 'sequence_number': seq}, **data), ensure_ascii=False)}\n\n"


async def sse(
    serving: ChatServing, prep: Prepared, ctx: dict, gen: Generation
) -> AsyncIterator[str]:
    """The Responses streaming event sequence (module docstring), one SSE event per line pair."""
    seq = 0
    output: list[dict] = []
    state: dict[str, Any] = {"item": None, "kind": None, "text": [], "call": None}

    def event(kind: str, **data: Any) -> str:
        nonlocal seq
        seq += 1
        return _event(kind, seq - 1, data)

    def close(status: str = "completed") -> list[str]:
        item = state["item"]
        kind = state["kind"]
        text = "".join(state["text"])
        out: list[str] = []
        if item is None:
            return out
        index = len(output) - 1
        if kind == "reasoning":
            out.append(
                event(
                    "response.reasoning_text.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    text=text,
                )
            )
            output[index] = _reasoning_item(item["id"], text, status)
        elif kind == "message":
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            out.append(
                event(
                    "response.output_text.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    text=text,
                    logprobs=[],
                )
            )
            out.append(
                event(
                    "response.content_part.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    part=part,
                )
            )
            output[index] = _message_item(item["id"], text, status)
        else:
            call_id, name = state["call"]
            done = _call_item(item["id"], call_id, name, text, ctx, status)
            if done["type"] == "custom_tool_call":
                out.append(
                    event(
                        "response.custom_tool_call_input.delta",
                        item_id=item["id"],
                        output_index=index,
                        delta=done["input"],
                    )
                )
                out.append(
                    event(
                        "response.custom_tool_call_input.done",
                        item_id=item["id"],
                        output_index=index,
                        input=done["input"],
                    )
                )
            else:
                out.append(
                    event(
                        "response.function_call_arguments.done",
                        item_id=item["id"],
                        output_index=index,
                        name=name,
                        arguments=text,
                    )
                )
            output[index] = done
        out.append(event("response.output_item.done", output_index=index, item=output[index]))
        state.update(item=None, kind=None, text=[], call=None)
        return out

    def open_item(kind: str, item: dict) -> list[str]:
        out = close()
        output.append(item)
        state.update(item=item, kind=kind, text=[])
        index = len(output) - 1
        out.append(event("response.output_item.added", output_index=index, item=item))
        if kind == "message":
            out.append(
                event(
                    "response.content_part.added",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    part={"type": "output_text", "text": "", "annotations": [], "logprobs": []},
                )
            )
        return out

    yield event("response.created", response=_response(prep, ctx, "in_progress", [], None))
    yield event("response.in_progress", response=_response(prep, ctx, "in_progress", [], None))
    started = False
    async for ev in gen.events():
        pieces: list[str] = []
        if gen.thinking_output and not started and not isinstance(ev, Finished):
            started = True
            pieces += open_item(
                "reasoning",
                {
                    "type": "reasoning",
                    "id": _item_id("rs"),
                    "summary": [],
                    "content": [],
                    "status": "in_progress",
                },
            )
        if isinstance(ev, ReasoningDelta):
            if state["kind"] != "reasoning":
                pieces += open_item(
                    "reasoning",
                    {
                        "type": "reasoning",
                        "id": _item_id("rs"),
                        "summary": [],
                        "content": [],
                        "status": "in_progress",
                    },
                )
            state["text"].append(ev.text)
            pieces.append(
                event(
                    "response.reasoning_text.delta",
                    item_id=state["item"]["id"],
                    output_index=len(output) - 1,
                    content_index=0,
                    delta=ev.text,
                )
            )
        elif isinstance(ev, ContentDelta):
            if state["kind"] != "message":
                pieces += open_item(
                    "message",
                    {
                        "type": "message",
                        "id": _item_id("msg"),
                        "status": "in_progress",
                        "role": "assistant",
                        "content": [],
                    },
                )
            state["text"].append(ev.text)
            pieces.append(
                event(
                    "response.output_text.delta",
                    item_id=state["item"]["id"],
                    output_index=len(output) - 1,
                    content_index=0,
                    delta=ev.text,
                    logprobs=[],
                )
            )
        elif isinstance(ev, ToolCallStart):
            item = _call_item(
                _item_id("ctc" if ev.name in ctx["custom"] else "fc"),
                ev.id,
                ev.name,
                "",
                ctx,
                "in_progress",
            )
            if item["type"] == "custom_tool_call":
                item["input"] = ""
            pieces += open_item("call", item)
            state["call"] = (ev.id, ev.name)
        elif isinstance(ev, ToolCallArgumentsDelta):
            state["text"].append(ev.text)
            if (
                state["item"]["type"] == "function_call"
            ):  # a custom call's input is sent whole when it ends
                pieces.append(
                    event(
                        "response.function_call_arguments.delta",
                        item_id=state["item"]["id"],
                        output_index=len(output) - 1,
                        delta=ev.text,
                    )
                )
        elif isinstance(ev, ToolCallEnd):
            state["text"] = [ev.arguments]
            pieces += close()
        elif isinstance(ev, Finished):
            if ev.finish_reason in ("abort", "error"):
                err = _failed(ev)
                failed = dict(
                    _response(prep, ctx, "failed", output, None),
                    error={"code": "server_error", "message": err.message},
                )
                yield "".join(pieces) + event("response.failed", response=failed)
                return
            status = "incomplete" if ev.finish_reason == "length" else "completed"
            pieces += close(status)
            final = _response(prep, ctx, status, output, _usage(ev.usage, gen.reasoning_tokens))
            pieces.append(
                event(
                    "response.incomplete" if status == "incomplete" else "response.completed",
                    response=final,
                )
            )
        if pieces:
            yield "".join(pieces)
