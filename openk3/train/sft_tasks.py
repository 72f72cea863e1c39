"""SFT task generators for tool use and JSON answers (the rest of the mixture: :mod:`sft_data`).

Every generator is a function ``gen(rng, effort) -> Item``: a chat-completions request (the
conversation up to the assistant turn being taught, with its request options), the reference
assistant message, the expected answer used by ``openk3 eval`` and an optional follow-up (tool
result and final answer) for training conversations. Everything is drawn from ``rng``
(:class:`random.Random`), so a seed fixes the data. Source: issue 8 item 2 (the SFT mixture).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any

from openk3.chat_format import make_tool_call_id


@dataclass
class Item:
    """One SFT / eval example.

    Attributes:
        suite: ``problems`` / ``tools`` / ``json`` / ``effort`` / ``chat`` / ``partial``.
        request: chat-completions body (``messages`` and options) ending before the taught turn.
        reference: the assistant message (OpenAI dict) to learn / the oracle answer.
        expected: what the scorer checks (suite-specific keys).
        follow_up: messages appended after ``reference`` in training (tool results, final answer).
    """

    suite: str
    request: dict
    reference: dict
    expected: dict
    follow_up: list = field(default_factory=list)

    def conversation(self) -> dict:
        """The training conversation: request + reference + follow-up (no partial flags)."""
        msgs = [dict(m) for m in self.request["messages"]]
        if msgs and msgs[-1].get("partial"):
            prefix = msgs.pop()["content"]
            ref = dict(self.reference, content=prefix + (self.reference.get("content") or ""))
        else:
            ref = self.reference
        return dict(self.request, messages=msgs + [ref] + list(self.follow_up))


def reasoning(lines: list[str], effort: str | None) -> str | None:
    """Think-channel text whose length follows the effort: ``low`` the first line (two if the first
    is short), ``medium`` half the lines, ``high`` all but the final check, ``max`` every line.
    ``lines`` go from most to least essential; the last one is a check. None when thinking is off."""
    if effort is None:
        return None
    n = len(lines)
    k = {"low": 1 if len(lines[0]) > 40 or n == 1 else 2, "medium": max(1, n // 2),
         "high": max(1, n - 1), "max": n}[effort]
    return "\n".join(lines[:min(k, n)])


# ------------------------------------------------------------------------------------ tools
_CITIES = ("Paris", "Tokyo", "Berlin", "Lima", "Cairo", "Oslo", "Madrid", "Toronto", "Sydney", "Nairobi",
           "Seoul", "Dublin", "Rome", "Austin", "Mumbai", "Vienna")
_CURRENCIES = ("USD", "EUR", "JPY", "GBP", "CHF", "CAD")
_TOPICS = ("python generators", "tide tables", "bread recipes", "the history of tea", "solar panels",
           "chess openings", "bird migration", "rust lifetimes", "volcano types", "jazz standards")
_PEOPLE = ("ana@example.com", "bo@example.org", "chen@example.net", "dita@example.com", "eli@example.org")
_ZONES = ("Europe/Paris", "Asia/Tokyo", "America/Lima", "Africa/Cairo", "Australia/Sydney", "UTC")


def _fn(name: str, desc: str, props: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {"name": name, "description": desc, "parameters": {
        "type": "object", "properties": props, "required": required, "additionalProperties": False}}}


TOOLS: dict[str, dict] = {
    "get_weather": _fn("get_weather", "Current weather for a city.", {
        "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, ["city"]),
    "convert_currency": _fn("convert_currency", "Convert an amount between currencies.", {
        "amount": {"type": "number"}, "from_currency": {"type": "string", "enum": list(_CURRENCIES)},
        "to_currency": {"type": "string", "enum": list(_CURRENCIES)}}, ["amount", "from_currency", "to_currency"]),
    "search_web": _fn("search_web", "Search the web.", {
        "query": {"type": "string"}, "max_results": {"type": "integer", "minimum": 1, "maximum": 10}}, ["query"]),
    "set_timer": _fn("set_timer", "Start a countdown timer.", {
        "minutes": {"type": "integer", "minimum": 1}, "label": {"type": "string"}}, ["minutes"]),
    "send_email": _fn("send_email", "Send an email.", {
        "to": {"type": "string"}, "subject": {"type": "string"}, "body": {"type": "string"}}, ["to", "subject"]),
    "get_time": _fn("get_time", "Current local time in a time zone.", {
        "timezone": {"type": "string", "enum": list(_ZONES)}}, ["timezone"]),
    "calculator": _fn("calculator", "Evaluate an arithmetic expression.", {
        "expression": {"type": "string"}}, ["expression"]),
}


def _call_for(rng: random.Random, name: str) -> tuple[str, dict, str, str]:
    """(user phrase, arguments, tool result text, final answer) for one call of tool ``name``."""
    if name == "get_weather":
        city = rng.choice(_CITIES)
        unit = rng.choice([None, "celsius", "fahrenheit"])
        args = {"city": city} if unit is None else {"city": city, "unit": unit}
        t = rng.randint(-5, 35)
        u = "F" if unit == "fahrenheit" else "C"
        phrase = f"the weather in {city}" + (f" in {unit}" if unit else "")
        return phrase, args, json.dumps({"temperature": t, "unit": u, "sky": rng.choice(["sunny", "cloudy", "rain"])}), \
            f"It is {t} degrees {u} in {city}."
    if name == "convert_currency":
        amt, a, b = rng.choice([5, 12, 40, 99, 250, 1000]), *rng.sample(_CURRENCIES, 2)
        rate = rng.choice([0.5, 0.9, 1.1, 1.3, 2.0])
        return (f"how much {amt} {a} is in {b}", {"amount": amt, "from_currency": a, "to_currency": b},
                json.dumps({"result": round(amt * rate, 2)}), f"{amt} {a} is {round(amt * rate, 2)} {b}.")
    if name == "search_web":
        topic = rng.choice(_TOPICS)
        n = rng.choice([None, 3, 5])
        args = {"query": topic} if n is None else {"query": topic, "max_results": n}
        return (f"search the web for {topic}" + (f", top {n} results" if n else ""), args,
                json.dumps({"results": [f"A guide to {topic}", f"{topic} explained"]}),
                f"I found: A guide to {topic}; {topic} explained.")
    if name == "set_timer":
        m = rng.randint(1, 90)
        label = rng.choice([None, "tea", "pasta", "laundry", "break"])
        args = {"minutes": m} if label is None else {"minutes": m, "label": label}
        return (f"set a timer for {m} minutes" + (f" called {label}" if label else ""), args,
                json.dumps({"ok": True}), f"Your {m}-minute timer is running.")
    if name == "send_email":
        to, topic = rng.choice(_PEOPLE), rng.choice(("lunch", "the report", "the trip", "the meeting"))
        return (f"email {to} with the subject {topic}", {"to": to, "subject": topic},
                json.dumps({"sent": True}), f"Done, the email to {to} is sent.")
    if name == "get_time":
        z = rng.choice(_ZONES)
        h, mi = rng.randint(0, 23), rng.choice((0, 15, 30, 45))
        return (f"what time it is in {z}", {"timezone": z}, json.dumps({"time": f"{h:02d}:{mi:02d}"}),
                f"It is {h:02d}:{mi:02d} in {z}.")
    a, b = rng.randint(2, 999), rng.randint(2, 99)
    op = rng.choice("+-*")
    val = a + b if op == "+" else a - b if op == "-" else a * b
    return (f"use the calculator for {a} {op} {b}", {"expression": f"{a} {op} {b}"}, json.dumps({"value": val}),
            f"{a} {op} {b} = {val}.")


_ASK = ("Please {p}.", "Can you {p}?", "I need {p}.", "{P}, please.", "Could you check {p}?")


def gen_tool_call(rng: random.Random, effort: str | None) -> Item:
    """Choose one or two tools among 3-5 declared ones and fill their arguments from the user's
    words; variants: tool_choice auto/required, tools declared dynamically in a system message,
    two calls in one turn. The follow-up is the tool result(s) and an answer that uses them."""
    names = rng.sample(sorted(TOOLS), rng.randint(3, 5))
    n_calls = 2 if rng.random() < 0.2 else 1
    chosen = rng.sample(names, n_calls)
    calls, phrases, results, answers = [], [], [], []
    for i, name in enumerate(chosen):
        phrase, args, result, answer = _call_for(rng, name)
        calls.append({"id": make_tool_call_id(name, i), "type": "function",
                      "function": {"name": name, "arguments": json.dumps(args)}})
        phrases.append(phrase)
        results.append(result)
        answers.append(answer)
    text = " and ".join(phrases)
    user = rng.choice(_ASK).format(p=text, P=text[:1].upper() + text[1:])
    tools = [TOOLS[n] for n in names]
    messages: list[dict] = [{"role": "user", "content": user}]
    request: dict = {"messages": messages}
    if rng.random() < 0.25:  # dynamic tool declaration (system message with tools)
        messages.insert(0, {"role": "system", "tools": tools})
    else:
        request["tools"] = tools
    choice = rng.choice(["auto", "auto", "required"])
    if choice != "auto":
        request["tool_choice"] = choice
    _effort(request, effort)
    lines = [f"The user wants {text}; I will call {' and '.join(chosen)}.",
             *[f"{c['function']['name']} arguments: {c['function']['arguments']}" for c in calls],
             "The arguments come from the user's words and fit the schema."]
    ref = {"role": "assistant", "content": None, "tool_calls": calls}
    r = reasoning(lines, effort)
    if r is not None:
        ref["reasoning_content"] = r
    follow = [{"role": "tool", "tool_call_id": c["id"], "content": res} for c, res in zip(calls, results)]
    final = {"role": "assistant", "content": " ".join(answers)}
    if effort is not None:
        final["reasoning_content"] = "The tool returned the result; I report it."
    expected = {"calls": [{"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}
                          for c in calls], "schemas": {n: TOOLS[n]["function"]["parameters"] for n in names}}
    # The tool-choice system message renders after the whole conversation (it belongs to the next
    # assistant turn), so a conversation that sets it ends at the call it governs.
    return Item("tools", request, ref, expected, follow + [final] if choice == "auto" else [])


def gen_tool_none(rng: random.Random, effort: str | None) -> Item:
    """Tools declared but ``tool_choice: none``: answer in words, say what would be needed."""
    names = rng.sample(sorted(TOOLS), 3)
    phrase, _, _, _ = _call_for(rng, names[0])
    request = {"messages": [{"role": "user", "content": rng.choice(_ASK).format(p=phrase, P=phrase.capitalize())}],
               "tools": [TOOLS[n] for n in names], "tool_choice": "none"}
    _effort(request, effort)
    ref = {"role": "assistant", "content": f"I cannot use tools right now, so I cannot get {phrase} for you."}
    r = reasoning([f"Tools are disabled (tool_choice=none); I must answer without calling {names[0]}.",
                   "I explain what I would need."], effort)
    if r is not None:
        ref["reasoning_content"] = r
    return Item("tools_none", request, ref, {"calls": []})


# ------------------------------------------------------------------------------------- json
_NAMES = ("Ada", "Bob", "Chen", "Dara", "Emil", "Fatima", "Goran", "Hana", "Ivan", "Jade", "Kofi", "Lena")
_COLORS = ("red", "blue", "green", "yellow", "purple", "orange")
_ANIMALS = ("cat", "dog", "owl", "fox", "horse", "rabbit")


def gen_json(rng: random.Random, effort: str | None) -> Item:
    """A JSON answer: a record of facts stated in the user's words, as ``json_object`` (keys
    named in the prompt) or ``json_schema`` (keys from the schema)."""
    name, age = rng.choice(_NAMES), rng.randint(3, 90)
    fields = {"name": name, "age": age}
    extra = rng.choice(["color", "pet", "city", None])
    props: dict[str, Any] = {"name": {"type": "string"}, "age": {"type": "integer"}}
    facts = f"{name} is {age} years old"
    if extra == "color":
        fields["color"] = rng.choice(_COLORS)
        props["color"] = {"type": "string", "enum": list(_COLORS)}
        facts += f" and likes {fields['color']}"
    elif extra == "pet":
        fields["pet"] = rng.choice(_ANIMALS)
        props["pet"] = {"type": "string"}
        facts += f" and has a {fields['pet']}"
    elif extra == "city":
        fields["city"] = rng.choice(_CITIES)
        props["city"] = {"type": "string"}
        facts += f" and lives in {fields['city']}"
    keys = list(fields)
    schema = {"type": "object", "properties": props, "required": keys, "additionalProperties": False}
    if rng.random() < 0.5:
        user = f"{facts}. Return a JSON object with the keys {', '.join(keys)}."
        rf: dict = {"type": "json_object"}
    else:
        user = f"{facts}. Give the record as JSON."
        rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}
    request = {"messages": [{"role": "user", "content": user}], "response_format": rf}
    _effort(request, effort)
    ref = {"role": "assistant", "content": json.dumps(fields)}
    r = reasoning([f"I need a JSON object with {', '.join(keys)}.",
                   *[f"{k} = {json.dumps(v)}" for k, v in fields.items()], "Raw JSON, no code fence."], effort)
    if r is not None:
        ref["reasoning_content"] = r
    return Item("json", request, ref, {"fields": fields, "schema": schema})


def _effort(request: dict, effort: str | None) -> None:
    if effort is None:
        request["thinking"] = {"type": "disabled"}
    else:
        request["reasoning_effort"] = effort


# ------------------------------------------------------------------------------------- copy
_WORDS = ("apple", "river", "green", "stone", "cloud", "seven", "table", "music", "north", "paper", "light",
          "window", "silver", "garden", "rocket", "candle", "forest", "pencil", "summer", "bridge", "orange",
          "planet", "winter", "yellow", "island", "marble", "shadow", "violet", "copper", "meadow", "harbor",
          "falcon", "lemon", "tiger", "velvet", "canyon", "pepper", "spring", "anchor", "basket")
_COPY_FORMS = ("Repeat exactly: {t}", "Copy this text: {t}", "Echo back: {t}", "Say back exactly this: {t}")


def _copy_piece(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.35:
        return rng.choice(_WORDS)
    if kind < 0.65:
        return str(rng.randint(1, 9999))
    if kind < 0.8:
        return rng.choice(_CITIES)
    if kind < 0.9:
        return f"{rng.randint(2, 999)} {rng.choice('+-*')} {rng.randint(2, 99)}"
    return rng.choice(_PEOPLE + _ZONES)


def gen_copy(rng: random.Random, effort: str | None) -> Item:
    """Repeat a random sequence of 3-10 words, numbers, cities, expressions or addresses exactly.

    Why: the tool set's argument values come from small pools, which a tiny model can fit by their
    frequencies instead of reading the request; uniformly random sequences leave copying as the
    only way to lower the loss (the induction-head curriculum), and the reasoning line copies the
    text once more, as the tool reasoning does before the call."""
    text = " ".join(_copy_piece(rng) for _ in range(rng.randint(3, 10)))
    request: dict = {"messages": [{"role": "user", "content": rng.choice(_COPY_FORMS).format(t=text)}]}
    _effort(request, effort)
    ref = {"role": "assistant", "content": text}
    r = reasoning([f"The user wants exactly: {text}", "I repeat it without changes."], effort)
    if r is not None:
        ref["reasoning_content"] = r
    return Item("copy", request, ref, {"content": text})


__all__ = ["Item", "TOOLS", "reasoning", "gen_tool_call", "gen_tool_none", "gen_json", "gen_copy"]
