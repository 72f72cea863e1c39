"""Synthetic agent-harness system prompts: long prose + many tool declarations, the shape of what
coding agents (Claude Code, Kimi CLI, Codex) send in front of every user turn, generated here from
templates and word lists (never a recorded third-party prompt).

Used twice: training rows put a prompt of 1K-16K tokens in front of ordinary SFT items so the
model learns to find the last user turn behind it (NoPE MLA has no position signal; the KDA layers
must carry "this is the current turn"), and the ``long_*`` eval suites put a ~16K-token prompt from
a held-out seed in front of the tool and arithmetic suites.

:func:`harness_tools` gives 10-16 tool declarations (file, shell, search, planning tools with long
descriptions); :func:`harness_prose` gives the system text (identity, rules in sections, examples
with quoted ``user:`` / ``assistant:`` lines, an environment block) of about ``n_chars`` characters.
Both are deterministic in their ``rng``.
"""

from __future__ import annotations

import random

_AGENTS = (
    "Orbit",
    "Quill",
    "Tern",
    "Lumen",
    "Pike",
    "Harbor",
    "Cinder",
    "Marlin",
    "Sable",
    "Fathom",
    "Wren",
    "Juno",
)
_DOMAINS = (
    "software engineering",
    "data analysis",
    "infrastructure",
    "documentation",
    "research",
    "testing",
    "web development",
    "scripting",
    "debugging",
    "refactoring",
)
_ADJS = (
    "careful",
    "concise",
    "interactive",
    "autonomous",
    "pragmatic",
    "helpful",
    "precise",
    "patient",
)
_SECTIONS = (
    "Tone and style",
    "Doing tasks",
    "Tool usage policy",
    "Following conventions",
    "Code style",
    "Task management",
    "Proactiveness",
    "Safety",
    "Asking questions",
    "Version control",
    "Testing",
    "Working with files",
    "Long-running commands",
    "Reporting results",
    "Planning",
    "Security",
    "Dependencies",
    "Errors and retries",
    "Output format",
    "Privacy",
)
_MODALS = (
    "Always",
    "Never",
    "Prefer to",
    "Avoid trying to",
    "Make sure to",
    "Do not",
    "Try to",
    "Remember to",
    "It is important to",
    "You should",
    "You must",
    "Only",
)
_ACTS = (
    "run the linter",
    "explain what a command does",
    "use absolute paths",
    "add comments to code",
    "create new files",
    "commit changes",
    "read a file before editing it",
    "search the code base",
    "ask the user for clarification",
    "summarise what you changed",
    "write tests",
    "install packages",
    "delete files",
    "push to the remote",
    "use the todo list",
    "check the build",
    "quote file paths",
    "repeat the user's request",
    "guess at URLs",
    "keep answers short",
    "mention the line numbers",
    "restart the server",
    "open a pull request",
    "change the configuration",
    "print secrets",
    "modify the lock file",
    "rename public functions",
    "batch independent tool calls",
    "verify your work",
    "look at neighbouring files",
    "follow the existing style",
    "edit generated files",
)
_CONDS = (
    "unless the user asks for it",
    "before you finish a task",
    "when a command may change the system",
    "if you are unsure",
    "after every edit",
    "when the task has several steps",
    "in a new repository",
    "even when it seems faster",
    "when tests fail",
    "if a tool call errors",
    "for every code change",
    "when the user is waiting",
    "unless it is trivial",
    "before running destructive commands",
    "when you reference code",
    "if the output is long",
)
_WHY = (
    "This keeps the user in control.",
    "The user reads your output in a terminal.",
    "Small steps are easier to review.",
    "Mistakes here are hard to undo.",
    "It saves the user time.",
    "The environment may be shared.",
    "This avoids surprises.",
    "Tests are the ground truth.",
    "Consistency matters more than cleverness.",
    "Long answers are rarely read.",
    "Secrets must never leave the machine.",
)
_TASKS = (
    "fix the failing test in the parser",
    "add a flag to the command line tool",
    "rename the config module",
    "explain the build script",
    "find where the cache is cleared",
    "update the changelog",
    "write a unit test for the date helper",
    "list the files in the src folder",
    "remove the unused imports",
    "check why the server returns 500",
    "bump the version number",
    "format the code",
)
_REPLIES = (
    "Done.",
    "I updated two files and the tests pass.",
    "The function lives in utils.py.",
    "I ran the tests: all green.",
    "It is defined in the config loader.",
    "Fixed; see the diff.",
    "Yes.",
    "No, that flag does not exist.",
    "I need the error message first.",
)
_TOOL_NAMES = (
    "run_shell",
    "read_file",
    "write_file",
    "edit_file",
    "list_dir",
    "glob_files",
    "grep_search",
    "fetch_url",
    "update_todos",
    "ask_user",
    "launch_subagent",
    "edit_notebook",
    "view_image",
    "run_tests",
    "git_diff",
    "search_docs",
    "move_file",
    "kill_process",
    "open_url",
    "diagnostics",
)
_PARAMS = (
    ("path", "string", "Absolute path of the file or directory."),
    ("command", "string", "The shell command to run."),
    ("pattern", "string", "A glob or regular expression."),
    ("timeout_ms", "integer", "Timeout in milliseconds (at most 600000)."),
    ("content", "string", "The full new file content."),
    ("old_text", "string", "Exact text to replace; must be unique in the file."),
    ("new_text", "string", "Replacement text."),
    ("url", "string", "A fully formed http(s) URL."),
    ("question", "string", "What to ask the user."),
    ("items", "array", "The complete todo list."),
    ("description", "string", "A short summary of what this call does."),
    ("limit", "integer", "Maximum number of lines or results."),
    ("offset", "integer", "Line to start reading from."),
    ("recursive", "boolean", "Descend into subdirectories."),
)


def _sentence(rng: random.Random) -> str:
    s = f"{rng.choice(_MODALS)} {rng.choice(_ACTS)} {rng.choice(_CONDS)}."
    return s + (" " + rng.choice(_WHY) if rng.random() < 0.35 else "")


def _section(rng: random.Random) -> str:
    out = [f"# {rng.choice(_SECTIONS)}"]
    for _ in range(rng.randint(2, 5)):
        if rng.random() < 0.5:
            out.append("\n".join(f"- {_sentence(rng)}" for _ in range(rng.randint(2, 6))))
        else:
            out.append(" ".join(_sentence(rng) for _ in range(rng.randint(2, 5))))
    if rng.random() < 0.4:
        n = rng.randint(1, 3)
        for _ in range(n):
            out.append(
                f"<example>\nuser: {rng.choice(_TASKS)}\nassistant: {rng.choice(_REPLIES)}\n</example>"
            )
    return "\n\n".join(out)


def harness_prose(rng: random.Random, n_chars: int) -> str:
    """System text of about ``n_chars`` characters (at least one section): an identity line,
    rule sections with examples, and an environment block."""
    agent = rng.choice(_AGENTS)
    head = (
        f"You are {agent}, a {rng.choice(_ADJS)} assistant for {rng.choice(_DOMAINS)} tasks. "
        f"Use the instructions below and the tools available to you to help the user."
    )
    env = (
        f"<env>\nWorking directory: /home/{rng.choice(_AGENTS).lower()}/project-{rng.randint(1, 999)}\n"
        f"Is directory a git repo: {rng.choice(('yes', 'no'))}\nPlatform: linux\n"
        f"Today's date: 20{rng.randint(25, 35)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}\n</env>"
    )
    parts = [head]
    size = len(head) + len(env)
    while size < n_chars or len(parts) < 2:
        s = _section(rng)
        parts.append(s)
        size += len(s) + 2
    parts.append(env)
    return "\n\n".join(parts)


def harness_tools(rng: random.Random, k: int | None = None) -> list[dict]:
    """``k`` (default 10-16) agent tool declarations with long descriptions and 1-4 parameters."""
    names = rng.sample(_TOOL_NAMES, k or rng.randint(10, 16))
    tools = []
    for name in names:
        desc = " ".join(_sentence(rng) for _ in range(rng.randint(3, 9)))
        desc = f"{name.replace('_', ' ').capitalize()}. {desc}"
        params = rng.sample(_PARAMS, rng.randint(1, 4))
        props = {}
        for p, typ, pdesc in params:
            props[p] = {"type": typ, "description": pdesc}
            if typ == "array":
                props[p]["items"] = {"type": "string"}
        required = [params[0][0]]
        tools.append(
            {
                "type": "function",
                "function": {
                    "name": name,
                    "description": desc,
                    "parameters": {
                        "type": "object",
                        "properties": props,
                        "required": required,
                        "additionalProperties": False,
                    },
                },
            }
        )
    return tools


def harness_chars_for_tokens(tokens: int) -> int:
    """Prose characters giving about ``tokens`` prompt tokens together with :func:`harness_tools`
    (about 3.2 characters per token for this text; tool declarations take ~3K tokens)."""
    return max(400, int((tokens - 3000) * 3.2))


def wrap_request(
    request: dict, prose: str, tools: list[dict], *, replace_tools: list[dict] | None = None
) -> dict:
    """``request`` behind a harness prompt: a system message ``prose`` first, ``tools`` declared
    before the request's own tools (``replace_tools``, when given, replace the request's own tool
    declarations, including dynamic ones in system messages)."""
    msgs = [dict(m) for m in request["messages"]]
    own = list(request.get("tools") or [])
    if replace_tools is not None:
        msgs = [m for m in msgs if not (m.get("role") == "system" and "tools" in m)]
        own = list(replace_tools)
    out = dict(request, messages=[{"role": "system", "content": prose}] + msgs, tools=tools + own)
    return out


__all__ = ["harness_prose", "harness_tools", "harness_chars_for_tokens", "wrap_request"]


def long_conversations(
    seed: int,
    n: int,
    max_tokens: int,
    tokenizer,
    *,
    mixture: dict | None = None,
    min_tokens: int = 1024,
) -> list[dict]:
    """``n`` training conversations of the SFT mixture behind harness prompts, each rendering to at
    most ``max_tokens`` tokens: prose sized uniformly between ``min_tokens`` and the room left,
    10-16 harness tools declared in front of the item's own tools (a fifth of the rows: in front of
    every task tool, as the long-prompt eval declares them).

    Raises:
        ValueError: ``max_tokens`` below ``min_tokens`` + 1024 (no room for the item).
    """
    from openk3.chat_format import render_training
    from openk3.datasets.sft_data import sft_items
    from openk3.datasets.sft_tasks import TOOLS

    if max_tokens < min_tokens + 1024:
        raise ValueError(
            f"max_tokens={max_tokens}: must be >= min_tokens + 1024 = {min_tokens + 1024}"
        )
    rng = random.Random(seed)
    sample = harness_prose(random.Random(seed + 1), 20_000)
    chars_per_token = len(sample) / max(1, len(tokenizer.encode_text(sample)))
    out = []
    for it in sft_items(seed, n, mixture=mixture):
        conv = it.conversation()
        tools = harness_tools(rng)
        all_tools = rng.random() < 0.2
        while True:  # fewer harness tools when their declarations alone leave no room for prose
            wrapped = wrap_request(
                conv,
                "",
                tools,
                replace_tools=list(TOOLS.values()) if all_tools and conv.get("tools") else None,
            )
            room = max_tokens - len(render_training(wrapped, tokenizer).token_ids) - 64
            if room >= min_tokens or not tools:
                break
            tools = tools[: len(tools) // 2]
        if room < min_tokens:
            continue
        chars = int(rng.uniform(min_tokens, room) * chars_per_token)
        for _ in range(
            4
        ):  # the chars-per-token estimate is a mean: shorten the prose until it fits
            wrapped["messages"][0]["content"] = harness_prose(rng, chars)
            used = len(render_training(wrapped, tokenizer).token_ids)
            if used <= max_tokens:
                out.append(wrapped)
                break
            chars = int(chars * (1 - (used - max_tokens) / max(1, used)) * 0.95)
    return out


__all__ += ["long_conversations"]
