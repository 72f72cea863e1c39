"""Exercise the nine K3 platform capabilities against a running Kimi-compatible server.

Written with the official ``openai`` SDK exactly as a Kimi platform client would be (Moonshot's
extensions go through ``extra_body``), so it runs unchanged against ``openk3 serve`` or the hosted
API. Exits non-zero if any capability fails.

    openk3 serve CHECKPOINT --served-model-name kimi-k3 &
    python examples/capabilities.py --base-url http://127.0.0.1:8000/v1

Capabilities: thinking + effort, preserved thinking across turns, streaming, JSON mode, partial
mode, an image, a cached long prefix (``cached_tokens``), a tool loop, dynamic tools. Transient
overload (HTTP 429 ``engine_overloaded_error``) is retried by the SDK, which honours ``Retry-After``.

Each line checks the protocol (``PASS`` / ``FAIL``) and prints the model's answer under it. An answer
that passes the protocol but is obviously empty or malformed (a JSON object without keys, a tool
argument that is reasoning text instead of a value, an empty reply) is marked ``WEAK`` with the
reason: the server did its job, the model did not. Exit status: 1 if any capability FAILs (with
``--strict`` also if any is WEAK), else 0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

import httpx
from openai import BadRequestError, OpenAI

PNG_1PX = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR4nGNgYGD4DwABBAEAwS2OUAA"
           "AAABJRU5ErkJggg==")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in an IANA timezone.",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}


class Outcome:
    """A capability that passed the protocol: `detail` (what was checked), `answer` (what the model
    said, one line) and `weak` (why the answer is empty or malformed; None when it looks sound)."""

    def __init__(self, detail: str, answer: str = "", weak: str | None = None):
        self.detail, self.answer, self.weak = detail, answer, weak


def one_line(text, limit: int = 110) -> str:
    """`text` on one line, shortened to `limit` characters."""
    s = " ".join(str(text if text is not None else "").split())
    return s if len(s) <= limit else s[:limit - 3] + "..."


def suspect_value(value, expect: str | None = None) -> str | None:
    """Why a tool argument / JSON value looks wrong (empty, reasoning text instead of a value, not
    mentioning `expect`), or None."""
    if not isinstance(value, str) or not value.strip():
        return f"empty value {value!r}"
    if "\n" in value or len(value.split()) > 6:
        return f"{one_line(value, 60)!r} reads like reasoning text, not a value"
    if expect and expect.lower() not in value.lower():
        return f"{value!r} where the request implies {expect!r}"
    return None


class Check:
    """Runs the capability checks; each raises AssertionError (or an API error) on a protocol
    failure and returns an :class:`Outcome` otherwise."""

    def __init__(self, client: OpenAI, http: httpx.Client, model: str, max_tokens: int):
        self.c, self.http, self.model, self.max_tokens = client, http, model, max_tokens
        # checks that only need the request accepted (not a finished answer) use a short budget
        self.probe = min(max_tokens, 64)

    def chat(self, messages, **kw):
        kw.setdefault("max_completion_tokens", self.max_tokens)
        return self.c.chat.completions.create(model=self.model, messages=messages, **kw)

    def count(self, messages, **kw) -> int:
        r = self.http.post("/tokenizers/estimate-token-count", json={"model": self.model, "messages": messages, **kw})
        r.raise_for_status()
        return r.json()["data"]["total_tokens"]

    def thinking_and_effort(self) -> Outcome:
        sizes, reasoning, m = {}, {}, None
        for effort in ("low", "high", "max"):
            r = self.chat([{"role": "user", "content": "What is 17 * 23?"}], reasoning_effort=effort,
                          max_completion_tokens=self.probe)
            m = r.choices[0].message
            assert isinstance(m.reasoning_content, str), "no reasoning_content"
            sizes[effort], reasoning[effort] = r.usage.completion_tokens, m.reasoning_content
        weak = None if any(v.strip() for v in reasoning.values()) else "empty reasoning at every effort"
        answer = f"reasoning {one_line(reasoning['max'], 50)!r} -> {one_line(m.content, 40)!r}"
        return Outcome("reasoning_content at " + ", ".join(f"{e}: {n} tokens" for e, n in sizes.items()), answer, weak)

    def preserved_thinking(self) -> str:
        turn1 = [{"role": "user", "content": "Pick a number between 1 and 10 and remember it."}]
        m = self.chat(turn1, max_completion_tokens=self.probe).choices[0].message
        reasoning = m.reasoning_content or " "
        back = {"role": "assistant", "content": m.content or "", "reasoning_content": reasoning}
        turn2 = turn1 + [back, {"role": "user", "content": "Which number did you pick?"}]
        r = self.chat(turn2, max_completion_tokens=self.probe)
        assert r.choices[0].finish_reason in ("stop", "length")
        kept = self.count(turn2) - self.count(turn1 + [dict(back, reasoning_content="")] + turn2[-1:])
        assert not reasoning.strip() or kept > 0, "reasoning_content did not reach the prompt"
        second = r.choices[0].message
        weak = None if (second.content or second.reasoning_content or "").strip() else "empty second answer"
        return Outcome(f"second turn accepted; {kept} reasoning tokens carried into the prompt",
                       f"turn 1 {one_line(m.content, 40)!r}, turn 2 {one_line(second.content, 40)!r}", weak)

    def streaming(self) -> str:
        order, usage, text = [], None, []
        stream = self.chat([{"role": "user", "content": "Reply with a JSON object."}], stream=True,
                           stream_options={"include_usage": True}, response_format={"type": "json_object"})
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for ch in chunk.choices:
                if getattr(ch.delta, "reasoning_content", None):
                    order.append("r")
                if ch.delta.content:
                    order.append("c")
                    text.append(ch.delta.content)
        assert usage is not None, "no usage chunk"
        seq = "".join(order)
        assert "c" not in seq or "r" not in seq[seq.index("c"):], "reasoning after content"
        content = "".join(text)
        weak = _json_object_problem(content)
        return Outcome(f"{seq.count('r')} reasoning + {seq.count('c')} content deltas, usage {usage.total_tokens} tokens",
                       one_line(content), weak)

    def json_mode(self) -> str:
        r = self.chat([{"role": "user", "content": "Give a JSON object with a key 'city'."}],
                      response_format={"type": "json_object"})
        assert r.choices[0].finish_reason == "stop", f"finish_reason {r.choices[0].finish_reason}"
        value = json.loads(r.choices[0].message.content)
        assert isinstance(value, dict)
        weak = _json_object_problem(r.choices[0].message.content) or (
            None if "city" in value else f"no 'city' key (keys {sorted(value)[:4]})")
        if weak is None:
            weak = suspect_value(value["city"]) if isinstance(value["city"], str) else f"city is {value['city']!r}"
        return Outcome(f"valid JSON object with keys {sorted(value)[:4]}", one_line(r.choices[0].message.content), weak)

    def partial_mode(self) -> str:
        prefix = '{"answer": "'
        r = self.chat([{"role": "user", "content": "Answer in JSON: what is the capital of France?"},
                       {"role": "assistant", "content": prefix, "partial": True}],
                      response_format={"type": "json_object"})
        content = r.choices[0].message.content or ""
        assert not content.startswith(prefix), "the prefix was echoed"
        value = json.loads(prefix + content)
        assert "answer" in value
        return Outcome(f"continued after {prefix!r}", one_line(prefix + content), suspect_value(value["answer"]))

    def image(self) -> str:
        card = next(m for m in self.c.models.list().data if m.id == self.model)
        messages = [{"role": "user", "content": [{"type": "text", "text": "Describe the image."},
                                                 {"type": "image_url", "image_url": {"url": PNG_1PX}}]}]
        if getattr(card, "supports_image_in", False):
            r = self.chat(messages, max_completion_tokens=self.probe)
            m = r.choices[0].message
            weak = None if (m.content or m.reasoning_content or "").strip() else "empty description"
            return Outcome(f"image accepted ({r.usage.prompt_tokens} prompt tokens)", one_line(m.content), weak)
        try:
            self.chat(messages, max_completion_tokens=self.probe)
        except BadRequestError as e:
            assert "does not support image input" in str(e), str(e)
            return Outcome("text-only model: image refused with the documented 400")
        raise AssertionError("a text-only model accepted an image")

    def cached_prefix(self) -> str:
        system = " ".join(f"Guideline {i}: keep answers short and factual, mention source {i}." for i in range(80))
        msgs = lambda q: [{"role": "system", "content": system}, {"role": "user", "content": q}]  # noqa: E731
        self.chat(msgs("First question?"), max_completion_tokens=1)
        r = self.chat(msgs("Second question?"), max_completion_tokens=1)
        cached = getattr(r.usage, "cached_tokens", None) or r.usage.prompt_tokens_details.cached_tokens
        assert cached and cached > 0, "no cached_tokens on a shared prefix"
        return Outcome(f"{cached} of {r.usage.prompt_tokens} prompt tokens served from cache")

    def tool_loop(self) -> str:
        msgs = [{"role": "user", "content": "What's the weather in Paris?"}]
        r = self.chat(msgs, tools=[WEATHER], tool_choice="required")
        m = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls" and m.tool_calls, "no tool call"
        call = m.tool_calls[0]
        args = json.loads(call.function.arguments)
        assert call.function.name == "get_weather" and isinstance(args.get("city"), str)
        msgs += [{"role": "assistant", "content": m.content or "", "reasoning_content": m.reasoning_content,
                  "tool_calls": [c.model_dump() for c in m.tool_calls]}]
        msgs += [{"role": "tool", "tool_call_id": c.id, "content": '{"temp_c": 18, "sky": "clear"}'}
                 for c in m.tool_calls]
        final = self.chat(msgs, tools=[WEATHER], max_completion_tokens=self.probe)
        assert final.choices[0].finish_reason in ("stop", "length", "tool_calls")
        return Outcome(f"{call.id} -> tool result -> finish_reason {final.choices[0].finish_reason}",
                       f"get_weather({call.function.arguments}) -> {one_line(final.choices[0].message.content, 50)!r}",
                       suspect_value(args["city"], expect="Paris"))

    def dynamic_tools(self) -> str:
        msgs = [{"role": "user", "content": "What time is it in Tokyo?"}, {"role": "system", "tools": [CLOCK]}]
        r = self.chat(msgs, tool_choice="required")
        calls = r.choices[0].message.tool_calls or []
        assert calls and calls[0].function.name == "get_time", "the dynamically loaded tool was not called"
        args = json.loads(calls[0].function.arguments)
        return Outcome("the tool declared in a system message was called",
                       f"{calls[0].function.name}({calls[0].function.arguments})", suspect_value(args.get("tz"), "Tokyo"))


def _json_object_problem(content: str) -> str | None:
    """Why `content` is not a usable JSON object (not JSON, not an object, no keys), or None."""
    try:
        value = json.loads(content)
    except (TypeError, ValueError):
        return f"not JSON: {one_line(content, 40)!r}"
    if not isinstance(value, dict):
        return f"a JSON {type(value).__name__}, not an object"
    return None if value else "an empty JSON object (no keys)"


CAPABILITIES = [("thinking + effort", "thinking_and_effort"), ("preserved thinking", "preserved_thinking"),
                ("streaming", "streaming"), ("JSON mode", "json_mode"), ("partial mode", "partial_mode"),
                ("image input", "image"), ("cached long prefix", "cached_prefix"), ("tool loop", "tool_loop"),
                ("dynamic tools", "dynamic_tools")]


def output_budget(requested: int | None, context_length: int) -> int:
    """Per-request output budget: `requested` (default 8192) capped at half the model's context,
    so that prompt + budget fits a small model's window (the server 400s a request that cannot)."""
    cap = max(1, context_length // 2)
    return min(requested if requested is not None else 8192, cap)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default=os.environ.get("OPENK3_BASE_URL", "http://127.0.0.1:8000/v1"))
    p.add_argument("--api-key",
                   default=os.environ.get("OPENK3_API_KEY") or os.environ.get("MOONSHOT_API_KEY") or "none")
    p.add_argument("--served-model-name", "--model", dest="model",
                   help="model id (default: the first one the server lists)")
    p.add_argument("--strict", action="store_true", help="also exit 1 when an answer is WEAK (empty or malformed)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="output budget per request, reasoning included (default 8192; always capped at half the "
                        "model's context_length from /v1/models)")
    args = p.parse_args(argv)
    client = OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=5, timeout=600)
    http = httpx.Client(base_url=args.base_url, headers={"Authorization": f"Bearer {args.api_key}"}, timeout=600)
    cards = client.models.list().data
    model = args.model or cards[0].id
    card = next((c for c in cards if c.id == model), None)
    context = getattr(card, "context_length", None) or (card.model_extra or {}).get("context_length") if card else None
    max_tokens = output_budget(args.max_tokens, int(context)) if context else (args.max_tokens or 8192)
    check = Check(client, http, model, max_tokens)
    failed, weak = 0, 0
    for name, method in CAPABILITIES:
        try:
            o = getattr(check, method)()
        except Exception as e:  # report every capability, then fail overall
            failed += 1
            print(f"FAIL  {name:<20} {type(e).__name__}: {e}")
            if os.environ.get("OPENK3_DEBUG"):
                traceback.print_exc()
            continue
        weak += o.weak is not None
        print(f"{'WEAK' if o.weak else 'PASS'}  {name:<20} {o.detail}")
        if o.answer:
            print(f"{'':26}answer: {o.answer}")
        if o.weak:
            print(f"{'':26}weak:   {o.weak}")
    n = len(CAPABILITIES)
    print(f"{n - failed}/{n} capabilities OK at the protocol level against {model} at {args.base_url}; "
          f"{weak} with an empty or malformed answer (WEAK)")
    return 1 if failed or (args.strict and weak) else 0


if __name__ == "__main__":
    sys.exit(main())
