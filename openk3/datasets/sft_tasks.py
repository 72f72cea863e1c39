"""SFT task generators for tool use, JSON answers, multi-turn recall, out-of-scope questions and
copying (the rest of the mixture: :mod:`sft_data`).

Every generator is a function ``gen(rng, effort, held_out=False) -> Item``: a chat-completions
request (the conversation up to the assistant turn being taught, with its request options), the
reference assistant message, the expected answer used by ``openk3 eval`` and an optional
follow-up (tool result and final answer) for training conversations. Everything is drawn from
``rng`` (:class:`random.Random`), so a seed fixes the data. ``held_out`` picks the values
(names, cities, words, ...) from the held-out part of each pool (:mod:`openk3.datasets.pools`):
training data never contains an eval set's argument values.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from openk3.chat_format import make_tool_call_id
from openk3.datasets.pools import draw, draw_date, draw_time, pool


@dataclass
class Item:
    """One SFT / eval example.

    Attributes:
        suite: the task family (``tools``, ``json``, ``recall``, ``problems``, ...).
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
    k = {
        "low": 1 if len(lines[0]) > 40 or n == 1 else 2,
        "medium": max(1, n // 2),
        "high": max(1, n - 1),
        "max": n,
    }[effort]
    return "\n".join(lines[: min(k, n)])


def set_effort(request: dict, effort: str | None) -> None:
    if effort is None:
        request["thinking"] = {"type": "disabled"}
    else:
        request["reasoning_effort"] = effort


def with_reasoning(msg: dict, text: str | None) -> dict:
    if text is not None:
        msg["reasoning_content"] = text
    return msg


# ------------------------------------------------------------------------------------ tools
def _fn(name: str, desc: str, props: dict, required: list[str]) -> dict:
    return {
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


_S = {"type": "string"}
_I = {"type": "integer"}
_N = {"type": "number"}
_DATE = {"type": "string", "description": "ISO date YYYY-MM-DD"}
MODES = ("driving", "walking", "cycling", "transit")

TOOLS: dict[str, dict] = {
    "get_weather": _fn(
        "get_weather",
        "Current weather for a city.",
        {"city": _S, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        ["city"],
    ),
    "convert_currency": _fn(
        "convert_currency",
        "Convert an amount between currencies.",
        {
            "amount": _N,
            "from_currency": {"type": "string", "enum": list(pool("currency"))},
            "to_currency": {"type": "string", "enum": list(pool("currency"))},
        },
        ["amount", "from_currency", "to_currency"],
    ),
    "search_web": _fn(
        "search_web",
        "Search the web.",
        {"query": _S, "max_results": {"type": "integer", "minimum": 1, "maximum": 10}},
        ["query"],
    ),
    "set_timer": _fn(
        "set_timer",
        "Start a countdown timer.",
        {"minutes": {"type": "integer", "minimum": 1}, "label": _S},
        ["minutes"],
    ),
    "send_email": _fn(
        "send_email", "Send an email.", {"to": _S, "subject": _S, "body": _S}, ["to", "subject"]
    ),
    "get_time": _fn(
        "get_time",
        "Current local time in a time zone.",
        {"timezone": {"type": "string", "enum": list(pool("timezone"))}},
        ["timezone"],
    ),
    "calculator": _fn(
        "calculator", "Evaluate an arithmetic expression.", {"expression": _S}, ["expression"]
    ),
    "book_flight": _fn(
        "book_flight",
        "Book a one-way flight.",
        {"origin": _S, "destination": _S, "date": _DATE},
        ["origin", "destination", "date"],
    ),
    "create_event": _fn(
        "create_event",
        "Add an event to the calendar.",
        {"title": _S, "date": _DATE, "time": {"type": "string", "description": "HH:MM"}},
        ["title", "date"],
    ),
    "lookup_contact": _fn(
        "lookup_contact",
        "Find a person's phone number and e-mail in the address book.",
        {"name": _S},
        ["name"],
    ),
    "get_stock_price": _fn(
        "get_stock_price", "Latest price of a stock by ticker symbol.", {"symbol": _S}, ["symbol"]
    ),
    "translate_text": _fn(
        "translate_text",
        "Translate a text into another language.",
        {"text": _S, "target_language": {"type": "string", "enum": list(pool("language"))}},
        ["text", "target_language"],
    ),
    "get_directions": _fn(
        "get_directions",
        "Route between two places.",
        {"origin": _S, "destination": _S, "mode": {"type": "string", "enum": list(MODES)}},
        ["origin", "destination"],
    ),
    "order_food": _fn(
        "order_food",
        "Order food for delivery.",
        {
            "dish": {"type": "string", "enum": list(pool("dish"))},
            "quantity": {"type": "integer", "minimum": 1},
        },
        ["dish", "quantity"],
    ),
    "play_music": _fn("play_music", "Play a song.", {"song": _S}, ["song"]),
    "create_reminder": _fn(
        "create_reminder",
        "Create a reminder for a date.",
        {"text": _S, "date": _DATE},
        ["text", "date"],
    ),
}


@dataclass
class Call:
    """One tool call drawn for a request: the user's phrase, the arguments (taken from the phrase),
    the tool result (JSON text), the final answer that uses it and the result values that answer
    must contain."""

    name: str
    phrase: str
    args: dict
    result: str
    answer: str
    result_values: list[str]
    question: tuple[str, str] | None = None  # (a question asking for this call, what it wants)


def _amount(rng: random.Random) -> int | float:
    return rng.randint(1, 99999) if rng.random() < 0.75 else round(rng.randint(1, 99999) / 100, 2)


def _num(v: int | float) -> str:
    return json.dumps(v)


def _code(rng: random.Random, prefix: str) -> str:
    return f"{prefix}-{rng.randint(1000, 99999)}"


def _question_for(rng: random.Random, call: Call) -> tuple[str, str] | None:
    """A direct question that asks for ``call`` (``"What is the weather in Paris?"``) and what it
    wants in the reasoning's words (``"the weather in Paris"``), or None for tools whose requests
    are naturally commands (timers, emails, bookings, orders, ...).

    Why: users and agent frameworks ask questions ("What is the weather in Paris?"); with only
    command phrasings in training, the tiny model reads every question as an out-of-scope one
    (those are all questions) and answers "I don't know" with the tool declared."""
    a = call.args
    if call.name == "get_weather":
        unit = f" in {a['unit']}" if "unit" in a else ""
        form = rng.choice(
            (
                "What is the weather in {c}{u}?",
                "What's the weather like in {c}{u}?",
                "How warm is it in {c}{u}?",
            )
        )
        return form.format(c=a["city"], u=unit), f"the weather in {a['city']}{unit}"
    if call.name == "get_time":
        return f"What time is it in {a['timezone']}?", f"the time in {a['timezone']}"
    if call.name == "convert_currency":
        x = _num(a["amount"])
        return (
            f"How much is {x} {a['from_currency']} in {a['to_currency']}?",
            f"{x} {a['from_currency']} in {a['to_currency']}",
        )
    if call.name == "lookup_contact":
        return f"What is the phone number of {a['name']}?", f"the phone number of {a['name']}"
    if call.name == "get_stock_price":
        form = rng.choice(("What is the stock price of {s}?", "How is {s} trading?"))
        return form.format(s=a["symbol"]), f"the stock price of {a['symbol']}"
    if call.name == "translate_text":
        return (
            f"How do you say '{a['text']}' in {a['target_language']}?",
            f"'{a['text']}' in {a['target_language']}",
        )
    if call.name == "get_directions":
        mode = f" by {a['mode']}" if "mode" in a else ""
        return (
            f"How do I get from {a['origin']} to {a['destination']}{mode}?",
            f"directions from {a['origin']} to {a['destination']}{mode}",
        )
    return None


def _call_for(rng: random.Random, name: str, held_out: bool = False) -> Call:
    """A :class:`Call` of tool ``name`` with arguments from the pools' training or held-out part,
    with a question form (:func:`_question_for`) where the tool has one."""
    call = _command_call(rng, name, held_out)
    call.question = _question_for(rng, call)
    return call


def _command_call(rng: random.Random, name: str, held_out: bool = False) -> Call:
    """A :class:`Call` of tool ``name`` phrased as a command (``phrase``: a verb phrase)."""
    h = held_out
    if name == "get_weather":
        city = draw(rng, "city", h)
        unit = rng.choice([None, "celsius", "fahrenheit"])
        args = {"city": city} if unit is None else {"city": city, "unit": unit}
        t = rng.randint(-30, 110) if unit == "fahrenheit" else rng.randint(-25, 45)
        u = "F" if unit == "fahrenheit" else "C"
        sky = rng.choice(["sunny", "cloudy", "rainy", "windy", "foggy", "snowy"])
        base = rng.choice(
            [
                "check the weather in {c}",
                "tell me how warm it is in {c}",
                "get the forecast for {c}",
                "look up the current weather in {c}",
            ]
        ).format(c=city)
        return Call(
            name,
            base + (f" in {unit}" if unit else ""),
            args,
            json.dumps({"temperature": t, "unit": u, "sky": sky}),
            f"It is {t} degrees {u} and {sky} in {city}.",
            [str(t)],
        )
    if name == "convert_currency":
        amt = _amount(rng)
        a, b = rng.sample(pool("currency"), 2)
        res = round(amt * rng.uniform(0.05, 20.0), 2)
        phrase = rng.choice(
            [
                "tell me how much {x} {a} is in {b}",
                "convert {x} {a} to {b}",
                "change {x} {a} into {b}",
            ]
        )
        return Call(
            name,
            phrase.format(x=_num(amt), a=a, b=b),
            {"amount": amt, "from_currency": a, "to_currency": b},
            json.dumps({"result": res}),
            f"{_num(amt)} {a} is {_num(res)} {b}.",
            [_num(res)],
        )
    if name == "search_web":
        topic = draw(rng, "topic", h)
        n = rng.choice([None, None, rng.randint(1, 10)])
        args = {"query": topic} if n is None else {"query": topic, "max_results": n}
        t1, t2 = (
            f"{draw(rng, 'word', h).capitalize()} {rng.choice(('guide', 'notes', 'basics', 'review'))}"
            for _ in range(2)
        )
        phrase = rng.choice(
            ["search the web for {t}", "look up {t} online", "find web pages about {t}"]
        ).format(t=topic)
        return Call(
            name,
            phrase + (f", top {n} results" if n else ""),
            args,
            json.dumps({"results": [t1, t2]}),
            f"I found: {t1}; {t2}.",
            [t1],
        )
    if name == "set_timer":
        m = rng.randint(1, 999)
        label = rng.choice([None, draw(rng, "word", h)])
        args = {"minutes": m} if label is None else {"minutes": m, "label": label}
        ends = draw_time(rng)
        return Call(
            name,
            f"set a timer for {m} minutes" + (f" called {label}" if label else ""),
            args,
            json.dumps({"ok": True, "ends_at": ends}),
            f"Your {m}-minute timer is running; it ends at {ends}.",
            [ends],
        )
    if name == "send_email":
        to = draw(rng, "email", h)
        subject = draw(rng, "title", h) if rng.random() < 0.5 else draw(rng, "word", h)
        mid = _code(rng, "msg")
        phrase = rng.choice(["email {to} with the subject {s}", "send an email to {to} about {s}"])
        return Call(
            name,
            phrase.format(to=to, s=subject),
            {"to": to, "subject": subject},
            json.dumps({"sent": True, "message_id": mid}),
            f"Done: the email to {to} is sent ({mid}).",
            [mid],
        )
    if name == "get_time":
        z = rng.choice(pool("timezone"))
        t = draw_time(rng)
        return Call(
            name,
            rng.choice(["tell me what time it is in {z}", "check the local time in {z}"]).format(
                z=z
            ),
            {"timezone": z},
            json.dumps({"time": t}),
            f"It is {t} in {z}.",
            [t],
        )
    if name == "calculator":
        a = rng.randint(2, 9999)
        b = rng.randint(2, 999)
        op = rng.choice("+-*")
        val = a + b if op == "+" else a - b if op == "-" else a * b
        expr = f"{a} {op} {b}"
        return Call(
            name,
            f"use the calculator for {expr}",
            {"expression": expr},
            json.dumps({"value": val}),
            f"{expr} = {val}.",
            [str(val)],
        )
    if name == "book_flight":
        o = draw(rng, "city", h)
        d = draw(rng, "city", h)
        while d == o:
            d = draw(rng, "city", h)
        date = draw_date(rng)
        ref = _code(rng, "BK")
        price = rng.randint(40, 2500)
        phrase = rng.choice(
            ["book a flight from {o} to {d} on {t}", "get me a flight from {o} to {d} on {t}"]
        )
        return Call(
            name,
            phrase.format(o=o, d=d, t=date),
            {"origin": o, "destination": d, "date": date},
            json.dumps({"booking": ref, "price_usd": price}),
            f"Booked: {o} to {d} on {date}, reference {ref}, {price} USD.",
            [ref],
        )
    if name == "create_event":
        title = draw(rng, "title", h)
        date = draw_date(rng)
        t = rng.choice([None, draw_time(rng)])
        args = (
            {"title": title, "date": date}
            if t is None
            else {"title": title, "date": date, "time": t}
        )
        eid = _code(rng, "evt")
        return Call(
            name,
            f"add {title} to my calendar on {date}" + (f" at {t}" if t else ""),
            args,
            json.dumps({"event_id": eid}),
            f"Added {title} on {date} ({eid}).",
            [eid],
        )
    if name == "lookup_contact":
        who = f"{draw(rng, 'first_name', h)} {draw(rng, 'surname', h)}"
        phone = f"+{rng.randint(1, 99)} {rng.randint(100, 999)} {rng.randint(1000, 9999)}"
        phrase = rng.choice(
            [
                "find the phone number of {n}",
                "look up {n} in my contacts",
                "get the contact details of {n}",
            ]
        )
        return Call(
            name,
            phrase.format(n=who),
            {"name": who},
            json.dumps({"name": who, "phone": phone}),
            f"{who}'s phone number is {phone}.",
            [phone],
        )
    if name == "get_stock_price":
        sym = draw(rng, "symbol", h)
        price = round(rng.randint(100, 500000) / 100, 2)
        phrase = rng.choice(
            [
                "get the stock price of {s}",
                "check how {s} shares are trading",
                "look up the latest price for {s}",
            ]
        )
        return Call(
            name,
            phrase.format(s=sym),
            {"symbol": sym},
            json.dumps({"symbol": sym, "price": price}),
            f"{sym} is at {_num(price)}.",
            [_num(price)],
        )
    if name == "translate_text":
        text = (
            draw(rng, "word", h)
            if rng.random() < 0.5
            else f"{draw(rng, 'word', h)} {draw(rng, 'word', h)}"
        )
        lang = rng.choice(pool("language"))
        out = "".join(rng.choice("aeioulmnrstkv") for _ in range(rng.randint(4, 9)))
        return Call(
            name,
            f"translate '{text}' into {lang}",
            {"text": text, "target_language": lang},
            json.dumps({"translation": out}),
            f"In {lang}, '{text}' is '{out}'.",
            [out],
        )
    if name == "get_directions":
        o = draw(rng, "city", h)
        d = draw(rng, "city", h)
        while d == o:
            d = draw(rng, "city", h)
        mode = rng.choice([None, *MODES])
        args = (
            {"origin": o, "destination": d}
            if mode is None
            else {"origin": o, "destination": d, "mode": mode}
        )
        km = rng.randint(1, 3000)
        mins = rng.randint(5, 3000)
        return Call(
            name,
            f"get directions from {o} to {d}" + (f" by {mode}" if mode else ""),
            args,
            json.dumps({"distance_km": km, "minutes": mins}),
            f"It is {km} km, about {mins} minutes.",
            [str(km)],
        )
    if name == "order_food":
        dish = rng.choice(pool("dish"))
        q = rng.randint(1, 20)
        oid = _code(rng, "ord")
        eta = rng.randint(10, 90)
        return Call(
            name,
            f"order {q} {dish}",
            {"dish": dish, "quantity": q},
            json.dumps({"order_id": oid, "eta_minutes": eta}),
            f"Ordered {q} {dish}; it arrives in {eta} minutes.",
            [str(eta)],
        )
    if name == "play_music":
        song = draw(rng, "song", h)
        pos = rng.randint(1, 50)
        return Call(
            name,
            rng.choice(["play the song {s}", "put on {s}"]).format(s=song),
            {"song": song},
            json.dumps({"playing": song, "queue_position": pos}),
            f"Playing {song} (queue position {pos}).",
            [str(pos)],
        )
    if name == "create_reminder":
        text = (
            f"{rng.choice(('call', 'pay', 'buy', 'visit', 'email'))} {draw(rng, 'first_name', h)}"
        )
        date = draw_date(rng)
        rid = _code(rng, "rem")
        return Call(
            name,
            f"remind me to {text} on {date}",
            {"text": text, "date": date},
            json.dumps({"reminder_id": rid}),
            f"I will remind you to {text} on {date} ({rid}).",
            [rid],
        )
    raise ValueError(f"tool {name!r}: unknown (known: {', '.join(TOOLS)})")


_ASK = (
    "Please {p}.",
    "Can you {p}?",
    "I want you to {p}.",
    "{P}, please.",
    "Could you {p}?",
    "Hey, {p}.",
    "I'd like you to {p}.",
    "{P}.",
)  # every phrase is a verb phrase
_JOIN = (" and ", ", and also ", " and then ", ", then ")
# Share of one-call requests asked as a direct question where the tool has one (_question_for).
QUESTION_SHARE = 0.4


def _ask(rng: random.Random, text: str) -> str:
    return rng.choice(_ASK).format(p=text, P=text[:1].upper() + text[1:])


def _declare(
    rng: random.Random, names: list[str], request: dict, messages: list[dict], dynamic_share: float
) -> None:
    tools = [TOOLS[n] for n in names]
    if rng.random() < dynamic_share:  # dynamic tool declaration (system message with tools)
        messages.insert(0, {"role": "system", "tools": tools})
    else:
        request["tools"] = tools


def _tool_request(
    rng: random.Random,
    effort: str | None,
    n_calls: int,
    held_out: bool,
    *,
    n_declared: int | None = None,
) -> tuple[dict, list[Call], list[str], str]:
    names = rng.sample(sorted(TOOLS), n_declared or rng.randint(max(3, n_calls), 6))
    chosen = rng.sample(names, n_calls)
    calls = [_call_for(rng, n, held_out) for n in chosen]
    text = calls[0].phrase
    for c in calls[1:]:
        text += rng.choice(_JOIN) + c.phrase
    content = _ask(rng, text)
    if n_calls == 1 and calls[0].question is not None and rng.random() < QUESTION_SHARE:
        content, text = calls[0].question
    messages: list[dict] = [{"role": "user", "content": content}]
    request: dict = {"messages": messages}
    _declare(rng, names, request, messages, 0.2)
    set_effort(request, effort)
    return request, calls, names, text


# How the reasoning of a tool-call turn states the call (:func:`_call_message`).
TOOL_REASONING = ("restate", "args", "name")


def _call_lines(calls: list[Call], text: str, style: str) -> list[str]:
    """The think-channel lines of a tool-call turn, most essential first (:func:`reasoning` cuts
    them by effort).

    ``restate``: the user's request restated in prose, the tool name(s), then each call's
    arguments JSON and a check (the shipped model's data). ``args``: each call's name with its
    arguments JSON as the call writes them (the values appear once before the call, in the call's
    own tokens), then the check; the request is not restated. ``name``: the tool name(s) only, no
    value: the call copies every value straight from the user's turn.

    Why the styles: the shipped model corrupts values while restating them in prose and then
    copies the corrupted restatement into the call (``Sleaxgaiia`` -> ``Sleal...``).

    Raises:
        ValueError: ``style`` not in :data:`TOOL_REASONING`.
    """
    names = " and ".join(c.name for c in calls)
    check = "The arguments come from the user's words and fit the schema."
    if style == "restate":
        return [
            f"The user wants {text}; I will call {names}.",
            *[f"{c.name} arguments: {json.dumps(c.args)}" for c in calls],
            check,
        ]
    if style == "args":
        return [*[f"I will call {c.name} with {json.dumps(c.args)}." for c in calls], check]
    if style == "name":
        return [f"I will call {names}.", check]
    raise ValueError(f"tool_reasoning={style!r}: must be one of {', '.join(TOOL_REASONING)}")


def _call_message(
    calls: list[Call], text: str, effort: str | None, start: int = 0, style: str = "restate"
) -> dict:
    tcs = [
        {
            "id": make_tool_call_id(c.name, start + i),
            "type": "function",
            "function": {"name": c.name, "arguments": json.dumps(c.args)},
        }
        for i, c in enumerate(calls)
    ]
    return with_reasoning(
        {"role": "assistant", "content": None, "tool_calls": tcs},
        reasoning(_call_lines(calls, text, style), effort),
    )


def _answer_message(calls: list[Call], effort: str | None) -> dict:
    lines = [f"The tool returned {calls[0].result}; I report it."]
    return with_reasoning(
        {"role": "assistant", "content": " ".join(c.answer for c in calls)},
        reasoning(lines, effort),
    )


def _expected_calls(calls: list[Call], names: list[str]) -> dict:
    return {
        "calls": [{"name": c.name, "arguments": c.args} for c in calls],
        "schemas": {n: TOOLS[n]["function"]["parameters"] for n in names},
    }


def gen_tool_call(
    rng: random.Random,
    effort: str | None,
    held_out: bool = False,
    *,
    n_calls: int | None = None,
    tool_reasoning: str = "restate",
) -> Item:
    """Choose one (or, a quarter of the time, two) of 3-6 declared tools and fill their arguments
    from the user's words; variants: tool_choice auto/required, tools declared dynamically in a
    system message, two calls in one turn. The follow-up is the tool result(s) and an answer that
    uses them. ``tool_reasoning``: the call turn's reasoning style (:func:`_call_lines`); it
    changes text only, never what is drawn from ``rng``."""
    if n_calls is None:
        n_calls = 2 if rng.random() < 0.25 else 1
    request, calls, names, text = _tool_request(rng, effort, n_calls, held_out)
    choice = rng.choice(["auto", "auto", "required"])
    if choice != "auto":
        request["tool_choice"] = choice
    ref = _call_message(calls, text, effort, style=tool_reasoning)
    follow = [
        {"role": "tool", "tool_call_id": tc["id"], "content": c.result}
        for tc, c in zip(ref["tool_calls"], calls)
    ]
    # The tool-choice system message renders after the whole conversation (it belongs to the next
    # assistant turn), so a conversation that sets it ends at the call it governs.
    return Item(
        "tools",
        request,
        ref,
        _expected_calls(calls, names),
        follow + [_answer_message(calls, effort)] if choice == "auto" else [],
    )


def gen_tool_two(
    rng: random.Random,
    effort: str | None,
    held_out: bool = False,
    *,
    tool_reasoning: str = "restate",
) -> Item:
    """A request that needs two calls in one turn (the ``tools_two`` eval suite)."""
    it = gen_tool_call(rng, effort, held_out, n_calls=2, tool_reasoning=tool_reasoning)
    return Item("tools_two", it.request, it.reference, it.expected, it.follow_up)


def gen_tool_result(
    rng: random.Random,
    effort: str | None,
    held_out: bool = False,
    *,
    tool_reasoning: str = "restate",
) -> Item:
    """The turn after a tool result: the history holds the request, the call (its reasoning in
    the ``tool_reasoning`` style) and its result; the answer must state the result's value
    (``expected.values``)."""
    n_calls = 2 if rng.random() < 0.2 else 1
    request, calls, names, text = _tool_request(rng, effort, n_calls, held_out)
    call = _call_message(calls, text, effort, style=tool_reasoning)
    if "reasoning_content" not in call:
        call["reasoning_content"] = (
            ""  # a tool-call turn in history needs its reasoning (may be "")
        )
    msgs = (
        request["messages"]
        + [call]
        + [
            {"role": "tool", "tool_call_id": tc["id"], "content": c.result}
            for tc, c in zip(call["tool_calls"], calls)
        ]
    )
    req = dict(request, messages=msgs)
    return Item(
        "tool_result",
        req,
        _answer_message(calls, effort),
        {"values": [v for c in calls for v in c.result_values]},
    )


def gen_tool_none(rng: random.Random, effort: str | None, held_out: bool = False) -> Item:
    """Tools declared but ``tool_choice: none``: answer in words, say what would be needed."""
    names = rng.sample(sorted(TOOLS), 3)
    c = _call_for(rng, names[0], held_out)
    request = {
        "messages": [{"role": "user", "content": _ask(rng, c.phrase)}],
        "tools": [TOOLS[n] for n in names],
        "tool_choice": "none",
    }
    set_effort(request, effort)
    ref = {
        "role": "assistant",
        "content": f"I cannot use tools right now, so I cannot {c.phrase} for you.",
    }
    r = reasoning(
        [
            f"Tools are disabled (tool_choice=none); I must answer without calling {names[0]}.",
            "I explain what I would need.",
        ],
        effort,
    )
    return Item("tools_none", request, with_reasoning(ref, r), {"calls": []})


# ------------------------------------------------------------------------------------- json
def _field(rng: random.Random, key: str, h: bool) -> tuple[Any, dict, str]:
    """(value, JSON-schema property, clause stating it) of one record field."""
    if key == "age":
        v = rng.randint(1, 99)
        return v, {"type": "integer"}, f"is {v} years old"
    if key == "city":
        v = draw(rng, "city", h)
        return v, {"type": "string"}, f"lives in {v}"
    if key == "job":
        v = rng.choice(pool("job"))
        return v, {"type": "string", "enum": list(pool("job"))}, f"works as a {v}"
    if key == "pet":
        v = rng.choice(pool("animal"))
        return v, {"type": "string"}, f"has a {v}"
    if key == "color":
        v = rng.choice(pool("colour"))
        return v, {"type": "string", "enum": list(pool("colour"))}, f"likes {v}"
    if key == "email":
        v = draw(rng, "email", h)
        return v, {"type": "string"}, f"has the e-mail {v}"
    if key == "score":
        v = rng.randint(0, 9999)
        return v, {"type": "integer"}, f"scored {v} points"
    if key == "birthday":
        v = draw_date(rng)
        return v, {"type": "string"}, f"was born on {v}"
    if key == "surname":
        v = draw(rng, "surname", h)
        return v, {"type": "string"}, f"has the surname {v}"
    raise ValueError(f"field {key!r}: unknown")


_JSON_KEYS = ("age", "city", "job", "pet", "color", "email", "score", "birthday", "surname")


def gen_json(rng: random.Random, effort: str | None, held_out: bool = False) -> Item:
    """A JSON answer: a record of 2-4 facts stated in the user's words (a name plus 1-3 of
    :data:`_JSON_KEYS`, values from the pools), as ``json_object`` (keys named in the prompt) or
    ``json_schema`` (keys from the schema)."""
    name = draw(rng, "first_name", held_out)
    fields: dict[str, Any] = {"name": name}
    props: dict[str, Any] = {"name": {"type": "string"}}
    clauses = []
    for key in rng.sample(_JSON_KEYS, rng.randint(1, 3)):
        v, prop, clause = _field(rng, key, held_out)
        fields[key] = v
        props[key] = prop
        clauses.append(clause)
    facts = f"{name} " + (
        clauses[0] if len(clauses) == 1 else ", ".join(clauses[:-1]) + " and " + clauses[-1]
    )
    keys = list(fields)
    schema = {
        "type": "object",
        "properties": props,
        "required": keys,
        "additionalProperties": False,
    }
    if rng.random() < 0.5:
        user = f"{facts}. " + rng.choice(
            [
                "Return a JSON object with the keys {k}.",
                "Reply in JSON with {k}.",
                "Give me JSON with the fields {k}.",
            ]
        ).format(k=", ".join(keys))
        rf: dict = {"type": "json_object"}
    else:
        user = f"{facts}. " + rng.choice(
            ["Give the record as JSON.", "Return it as JSON.", "Fill in the record."]
        )
        rf = {
            "type": "json_schema",
            "json_schema": {"name": "record", "schema": schema, "strict": True},
        }
    request = {"messages": [{"role": "user", "content": user}], "response_format": rf}
    set_effort(request, effort)
    ref = {"role": "assistant", "content": json.dumps(fields)}
    r = reasoning(
        [
            f"I need a JSON object with {', '.join(keys)}.",
            *[f"{k} = {json.dumps(v)}" for k, v in fields.items()],
            "Raw JSON, no code fence.",
        ],
        effort,
    )
    return Item("json", request, with_reasoning(ref, r), {"fields": fields, "schema": schema})


# ----------------------------------------------------------------------------------- recall
_FACTS = {
    "name": (
        ("My name is {v}.", "Hi, I'm {v}.", "Call me {v}.", "Hello, I am {v}."),
        "first_name",
        ("What is my name?", "What's my name?", "Do you remember my name?", "Who am I?"),
        "Nice to meet you, {v}!",
        "Your name is {v}.",
    ),
    "city": (
        ("I live in {v}.", "I'm from {v}.", "My home town is {v}."),
        "city",
        ("Where do I live?", "Which city am I from?", "What is my home town?"),
        "{v} sounds like a nice place.",
        "You live in {v}.",
    ),
    "number": (
        ("My favourite number is {v}.", "Remember the number {v}.", "My lucky number is {v}."),
        None,
        ("What is my favourite number?", "Which number did I tell you?", "What was the number?"),
        "Noted: {v}.",
        "The number is {v}.",
    ),
    "pet": (
        ("My dog is called {v}.", "I have a cat named {v}.", "My pet's name is {v}."),
        "pet_name",
        ("What is my pet called?", "What's my pet's name?"),
        "{v} is a lovely name.",
        "Your pet is called {v}.",
    ),
    "code": (
        ("My locker code is {v}.", "The door code is {v}."),
        "symbol",
        ("What is the code?", "Which code did I give you?"),
        "Got it, {v}.",
        "The code is {v}.",
    ),
}


def _fact_value(rng: random.Random, kind: str, h: bool) -> str:
    p = _FACTS[kind][1]
    return str(rng.randint(0, 99999)) if p is None else draw(rng, p, h)


def gen_recall(rng: random.Random, effort: str | None, held_out: bool = False) -> Item:
    """Multi-turn recall: a fact (name, city, number, pet name, code) given in an earlier user turn,
    0-2 unrelated exchanges (possibly with other facts), then a question about one fact; the
    answer must hold its value (``expected.value``)."""
    kinds = rng.sample(sorted(_FACTS), rng.randint(1, 3))
    values = {k: _fact_value(rng, k, held_out) for k in kinds}
    said = {k: rng.choice(_FACTS[k][0]).format(v=values[k]) for k in kinds}
    pairs = [
        [
            {"role": "user", "content": said[k]},
            {"role": "assistant", "content": _FACTS[k][3].format(v=values[k])},
        ]
        for k in kinds
    ]
    for _ in range(rng.randint(0, 2)):
        w = draw(rng, "word", held_out)
        pairs.append(
            [
                {"role": "user", "content": f"Say '{w}' and nothing else."},
                {"role": "assistant", "content": w},
            ]
        )
    if rng.random() < 0.3:
        rng.shuffle(pairs)
    target = rng.choice(kinds)
    v = values[target]
    msgs = [m for pair in pairs for m in pair] + [
        {"role": "user", "content": rng.choice(_FACTS[target][2])}
    ]
    request = {"messages": msgs}
    set_effort(request, effort)
    r = reasoning([f"Earlier the user said: {said[target]}", f"So the answer is {v}."], effort)
    return Item(
        "recall",
        request,
        with_reasoning({"role": "assistant", "content": _FACTS[target][4].format(v=v)}, r),
        {"value": v},
    )


# ------------------------------------------------------------------------------ out of scope
_OOS = (
    "What is the population of {city}?",
    "Who will win the next {word} championship?",
    "What number am I thinking of?",
    "What did I eat for breakfast today?",
    "What is the password of my {word} account?",
    "How many {animal}s live in {city}?",
    "What was the name of my first teacher?",
    "What will the price of {word}s be in ten years?",
    "Who is the mayor of {city}?",
    "What is {first}'s middle name?",
    "In which year was {city} founded?",
    "How tall is the tallest tree in {city}?",
    "What colour is my car?",
    "What is my neighbour's name?",
)
OOS_ANSWER = "I don't know that, and I have no way to find it out."


def gen_out_of_scope(rng: random.Random, effort: str | None, held_out: bool = False) -> Item:
    """A question the model cannot know (and no declared tool answers): a short honest answer,
    no tool call. Half the requests declare 2-4 unrelated tools (tool_choice auto)."""
    q = rng.choice(_OOS).format(
        city=draw(rng, "city", held_out),
        word=draw(rng, "word", held_out),
        animal=rng.choice(pool("animal")),
        first=draw(rng, "first_name", held_out),
    )
    request: dict = {"messages": [{"role": "user", "content": q}]}
    if rng.random() < 0.5:
        allowed = [n for n in sorted(TOOLS) if n not in ("search_web", "lookup_contact")]
        _declare(rng, rng.sample(allowed, rng.randint(2, 4)), request, request["messages"], 0.2)
    set_effort(request, effort)
    r = reasoning(
        [
            "I have no information about this, and no tool can find it; I say so briefly.",
            "No guessing.",
        ],
        effort,
    )
    return Item(
        "out_of_scope",
        request,
        with_reasoning({"role": "assistant", "content": OOS_ANSWER}, r),
        {"honest": True},
    )


# ------------------------------------------------------------------------------------- copy
_COPY_FORMS = (
    "Repeat exactly: {t}",
    "Copy this text: {t}",
    "Echo back: {t}",
    "Say back exactly this: {t}",
)


def _copy_piece(rng: random.Random, h: bool) -> str:
    kind = rng.random()
    if kind < 0.25:
        return draw(rng, "word", h)
    if kind < 0.5:
        return str(rng.randint(0, 99999))
    if kind < 0.65:
        return draw(rng, "city", h)
    if kind < 0.8:
        return draw(rng, "first_name", h)
    if kind < 0.9:
        return f"{rng.randint(2, 999)} {rng.choice('+-*')} {rng.randint(2, 99)}"
    return draw(rng, "email", h)


def gen_copy(rng: random.Random, effort: str | None, held_out: bool = False) -> Item:
    """Repeat a random sequence of 3-10 words, numbers, cities, names, expressions or addresses.

    Why: uniformly random sequences from large pools leave copying as the only way to lower the
    loss (the induction-head curriculum); the reasoning line copies the text once more, as the
    tool reasoning does before the call."""
    text = " ".join(_copy_piece(rng, held_out) for _ in range(rng.randint(3, 10)))
    request: dict = {
        "messages": [{"role": "user", "content": rng.choice(_COPY_FORMS).format(t=text)}]
    }
    set_effort(request, effort)
    r = reasoning([f"The user wants exactly: {text}", "I repeat it without changes."], effort)
    return Item(
        "copy",
        request,
        with_reasoning({"role": "assistant", "content": text}, r),
        {"content": text},
    )


def gen_lookup(rng: random.Random, effort: str | None, held_out: bool = False) -> Item:
    """Key-value lookup: 3-12 ``key: value`` lines (keys names / cities / words, values numbers,
    codes or words), then a question about one key; the answer is its value."""
    kind = rng.choice(("first_name", "city", "word"))
    keys: list[str] = []
    while len(keys) < rng.randint(3, 12):
        k = draw(rng, kind, held_out)
        if k not in keys:
            keys.append(k)
    vk = rng.choice(("number", "symbol", "colour"))
    vals = [str(rng.randint(0, 9999)) if vk == "number" else draw(rng, vk, held_out) for _ in keys]
    i = rng.randrange(len(keys))
    table = "\n".join(f"{k}: {v}" for k, v in zip(keys, vals))
    q = rng.choice(("What is the value for {k}?", "Which value does {k} have?", "Look up {k}."))
    request: dict = {"messages": [{"role": "user", "content": f"{table}\n{q.format(k=keys[i])}"}]}
    set_effort(request, effort)
    r = reasoning(
        [f"The line for {keys[i]} reads {keys[i]}: {vals[i]}.", f"So the value is {vals[i]}."],
        effort,
    )
    return Item(
        "lookup",
        request,
        with_reasoning({"role": "assistant", "content": vals[i]}, r),
        {"content": vals[i]},
    )


TASKS: dict[str, Callable[..., Item]] = {
    "tools": gen_tool_call,
    "tools_two": gen_tool_two,
    "tool_result": gen_tool_result,
    "tools_none": gen_tool_none,
    "json": gen_json,
    "recall": gen_recall,
    "out_of_scope": gen_out_of_scope,
    "copy": gen_copy,
    "lookup": gen_lookup,
}

__all__ = [
    "Item",
    "Call",
    "TOOLS",
    "TASKS",
    "TOOL_REASONING",
    "OOS_ANSWER",
    "reasoning",
    "gen_tool_call",
    "gen_tool_two",
    "gen_tool_result",
    "gen_tool_none",
    "gen_json",
    "gen_recall",
    "gen_out_of_scope",
    "gen_copy",
    "gen_lookup",
]
