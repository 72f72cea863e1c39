"""The project's Jinja chat template (``template.jinja``) and the variables a server passes to it.

``render_template(template_variables(request))`` equals ``encode_request(request, tok).text``; the
template ships with checkpoints as ``chat_template.jinja`` (written by
:meth:`openk3.tokenizer.Tokenizer.save_pretrained`) for transformers / vLLM / SGLang. Variable
mapping follows ``../shared/fixtures/k3-chat-format/README.md`` ("How a request becomes template
variables"), except that a final ``partial`` assistant message stays in ``messages``: the template
continues it itself (spec §9 server convention).
"""

from __future__ import annotations

import copy
import json
from functools import lru_cache
from importlib import resources
from typing import Any

from openk3.chat_format.request import (
    AssistantMessage,
    parse_arguments,
    parse_messages,
    parse_options,
)


def chat_template() -> str:
    """Text of ``openk3/chat_format/template.jinja``."""
    return (
        resources.files("openk3.chat_format").joinpath("template.jinja").read_text(encoding="utf-8")
    )


def template_variables(request: dict, *, add_generation_prompt: bool = True) -> dict[str, Any]:
    """Map a chat-completions request to the template's variables.

    ``messages`` (``developer`` -> ``system``; tool-call ``arguments`` strings that hold a JSON object
    replaced by the object), ``tools`` (if non-empty), ``tool_choice`` (only ``none``/``required``
    with a tool declared), ``response_format`` (only json types), ``thinking``, ``thinking_effort``,
    ``add_generation_prompt``.

    Raises:
        ValueError: the request is malformed (same checks and messages as ``encode_request``).
    """
    parsed = parse_messages(request)
    opts = parse_options(request, parsed)
    messages = []
    for i, (raw, m) in enumerate(zip(request["messages"], parsed)):
        msg = copy.deepcopy(raw)
        if msg.get("role") == "developer":
            msg["role"] = "system"
        if isinstance(m, AssistantMessage) and isinstance(msg.get("tool_calls"), list):
            for j, call in enumerate(msg["tool_calls"]):
                fn = call["function"] if isinstance(call.get("function"), dict) else call
                obj, _ = parse_arguments(
                    fn.get("arguments"), f"messages[{i}].tool_calls[{j}].function.arguments"
                )
                if obj is not None:
                    fn["arguments"] = obj
        messages.append(msg)
    out: dict[str, Any] = {
        "messages": messages,
        "thinking": opts.thinking,
        "thinking_effort": opts.thinking_effort or "max",
        "add_generation_prompt": add_generation_prompt,
    }
    if opts.tools:
        out["tools"] = opts.tools
    if opts.render_tool_choice:
        out["tool_choice"] = opts.tool_choice
    if opts.response_format is not None:
        out["response_format"] = request["response_format"]
    return out


def _raise(message: str) -> None:
    raise ValueError(f"chat template: {message}")


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # Same keywords and defaults as transformers' override: plain json.dumps, no HTML escaping.
    return json.dumps(
        value,
        ensure_ascii=ensure_ascii,
        indent=indent,
        separators=tuple(separators) if separators else None,
        sort_keys=sort_keys,
    )


@lru_cache(maxsize=4)
def _compiled(source: str):
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    return env.from_string(source)


def render_template(variables: dict[str, Any], source: str | None = None) -> str:
    """Render the chat template (default: openk3's) with jinja2 configured like transformers'
    ``apply_chat_template`` (sandboxed, trim/lstrip blocks, json.dumps-style ``tojson``).

    Raises:
        ValueError: the template called ``raise_exception`` (malformed messages).
    """
    return _compiled(source if source is not None else chat_template()).render(**variables)
