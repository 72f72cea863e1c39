"""JSON Schemas as the output grammar enforces them: annotations out, numbers bounded, and the
keywords the grammar cannot enforce named.

The server accepts a schema when every keyword that constrains the value is enforced by the
grammar (llguidance's JSON Schema compiler, plus :mod:`openk3.engine.grammars` for the typed
argument form). Three rewrites make that hold without changing what a schema means:

* **Annotations are removed** (:data:`ANNOTATIONS`: ``$schema``, ``$id``, ``$comment``, ``title``,
  ``description``, ``examples``, ``default``, ``deprecated``, ``readOnly``, ``writeOnly``, the
  ``content*`` keywords, and a ``format`` llguidance does not implement): JSON Schema 2020-12
  (Validation §7.2.1 and §9, Core §8.2) says they assert nothing. Known formats stay enforced.
  ``$id`` also sets a base URI that llguidance resolves ``$ref`` against and refuses when it is a
  bare fragment (``"#user"``), not a URI (``"anyOf with refs"``) or carries a fragment
  (``https://x/s#/a``); with in-document references only (MFJS, ``MoonshotAI/walle``: "``$ref``
  only supports internal subschemas"), dropping it resolves every reference the same way, and a
  reference spelled as the absolute ``$id`` plus a fragment is rewritten to the fragment.
* **Keywords that constrain nothing are removed** (:func:`_is_vacuous`): ``propertyNames`` of
  ``true`` / ``{}`` / ``{"type": "string"}`` (object keys are always strings), ``uniqueItems:
  false``, ``minItems`` / ``minLength`` / ``minProperties`` of 0, ``unevaluated*`` of ``true``,
  ``if`` without ``then`` / ``else``, empty ``patternProperties`` / ``dependentRequired`` /
  ``dependentSchemas``.
* **Numbers are bounded** (:data:`NUMBER_BOUND`): a number or integer with no bound of its own on
  a side gets ``|x| <= 2**53 - 1`` there, and "any value" (``true``, ``{}``, an absent ``items`` /
  ``additionalProperties``) becomes a definition whose numbers are bounded the same way. Without
  it the grammar admits ``2903E493``, which no JSON decoder reads back as a finite number (Python
  gives ``inf``, JavaScript ``Infinity``); with a bound llguidance writes numbers in plain decimal
  notation, and every value within ``2**53 - 1`` is exact in IEEE double precision (the interop
  range of RFC 7493 §2.2 and walle's integer range, ``[-2**53 + 1, 2**53 - 1]``). llguidance cannot
  compile a range as wide as float64's (its range compiler stops near 1e19), so one bound serves
  both types. Schemas that pin values (``enum``, ``const``) are left alone.

What remains unenforceable is reported by :func:`unenforceable_keywords` (llguidance's
"Unimplemented keys" and its other compile errors); :func:`prepare_schema` either raises
(``strict``) or removes those keywords from the grammar's copy (non-strict: the model still sees
the full schema in the tool declaration, but its arguments may then violate the dropped keywords).

Source: JSON Schema 2020-12 Core / Validation; llguidance ``docs/json_schema.md`` (supported
keywords, ``x-guidance``); the platform's strictness levels (platform.kimi.ai "Tool Use":
``strict`` true by default, ``false`` only guarantees a JSON object).
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any

NUMBER_BOUND = 2**53 - 1
ANY_DEF = "openk3_any_json"  # the definition that stands for "any JSON value" with bounded numbers

ANNOTATIONS = frozenset(
    {
        "$schema",
        "$id",
        "$comment",
        "title",
        "description",
        "examples",
        "default",
        "deprecated",
        "readOnly",
        "writeOnly",
        "contentEncoding",
        "contentMediaType",
        "contentSchema",
        "$vocabulary",
    }
)
# Keywords whose value is one subschema / a list of subschemas / a name -> subschema map.
_ONE = (
    "items",
    "additionalProperties",
    "unevaluatedProperties",
    "unevaluatedItems",
    "contains",
    "propertyNames",
    "not",
    "if",
    "then",
    "else",
    "additionalItems",
)
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_NUMERIC_TYPES = ("number", "integer")
# ``format`` values llguidance enforces; any other ``format`` is an annotation (2020-12 Validation §7.2.1)
# and is removed like the other annotations.
ENFORCED_FORMATS = frozenset(
    {"date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uuid", "uri"}
)
_UNIMPLEMENTED = re.compile(r"Unimplemented keys: \[([^\]]*)\]")


def _children(node: dict):
    """(key, index-or-name-or-None, subschema) for every direct subschema of `node`."""
    for key in _ONE:
        if key in node and isinstance(node[key], (dict, bool)):
            yield key, None, node[key]
    for key in _LIST:
        if isinstance(node.get(key), list):
            for i, sub in enumerate(node[key]):
                if isinstance(sub, (dict, bool)):
                    yield key, i, sub
    if isinstance(node.get("items"), list):  # draft-07 tuple form
        for i, sub in enumerate(node["items"]):
            if isinstance(sub, (dict, bool)):
                yield "items", i, sub
    for key in _MAP:
        if isinstance(node.get(key), dict):
            for name, sub in node[key].items():
                if isinstance(sub, (dict, bool)):
                    yield key, name, sub
    deps = node.get("dependencies")
    if isinstance(deps, dict):
        for name, sub in deps.items():
            if isinstance(sub, (dict, bool)):
                yield "dependencies", name, sub


def _replace(node: dict, key: str, at: Any, new: Any) -> None:
    if at is None:
        node[key] = new
    else:
        node[key][at] = new


def _is_vacuous(key: str, value: Any, node: dict) -> bool:
    """True when keyword `key` with `value` (in `node`) admits every instance."""
    if key == "propertyNames":
        if value is True or value == {}:
            return True
        return (
            isinstance(value, dict)
            and value.get("type") == "string"
            and set(value) - ANNOTATIONS == {"type"}
        )
    if key == "uniqueItems":
        return value is False
    if key in ("minItems", "minLength", "minProperties"):
        return value == 0 and not isinstance(value, bool)
    if key in ("unevaluatedProperties", "unevaluatedItems"):
        return value is True or value == {}
    if key == "if":
        return "then" not in node and "else" not in node
    if key in ("patternProperties", "dependentRequired", "dependentSchemas"):
        return value == {}
    return False


def _admits(node: dict, types: tuple[str, ...]) -> bool:
    t = node.get("type")
    if t is None:
        return True
    names = t if isinstance(t, list) else [t]
    return any(x in names for x in types)


def _any_json() -> dict:
    ref = {"$ref": f"#/$defs/{ANY_DEF}"}
    return {
        "anyOf": [
            {"type": "null"},
            {"type": "boolean"},
            {"type": "string"},
            {"type": "number", "minimum": -NUMBER_BOUND, "maximum": NUMBER_BOUND},
            {"type": "array", "items": ref},
            {"type": "object", "additionalProperties": ref},
        ]
    }


class _Prep:
    """One pass over a schema tree (a deep copy); records whether "any value" was used."""

    def __init__(self, root_id: Any):
        self.root_id = root_id if isinstance(root_id, str) and root_id else None
        self.used_any = False

    def any_ref(self) -> dict:
        self.used_any = True
        return {"$ref": f"#/$defs/{ANY_DEF}"}

    def node(self, node: Any, bound: bool = True) -> Any:
        """Rewrite one subschema; returns the replacement (``true`` and ``{}`` may become the
        any-value reference). `bound` False (inside ``not``, ``if``, ``propertyNames``,
        ``contains``, where a bound would change the meaning): annotations only."""
        if bound and (node is True or node == {}):
            return self.any_ref()
        if not isinstance(node, dict):
            return node
        for key in [k for k in node if k in ANNOTATIONS]:
            del node[key]
        if "format" in node and node["format"] not in ENFORCED_FORMATS:
            del node["format"]
        for key in [k for k, v in node.items() if _is_vacuous(k, v, node)]:
            del node[key]
        ref = node.get("$ref")
        base = self.root_id.split("#")[0] if self.root_id else ""
        if isinstance(ref, str) and base and ref.startswith(base + "#"):
            node["$ref"] = ref[len(base) :]
        if bound and not node:  # only annotations: any value
            return self.any_ref()
        for key, at, sub in list(_children(node)):
            inner = bound and key not in ("not", "if", "propertyNames", "contains")
            _replace(node, key, at, self.node(sub, inner))
        if not bound or "enum" in node or "const" in node:
            return node  # literal values need no bound
        if any(k in node for k in ("$ref", "anyOf", "oneOf", "allOf")):
            return node  # the branches / the target carry the bounds
        if _admits(node, _NUMERIC_TYPES):
            if "minimum" not in node and "exclusiveMinimum" not in node:
                node["minimum"] = -NUMBER_BOUND
            if "maximum" not in node and "exclusiveMaximum" not in node:
                node["maximum"] = NUMBER_BOUND
        if _admits(node, ("array",)) and "items" not in node:
            node["items"] = self.any_ref()
        if (
            _admits(node, ("object",))
            and "additionalProperties" not in node
            and "unevaluatedProperties" not in node
        ):
            node["additionalProperties"] = self.any_ref()
        return node


def bound_schema(schema: Any) -> Any:
    """A copy of `schema` with annotations and vacuous keywords removed and numbers bounded (module
    docstring); what the grammar compiles. `schema` itself is not modified.

    Returns:
        The rewritten schema (a dict; a ``true`` / ``{}`` schema becomes the any-value definition).
    """
    if schema is False:
        return False
    root = copy.deepcopy(schema) if isinstance(schema, dict) else {}
    defs_key = "$defs"
    p = _Prep(root.get("$id") if isinstance(root, dict) else None)
    out = p.node(root)
    if p.used_any:
        if not isinstance(out, dict) or set(out) == {"$ref"}:
            out = {"allOf": [out]} if isinstance(out, dict) else {}
        out.setdefault(defs_key, {})
        if ANY_DEF not in out[defs_key]:
            out[defs_key][ANY_DEF] = _any_json()
    return out


def remove_keywords(schema: Any, keywords: set[str]) -> Any:
    """A copy of `schema` without `keywords` wherever they are keywords (never where they are
    property names or data inside ``enum`` / ``const``)."""
    if not isinstance(schema, dict):
        return schema
    node = {k: v for k, v in schema.items() if k not in keywords}
    for key in {k for k, _, _ in _children(node)}:  # containers copied before their items change
        if isinstance(node[key], (list, dict)):
            node[key] = copy.copy(node[key])
    for key, at, sub in list(_children(node)):
        _replace(node, key, at, remove_keywords(sub, keywords))
    return node


def compile_error(schema: Any, lenient: bool = False) -> str:
    """llguidance's error for compiling `schema` as a JSON grammar ("" when it compiles)."""
    from llguidance import LLMatcher

    probe = dict(schema) if isinstance(schema, dict) else {"allOf": [schema]}
    probe["x-guidance"] = {"lenient": lenient}
    try:
        text = "start: %json " + json.dumps(probe, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as e:
        return f"not JSON: {e}"
    return LLMatcher.validate_grammar(text) or ""


def _first_line(msg: str) -> str:
    """llguidance's message without its position prefix and grammar echo (one line)."""
    lines = []
    for line in msg.strip().splitlines():
        if re.match(r"\s+\d+ \| ", line):  # the echoed grammar starts here
            break
        lines.append(line.strip())
    text = " ".join(x for x in lines if x and set(x) != {"^"})
    return re.sub(r"^at \d+\(\d+\): ", "", text).replace("failed to compile JSON schema: ", "")


def unenforceable_keywords(schema: Any) -> tuple[list[str], str]:
    """What the grammar cannot enforce in `schema` (already passed through :func:`bound_schema`).

    Returns:
        ``(keywords, error)``: the keywords llguidance does not implement (sorted), and its first
        other compile error ("" when none); both empty when `schema` is fully enforceable.
    """
    found: set[str] = set()
    current = schema
    for _ in range(16):  # llguidance reports the unimplemented keys of one subschema at a time
        err = compile_error(current)
        m = _UNIMPLEMENTED.search(err)
        if not m:
            return sorted(found), _first_line(err) if err else ""
        keys = {k.strip().strip('"') for k in m.group(1).split(",") if k.strip()}
        if not keys - found:
            return sorted(found), _first_line(err)
        found |= keys
        current = remove_keywords(current, found)
    return sorted(found), ""


class SchemaNotEnforceable(ValueError):
    """A strict schema uses keywords the grammar cannot enforce (``keywords``) or fails to compile."""

    def __init__(self, where: str, keywords: list[str], error: str):
        self.where = where
        self.keywords = keywords
        self.error = error
        if keywords:
            named = ", ".join(json.dumps(k) for k in keywords)
            msg = (
                f"{where}: JSON Schema keyword(s) {named} cannot be enforced by the output grammar "
                '(set "strict": false to accept the schema without them)'
            )
        else:
            msg = f"{where}: the schema cannot be enforced by the output grammar ({error})"
        super().__init__(msg)


def prepare_schema(schema: Any, where: str, strict: bool) -> tuple[Any, list[str]]:
    """The schema the grammar compiles for a tool's parameters or a response format.

    Args:
        schema: the JSON Schema as sent (not modified).
        where: field name for errors (``tools[0].function.parameters (tool 'x')``).
        strict: unenforceable keywords are an error; otherwise they are dropped from the grammar.
    Returns:
        ``(grammar_schema, dropped)``: the keywords left out of the grammar (or llguidance's message
        when it compiles the rest leniently); a non-strict schema that still does not compile
        becomes a plain object schema (the platform's non-strict guarantee: a JSON object) and
        `dropped` is ``["*"]``.
    Raises:
        SchemaNotEnforceable: `strict` and some keyword cannot be enforced.
    """
    bounded = bound_schema(schema)
    keywords, error = unenforceable_keywords(bounded)
    if not keywords and not error:
        return bounded, []
    if strict:
        raise SchemaNotEnforceable(where, keywords, error)
    trimmed = remove_keywords(bounded, set(keywords))
    if compile_error(trimmed, lenient=True):
        return bound_schema({"type": "object"}), ["*"]
    return trimmed, keywords or [error]
