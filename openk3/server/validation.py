"""The platform's request contract, checked before rendering (``../shared/spec/api.md``).

Each check raises :class:`~openk3.server.protocol.APIError` 400 with the platform's message where
one is documented (§1.5 fixed sampling, §3 reasoning_content in history, §1.7 tool_choice) and a
field-named message otherwise. Order of use: :meth:`openk3.server.serving.ChatServing.prepare`.

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
  anywhere in the body (:func:`check_unicode`), a JSON Schema nested deeper than
  ``MAX_SCHEMA_DEPTH`` (64) levels (:func:`check_schema_depths`).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

from openk3.chat_format.request import DynamicTools, parse_messages
from openk3.server.protocol import ChatCompletionRequest, bad_request

TOOL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_-]{0,255}$")  # api.md §1.1
THINKING_BOOL = "the thinking field in the request (expected type object) is illegal, and bool is not acceptable"


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
    max_request_memory: int | None = None  # bytes of activations one request may need; None: unbounded


def _fmt(v: float) -> str:
    return f"{v:g}"


def check_sampling(req: ChatCompletionRequest, thinking: bool) -> None:
    """The immutable sampling contract (api.md §1.5, release notes §2).

    Raises:
        APIError: 400 ``invalid <param>: only <value> is allowed for this model``.
    """
    temps = (1.0, 0.6, 0.0) if thinking else (0.6,)
    fixed = [("temperature", req.temperature, temps), ("top_p", req.top_p, (0.95,)), ("n", req.n, (1,)),
             ("presence_penalty", req.presence_penalty, (0.0,)),
             ("frequency_penalty", req.frequency_penalty, (0.0,))]
    for name, value, allowed in fixed:
        if value is None:
            continue
        if not math.isfinite(value) or not any(abs(value - a) <= 1e-9 for a in allowed):
            raise bad_request(f"invalid {name}: only {_fmt(allowed[0])} is allowed for this model")


def check_effort(body: dict) -> None:
    """``reasoning_effort`` is one of low, medium, high, max: ``"none"`` (which the open template's
    servers map to instant mode) is a 400 as on the hosted K3; instant mode is ``thinking: {"type":
    "disabled"}``.

    Raises:
        APIError: 400 naming ``reasoning_effort`` and the accepted values.
    """
    if body.get("reasoning_effort") == "none":
        raise bad_request("reasoning_effort: unsupported value 'none' (low, medium, high, max); "
                          "for instant mode send thinking: {\"type\": \"disabled\"}")


def _is_empty_content(content: Any) -> bool:
    if content is None or content == "":
        return True
    if isinstance(content, list):
        return all(isinstance(p, dict) and p.get("type", "text") == "text" and not p.get("text") for p in content)
    return False


def check_keep(keep: str | None) -> None:
    """``thinking.keep`` is null or ``"all"`` (api.md §1.3 table: K3-class models preserve all
    thinking; other values are an error there).

    Raises:
        APIError: 400 naming ``thinking.keep`` and the value.
    """
    if keep is not None and keep != "all":
        raise bad_request(f"thinking.keep: only null or 'all' is allowed for this model, got {keep!r}")


def check_messages(body: dict, thinking: bool, keep: str | None) -> None:
    """Per-message platform rules (api.md §1.2, §3; release notes §2 "Tools").

    Raises:
        APIError: 400 naming the message index.
    """
    msgs = body["messages"]
    last = len(msgs) - 1
    for i, m in enumerate(msgs):
        role = m.get("role")
        if role in ("user", "assistant", "tool") and m.get("tools"):
            raise bad_request(f"messages[{i}].tools: dynamic tools are only allowed in system messages")
        if role in ("system", "developer") and m.get("tools"):
            if not _is_empty_content(m.get("content")):
                raise bad_request(f"messages[{i}].content: a system message with tools must have empty content")
            continue
        if role in ("system", "developer", "user", "tool") and _is_empty_content(m.get("content")):
            raise bad_request(f"messages[{i}].content: content must not be empty for {role} messages")
        if role == "tool" and not m.get("tool_call_id"):
            raise bad_request(f"messages[{i}].tool_call_id: required for tool messages")
        if role == "assistant" and thinking and not (i == last and m.get("partial")):
            has_reasoning = m.get("reasoning_content") is not None or m.get("reasoning") is not None
            if has_reasoning:
                continue
            if keep == "all":
                raise bad_request("preserved thinking (thinking.keep=all) requires reasoning_content on every "
                                  f"assistant message, but assistant message at index {i} is missing reasoning_content")
            if m.get("tool_calls"):
                raise bad_request("thinking is enabled but reasoning_content is missing in assistant tool call "
                                  f"message at index {i}")


_IMAGE_PARTS = ("image_url", "image")  # the part types the renderer turns into image slots


def check_image_roles(body: dict, tool_images: bool = False) -> None:
    """Image parts only in user messages (OpenAI's chat-completions rule: system / developer,
    assistant and tool content is text only; Kimi's OpenAPI document shares one content schema
    across roles and says nothing either way, so the stricter rule is kept).

    Args:
        tool_images: also allow them in ``tool`` messages (the Anthropic surface, whose
            ``tool_result`` content may hold image blocks).
    Raises:
        APIError: 400 naming the part, ``messages[i].content[j]``.
    """
    allowed = ("user", "tool") if tool_images else ("user",)
    for i, m in enumerate(body["messages"]):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list) or m.get("role") in allowed:
            continue
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") in _IMAGE_PARTS:
                raise bad_request(f"messages[{i}].content[{j}]: image parts are only allowed in user messages, "
                                  f"not in {m.get('role')} messages")


def check_tool_history(body: dict) -> None:
    """Tool-call structure of the history (api.md §4): every call of an assistant message is
    ``type: "function"`` with an id unique in the conversation, and every id gets a ``tool``
    result before the next user / assistant message. A platform rule (OpenAI and Kimi answer 400),
    not a chat-format one: the renderer accepts any sequence.

    Raises:
        APIError: 400 naming the message index and the tool-call id.
    """
    msgs = body["messages"]
    seen: set[str] = set()
    pending: dict[str, int] = {}

    def unanswered() -> None:
        if pending:
            cid, at = next(iter(pending.items()))
            raise bad_request(f"messages[{at}].tool_calls: tool call id {cid!r} has no tool result message "
                              "(each tool call must be answered by a tool message before the next user or "
                              "assistant message)")

    last = len(msgs) - 1
    for i, m in enumerate(msgs):
        role = m.get("role")
        if role == "tool":
            pending.pop(m.get("tool_call_id"), None)
            continue
        if role not in ("user", "assistant"):
            continue
        unanswered()
        if role != "assistant" or not m.get("tool_calls"):
            continue
        if i == last and m.get("partial"):
            continue
        for k, call in enumerate(m["tool_calls"]):
            if not isinstance(call, dict):
                continue
            kind = call.get("type", "function")
            if kind is not None and kind != "function":
                raise bad_request(f"messages[{i}].tool_calls[{k}].type: only 'function' is supported, got {kind!r}")
            cid = call.get("id")
            if cid is None:
                continue
            if cid in seen:
                raise bad_request(f"messages[{i}].tool_calls[{k}].id: duplicate tool call id {cid!r}")
            seen.add(cid)
            pending[cid] = i
    unanswered()


def _strings(value: Any, keys: bool = True) -> int:
    """Characters of every string in a JSON value (object keys too when ``keys``); iterative."""
    total, stack = 0, [value]
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


def _arguments_chars(args: Any) -> int:
    """Rendered characters of a tool call's ``arguments`` at least: an object's keys and string
    values are rendered verbatim (§6); text that is not JSON is rendered verbatim as a json block.
    The whitespace and punctuation of a JSON string are not, hence the parse."""
    if isinstance(args, dict):
        return _strings(args)
    if not isinstance(args, str) or not args.strip():
        return 0
    try:
        return _strings(json.loads(args))
    except (ValueError, RecursionError):
        return len(args)


def rendered_chars(body: dict, thinking: bool = False) -> int:
    """A lower bound on the characters the renderer will tokenize for a chat body, in one cheap
    pass (no tokenizer, no JSON encoding): every string that reaches the prompt verbatim —
    message ``content`` strings and text parts, tool-call names and argument keys / values, and
    with ``thinking`` the assistant reasoning (``reasoning_content``, else ``reasoning``; instant
    mode drops it) — and, since tool declarations and the ``response_format`` schema are
    rendered as their canonical JSON (chat-format §5, §7), every key and string value of
    request-level ``tools``, of dynamic ``messages[i].tools`` and of the response schema. Image
    parts and fields rendered only in some cases (``name``) or never (ids, roles, ``model``,
    ``stop``) are not counted, so the count never exceeds what is rendered (escaping only adds)."""
    total = 0
    for m in body.get("messages") if isinstance(body.get("messages"), list) else ():
        if not isinstance(m, dict):
            continue
        v = m.get("content")
        if isinstance(v, str):
            total += len(v)
        elif isinstance(v, list):
            total += sum(len(p["text"]) for p in v if isinstance(p, dict) and p.get("type", "text") == "text"
                         and isinstance(p.get("text"), str))
        reasoning = m.get("reasoning_content") or m.get("reasoning")
        if thinking and m.get("role") == "assistant" and isinstance(reasoning, str):
            total += len(reasoning)
        for call in m.get("tool_calls") if isinstance(m.get("tool_calls"), list) else ():
            fn = call.get("function", call) if isinstance(call, dict) else None
            if isinstance(fn, dict):
                total += len(fn["name"]) if isinstance(fn.get("name"), str) else 0
                total += _arguments_chars(fn.get("arguments"))
        if m.get("tools") is not None:
            total += _strings(m["tools"])
    total += _strings(body.get("tools"))
    rf = body.get("response_format")
    wrapper = rf.get("json_schema") if isinstance(rf, dict) and rf.get("type") == "json_schema" else None
    if isinstance(wrapper, dict):
        key = next((k for k in ("schema", "json_schema") if k in wrapper), None)
        total += _strings(wrapper[key] if key else wrapper)
    return total


def _declarations(body: dict) -> list[tuple[str, Any]]:
    """``(where, tool)`` for every declared tool: request-level ``tools[j]``, then the dynamic
    ``messages[i].tools[j]`` (system messages only; other roles are refused by :func:`check_messages`)."""
    out = [(f"tools[{j}]", t) for j, t in enumerate(body.get("tools") or ())]
    for i, m in enumerate(body.get("messages") or ()):
        if isinstance(m, dict) and m.get("role") in ("system", "developer") and isinstance(m.get("tools"), list):
            out += [(f"messages[{i}].tools[{j}]", t) for j, t in enumerate(m["tools"])]
    return out


def check_tool_choice(choice: Any) -> None:
    """The named form ``{"type": "function", "function": {"name": ...}}`` is accepted and, as on the
    platform, ignored (treated as no tool_choice: the vendor verifier skips its rejection test
    "current behavior silently ignores named-function tool_choice"); other objects are a 400.

    Raises:
        APIError: 400 naming ``tool_choice``.
    """
    if isinstance(choice, dict) and choice.get("type") != "function":
        raise bad_request(f"tool_choice: unsupported value {json.dumps(choice)[:80]} (auto, none, required, or "
                          "{'type': 'function', 'function': {'name': ...}})")


def check_tools(body: dict, opts: Any, limits: Limits, strict_default: bool = True) -> list[dict]:
    """Tools and tool_choice rules (api.md §1.7, release notes §2 "Tools"); returns every declared
    tool (request-level, then dynamic) as the constraint compiles it: the same tool objects with
    ``function.parameters`` replaced by :func:`openk3.engine.json_schema.prepare_schema`'s schema.

    * ``tools: []`` declares nothing (kosong sends it on every tool-less call); ``required`` still
      needs a tool;
    * every tool has ``type: "function"`` (platform.kimi.ai Tool Use: "each tool in the list must
      include a type"; the vendor verifier's ``test_dynamic_tool_missing_required_field_rejected``),
      a name matching :data:`TOOL_NAME`, and an object root schema;
    * strictness: ``function.strict`` when it is a boolean, else `strict_default` (the platform's
      default is true; the Anthropic surface passes false, Anthropic's own default). A strict tool
      whose schema uses a keyword the grammar cannot enforce is a 400 naming the tool and keyword;
      a non-strict one is accepted and the keyword left out of the grammar.

    Raises:
        APIError: 400 naming the tool (``tools[j]`` or ``messages[i].tools[j]``) for a missing or
            non-function ``type``, a bad name, a non-object root, an unenforceable strict schema;
            too many tools; ``required`` without any tool.
    """
    from openk3.engine.json_schema import SchemaNotEnforceable, prepare_schema

    check_tool_choice(body.get("tool_choice"))
    found = _declarations(body)
    if len(found) > limits.max_tools:
        raise bad_request(f"tools: at most {limits.max_tools} tools are allowed, got {len(found)}")
    declared: list[dict] = []
    for where, t in found:
        if not isinstance(t, dict):
            raise bad_request(f"{where}: must be a tool object, got {type(t).__name__}")
        if "type" not in t:
            raise bad_request(f"{where}.type: required (only 'function' tools are supported)")
        if t["type"] != "function":
            raise bad_request(f"{where}.type: only 'function' tools are supported, got {t['type']!r}")
        fn = t.get("function") if isinstance(t.get("function"), dict) else None
        name = fn.get("name") if fn else None
        if not isinstance(name, str) or not TOOL_NAME.match(name):
            raise bad_request(f"{where}.function.name: {name!r} does not match {TOOL_NAME.pattern}")
        params = fn.get("parameters")
        if params is not None and not (isinstance(params, dict) and params.get("type", "object") == "object"):
            raise bad_request(f"{where}.function.parameters: the root must be an object schema")
        strict = fn.get("strict") if isinstance(fn.get("strict"), bool) else strict_default
        if params:
            try:
                params, _ = prepare_schema(params, f"{where}.function.parameters (tool {name!r})", strict)
            except SchemaNotEnforceable as e:
                raise bad_request(str(e)) from None
            t = dict(t, function=dict(fn, parameters=params))
        declared.append(t)
    if opts.tool_choice == "required" and not declared:
        raise bad_request("tool_choice: 'required' needs at least one tool")
    return declared


_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def check_unicode(body: Any) -> None:
    """Every string of the body (object keys included) is valid Unicode: JSON's ``\\uXXXX`` escapes
    can spell a lone UTF-16 surrogate, which no tokenizer, grammar or UTF-8 response can carry.
    Iterative, any nesting depth.

    Raises:
        APIError: 400 naming the field path (``messages[0].content``) and the character index.
    """
    stack = [(body, "")]
    while stack:
        value, where = stack.pop()
        if isinstance(value, str):
            if not value.isascii():
                try:
                    value.encode("utf-8")
                except UnicodeEncodeError as e:
                    raise bad_request(f"{where or 'body'}: unpaired UTF-16 surrogate U+{ord(value[e.start]):04X} at "
                                      f"character {e.start}; text must be valid Unicode") from None
        elif isinstance(value, dict):
            items = []  # pushed reversed: the first bad string in document order is reported
            for key, child in value.items():
                items.append((key, f"{where or 'body'} (an object key)"))
                if isinstance(key, str) and _IDENT.match(key):
                    items.append((child, f"{where}.{key}" if where else key))
                else:  # json.dumps escapes to ASCII: the key itself may hold the surrogate
                    items.append((child, f"{where}[{json.dumps(key)}]"))
            stack.extend(reversed(items))
        elif isinstance(value, list):
            stack.extend((child, f"{where}[{j}]") for j, child in reversed(list(enumerate(value))))


def _tool_schemas(tools: Any, where: str) -> list[tuple[Any, str]]:
    out = []
    for j, t in enumerate(tools if isinstance(tools, list) else ()):
        fn = t.get("function", t) if isinstance(t, dict) else None
        if isinstance(fn, dict) and "parameters" in fn:
            out.append((fn["parameters"], f"{where}[{j}].{'function.' if fn is not t else ''}parameters"))
    return out


def check_schema_depths(body: dict) -> None:
    """Every JSON Schema of a chat body (``response_format.json_schema.schema`` — or wherever the
    renderer finds it — request-level and dynamic tool ``parameters``) nests at most
    :data:`~openk3.engine.constraints.MAX_SCHEMA_DEPTH` levels. Runs first, without recursion:
    the later schema checks, the renderer and the constraint compiler all recurse.

    Raises:
        APIError: 400 naming the field.
    """
    from openk3.engine.constraints import check_schema_depth

    found = _tool_schemas(body.get("tools"), "tools")
    rf = body.get("response_format")
    wrapper = rf.get("json_schema") if isinstance(rf, dict) and rf.get("type") == "json_schema" else None
    if isinstance(wrapper, dict):
        key = next((k for k in ("schema", "json_schema") if k in wrapper), None)
        found.append((wrapper[key] if key else wrapper, f"response_format.json_schema{'.' + key if key else ''}"))
    for i, m in enumerate(body.get("messages") if isinstance(body.get("messages"), list) else ()):
        if isinstance(m, dict):
            found += _tool_schemas(m.get("tools"), f"messages[{i}].tools")
    for schema, where in found:
        try:
            check_schema_depth(schema, where)
        except ValueError as e:
            raise bad_request(str(e)) from None


def check_stops(stop: str | list[str] | None, limits: Limits) -> list[str]:
    """``stop`` as a list (api.md §1.1: at most 5 strings of at most 32 bytes).

    Raises:
        APIError: 400 for too many, empty or too long stop strings.
    """
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop)
    if len(stops) > limits.max_stop:
        raise bad_request(f"stop: at most {limits.max_stop} stop strings are allowed, got {len(stops)}")
    for s in stops:
        if not s or len(s.encode("utf-8")) > limits.max_stop_bytes:
            raise bad_request(f"stop: each stop string must be 1 to {limits.max_stop_bytes} bytes, got {s!r}")
    return stops


def check_image_parts(images: list[dict], supports_image_in: bool, locations: dict[int, str] | None = None) -> None:
    """Images must be base64 data URLs (api.md §1.2, §11: http(s) URLs are a 400), and the model
    must have a vision tower.

    Args:
        locations: ``id(part) -> "messages[i].content[j]"`` (:func:`openk3.server.images.
            image_locations`); errors name the part there (the Anthropic adapter records the
            client's own block path, e.g. ``messages[0].content[1].source``).
    Raises:
        APIError: 400 naming the part.
    """
    locations = locations or {}
    for part in images:
        where = locations.get(id(part), "")
        anthropic = bool(where) and where.endswith(".source")
        field = (where or "image_url") if anthropic else (f"{where}.image_url.url" if where else "image_url.url")
        ref = part.get("image_url", part.get("image"))
        url = ref.get("url") if isinstance(ref, dict) else ref
        if not isinstance(url, str):
            raise bad_request(f"{field}: missing image URL")
        if url.startswith(("http://", "https://")):
            hint = ("use a base64 source" if anthropic
                    else "send the image as a base64 data URL (data:image/png;base64,...)")
            raise bad_request(f"{field}: http(s) image URLs are not supported; {hint}")
        if not url.startswith("data:") or ";base64," not in url:
            raise bad_request(f"{field}: must be a base64 data URL (data:image/<type>;base64,...)")
    if images and not supports_image_in:
        raise bad_request("model does not support image input")
