"""The fixtures' prompts under the prompt rule of chat-format spec §12 that openk3 adopts.

The shared fixtures hold the template rendering, where a history assistant message with tool calls
and no content keeps an empty response channel. openk3's prompt leaves that channel out (the rule
reproduces both of Moonshot's counts: 99 for the vendor verifier README's example, 539 for its
groundtruth payload), so the expected prompt of a fixture case is its rendering without those six
tokens. Training renders keep them (they are what the model generates), so training tests compare
with the fixture as it is.
"""

from __future__ import annotations

EMPTY_RESPONSE_BEFORE_TOOLS = "<|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|>"


def prompt_form(case: dict, tok) -> dict:
    """``{"text", "token_ids", "prompt_tokens", "removed"}`` of `case` under the prompt rule;
    ``removed`` counts the channels left out (each 6 tokens). Works on the ids (never on text a
    user could type) and checks that the text and the ids agree."""
    response = tok.encode_text("response")
    empty = [tok.open_id, *response, tok.sep_id, tok.close_id, *response, tok.sep_id]
    tools_open = [tok.open_id, *tok.encode_text("tools"), tok.sep_id]
    ids, out, i, removed = case["token_ids"], [], 0, 0
    while i < len(ids):
        if ids[i:i + len(empty)] == empty and ids[i + len(empty):i + len(empty) + len(tools_open)] == tools_open:
            i += len(empty)
            removed += 1
            continue
        out.append(ids[i])
        i += 1
    text = case["rendered_text"].replace(EMPTY_RESPONSE_BEFORE_TOOLS, "<|open|>tools<|sep|>")
    assert case["rendered_text"].count(EMPTY_RESPONSE_BEFORE_TOOLS) == removed, case["id"]
    prompt_tokens = None if case["prompt_tokens"] is None else case["prompt_tokens"] - len(empty) * removed
    return {"text": text, "token_ids": out, "prompt_tokens": prompt_tokens, "removed": removed}
