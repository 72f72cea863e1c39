"""Validate a chat-completions request and normalise it into the shapes the K3 renderer needs.

Everything here is pure data handling (no tokenizer): the one-shot options (thinking, effort,
tool_choice, response_format; ``../shared/spec/k3-chat-format.md`` §8-§9 and the server mapping in
``../shared/fixtures/k3-chat-format/README.md``) and one normalised object per message (§4).
Malformed input raises ``ValueError`` whose message starts with the field path, for example
``messages[3].tool_calls[0].function.name: ...``.

Leniency is the template's, strictness the platform's. By default (``strict=False``, what
:func:`~openk3.chat_format.encode_request`, the training renderer and the chat template use)
everything the official K3 template renders is accepted and rendered as it renders it (§4-§6): a
message of another role is skipped, any non-image content part renders its ``text`` (``input_text``
and friends; a part without string text renders nothing), tool-call arguments that are valid JSON
but not an object render verbatim as a json block, a ``json_schema`` response format without
``schema`` renders its ``json_schema`` object (without that, ``null``). The server passes
``strict=True``: each of those is then a ``ValueError`` (an HTTP 400 there), see :data:`PLATFORM_RULES`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

#: What ``strict=True`` refuses although the template renders it, and why (the server's decision).
PLATFORM_RULES = {
    "role": "only system / user / assistant / tool / developer: the legacy `function` role is not part of the "
    "Kimi API (the template skips such a message)",
    "content part": "only text, image_url and image parts, a text part with a string `text` (OpenAI-only types "
    "such as input_text are not part of the Kimi chat API; the template renders their text)",
    "arguments": "a JSON-object string (k3-chat-format.md §6: valid JSON that is not an object is rejected, as "
    "the vLLM port does; the template renders it as a json block)",
    "response_format.json_schema": "json_schema with a `schema` object (api.md §1.6; OpenAI allows a schema-less "
    "json_schema and the template then renders the wrapper)",
}

EFFORTS = ("low", "medium", "high", "max")  # the template's set (§8); the hosted API omits medium
TOOL_CHOICES = ("auto", "none", "required")
IMAGE_PART_TYPES = ("image", "image_url")


@dataclass(frozen=True)
class ImageSlot:
    """An image content part; renders as one ``<|media_pad|>`` id that the server expands (§10).

    ``part`` is the original content part (the server reads the URL / data from it); ``where`` is
    where the client wrote it (``messages[i].content[j]``), for error messages."""

    part: dict
    where: str = ""


Parts = list  # list[str | ImageSlot], in content order


@dataclass
class TextMessage:
    """A ``user`` or ``system`` message (``developer`` is mapped to ``system``, §4.5; ``developer``
    says it was sent so). ``stray_tools``: the message carried a non-empty ``tools`` list, which
    only a system message can declare (not rendered; the server refuses it)."""

    index: int
    role: str
    name: str | None
    parts: Parts
    developer: bool = False
    stray_tools: bool = False


@dataclass
class DynamicTools:
    """A ``system`` message with a non-empty ``tools`` list: a dynamic tool declaration (§4.2).
    ``parts`` is the message's content, which the template does not render (the server requires
    it empty)."""

    index: int
    tools: list
    parts: Parts = field(default_factory=list)


@dataclass
class ToolCall:
    """One assistant tool call. Exactly one of ``arguments`` (an object: typed argument tags) and
    ``raw_json`` (text that is not JSON: a json block) is set, or neither (no arguments, §6)."""

    name: str
    id: Any
    arguments: dict | None = None
    raw_json: str | None = None
    type: Any = "function"  # the call's ``type`` as sent (the server accepts only "function")


@dataclass
class AssistantMessage:
    """An assistant message: reasoning (think channel), content (response channel), tool calls.
    ``reasoning`` is None when the message has no ``reasoning_content`` / ``reasoning`` (``""``
    when one is sent empty: the platform tells the two apart, §3)."""

    index: int
    name: str | None
    reasoning: str | None
    parts: Parts
    calls: list[ToolCall] = field(default_factory=list)
    partial: bool = False
    stray_tools: bool = False


@dataclass
class ToolResult:
    """A ``tool`` message. ``id`` is ``tool_call_id`` (or ``id``), None when absent; ``fallback_name``
    is the ``tool`` field if that key exists, else ``name`` (used only for unresolved runs, §4.4)."""

    index: int
    id: Any
    fallback_name: str | None
    parts: Parts
    id_key: str = "tool_call_id"  # the key ``id`` came from (``tool_call_id`` or ``id``)
    stray_tools: bool = False
    # A result that answers no call and is named by ``fallback_name`` alone (a Responses
    # ``function_call_output`` without ``call_id``, which Codex sends for context it injects):
    # rendered after the run's other results, never matched against the calls.
    by_name: bool = False


@dataclass
class SkippedMessage:
    """A message of a role the template has no branch for (e.g. the legacy ``function`` role): it
    renders nothing, but it still ends a run of tool results (§4.4-§4.5)."""

    index: int
    role: Any


Message = TextMessage | DynamicTools | AssistantMessage | ToolResult | SkippedMessage


@dataclass
class RequestOptions:
    """Request-level settings after the server mapping (fixtures README, §8-§9).

    ``tool_choice`` is the request's value (``auto`` when absent); ``render_tool_choice`` says
    whether the §5.3 message is emitted (``none``/``required`` with at least one tool declared)."""

    thinking: bool
    thinking_effort: str | None
    tools: list
    tool_choice: str
    render_tool_choice: bool
    response_format: str | None
    response_schema: Any = None
    keep: str | None = None


def _fail(where: str, problem: str) -> ValueError:
    return ValueError(f"{where}: {problem}")


MAX_JSON_DEPTH = 500  # deeper values cannot be rendered: json.dumps, which renders them, recurses


def check_json(value: Any, where: str) -> None:
    """Check that `value` is plain JSON data: objects with string keys, arrays (list / tuple), strings,
    finite numbers, booleans and null, acyclic and nested at most :data:`MAX_JSON_DEPTH` levels.
    Objects the client sends always are (up to the depth); Python callers (training data, tests)
    can pass sets, NaN or cycles, which would otherwise crash or render non-JSON (§6, §7). The walk
    is iterative: it never recurses, whatever the value.

    Raises:
        ValueError: naming `where` (plus the path inside the value) and the offending value.
    """
    on_path: set[int] = set()  # containers being walked: one met again inside itself is a cycle
    stack: list[tuple[Any, str, int]] = [(value, where, 1)]  # depth < 0: leaving that container
    while stack:
        v, w, depth = stack.pop()
        if depth < 0:
            on_path.discard(id(v))
            continue
        if isinstance(v, (dict, list, tuple)):
            if id(v) in on_path:
                raise _fail(w, "not JSON data (Circular reference detected)")
            if depth > MAX_JSON_DEPTH:
                raise _fail(where, f"not JSON data (nested more than {MAX_JSON_DEPTH} levels deep)")
            on_path.add(id(v))
            stack.append((v, w, -1))
            if isinstance(v, dict):
                for k, x in v.items():
                    if not isinstance(k, str):  # json.dumps would silently turn 1 into "1"
                        raise _fail(w, f"object key {k!r} is not a string")
                    stack.append((x, f"{w}[{json.dumps(k, ensure_ascii=False)}]", depth + 1))
            else:
                stack.extend((x, f"{w}[{j}]", depth + 1) for j, x in enumerate(v))
        elif isinstance(v, float) and not math.isfinite(v):
            raise _fail(w, f"{v!r} is not a JSON number")
        elif v is not None and not isinstance(v, (str, int, float)):
            raise _fail(w, f"{type(v).__name__} value {v!r:.40} is not JSON data")


def _object(value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        raise _fail(where, f"must be an object, got {type(value).__name__}")
    return value


class _NotStandardJSON(Exception):
    """``NaN`` / ``Infinity`` / an overflowing number: Python's json accepts them, JSON does not."""


def _reject_constant(name: str) -> Any:
    raise _NotStandardJSON(name)


def _finite_float(text: str) -> float:
    x = float(text)
    if not math.isfinite(x):  # 1e400 parses to inf, which is not JSON either
        raise _NotStandardJSON(text)
    return x


def parse_content(content: Any, where: str, strict: bool = False) -> Parts:
    """Content (str / None / list of parts) -> parts list; empty strings are kept out.

    An image part is an image slot; any other part renders its ``text`` when that is a string and
    nothing otherwise (the template's rule, §4.1).

    Raises:
        ValueError: content of another type or a part that is not an object; with ``strict``, also a
            text part without a string ``text`` or a part type other than text / image_url / image.
    """
    if content is None:
        return []
    if isinstance(content, str):
        return [content] if content else []
    if not isinstance(content, list):
        raise _fail(
            where, f"must be a string, null or a list of parts, got {type(content).__name__}"
        )
    parts: Parts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            raise _fail(
                f"{where}[{j}]", f"content part must be an object, got {type(part).__name__}"
            )
        kind = part.get("type", "text")
        if kind in IMAGE_PART_TYPES:
            parts.append(ImageSlot(part, f"{where}[{j}]"))
            continue
        text = part.get("text")
        if strict and kind == "text" and not isinstance(text, str):
            raise _fail(f"{where}[{j}].text", "text part needs a string 'text'")
        if strict and kind != "text":
            raise _fail(
                f"{where}[{j}].type",
                f"unsupported content part type {kind!r} (text, image_url, image)",
            )
        if isinstance(text, str) and text:
            parts.append(text)
    return parts


def _partial(msg: dict, role: str, where: str) -> bool:
    """``partial`` (api.md §1.8): a JSON boolean; true only on an assistant message (the last one,
    checked by :func:`parse_messages`)."""
    value = msg.get("partial")
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _fail(f"{where}.partial", f"must be a boolean, got {value!r}")
    if value and role != "assistant":
        raise _fail(
            f"{where}.partial",
            f"only the final assistant message can be partial, not a {role} message",
        )
    return value


def _name(msg: dict, where: str) -> str | None:
    name = msg.get("name")
    if name is None or name == "":
        return None
    if not isinstance(name, str):
        raise _fail(f"{where}.name", f"must be a string, got {type(name).__name__}")
    return name


def parse_arguments(args: Any, where: str, strict: bool = False) -> tuple[dict | None, str | None]:
    """OpenAI ``function.arguments`` -> (object for typed tags, raw text for a json block) per §6.

    A JSON-object string or an object gives typed tags; text that is not JSON gives a json block;
    missing / null / blank gives neither. ``NaN``, ``Infinity`` and numbers that overflow to them are
    not JSON: a string holding them is "text that is not JSON" and renders verbatim as a json block,
    like the parser's reading of such a block (so the model's own output replays unchanged).

    A string holding valid JSON that is not an object (an array, a number) is, like any string the
    server does not turn into an object, rendered verbatim as a json block.

    Raises:
        ValueError: a value that is neither string nor object, an object holding non-JSON data (a
            set, NaN, a non-string key, a cycle); with ``strict``, valid JSON that is not an object.
    """
    if args is None:
        return None, None
    if isinstance(args, dict):
        check_json(args, where)
        return args, None
    if not isinstance(args, str):
        raise _fail(where, f"must be a JSON-object string or an object, got {type(args).__name__}")
    if not args.strip():
        return None, None
    try:
        value = json.loads(args, parse_constant=_reject_constant, parse_float=_finite_float)
    except (
        ValueError,
        _NotStandardJSON,
        RecursionError,
    ):  # ValueError: also ints over Python's digit limit
        return None, args
    if not isinstance(value, dict):
        if strict:
            raise _fail(where, f"must encode a JSON object, got JSON {type(value).__name__}")
        return None, args
    return value, None


def _parse_calls(calls: Any, where: str, strict: bool = False) -> list[ToolCall]:
    if calls is None:
        return []
    if not isinstance(calls, list):
        raise _fail(where, f"must be a list, got {type(calls).__name__}")
    out = []
    for j, call in enumerate(calls):
        cw = f"{where}[{j}]"
        if not isinstance(call, dict):
            raise _fail(cw, f"tool call must be an object, got {type(call).__name__}")
        fn, fw = (
            (_object(call["function"], f"{cw}.function"), f"{cw}.function")
            if call.get("function") is not None
            else (call, cw)
        )
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise _fail(f"{fw}.name", f"tool call needs a non-empty string name, got {name!r}")
        arguments, raw = parse_arguments(fn.get("arguments"), f"{fw}.arguments", strict)
        out.append(
            ToolCall(
                name=name,
                id=_call_id(call.get("id"), f"{cw}.id"),
                arguments=arguments,
                raw_json=raw,
                type=call.get("type", "function"),
            )
        )
    return out


def _call_id(value: Any, where: str) -> Any:
    # Ids are only compared (as strings); anything but a string / integer is a client bug.
    if value is not None and (isinstance(value, bool) or not isinstance(value, (str, int))):
        raise _fail(where, f"must be a string (or an integer), got {type(value).__name__}")
    return value


def _parse_tools(tools: Any, where: str) -> list:
    """Validate a tool list (request-level ``tools`` or a dynamic declaration): a list of objects,
    each with a non-empty string name, all JSON data (they are rendered as canonical JSON, §7)."""
    if not isinstance(tools, list):
        raise _fail(where, f"must be a list of tool objects, got {type(tools).__name__}")
    for j, tool in enumerate(tools):
        tw = f"{where}[{j}]"
        _object(tool, tw)
        fn, fw = (
            (_object(tool["function"], f"{tw}.function"), f"{tw}.function")
            if tool.get("function") is not None
            else (tool, tw)
        )
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise _fail(f"{fw}.name", f"tool needs a non-empty string name, got {name!r}")
        check_json(tool, tw)
    return tools


def tool_name(tool: dict) -> str | None:
    """Declared name of a tool object validated by :func:`_parse_tools` (``function.name``, or a
    flat ``name``)."""
    fn = tool.get("function") if isinstance(tool.get("function"), dict) else tool
    name = fn.get("name")
    return name if isinstance(name, str) else None


def parse_message(msg: Any, i: int, where: str | None = None, strict: bool = False) -> Message:
    """Validate and normalise ``messages[i]``; errors are prefixed with `where` (default ``messages[i]``).
    A role the template has no branch for gives a :class:`SkippedMessage` (``strict``: an error).

    Raises:
        ValueError: not an object, missing role, or a malformed field (named in the message); see
            :data:`PLATFORM_RULES` for what ``strict`` adds.
    """
    where = where or f"messages[{i}]"
    if not isinstance(msg, dict):
        raise _fail(where, f"message must be an object, got {type(msg).__name__}")
    if "role" not in msg:
        raise _fail(f"{where}.role", "missing")
    role = msg["role"]
    developer = role == "developer"
    if developer:
        role = "system"
    if role not in ("user", "system", "assistant", "tool"):
        if strict:
            raise _fail(
                f"{where}.role", f"unknown role {role!r} (system, user, assistant, tool, developer)"
            )
        return SkippedMessage(i, role)
    partial = _partial(msg, role, where)
    stray_tools = role != "system" and bool(msg.get("tools"))
    if role in ("user", "system"):
        if role == "system" and msg.get("tools") is not None:
            tools = _parse_tools(msg["tools"], f"{where}.tools")
            if tools:  # an empty list declares nothing: a plain system message, as in the template
                # the content is not rendered; parsed leniently, only for the server's "must be empty"
                return DynamicTools(i, tools, parse_content(msg.get("content"), f"{where}.content"))
        return TextMessage(
            i,
            role,
            _name(msg, where),
            parse_content(msg.get("content"), f"{where}.content", strict),
            developer=developer,
            stray_tools=stray_tools,
        )
    if role == "assistant":
        for key in ("reasoning_content", "reasoning"):
            if msg.get(key) is not None and not isinstance(msg[key], str):
                raise _fail(f"{where}.{key}", f"must be a string, got {type(msg[key]).__name__}")
        reasoning = msg.get("reasoning_content") or msg.get("reasoning")
        if not reasoning:
            reasoning = (
                ""
                if msg.get("reasoning_content") is not None or msg.get("reasoning") is not None
                else None
            )
        return AssistantMessage(
            i,
            _name(msg, where),
            reasoning,
            parse_content(msg.get("content"), f"{where}.content", strict),
            _parse_calls(msg.get("tool_calls"), f"{where}.tool_calls", strict),
            partial=partial,
            stray_tools=stray_tools,
        )
    key = "tool_call_id" if "tool_call_id" in msg else "id"
    call_id = _call_id(msg.get(key), f"{where}.{key}")
    fallback = msg["tool"] if "tool" in msg else msg.get("name")
    if fallback is not None and not isinstance(fallback, str):
        raise _fail(
            f"{where}.{'tool' if 'tool' in msg else 'name'}", f"must be a string, got {fallback!r}"
        )
    return ToolResult(
        i,
        call_id,
        fallback,
        parse_content(msg.get("content"), f"{where}.content", strict),
        id_key=key,
        stray_tools=stray_tools,
    )


def parse_messages(request: dict, strict: bool = False) -> list[Message]:
    """All messages of `request`, normalised, in order.

    Raises:
        ValueError: `request` not an object; ``messages`` missing, not a list or empty; any malformed
            message; ``partial: true`` anywhere but on the final message (api.md §1.8).
    """
    if not isinstance(request, dict):
        raise _fail(
            "request", f"must be a JSON object with a 'messages' list, got {type(request).__name__}"
        )
    msgs = request.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _fail("messages", f"must be a non-empty list, got {msgs!r:.60}")
    parsed = [parse_message(m, i, strict=strict) for i, m in enumerate(msgs)]
    for m in parsed[:-1]:
        if isinstance(m, AssistantMessage) and m.partial:
            raise _fail(
                f"messages[{m.index}].partial",
                "only the final message can be partial "
                f"(this is message {m.index} of {len(parsed)})",
            )
    return parsed


def _effort_source(request: dict, ctk: dict, thinking_obj: dict) -> tuple[str | None, str]:
    for value, where in (
        (ctk.get("thinking_effort"), "chat_template_kwargs.thinking_effort"),
        (thinking_obj.get("effort"), "thinking.effort"),
        (request.get("reasoning_effort"), "reasoning_effort"),
    ):
        if value is not None:
            return value, where
    return None, ""


_SCHEMA_WRAPPER_KEYS = {
    "name",
    "strict",
    "description",
}  # wrapper fields that are not rendered (§5.4)


def _response_schema(rf: dict, strict: bool = False) -> Any:
    """The schema of a ``json_schema`` response format, looked up in the template's order (§5.4:
    ``json_schema.schema``, ``json_schema.json_schema``, the wrapper itself; no wrapper: null).
    With ``strict`` (the server: the API requires ``json_schema.schema``, api.md §1.6) a missing or
    non-object schema is rejected instead of telling the model to match ``null``.

    Raises:
        ValueError: the schema is not JSON data; with ``strict``, see above.
    """
    wrapper = rf.get("json_schema")
    if not strict:
        if isinstance(wrapper, dict):
            key = next((k for k in ("schema", "json_schema") if k in wrapper), None)
            where = f"response_format.json_schema.{key}" if key else "response_format.json_schema"
            schema = wrapper[key] if key else wrapper
        else:
            where = "response_format.json_schema"
            schema = wrapper
        check_json(schema, where)
        return schema
    if wrapper is None:
        raise _fail(
            "response_format.json_schema",
            "required for type 'json_schema' (shape: {'name': ..., 'schema': {...}})",
        )
    _object(wrapper, "response_format.json_schema")
    key = next((k for k in ("schema", "json_schema") if k in wrapper), None)
    if key is None and set(wrapper) <= _SCHEMA_WRAPPER_KEYS:  # a wrapper, but its schema is missing
        raise _fail(
            "response_format.json_schema.schema", "missing (shape: {'name': ..., 'schema': {...}})"
        )
    where = f"response_format.json_schema.{key}" if key else "response_format.json_schema"
    schema = wrapper[key] if key else wrapper
    if not isinstance(schema, dict):
        raise _fail(where, f"the schema must be a JSON object, got {schema!r:.60}")
    check_json(schema, where)
    return schema


def parse_options(request: dict, messages: list[Message], strict: bool = False) -> RequestOptions:
    """Request-level options per §8-§9 and the fixtures' server mapping.

    * thinking is off when ``thinking.type == "disabled"``, ``chat_template_kwargs.thinking`` is
      false, or ``reasoning_effort == "none"``;
    * effort = first set of ``chat_template_kwargs.thinking_effort``, ``thinking.effort``,
      ``reasoning_effort``; default ``max``;
    * tool_choice ``none``/``required`` is rendered only when a tool is declared (request-level or
      dynamic); the named-function form renders nothing (the platform treats it as absent, §9);
    * response_format ``json_object`` / ``json_schema`` render a message, ``text`` nothing.

    Raises:
        ValueError: naming the field (``thinking``, ``reasoning_effort``, ``tool_choice``, ...).
    """
    if not isinstance(request, dict):
        raise _fail("request", f"must be an object, got {type(request).__name__}")
    ctk = request.get("chat_template_kwargs")
    ctk = {} if ctk is None else _object(ctk, "chat_template_kwargs")
    thinking_obj = request.get("thinking")
    if thinking_obj is None:
        thinking_obj = {}
    if not isinstance(thinking_obj, dict):
        raise _fail(
            "thinking",
            f"must be an object like {{'type': 'enabled'}}, got {type(thinking_obj).__name__}",
        )
    ttype = thinking_obj.get("type")
    if ttype not in (None, "enabled", "disabled"):
        raise _fail("thinking.type", f"must be 'enabled' or 'disabled', got {ttype!r}")
    keep = thinking_obj.get("keep")
    if keep is not None and not isinstance(keep, str):
        raise _fail("thinking.keep", f"must be a string or null, got {type(keep).__name__}")
    ctk_thinking = ctk.get("thinking")
    if ctk_thinking is not None and not isinstance(ctk_thinking, bool):
        raise _fail("chat_template_kwargs.thinking", f"must be a boolean, got {ctk_thinking!r}")
    effort, effort_where = _effort_source(request, ctk, thinking_obj)
    thinking = not (
        ttype == "disabled" or ctk_thinking is False or request.get("reasoning_effort") == "none"
    )
    if effort is not None and effort not in EFFORTS and not (effort == "none" and not thinking):
        raise _fail(effort_where, f"unsupported effort {effort!r} (low, medium, high, max)")
    effort = (effort or "max") if thinking else None

    tools = _parse_tools(request["tools"], "tools") if request.get("tools") is not None else []
    declared = _declared_names(tools, messages)

    choice = request.get("tool_choice")
    if choice is None:
        choice = "auto"
    if isinstance(choice, dict):
        choice = "auto"  # the named form: the platform ignores it (§9); the server checks its shape
    if choice not in TOOL_CHOICES:
        raise _fail("tool_choice", f"unsupported value {choice!r} (auto, none, required)")

    rf = request.get("response_format")
    rf_type = None
    schema = None
    if rf is not None:
        if not isinstance(rf, dict):
            raise _fail("response_format", f"must be an object, got {type(rf).__name__}")
        kind = rf.get("type", "text")
        if kind not in ("text", "json_object", "json_schema"):
            raise _fail(
                "response_format.type",
                f"unsupported value {kind!r} (text, json_object, json_schema)",
            )
        if kind != "text":
            rf_type = kind
        if kind == "json_schema":
            schema = _response_schema(rf, strict)
    return RequestOptions(
        thinking=thinking,
        thinking_effort=effort,
        tools=tools,
        tool_choice=choice,
        render_tool_choice=choice in ("none", "required") and bool(declared),
        response_format=rf_type,
        response_schema=schema,
        keep=keep,
    )


def _declared_names(tools: list, messages: list[Message]) -> list[str | None]:
    """Names of the request-level `tools`, then of the dynamic declarations in `messages`.

    Raises:
        ValueError: a name declared twice (``tools: duplicate tool name ...``).
    """
    declared = [tool_name(t) for t in tools] + [
        tool_name(t) for m in messages if isinstance(m, DynamicTools) for t in m.tools
    ]
    seen: set[str | None] = set()
    for name in declared:
        if name is not None and name in seen:
            raise _fail("tools", f"duplicate tool name {name!r} across the declarations")
        seen.add(name)
    return declared


def make_options(
    messages: list[Message],
    *,
    thinking: bool,
    thinking_effort: str | None = None,
    tools: list | None = None,
    tool_choice: str = "auto",
    response_format: str | None = None,
    response_schema: Any = None,
) -> RequestOptions:
    """Request options given as values rather than a chat-completions body (the server's Anthropic
    and Responses adapters): the tools are validated as :func:`parse_options` validates them
    (objects with a non-empty name, JSON data, no name declared twice across `tools` and the
    dynamic declarations in `messages`), the effort defaults to ``max`` with thinking on, and the
    tool_choice message is rendered under the same rule (§9).

    Args:
        response_format: None, ``json_object`` or ``json_schema`` (then `response_schema`, a JSON
            Schema object).
    Raises:
        ValueError: naming the field (``tools[j].function.name``, ``tool_choice``, ...).
    """
    tools = _parse_tools(tools, "tools") if tools is not None else []
    declared = _declared_names(tools, messages)
    if tool_choice not in TOOL_CHOICES:
        raise _fail("tool_choice", f"unsupported value {tool_choice!r} (auto, none, required)")
    if thinking_effort is not None and thinking_effort not in EFFORTS:
        raise _fail(
            "thinking_effort", f"unsupported effort {thinking_effort!r} (low, medium, high, max)"
        )
    if response_format not in (None, "json_object", "json_schema"):
        raise _fail(
            "response_format", f"unsupported value {response_format!r} (json_object, json_schema)"
        )
    if response_format == "json_schema":
        check_json(_object(response_schema, "response_format.schema"), "response_format.schema")
    return RequestOptions(
        thinking=thinking,
        thinking_effort=(thinking_effort or "max") if thinking else None,
        tools=tools,
        tool_choice=tool_choice,
        render_tool_choice=tool_choice in ("none", "required") and bool(declared),
        response_format=response_format,
        response_schema=response_schema,
    )


@dataclass
class Conversation:
    """A request as the renderer sees it: the normalised messages and the request-level options
    (:func:`openk3.chat_format.render.render` takes it; the server's ``ChatRequest`` is one)."""

    messages: list[Message]
    options: RequestOptions


def parse_conversation(request: Any, strict: bool = False) -> Conversation:
    """:func:`parse_messages` and :func:`parse_options` of a chat-completions request.

    Raises:
        ValueError: as those (the field named in the message).
    """
    messages = parse_messages(request, strict=strict)
    return Conversation(messages, parse_options(request, messages, strict=strict))
