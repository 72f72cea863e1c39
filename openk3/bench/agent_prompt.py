"""A synthetic agent request shaped like Claude Code's default first request (the long-prefill input).

The shape is taken from one request of ``@anthropic-ai/claude-code`` 2.1.197 (``claude -p "say hi"``
recorded at run time against a local logging endpoint, ``benchmarks/claude_code_request.py
--record``; the recorded text itself is never stored in the repository): an Anthropic Messages body
with three system blocks (74, 62 and 5,676 characters), 25 tools whose descriptions run from 106 to
18,780 characters and whose JSON schemas from 126 to 5,423 characters (73,791 characters of tool
JSON in all), one user turn of two text blocks (a 306-character context reminder and the prompt),
``max_tokens`` 64,000 and streaming. Rendered through openk3's Anthropic surface and the K3 chat
template with ``openk3-tiny``'s tokenizer it is 26,482 tokens, 22.7K of them the tool definitions.

Here every word is generated: sentences drawn (seeded) from a fixed vocabulary of agent-harness
terms, tool schemas built from a fixed set of property kinds, at the recorded sizes times ``scale``.
The default ``scale`` (1.15) gives about 24K prompt tokens with ``openk3-tiny``'s tokenizer.

:func:`claude_code_like_request` builds turn 1; :func:`next_turn` appends the assistant's reply
and a new user turn (the second request of an agent session, which shares turn 1's prefix).
"""

from __future__ import annotations

import json
import random

# Recorded shape (characters): system blocks; tools as (description, input schema JSON).
SYSTEM_BLOCKS = (74, 62, 5676)
TOOLS = (
    (1227, 1260),
    (1218, 1456),
    (2924, 987),
    (167, 219),
    (106, 126),
    (3724, 5423),
    (360, 584),
    (3031, 630),
    (1923, 502),
    (619, 981),
    (838, 776),
    (574, 1286),
    (2802, 820),
    (655, 452),
    (1713, 345),
    (2146, 607),
    (732, 227),
    (998, 126),
    (1049, 465),
    (203, 293),
    (2243, 1168),
    (374, 336),
    (311, 499),
    (18780, 1833),
    (240, 367),
)
REMINDER = 306
DEFAULT_SCALE = 1.15

_WORDS = (
    "the a an this that each every any when before after while until if unless then otherwise and or but "
    "not only also always never usually first next last use call run read write edit create update delete "
    "list find search match check verify report return keep avoid prefer ask tell show explain stop wait "
    "retry schedule cancel resume start finish commit push pull merge review open close save load send "
    "file files path directory folder repository branch worktree commit diff patch change changes line lines "
    "command commands shell terminal process job task tasks agent agents subagent session user assistant "
    "tool tools result results output input error errors warning message messages request response content "
    "block text string number integer boolean array object field fields value values option options flag "
    "flags default setting settings config environment variable token tokens limit timeout interval minute "
    "minutes second seconds hour status state progress owner pending blocked done description summary "
    "note notes plan step steps goal context window history cache budget pattern glob regex query url "
    "page site domain link source code function class module package test tests build lint format style "
    "notebook cell kernel schedule cron wake background foreground parallel sequential safe unsafe exact "
    "relative absolute existing new old current previous specific general short long clear concise direct "
    "important carefully quickly together separately instead of with without from into onto over under for "
    "to in on at by as is are was be can should must may will does do has have it its their your you we"
).split()
_CODE_WORDS = (
    "src/app/main.py",
    "tests/test_api.py",
    "README.md",
    "package.json",
    "git status",
    "npm test",
    "make build",
    "--verbose",
    "config.yaml",
    "$HOME/.config",
    "*.ts",
    "**/*.py",
)
_PROPS = (
    "file_path",
    "command",
    "pattern",
    "description",
    "timeout",
    "run_in_background",
    "old_string",
    "new_string",
    "replace_all",
    "offset",
    "limit",
    "url",
    "prompt",
    "query",
    "allowed_domains",
    "blocked_domains",
    "task_id",
    "status",
    "subject",
    "active_form",
    "owner",
    "blocks",
    "blocked_by",
    "metadata",
    "cron",
    "recurring",
    "name",
    "content",
    "cell_id",
    "edit_mode",
    "path",
    "glob",
    "output_mode",
    "head_limit",
    "multiline",
    "message",
    "recipient",
    "reason",
    "delay_seconds",
    "findings",
    "severity",
    "location",
    "branch",
    "base",
    "workflow",
    "inputs",
    "skill",
    "args",
)


def _sentence(rng: random.Random) -> str:
    words = [rng.choice(_WORDS) for _ in range(rng.randint(7, 22))]
    if rng.random() < 0.3:
        words.insert(rng.randrange(len(words)), f"`{rng.choice(_CODE_WORDS)}`")
    return " ".join(words).capitalize() + rng.choice(".....:;?")


def prose(rng: random.Random, chars: int) -> str:
    """About ``chars`` characters of generated instruction text: paragraphs, bullet lists, headings."""
    out: list[str] = []
    n = 0
    while n < chars:
        r = rng.random()
        if r < 0.12:
            piece = (
                "\n# "
                + " ".join(rng.choice(_WORDS) for _ in range(rng.randint(2, 5))).title()
                + "\n"
            )
        elif r < 0.45:
            piece = "\n- " + _sentence(rng)
        else:
            piece = (" " if out and not out[-1].endswith("\n") else "") + _sentence(rng)
        out.append(piece)
        n += len(piece)
    return "".join(out).strip()[:chars]


def _property(rng: random.Random, depth: int = 0) -> dict:
    kind = rng.choice(
        ("string", "string", "string", "integer", "boolean", "array", "enum", "object")
    )
    desc = prose(rng, rng.randint(40, 160))
    if kind == "enum":
        return {
            "type": "string",
            "enum": [rng.choice(_WORDS) + "_" + rng.choice(_WORDS) for _ in range(3)],
            "description": desc,
        }
    if kind == "array":
        return {"type": "array", "items": {"type": "string"}, "description": desc}
    if kind == "object" and depth == 0:
        props = {rng.choice(_PROPS): _property(rng, 1) for _ in range(rng.randint(1, 3))}
        return {
            "type": "object",
            "properties": props,
            "additionalProperties": False,
            "description": desc,
        }
    if kind == "integer":
        return {"type": "integer", "minimum": 0, "description": desc}
    return {"type": "boolean" if kind == "boolean" else "string", "description": desc}


def _schema(rng: random.Random, chars: int) -> dict:
    props: dict = {}
    while len(json.dumps(props)) < chars - 80:
        name = rng.choice(_PROPS)
        props[name if name not in props else f"{name}_{len(props)}"] = _property(rng)
    required = sorted(props)[: max(1, len(props) // 2)]
    return {
        "type": "object",
        "properties": props,
        "required": required,
        "additionalProperties": False,
        "$schema": "http://json-schema.org/draft-07/schema#",
    }


def claude_code_like_request(
    scale: float = DEFAULT_SCALE, seed: int = 0, prompt: str = "say hi", n_tools: int = len(TOOLS)
) -> dict:
    """Turn 1 of an agent session: an Anthropic Messages body of Claude Code's default shape.

    Args:
        scale: multiplies every recorded size (1.0 = the recorded character counts).
        seed: generator seed (same seed, same request).
        prompt: the user's text.
        n_tools: how many of the 25 tools to declare (fewer: smoke-test sizes).
    Returns:
        ``{"model", "max_tokens", "stream", "system": [blocks], "tools": [...], "messages": [...]}``.
    """
    rng = random.Random(seed)
    system = [{"type": "text", "text": prose(rng, int(n * scale))} for n in SYSTEM_BLOCKS]
    tools = []
    for i, (desc, schema) in enumerate(TOOLS[:n_tools]):
        name = "".join(w.capitalize() for w in (rng.choice(_WORDS), rng.choice(_WORDS))) + str(i)
        tools.append(
            {
                "name": name,
                "description": prose(rng, int(desc * scale)),
                "input_schema": _schema(rng, int(schema * scale)),
            }
        )
    reminder = "<system-reminder>\n" + prose(rng, int(REMINDER * scale)) + "\n</system-reminder>"
    messages = [
        {
            "role": "user",
            "content": [{"type": "text", "text": reminder}, {"type": "text", "text": prompt}],
        }
    ]
    return {
        "model": "openk3-tiny",
        "max_tokens": 64000,
        "stream": True,
        "system": system,
        "tools": tools,
        "messages": messages,
    }


def next_turn(request: dict, reply: str, user_text: str) -> dict:
    """The session's next request: ``request`` + the assistant's ``reply`` + a new user turn."""
    messages = list(request["messages"]) + [
        {"role": "assistant", "content": [{"type": "text", "text": reply}]},
        {"role": "user", "content": [{"type": "text", "text": user_text}]},
    ]
    return dict(request, messages=messages)


def prompt_ids(request: dict, tokenizer) -> list[int]:
    """The prompt ids openk3 serves for an Anthropic Messages body ``request``: the server's own
    parse (:func:`openk3.server.anthropic.parse_request`) rendered by the K3 chat format.

    Raises:
        APIError: the body is one the server answers with a 400.
    """
    from openk3.chat_format import render
    from openk3.server.anthropic import parse_request

    return list(render(parse_request(request), tokenizer).token_ids)
