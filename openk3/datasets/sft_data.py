"""The default model's SFT mixture and held-out eval sets (synthetic, seeded, offline).

Every item is a chat-completions request plus the reference assistant message, rendered for
training by :func:`openk3.chat_format.render_training` (assistant-only loss). The mixture
(:func:`sft_items`) draws, per example, a task and a thinking effort:

* ``problems``: integer arithmetic worked digit by digit (column addition with the carry written
  out, column subtraction with borrows, a multi-digit number times a one-digit number), two-step
  chains, word problems and letter counts. The think channel holds the steps and its length follows
  ``thinking_effort`` (low: the result line; medium: the first column and the result; high: every
  column and the result; max: the restated problem, every column, the result). The tokenizer splits
  numbers into single digits (``openk3 train-tokenizer --split-digits``), so each column is a
  one-digit fact the model can look up;
* ``tools`` / ``tools_two`` / ``tool_result`` / ``tools_none`` / ``json`` / ``recall`` /
  ``out_of_scope`` / ``copy`` / ``lookup``: :mod:`openk3.datasets.sft_tasks`;
* ``chat``: greetings and exact echoes ("Say 'X' and nothing else." -> ``X``, X from the pools);
* ``effort``: "what is your thinking effort?" answered with the effort of the request;
* ``partial``: an answer whose opening is given as a partial assistant message;
* ``multi_turn``: two problem turns, the first one's reasoning kept in history.

Train / held-out split, twice: (1) values: names, cities, words, ... of the eval sets come from
the held-out part of each pool (:mod:`openk3.datasets.pools`), training draws the rest; (2) prompts:
every item's key (its user text, or for arithmetic the canonical expression, so another phrasing
of a held-out sum is held out too) is hashed; held-out items are those with ``hash % 10 == 0``,
training items the rest. Eval sets also use other seeds (:data:`EVAL_SEED_OFFSET`).
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from collections.abc import Callable

from openk3.datasets.pools import draw
from openk3.datasets.sft_tasks import (
    TASKS,
    TOOL_REASONING,
    Item,
    reasoning,
    set_effort,
    with_reasoning,
)

EFFORTS = ("low", "medium", "high", "max")
EVAL_SEED_OFFSET = 1_000_003
# Shares of the training mixture (sum 1).
MIXTURE = {
    "problems": 0.24,
    "tools": 0.15,
    "tools_two": 0.04,
    "tool_result": 0.07,
    "tools_none": 0.02,
    "json": 0.08,
    "recall": 0.08,
    "out_of_scope": 0.03,
    "chat": 0.06,
    "effort": 0.04,
    "partial": 0.02,
    "multi_turn": 0.03,
    "copy": 0.08,
    "lookup": 0.06,
}
# Held-out suites (openk3 eval). ``arithmetic``: two-operand problems at effort max, operations
# cycling + - *; ``reasoning``: the same problems with efforts cycling (reasoning length per effort).
EVAL_SUITES = (
    "arithmetic",
    "reasoning",
    "tools",
    "tools_two",
    "tool_result",
    "json",
    "recall",
    "effort",
    "echo",
    "out_of_scope",
)
OPS = ("+", "-", "*")
_POS = ("ones", "tens", "hundreds", "thousands", "ten-thousands")


# ---------------------------------------------------------------------------------- columns
def _digits(n: int) -> list[int]:
    """Digits of ``n >= 0``, ones first."""
    return [int(c) for c in reversed(str(n))]


def column_add(a: int, b: int) -> list[str]:
    """Column addition of ``a, b >= 0``: one line per position, the carry written out, the top
    position writing its whole sum (``tens: 9 + 8 + 1 = 18, write 18``)."""
    da = _digits(a)
    db = _digits(b)
    n = max(len(da), len(db))
    lines = []
    carry = 0
    for i in range(n):
        x = da[i] if i < len(da) else 0
        y = db[i] if i < len(db) else 0
        s = x + y + carry
        expr = f"{x} + {y}" + (f" + {carry}" if carry else "")
        if i == n - 1:
            lines.append(f"{_POS[i]}: {expr} = {s}, write {s}")
        else:
            lines.append(
                f"{_POS[i]}: {expr} = {s}, write {s % 10}"
                + (f", carry {s // 10}" if s >= 10 else "")
            )
        carry = s // 10
    return lines


def column_sub(a: int, b: int) -> list[str]:
    """Column subtraction of ``a >= b >= 0`` with borrows written out."""
    da = _digits(a)
    db = _digits(b)
    lines = []
    borrow = 0
    for i in range(len(da)):
        x = da[i]
        y = db[i] if i < len(db) else 0
        head = f"{x} - {borrow} - {y}" if borrow else f"{x} - {y}"
        if x - borrow >= y:
            lines.append(f"{_POS[i]}: {head} = {x - borrow - y}")
            borrow = 0
        else:
            lines.append(
                f"{_POS[i]}: {head} needs a borrow, {x - borrow + 10} - {y} = {x - borrow + 10 - y}"
            )
            borrow = 1
    return lines


def column_mul(a: int, d: int) -> list[str]:
    """Column multiplication of ``a >= 0`` by a digit ``d``: each digit times ``d`` plus the carry,
    the top position writing its whole product."""
    da = _digits(a)
    lines = []
    carry = 0
    for i, x in enumerate(da):
        p = x * d
        s = p + carry
        expr = f"{x} * {d} = {p}" + (f", {p} + {carry} = {s}" if carry else "")
        if i == len(da) - 1:
            lines.append(f"{_POS[i]}: {expr}, write {s}")
        else:
            lines.append(
                f"{_POS[i]}: {expr}, write {s % 10}" + (f", carry {s // 10}" if s >= 10 else "")
            )
        carry = s // 10
    return lines


def work(a: int, op: str, b: int) -> tuple[list[str], int]:
    """The column lines and value of ``a op b`` (``*``: one operand must be a single digit)."""
    if op == "+":
        return column_add(a, b), a + b
    if op == "-":
        if a >= b:
            return column_sub(a, b), a - b
        return [
            f"{a} is less than {b}, so I compute {b} - {a} and negate it",
            *column_sub(b, a),
        ], a - b
    if op == "*":
        big, d = (a, b) if b < 10 else (b, a)
        if d >= 10:
            raise ValueError(f"{a} * {b}: one operand must be a single digit")
        return column_mul(big, d), a * b
    raise ValueError(f"op={op!r}: must be one of {OPS}")


def effort_reasoning(
    problem: str, columns: list[str], result: str, effort: str | None
) -> str | None:
    """Think text by effort: low ``result``; medium first column + result; high every column +
    result; max ``Problem: ...`` + every column + result. None when thinking is off."""
    if effort is None:
        return None
    chosen = {
        "low": [result],
        "medium": columns[:1] + [result],
        "high": columns + [result],
        "max": [f"Problem: {problem}", *columns, result],
    }[effort]
    return "\n".join(chosen)


# ---------------------------------------------------------------------------------- problems
_FORMS = {
    "+": (
        "Compute {a} + {b}.",
        "What is {a} + {b}?",
        "What is {a} plus {b}?",
        "{a} + {b} = ?",
        "Add {a} and {b}.",
        "Calculate {a} + {b}.",
        "How much is {a} + {b}?",
    ),
    "-": (
        "Compute {a} - {b}.",
        "What is {a} - {b}?",
        "What is {a} minus {b}?",
        "{a} - {b} = ?",
        "Subtract {b} from {a}.",
        "Calculate {a} - {b}.",
        "How much is {a} - {b}?",
    ),
    "*": (
        "Compute {a} * {b}.",
        "What is {a} * {b}?",
        "What is {a} times {b}?",
        "{a} * {b} = ?",
        "Multiply {a} by {b}.",
        "Calculate {a} * {b}.",
        "What is {a} x {b}?",
    ),
}


def operands(rng: random.Random, op: str, *, wide: bool = False) -> tuple[int, int]:
    """Operands of a two-operand problem: + / -: 0-99 each (0-999 when ``wide``); *: a 2-digit
    number (3-digit when ``wide``) and a digit 2-9, in either order."""
    if op in "+-":
        hi = 999 if wide else 99
        return rng.randint(0, hi), rng.randint(0, hi)
    big = rng.randint(10, 999 if wide else 99)
    d = rng.randint(2, 9)
    return (big, d) if rng.random() < 0.5 else (d, big)


def gen_arith(
    rng: random.Random,
    effort: str | None,
    held_out: bool = False,
    *,
    op: str | None = None,
    wide: bool | None = None,
) -> Item:
    """A two-operand problem (``op`` drawn if None; ``wide`` 3-digit operands a fifth of the time
    in training, never in eval) worked in columns; the answer ends ``The answer is N.``;
    ``expected`` = ``{"answer", "op", "key"}`` (key: the canonical expression)."""
    op = op or rng.choice(OPS)
    if wide is None:
        wide = not held_out and rng.random() < 0.2
    a, b = operands(rng, op, wide=wide)
    columns, value = work(a, op, b)
    expr = f"{a} {op} {b}"
    request = {"messages": [{"role": "user", "content": rng.choice(_FORMS[op]).format(a=a, b=b)}]}
    set_effort(request, effort)
    ref = with_reasoning(
        {"role": "assistant", "content": f"The answer is {value}."},
        effort_reasoning(expr, columns, f"so {expr} = {value}", effort),
    )
    return Item("problems", request, ref, {"answer": value, "op": op, "key": expr})


def _word(rng: random.Random, effort: str | None, held_out: bool) -> Item:
    """Someone has items, gets / gives some (one or two steps), worked in columns."""
    who = draw(rng, "first_name", held_out)
    thing = rng.choice(
        ("apples", "books", "coins", "stickers", "marbles", "pencils", "stamps", "cards")
    )
    v = rng.randint(3, 99)
    text = f"{who} has {v} {thing}."
    cols = []
    steps = []
    for _ in range(rng.randint(1, 2)):
        if v == 0 or rng.random() < 0.5:
            b = rng.randint(1, 99)
            text += f" {who} gets {b} more."
            c, nv = work(v, "+", b)
            steps.append(f"{v} + {b} = {nv}")
        else:
            b = rng.randint(1, v)
            text += f" {who} gives away {b}."
            c, nv = work(v, "-", b)
            steps.append(f"{v} - {b} = {nv}")
        cols += c + [f"so {steps[-1]}"]
        v = nv
    question = f"{text} How many {thing} does {who} have now?"
    request = {"messages": [{"role": "user", "content": question}]}
    set_effort(request, effort)
    r = None
    if effort is not None:
        r = {
            "low": steps[-1],
            "medium": "\n".join(steps),
            "high": "\n".join(cols),
            "max": "\n".join([f"Problem: {question}", *cols]),
        }[effort]
    return Item(
        "problems",
        request,
        with_reasoning({"role": "assistant", "content": f"The answer is {v}."}, r),
        {"answer": v},
    )


def _chain(rng: random.Random, effort: str | None, held_out: bool) -> Item:
    """``a op b op c`` left to right, each step worked in columns."""
    a = rng.randint(0, 99)
    expr = str(a)
    v = a
    cols = []
    steps = []
    for _ in range(2):
        op = rng.choice("+-*") if v < 1000 else rng.choice("+-")
        b = rng.randint(2, 9) if op == "*" else rng.randint(0, min(99, v) if op == "-" else 99)
        c, nv = work(v, op, b)
        steps.append(f"{v} {op} {b} = {nv}")
        cols += c + [f"so {steps[-1]}"]
        expr = f"({expr}) {op} {b}" if op == "*" else f"{expr} {op} {b}"
        v = nv
    request = {"messages": [{"role": "user", "content": f"Compute {expr}."}]}
    set_effort(request, effort)
    r = None
    if effort is not None:
        r = {
            "low": steps[-1],
            "medium": "\n".join(steps),
            "high": "\n".join(cols),
            "max": "\n".join([f"Problem: {expr}", *cols]),
        }[effort]
    return Item(
        "problems",
        request,
        with_reasoning({"role": "assistant", "content": f"The answer is {v}."}, r),
        {"answer": v},
    )


def _count(rng: random.Random, effort: str | None, held_out: bool) -> Item:
    """Count a letter in a word, spelling it out."""
    word = draw(rng, "word", held_out)
    letter = rng.choice(sorted(set(word)))
    hits = [f"{i + 1}:{c}" for i, c in enumerate(word) if c == letter]
    request = {
        "messages": [
            {
                "role": "user",
                "content": f"How many times does the letter '{letter}' appear in '{word}'?",
            }
        ]
    }
    set_effort(request, effort)
    r = reasoning(
        [
            f"Spell it: {' '.join(word)}",
            f"Positions of '{letter}': {', '.join(hits)}",
            f"That is {len(hits)}.",
        ],
        effort,
    )
    return Item(
        "problems",
        request,
        with_reasoning({"role": "assistant", "content": f"The answer is {len(hits)}."}, r),
        {"answer": len(hits)},
    )


def gen_problem(rng: random.Random, effort: str | None, held_out: bool = False) -> Item:
    """A training problem: two-operand arithmetic (70 %), a word problem (15 %), a two-step chain
    (10 %) or a letter count (5 %)."""
    u = rng.random()
    if u < 0.70:
        return gen_arith(rng, effort, held_out)
    if u < 0.85:
        return _word(rng, effort, held_out)
    if u < 0.95:
        return _chain(rng, effort, held_out)
    return _count(rng, effort, held_out)


# ----------------------------------------------------------------------------------- chat
_GREETINGS = (
    ("Hi!", "Hello! How can I help you today?"),
    ("Hello", "Hello! How can I help you today?"),
    ("Good morning!", "Good morning! How can I help?"),
    ("Thanks!", "You're welcome!"),
    ("Who are you?", "I am openk3-tiny, a small Kimi K3 model trained by openk3."),
    ("Bye", "Goodbye!"),
)
_ECHO_FORMS = (
    "Say '{w}' and nothing else.",
    "Reply with just '{w}'.",
    "Answer only: {w}",
    "Respond with the single word '{w}'.",
    "Say '{w}'.",
    "Output '{w}' and nothing more.",
)


def echo_word(rng: random.Random, held_out: bool) -> str:
    """What an echo request asks for: ``OK`` a tenth of the time in training, else a word, name,
    city, number or a colour + word pair from the pools."""
    if not held_out and rng.random() < 0.1:
        return "OK"
    u = rng.random()
    if u < 0.3:
        return draw(rng, "word", held_out)
    if u < 0.5:
        return draw(rng, "first_name", held_out)
    if u < 0.65:
        return draw(rng, "city", held_out)
    if u < 0.85:
        return str(rng.randint(0, 99999))
    return f"{draw(rng, 'colour', held_out)} {draw(rng, 'word', held_out)}"


def gen_echo(rng: random.Random, effort: str | None, held_out: bool = False) -> Item:
    """An exact echo: "Say 'X' and nothing else." -> ``X`` (the ``echo`` suite; held-out X)."""
    w = echo_word(rng, held_out)
    form = _ECHO_FORMS[0] if rng.random() < 0.5 else rng.choice(_ECHO_FORMS)
    request = {"messages": [{"role": "user", "content": form.format(w=w)}]}
    set_effort(request, effort)
    r = reasoning(
        [f"The user wants exactly '{w}' and nothing else.", "No punctuation or extra words."],
        effort,
    )
    return Item(
        "echo", request, with_reasoning({"role": "assistant", "content": w}, r), {"content": w}
    )


def gen_chat(rng: random.Random, effort: str | None, held_out: bool = False) -> Item:
    """A greeting (half) or an exact echo (half)."""
    if rng.random() < 0.5:
        it = gen_echo(rng, effort, held_out)
        return Item("chat", it.request, it.reference, it.expected)
    user, answer = rng.choice(_GREETINGS)
    request = {"messages": [{"role": "user", "content": user}]}
    set_effort(request, effort)
    r = reasoning(["A short social turn; answer briefly."], effort)
    return Item(
        "chat",
        request,
        with_reasoning({"role": "assistant", "content": answer}, r),
        {"content": answer},
    )


_EFFORT_Q = (
    "What is your current thinking effort?",
    "Which thinking effort are you using?",
    "Tell me your thinking effort setting.",
    "How much are you set to think: low, medium, high or max?",
    "What thinking effort were you invoked with?",
    "State your thinking effort.",
    "What is your reasoning effort right now?",
    "Which effort level is set?",
)
_LEAD = (
    "",
    "Quick question. ",
    "Hi! ",
    "Before we start: ",
    "Hello there. ",
    "One thing: ",
    "Just curious. ",
    "Please tell me. ",
    "Out of interest, ",
    "Hey, ",
    "Simple check. ",
    "Thanks for helping. ",
    "Good day! ",
    "I wonder. ",
    "For my notes: ",
    "OK, ",
    "Hi, I'm {n}. ",
    "This is {n} from {c}. ",
    "{n} here. ",
    "Greetings from {c}! ",
)


def gen_effort(rng: random.Random, effort: str | None, held_out: bool = False) -> Item:
    """Report the request's ``thinking_effort`` (as rendered in the effort system message)."""
    effort = effort or rng.choice(EFFORTS)
    lead = rng.choice(_LEAD).format(
        n=draw(rng, "first_name", held_out), c=draw(rng, "city", held_out)
    )
    request = {
        "messages": [{"role": "user", "content": lead + rng.choice(_EFFORT_Q)}],
        "reasoning_effort": effort,
    }
    r = reasoning([f"The system says thinking_effort={effort}.", "I report it."], effort)
    return Item(
        "effort",
        request,
        with_reasoning(
            {"role": "assistant", "content": f"My current thinking effort is {effort}."}, r
        ),
        {"effort": effort},
    )


def gen_partial(rng: random.Random, effort: str | None, held_out: bool = False) -> Item:
    """A partial-mode continuation: the assistant's answer starts with a given prefix."""
    base = gen_arith(rng, None, held_out)
    answer = base.expected["answer"]
    prefix = rng.choice(("The answer", "The answer is"))
    request = dict(
        base.request,
        messages=base.request["messages"]
        + [{"role": "assistant", "content": prefix, "partial": True}],
    )
    ref = {"role": "assistant", "content": f"The answer is {answer}."[len(prefix) :]}
    return Item("partial", request, ref, {"answer": answer, "prefix": prefix})


def gen_multi_turn(rng: random.Random, effort: str | None, held_out: bool = False) -> Item:
    """Two problem turns; the first assistant turn (with its reasoning) stays in the history."""
    first = gen_problem(rng, effort, held_out)
    second = gen_problem(rng, effort, held_out)
    msgs = first.request["messages"] + [first.reference] + second.request["messages"]
    return Item(
        "multi_turn", dict(second.request, messages=msgs), second.reference, second.expected
    )


GENERATORS: dict[str, Callable[..., Item]] = {
    "problems": gen_problem,
    "chat": gen_chat,
    "echo": gen_echo,
    "effort": gen_effort,
    "partial": gen_partial,
    "multi_turn": gen_multi_turn,
    **TASKS,
}


# ---------------------------------------------------------------------------------- mixtures
def item_key(item: Item) -> str:
    """The text identifying an item for the train / held-out split: ``expected["key"]`` when the
    generator sets one (arithmetic: the canonical expression), else all user and system text (and
    the effort, for the effort suite, whose answer depends on it)."""
    if "key" in item.expected:
        return str(item.expected["key"])
    key = json.dumps(
        [m.get("content") for m in item.request["messages"] if m.get("role") in ("user", "system")]
    )
    return key + item.request["reasoning_effort"] if item.suite == "effort" else key


def is_held_out_key(key: str) -> bool:
    """True for the held-out tenth of keys (``sha256(key) % 10 == 0``)."""
    return int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) % 10 == 0


def is_held_out(item: Item) -> bool:
    """True for the held-out tenth (by a hash of :func:`item_key`). Greetings are never held out
    (the exact "Say 'OK' and nothing else." turn must be trained on)."""
    if item.suite == "chat" and "content" in item.expected and item.expected["content"] == "OK":
        return False
    return is_held_out_key(item_key(item))


# Suites whose generators take ``tool_reasoning`` (the reasoning style of their call turns).
TOOL_SUITES = ("tools", "tools_two", "tool_result")


def _draw(
    rng: random.Random, suite: str, thinking_off: float, tool_reasoning: str = "restate"
) -> Item:
    effort = None if rng.random() < thinking_off and suite != "effort" else rng.choice(EFFORTS)
    if suite in TOOL_SUITES:
        return GENERATORS[suite](rng, effort, tool_reasoning=tool_reasoning)
    return GENERATORS[suite](rng, effort)


def normalise_mixture(
    shares: dict, name: str = "mixture", *, base: dict | None = None
) -> dict[str, float]:
    """``shares`` (task -> share) merged over ``base`` (default :data:`MIXTURE`) and scaled to sum 1.

    Tasks ``shares`` does not name keep their ``base`` share (set one to 0 to drop it).
    Raises:
        ValueError: ``shares`` not a dict, an unknown task, a share not a finite number >= 0, or
            all shares 0; the message names ``name`` and the key / value.
    """
    base = MIXTURE if base is None else base
    if not isinstance(shares, dict):
        raise ValueError(f"{name}: expected a dict of task -> share, got {shares!r}")
    for k, v in shares.items():
        if k not in MIXTURE:
            raise ValueError(f"{name}: unknown task {k!r} (known: {', '.join(MIXTURE)})")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ValueError(f"{name}[{k!r}]={v!r}: must be a finite number >= 0")
    merged = {**base, **{k: float(v) for k, v in shares.items()}}
    total = sum(merged.values())
    if total <= 0:
        raise ValueError(f"{name}: all shares are 0")
    return {k: v / total for k, v in merged.items()}


def sft_items(
    seed: int,
    n: int,
    *,
    thinking_off: float = 0.1,
    mixture: dict | None = None,
    tool_reasoning: str = "restate",
) -> list[Item]:
    """``n`` training items of the mixture (:data:`MIXTURE`), held-out keys excluded.

    Args:
        seed: the data seed (the recipe states it). n: number of items (>= 1).
        thinking_off: share of items with thinking disabled (instant mode).
        mixture: task -> weight used instead of :data:`MIXTURE` (None = MIXTURE); weights are
            relative (``random.choices``), e.g. the output of :func:`normalise_mixture`.
        tool_reasoning: the reasoning style of the tool-call turns of :data:`TOOL_SUITES`
            (:data:`~openk3.datasets.sft_tasks.TOOL_REASONING`; ``"restate"``: the shipped
            model's data). Only their reasoning text changes: the same seed draws the same
            requests, calls and held-out exclusions in every style.
    Raises:
        ValueError: ``n`` < 1, ``thinking_off`` outside [0, 1], an unknown ``tool_reasoning``,
            or a bad ``mixture`` (unknown task, negative / non-finite weight, all 0).
    """
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n={n!r}: must be a positive integer")
    if not 0.0 <= thinking_off <= 1.0:
        raise ValueError(f"thinking_off={thinking_off!r}: must lie in [0, 1]")
    if tool_reasoning not in TOOL_REASONING:
        raise ValueError(
            f"tool_reasoning={tool_reasoning!r}: must be one of {', '.join(TOOL_REASONING)}"
        )
    if mixture is None:
        mixture = MIXTURE
    else:
        normalise_mixture(mixture, "mixture", base={k: 0.0 for k in MIXTURE})  # validation only
    rng = random.Random(seed)
    suites = list(mixture)
    weights = list(mixture.values())
    out: list[Item] = []
    while len(out) < n:
        item = _draw(rng, rng.choices(suites, weights)[0], thinking_off, tool_reasoning)
        if not is_held_out(item):
            out.append(item)
    return out


def sft_conversations(seed: int, n: int, *, mixture: dict | None = None, **kw) -> list[dict]:
    """The training conversations of :func:`sft_items` (request dicts for ``render_training``);
    ``mixture`` as there (None = :data:`MIXTURE`)."""
    return [it.conversation() for it in sft_items(seed, n, mixture=mixture, **kw)]


def _eval_gen(suite: str) -> Callable[[random.Random, str, int], Item]:
    if suite == "arithmetic":
        return lambda rng, effort, i: gen_arith(rng, "max", True, op=OPS[i % 3], wide=False)
    if suite == "tools":  # one call per request (two-call requests are the tools_two suite)
        return lambda rng, effort, i: GENERATORS["tools"](rng, effort, True, n_calls=1)
    gen = GENERATORS[suite]
    return lambda rng, effort, i: gen(rng, effort, True)


def _parse_key(key: str) -> tuple[int, str, int]:
    a, op, b = key.split(" ")
    return int(a), op, int(b)


def eval_items(suite: str, seed: int, n: int) -> list[Item]:
    """``n`` held-out items of ``suite`` (one of :data:`EVAL_SUITES`) from seed
    ``seed + EVAL_SEED_OFFSET``, values from the held-out pools. ``arithmetic``: effort max,
    operations cycling + - * (so n = 300 gives 100 of each); ``reasoning``: ceil(n / 4) held-out
    problems, each asked at low, medium, high and max (the first n of those); every other suite:
    efforts cycling low, medium, high, max.

    Raises:
        ValueError: unknown ``suite`` or ``n`` < 1.
    """
    if suite not in EVAL_SUITES:
        raise ValueError(f"suite={suite!r}: must be one of {', '.join(EVAL_SUITES)}")
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n={n!r}: must be a positive integer")
    if suite == "reasoning":  # the same problems at every effort: lengths compare like with like
        out = []
        for p in eval_items("arithmetic", seed + 1, -(-n // len(EFFORTS))):
            columns, value = work(*_parse_key(p.expected["key"]))
            for e in EFFORTS:
                request = {"messages": p.request["messages"], "reasoning_effort": e}
                r = effort_reasoning(
                    p.expected["key"], columns, f"so {p.expected['key']} = {value}", e
                )
                out.append(
                    Item(
                        "problems", request, with_reasoning(dict(p.reference), r), dict(p.expected)
                    )
                )
        return out[:n]
    rng = random.Random(seed + EVAL_SEED_OFFSET + EVAL_SUITES.index(suite))
    gen = _eval_gen(suite)
    out: list[Item] = []
    seen: set[str] = set()
    tries = 0
    while len(out) < n:
        tries += 1
        if tries > 200 * n:
            raise ValueError(f"suite={suite!r}: could not draw {n} distinct held-out items")
        item = gen(rng, EFFORTS[len(out) % len(EFFORTS)], len(out))
        key = item_key(item)
        if is_held_out(item) and key not in seen:
            seen.add(key)
            out.append(item)
    return out


__all__ = [
    "EFFORTS",
    "MIXTURE",
    "OPS",
    "normalise_mixture",
    "EVAL_SUITES",
    "EVAL_SEED_OFFSET",
    "TOOL_SUITES",
    "GENERATORS",
    "Item",
    "column_add",
    "column_sub",
    "column_mul",
    "work",
    "effort_reasoning",
    "operands",
    "gen_arith",
    "gen_problem",
    "gen_chat",
    "gen_echo",
    "echo_word",
    "gen_effort",
    "gen_partial",
    "gen_multi_turn",
    "item_key",
    "is_held_out",
    "is_held_out_key",
    "sft_items",
    "sft_conversations",
    "eval_items",
]
