"""Lark grammars (llguidance dialect) for K3 output: think channel, response JSON, tool calls.

Implements the output language of ``../shared/spec/k3-chat-format.md`` §11.1 as it is produced by
the canonical renderer (``openk3.chat_format.render_assistant_output``), restricted so that every
string the grammar accepts parses cleanly with ``openk3.chat_format.OutputParser`` (§11.3):

    thinking on:  THINK <|close|>think<|sep|> <|open|>response<|sep|> BODY <|close|>response<|sep|>
                  [TOOLS] <|close|>message<|sep|> <|end_of_msg|>
    thinking off: BODY <|close|>response<|sep|> [TOOLS] <|close|>message<|sep|> <|end_of_msg|>

Markers are referenced by token id (``<[163587]>``), never by text, so the grammar works for any
vocabulary that carries them (the Kimi BPE and project-trained BPEs). Tag names and attributes are
written exactly as the renderer writes them (§2: no whitespace, fixed attribute order, ``&``/``"``
escaped); tool calls are numbered ``index="1"``, ``"2"`` ... in order (§4.3). Each argument uses the
typed form of §6 (``type="string"`` bodies are raw text, other types are JSON text) or, as the
parser also accepts, one ``json`` block holding the whole arguments object.

Typed-argument coverage: the properties declared in ``properties``, in declared order (the order
llguidance also imposes on JSON objects), required ones mandatory. Raw string bodies honour
``enum``/``const``, ``pattern`` (search semantics, as JSON Schema), ``minLength``/``maxLength``,
``format`` in {date, time, date-time, uuid} (syntax only), ``anyOf``, single-string-branch
``oneOf``, ``allOf`` and ``$ref``; other value types go through llguidance's JSON Schema compiler.
A property whose schema cannot be expressed in the typed form drops that alternative; a tool whose
parameters use object-level keywords beyond ``properties``/``required``/``additionalProperties``
(e.g. ``anyOf`` at the top, ``minProperties``) is only offered the json-block form, which
llguidance compiles from the full schema.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

from llguidance import LLMatcher, regex_to_lark

ALL_TYPES = frozenset({"string", "number", "integer", "boolean", "null", "object", "array"})
_ANY_TEXT = "/(?s:.*)/"
QUOTE = '"'
# Syntax-only regexes (RFC 3339 / RFC 4122) for the raw-string form; jsonschema treats `format`
# as an annotation unless asked, so these only steer the model toward well-formed values.
_DATE = r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
_TIME = r"([01][0-9]|2[0-3]):[0-5][0-9]:([0-5][0-9]|60)(\.[0-9]{1,9})?([Zz]|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
_FORMATS = {
    "date": _DATE,
    "time": _TIME,
    "date-time": _DATE + "[Tt]" + _TIME,
    "uuid": r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}",
}
# Object-level keywords the typed-argument form does not implement: such parameters get the json block only.
_OBJECT_ONLY_KEYS = {
    "minProperties",
    "maxProperties",
    "patternProperties",
    "propertyNames",
    "dependentRequired",
    "dependentSchemas",
    "dependencies",
    "allOf",
    "anyOf",
    "oneOf",
    "not",
    "$ref",
    "if",
    "then",
    "else",
    "enum",
    "const",
    "$dynamicRef",
}


class _Unsupported(Exception):
    """The typed-argument form cannot express a (sub)schema; the caller drops that alternative."""


@dataclass(frozen=True)
class Markers:
    """Token ids of the four XTML markers (spec §1.1): official BPE 163587/163588/163589/163586."""

    open: int
    close: int
    sep: int
    end_of_msg: int

    def ref(self, name: str) -> str:
        return f"<[{getattr(self, name)}]>"


@dataclass(frozen=True)
class Tool:
    """One callable function: its name and JSON Schema ``parameters`` (an object schema)."""

    name: str
    parameters: dict


def lark_literal(text: str) -> str:
    """A Lark string literal matching exactly `text` (JSON escapes are valid Lark escapes)."""
    return json.dumps(text, ensure_ascii=False)


def regex_literal(text: str) -> str:
    """Regex source matching exactly `text`: ASCII alphanumerics as-is, everything else as ``\\x{..}``."""
    return "".join(c if c.isascii() and c.isalnum() else f"\\x{{{ord(c):X}}}" for c in text)


def escape_attr(value: str) -> str:
    """Attribute escaping of spec §2: ``&`` -> ``&amp;`` first, then ``"`` -> ``&quot;``."""
    return value.replace("&", "&amp;").replace('"', "&quot;")


def text_terminal(max_chars: int | None) -> str | None:
    """Non-empty free text (any characters; a marker id never matches), of at most `max_chars`
    characters; None when `max_chars` is 0. Callers make it optional.

    Raises:
        ValueError: `max_chars` is not None or an int >= 0.
    """
    if max_chars is None:
        return "/(?s:.+)/"
    if isinstance(max_chars, bool) or not isinstance(max_chars, int) or max_chars < 0:
        raise ValueError(f"max_chars: must be an int >= 0 or None, got {max_chars!r}")
    return f"/(?s:.){{1,{max_chars}}}/" if max_chars else None


# --------------------------------------------------------------------------- schema helpers


def resolve_ref(ref: Any, root: Any) -> Any:
    """The subschema a local ``$ref`` (``#``, ``#/$defs/X``, JSON pointer) points to in `root`.

    Raises ``ValueError`` for a remote or dangling reference.
    """
    if not isinstance(ref, str) or not ref.startswith("#"):
        raise ValueError(f"$ref: only local references ('#/...') are supported, got {ref!r}")
    node = root
    for part in [p for p in ref[1:].split("/") if p]:
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise ValueError(f"$ref: {ref!r} does not resolve")
    return node


def _value_types(v: Any) -> set[str]:
    if isinstance(v, bool):
        return {"boolean"}
    if v is None:
        return {"null"}
    if isinstance(v, int) or (isinstance(v, float) and v.is_integer()):
        return {"integer", "number"}
    if isinstance(v, float):
        return {"number"}
    if isinstance(v, str):
        return {"string"}
    return {"array"} if isinstance(v, list) else {"object"}


def json_types(schema: Any, root: Any, depth: int = 0) -> set[str]:
    """Over-approximation of the JSON types `schema` admits (``integer`` counted inside ``number``).

    Follows ``$ref`` (local), ``type``, ``enum``, ``const``, ``anyOf``/``oneOf`` (union) and
    ``allOf`` (intersection). Raises ``ValueError`` for a non-schema value or a bad reference.
    """
    if depth > 64:
        raise _Unsupported("schema recursion too deep")
    if schema is True:
        return set(ALL_TYPES)
    if schema is False:
        return set()
    if not isinstance(schema, dict):
        raise ValueError(f"schema: expected an object or boolean, got {type(schema).__name__}")
    out = set(ALL_TYPES)
    if "$ref" in schema:
        out &= json_types(resolve_ref(schema["$ref"], root), root, depth + 1)
    if "type" in schema:
        t = schema["type"]
        types = set(t) if isinstance(t, list) else {t}
        if "number" in types:
            types.add("integer")
        out &= types
    if "const" in schema:
        out &= _value_types(schema["const"])
    if isinstance(schema.get("enum"), list):
        out &= set().union(*(_value_types(v) for v in schema["enum"]))
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            out &= set().union(*(json_types(s, root, depth + 1) for s in schema[key]))
    for s in schema.get("allOf") or []:
        out &= json_types(s, root, depth + 1)
    return out


def _pattern_terminal(pattern: Any) -> str:
    """Regex terminal for a JSON Schema ``pattern``: search semantics unless anchored by ``^``/``$``."""
    if not isinstance(pattern, str):
        raise ValueError(f"pattern: must be a string, got {pattern!r}")
    body = pattern
    head = "(?s:.*)"
    tail = "(?s:.*)"
    if body.startswith("^"):
        body = body[1:]
        head = ""
    if body.endswith("$"):
        stem = body[:-1]
        if (len(stem) - len(stem.rstrip("\\"))) % 2 == 0:  # an escaped `\$` is a literal dollar
            body = stem
            tail = ""
    return "/" + head + "(?:" + regex_to_lark(body, "dw") + ")" + tail + "/"


def raw_string_terminal(schema: Any, root: Any, depth: int = 0) -> str | None:
    """Lark terminal expression for the raw (unescaped) strings `schema` admits, or None if none.

    Used for ``type="string"`` argument bodies (§6), which carry the string without JSON quoting.
    Raises ``_Unsupported`` when a keyword that constrains strings cannot be expressed.
    """
    if depth > 64:
        raise _Unsupported("schema recursion too deep")
    if schema is True:
        return _ANY_TEXT
    if schema is False or not isinstance(schema, dict):
        return None
    parts: list[str] = []
    if "type" in schema:
        t = schema["type"]
        if "string" not in (t if isinstance(t, list) else [t]):
            return None
    if "$ref" in schema:
        sub = raw_string_terminal(resolve_ref(schema["$ref"], root), root, depth + 1)
        if sub is None:
            return None
        parts.append(sub)
    if "const" in schema:
        if not isinstance(schema["const"], str):
            return None
        parts.append("/" + regex_literal(schema["const"]) + "/")
    if isinstance(schema.get("enum"), list):
        strings = [v for v in schema["enum"] if isinstance(v, str)]
        if not strings:
            return None
        parts.append("/" + "|".join(f"(?:{regex_literal(s)})" for s in strings) + "/")
    if "pattern" in schema:
        parts.append(_pattern_terminal(schema["pattern"]))
    lo = schema.get("minLength", 0)
    hi = schema.get("maxLength")
    if lo or hi is not None:
        if hi is not None and hi < lo:
            return None
        parts.append(f"/(?s:.){{{int(lo)},{'' if hi is None else int(hi)}}}/")
    if schema.get("format") in _FORMATS:
        parts.append("/" + _FORMATS[schema["format"]] + "/")
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            alive = [
                r
                for r in (raw_string_terminal(s, root, depth + 1) for s in schema[key])
                if r is not None
            ]
            if not alive:
                return None
            if key == "oneOf" and len(alive) > 1:
                raise _Unsupported(
                    "oneOf with several string branches"
                )  # exclusivity is not regular-cheap
            parts.append("(" + " | ".join(alive) + ")")
    for s in schema.get("allOf") or []:
        sub = raw_string_terminal(s, root, depth + 1)
        if sub is None:
            return None
        parts.append(sub)
    if "not" in schema:
        raise _Unsupported("not")
    if not parts:
        return _ANY_TEXT
    return parts[0] if len(parts) == 1 else "(" + " & ".join(parts) + ")"


def _with_options(schema: Any, root: Any, options: dict) -> dict:
    """A standalone schema for ``%json``: `schema` plus the root's definitions and JSON options."""
    out: dict = {"allOf": [schema]} if not isinstance(schema, dict) else dict(schema)
    if isinstance(root, dict):
        for key in ("$defs", "definitions"):
            if key in root and key not in out:
                out[key] = root[key]
    if options:
        out["x-guidance"] = dict(options)
    return out


def json_rule(schema: Any, options: dict) -> str:
    """``%json {...}`` for a whole (root) schema with llguidance compile `options` (``x-guidance``)."""
    return "%json " + json.dumps(_with_options(schema, schema, options), ensure_ascii=False)


def _valid(lark: str) -> bool:
    return LLMatcher.validate_grammar(lark) == ""


# --------------------------------------------------------------------------- grammar builder


class GrammarBuilder:
    """Accumulates named Lark rules; ``build(start_body)`` returns the grammar text.

    Args:
        markers: the marker ids of the target vocabulary.
        json_options: llguidance ``x-guidance`` options for every JSON (sub)schema (whitespace,
            lenient mode ...).
    """

    def __init__(self, markers: Markers, json_options: dict):
        self.m = markers
        self.json_options = json_options
        self.rules: list[str] = []
        self._n = 0

    def name(self, prefix: str) -> str:
        self._n += 1
        return f"{prefix}_{self._n}"

    def add(self, name: str, body: str) -> str:
        self.rules.append(f"{name}: {body}")
        return name

    def terminal(self, expr: str) -> str:
        """A named terminal (uppercase: one lexeme) for `expr`."""
        return self.add(self.name("T").upper(), expr)

    def optional_text(self, name: str, max_chars: int | None) -> str:
        """Rule name for optional free text (see ``text_terminal``), or "" when it must be empty."""
        expr = text_terminal(max_chars)
        return "" if expr is None else self.add(name, self.terminal(expr) + "?")

    def open_tag(self, text: str) -> str:
        return f"{self.m.ref('open')} {lark_literal(text)} {self.m.ref('sep')}"

    def close_tag(self, name: str) -> str:
        return f"{self.m.ref('close')} {lark_literal(name)} {self.m.ref('sep')}"

    # -- tool calls ---------------------------------------------------------------------------
    def _typed_value(self, schema: Any, root: dict) -> list[str]:
        """Alternatives ``'TYPE"' <|sep|> BODY`` for one argument value; [] when none is expressible."""
        try:
            types = json_types(schema, root)
        except _Unsupported:
            return []
        alts = []
        if "string" in types:
            try:
                expr = raw_string_terminal(schema, root)
            except _Unsupported:
                expr = None
            if expr is not None and _valid(f"start: X\nX: {expr}"):
                alts.append(
                    f"{lark_literal('string' + QUOTE)} {self.m.ref('sep')} {self.terminal(expr)}"
                )
        for tag, json_type in (
            ("number", ["number", "integer"]),
            ("boolean", ["boolean"]),
            ("null", ["null"]),
            ("object", ["object"]),
            ("array", ["array"]),
        ):
            if not types.intersection(json_type):
                continue
            sub = _with_options({"allOf": [schema], "type": json_type}, root, self.json_options)
            rule = "%json " + json.dumps(sub, ensure_ascii=False)
            if _valid(f"start: {rule}"):
                alts.append(
                    f"{lark_literal(tag + QUOTE)} {self.m.ref('sep')} {self.add(self.name('v'), rule)}"
                )
        return alts

    def typed_arguments(self, params: dict) -> str | None:
        """Rule body for a call's typed argument tags (§6), or None if the schema needs the json block.

        Declared properties come first, in declared order (required ones mandatory); then, unless
        ``additionalProperties`` is false, any number of other keys valued per that schema (the
        order llguidance also uses in a json block, so both forms render to the same typed tags).
        """
        root = params
        for _ in range(8):  # a parameters schema that is only a $ref to its definition
            if not (
                isinstance(params, dict)
                and "$ref" in params
                and set(params)
                <= {"$ref", "$defs", "definitions", "$schema", "$id", "title", "description"}
            ):
                break
            params = resolve_ref(params["$ref"], root)
        if not isinstance(params, dict) or any(k in params for k in _OBJECT_ONLY_KEYS):
            return None
        if params.get("type", "object") not in ("object", ["object"]):
            return None
        props = params.get("properties") or {}
        required = params.get("required") or []
        if (
            not isinstance(props, dict)
            or not isinstance(required, list)
            or any(r not in props for r in required)
        ):
            return None
        items = []
        for key, sub in props.items():
            alts = self._typed_value(sub, root)
            if not alts:
                if key in required:
                    return None
                continue  # an optional property the typed form cannot express is left out
            head = lark_literal(f'argument key="{escape_attr(key)}" type="')
            rule = self.add(
                self.name("arg"),
                f"{self.m.ref('open')} {head} ({' | '.join(alts)}) {self.close_tag('argument')}",
            )
            items.append(rule if key in required else rule + "?")
        extra = params.get("additionalProperties", params.get("unevaluatedProperties", True))
        alts = [] if extra is False else self._typed_value(extra, root)
        if alts:
            # An escaped attribute value (§2) that is none of the declared keys.
            key = r'/([^"&]|&amp;|&quot;)*/'
            if props:
                # (?:...) keeps an empty key ("") a valid regex
                key = f"({key} & ~({' | '.join('/(?:' + regex_literal(escape_attr(k)) + ')/' for k in props)}))"
            rule = self.add(
                self.name("extra"),
                f"{self.m.ref('open')} {lark_literal('argument key=' + QUOTE)} "
                f"{self.terminal(key)} {lark_literal(QUOTE + ' type=' + QUOTE)} "
                f"({' | '.join(alts)}) {self.close_tag('argument')}",
            )
            items.append(rule + "*")
        return " ".join(items)

    def call_bodies(self, tool: Tool, json_block: bool) -> str:
        """Rule name for what may sit between a call's open and close tags."""
        alts = []
        typed = self.typed_arguments(tool.parameters)
        if typed is not None:
            alts.append(f"({typed})" if typed else '""')
        if json_block or typed is None:
            schema = dict(tool.parameters)
            schema.setdefault("type", "object")
            alts.append(
                f"{self.open_tag('json type=' + QUOTE + 'object' + QUOTE)} "
                f"{self.add(self.name('jb'), json_rule(schema, self.json_options))} "
                f"{self.close_tag('json')}"
            )
        return self.add(self.name("body"), " | ".join(alts))

    def tools_channel(
        self, tools: list[Tool], max_calls: int, json_block: bool, json_options: dict
    ) -> str:
        """Rule name for ``<|open|>tools<|sep|> CALL+ <|close|>tools<|sep|>`` with calls 1..max_calls;
        argument JSON is compiled with `json_options`."""
        saved = self.json_options
        self.json_options = json_options
        bodies = [self.call_bodies(t, json_block) for t in tools]
        self.json_options = saved
        calls = []
        for k in range(1, max_calls + 1):
            heads = [lark_literal(f'call tool="{escape_attr(t.name)}" index="{k}"') for t in tools]
            alts = [f"{h} {self.m.ref('sep')} {b}" for h, b in zip(heads, bodies)]
            calls.append(
                self.add(
                    f"call_{k}",
                    f"{self.m.ref('open')} ({' | '.join(alts)}) {self.close_tag('call')}",
                )
            )
        seq = calls[-1]
        for k in range(
            max_calls - 1, 0, -1
        ):  # call_1 (call_2 (call_3 ...)?)?: indices stay consecutive
            seq = self.add(f"calls_{k}", f"{calls[k - 1]} {seq}?")
        return self.add("tools_ch", f"{self.open_tag('tools')} {seq} {self.close_tag('tools')}")

    def build(self, start_body: str) -> str:
        return "\n".join(["%llguidance {}", f"start: {start_body}", *self.rules]) + "\n"


def output_grammar_lark(
    markers: Markers,
    *,
    body: str,
    thinking: bool,
    tools: list[Tool] | None,
    tool_choice: str,
    json_schema: Any = None,
    json_options: dict | None = None,
    tool_json_options: dict | None = None,
    think_max_chars: int | None = None,
    text_max_chars: int | None = None,
    max_tool_calls: int = 16,
    json_block: bool = True,
) -> str:
    """The whole-output grammar (module docstring) as llguidance Lark text.

    Args:
        markers: marker ids of the vocabulary.
        body: ``"text"`` (free response text) or ``"json"`` (response = JSON per `json_schema`).
        thinking: generation starts in the think channel (else in the response channel).
        tools: callable tools (empty/None: no tools channel).
        tool_choice: ``"auto"`` (response, or calls after a response), ``"required"`` (at least one
            call), ``"none"`` (no tools channel). With a JSON body, the response before calls is empty.
        json_schema: the response schema for ``body="json"`` (e.g. ``{"type": "object"}``).
        json_options: llguidance ``x-guidance`` options for the response JSON.
        tool_json_options: the same for tool arguments (default: `json_options`).
        think_max_chars / text_max_chars: bounds on the free think / response text (None: none).
        max_tool_calls: most calls in one message (>= 1).
        json_block: also offer the json-block form of arguments (the parser accepts it, §11.1).

    Raises:
        ValueError: an unknown `body`/`tool_choice`, `max_tool_calls` < 1, required without tools.
    """
    if body not in ("text", "json"):
        raise ValueError(f"body: must be 'text' or 'json', got {body!r}")
    if tool_choice not in ("auto", "none", "required"):
        raise ValueError(f"tool_choice: must be 'auto', 'none' or 'required', got {tool_choice!r}")
    if (
        isinstance(max_tool_calls, bool)
        or not isinstance(max_tool_calls, int)
        or max_tool_calls < 1
    ):
        raise ValueError(f"max_tool_calls: must be an int >= 1, got {max_tool_calls!r}")
    tools = list(tools or [])
    if tool_choice == "required" and not tools:
        raise ValueError("tool_choice: 'required' needs at least one tool")
    g = GrammarBuilder(markers, dict(json_options or {}))
    end = f"{g.close_tag('message')} {markers.ref('end_of_msg')}"
    close_resp = g.close_tag("response")
    text = g.optional_text("text", text_max_chars) if body == "text" else ""
    final = text if body == "text" else g.add("json_body", json_rule(json_schema, g.json_options))
    if tools and tool_choice != "none":
        tch = g.tools_channel(
            tools,
            max_tool_calls,
            json_block,
            dict(json_options or {}) if tool_json_options is None else dict(tool_json_options),
        )
        pre = (
            text if body == "text" else ""
        )  # content before calls: free text, or empty under a JSON format
        with_calls = f"{pre} {close_resp} {tch} {end}".strip()
        if tool_choice == "required":
            tail = with_calls
        elif body == "text":
            tail = f"{text} {close_resp} {tch}? {end}"
        else:
            tail = f"({final} {close_resp} {end} | {with_calls})"
    else:
        tail = f"{final} {close_resp} {end}"
    if thinking:
        think = g.optional_text("think", think_max_chars)
        start = f"{think} {g.close_tag('think')} {g.open_tag('response')} {g.add('tail', tail)}"
    else:
        start = g.add("tail", tail)
    return g.build(start)
