"""``openk3 chat PATH``: stdin piped into a real subprocess over the tiny server checkpoint."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from openk3.chat_format import encode_request
from tests.server.conftest import REPO

STATUS = re.compile(r"\[(stop|length): (\d+) prompt \+ (\d+) generated tokens\]")


def _chat(checkpoint, tmp_path, stdin: str, *extra: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    save = tmp_path / "conversation.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "openk3.cli", "chat", str(checkpoint), "--max-tokens", "6",
                        "--seed", "3", "--save", str(save), *extra],
                       input=stdin, cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    return r, json.loads(save.read_text())


def test_multi_turn_chat_preserves_reasoning(checkpoint, tokenizer, tmp_path):
    r, messages = _chat(checkpoint, tmp_path, "Hello there!\n\nWhat is the weather in Paris?\n/exit\nnot read\n",
                        "--effort", "low")
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
    assert messages[0]["content"] == "Hello there!" and messages[2]["content"] == "What is the weather in Paris?"
    turns = STATUS.findall(r.stderr)
    assert len(turns) == 2  # the blank line is skipped, "/exit" ends before the last line
    for k, (reason, prompt_tokens, generated) in enumerate(turns):
        # the prompt of turn k is exactly the chat-format rendering of the history so far, with the
        # earlier assistant turn's reasoning preserved, at the requested effort
        history = messages[:2 * k + 1]
        expected = encode_request({"messages": history, "reasoning_effort": "low"}, tokenizer)
        assert int(prompt_tokens) == len(expected.token_ids)
        assert 1 <= int(generated) <= 6 and reason in ("stop", "length")
        reply = messages[2 * k + 1]
        # what streamed to the terminal is the reasoning (between the think lines), then the answer
        if reply["reasoning_content"]:
            assert "<think>\n" + reply["reasoning_content"] in r.stdout
        assert reply["content"] in r.stdout
    first = messages[1]
    with_reasoning = encode_request({"messages": messages[:3], "reasoning_effort": "low"}, tokenizer)
    without = encode_request({"messages": [*messages[:1], dict(first, reasoning_content=""), messages[2]],
                              "reasoning_effort": "low"}, tokenizer)
    if first["reasoning_content"]:
        assert len(with_reasoning.token_ids) > len(without.token_ids)  # the reasoning really is in the prompt
    # --effort reached the renderer: the low-effort prompt is not the default (max) one
    effort_max = encode_request({"messages": messages[:1], "reasoning_effort": "max"}, tokenizer)
    assert effort_max.token_ids != encode_request({"messages": messages[:1], "reasoning_effort": "low"},
                                                  tokenizer).token_ids

def test_chat_ends_at_end_of_input_and_rejects_bad_args(checkpoint, tmp_path):
    r, messages = _chat(checkpoint, tmp_path, "Hi\n")
    assert len(messages) == 2 and len(STATUS.findall(r.stderr)) == 1
    bad = subprocess.run([sys.executable, "-m", "openk3.cli", "chat", str(checkpoint), "--effort", "huge"],
                         input="", cwd=REPO, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--effort" in bad.stderr
    missing = subprocess.run([sys.executable, "-m", "openk3.cli", "chat", str(tmp_path / "nope")],
                             input="", cwd=REPO, capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "openk3 chat:" in missing.stderr


def test_cancelled_turn_is_dropped_and_frees_the_engine(checkpoint, tokenizer):
    import io

    import torch

    from openk3.chat_repl import ChatSession
    from openk3.pretrained import load_pretrained

    session = ChatSession(load_pretrained(checkpoint, dtype=torch.float32), tokenizer, effort="low",
                          max_tokens=50, seed=0)
    steps = []
    out, err = io.StringIO(), io.StringIO()
    # Ctrl-C arrives after two engine steps: the request is aborted between steps
    assert session.turn("Hello there!", out, err, cancelled=lambda: steps.append(1) or len(steps) > 2) is None
    assert session.messages == [] and session.turns == 0 and not session.engine.has_unfinished()
    assert "[interrupted: reply dropped, the conversation goes on]" in err.getvalue()
    stats = session.engine.stats()
    assert (stats["running"], stats["kda_slots"]["used"], stats["mla_blocks"]["reserved"]) == (0, 0, 0), stats
    reply = session.turn("Hello there!", io.StringIO(), err)  # the session goes on
    assert reply is not None and [m["role"] for m in session.messages] == ["user", "assistant"]


def test_terminal_input_joins_backslash_continuations_and_pastes(monkeypatch, tmp_path):
    import builtins

    from openk3.chat_repl import TerminalInput

    typed = iter(["first line \\", "second line", "pasted\nblock of\nthree lines"])
    prompts = []
    monkeypatch.setattr(builtins, "input", lambda prompt="": prompts.append(prompt) or next(typed))
    term = TerminalInput(history_file=str(tmp_path / "history"))
    assert term.read() == "first line \nsecond line" and prompts == ["> ", ". "]
    assert term.read() == "pasted\nblock of\nthree lines"  # readline hands a bracketed paste over whole
    monkeypatch.setattr(builtins, "input", lambda prompt="": (_ for _ in ()).throw(EOFError))
    assert term.read() is None
