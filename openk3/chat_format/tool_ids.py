"""Kimi tool-call ids: ``functions.NAME:IDX`` with a conversation-wide running index.

The model never generates ids; the server assigns one per parsed call (spec
k3-chat-format.md §11.3). The official platform uses ``functions.<name>:<idx>``
where ``idx`` counts calls over the whole conversation (spec api.md §2.1), and
rewrites historical client ids into that form. A new response therefore starts
its index after every call already present in the history, which keeps ids
unique within the conversation.
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Mapping

KIMI_ID_PREFIX = "functions."
# NAME may itself contain ':' in principle; the index is always the last ':digits'.
_KIMI_ID = re.compile(r"^(?:functions\.)?(?P<name>.*):\s*(?P<idx>\d+)$", re.DOTALL)


def make_tool_call_id(name: str, index: int) -> str:
    """The Kimi id ``functions.{name}:{index}`` (spec api.md §2.1).

    Raises ``ValueError`` if ``name`` is empty or ``index`` is negative.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"name: a tool-call id needs a non-empty function name, got {name!r}")
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ValueError(f"index: must be an int >= 0, got {index!r}")
    return f"{KIMI_ID_PREFIX}{name}:{index}"


def parse_tool_call_id(call_id: str) -> tuple[str, int] | None:
    """``(name, index)`` of a Kimi-form id, or ``None`` for any other id.

    Tolerates a missing ``functions.`` prefix and whitespace after the colon,
    deviations seen in the wild (spec api.md, "Observed deviations").
    """
    if not isinstance(call_id, str):
        return None
    m = _KIMI_ID.match(call_id)
    if m is None or not m.group("name"):
        return None
    return m.group("name"), int(m.group("idx"))


def next_tool_call_index(messages: Iterable[Mapping[str, Any]]) -> int:
    """Starting index for the calls of the next assistant response, over chat-completions message
    dicts: :func:`next_index_after` of the ids of every tool call in `messages`."""
    ids = [
        call.get("id") if isinstance(call, Mapping) else None
        for msg in messages
        if isinstance(msg, Mapping)
        for call in (msg.get("tool_calls") or [])
    ]
    return next_index_after(ids)


def next_index_after(call_ids: Iterable[Any]) -> int:
    """Starting index for the calls of the next assistant response, given the ids of the calls
    already in the history (one entry per call; None for a call without an id).

    The larger of (number of tool calls in the history) and (highest Kimi-form
    index seen + 1), so that a new id can never equal an id already issued,
    even when the history ids were not consecutive.
    """
    count = 0
    top = -1
    for call_id in call_ids:
        count += 1
        parsed = parse_tool_call_id(call_id)
        if parsed is not None:
            top = max(top, parsed[1])
    return max(count, top + 1)
