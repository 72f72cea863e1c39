"""Offline SFT data for the shipped default model (issue 8 item 2), rendered through the K3 chat
format with assistant-only loss (:func:`openk3.train.data.chat_document`).

The mixture (:func:`sft_items`) draws, per example, a task and a thinking effort:

* ``problems``: multi-step arithmetic and word problems written here (the ``reasoning-gym``
  package is on PyPI, but pulls a dozen extra dependencies for generators this small; ours are
  seeded and offline). The think channel holds the steps, its length follows ``thinking_effort``
  (low: the final step, medium: the last half, high: every step, max: problem, steps and check);
* ``tools`` / ``tools_none`` / ``json``: :mod:`openk3.train.sft_tasks`;
* ``chat``: greetings and exact-echo turns ("Say 'OK' and nothing else." -> ``OK``);
* ``effort``: "what is your thinking effort?" answered with the effort of the request;
* ``partial``: an answer whose opening is given as a partial assistant message (eval / serving
  continue it; training sees the whole answer);
* ``multi_turn``: two problem turns, the first one's reasoning kept in history;
* ``copy`` (share 0 in :data:`MIXTURE`; used by the vision stage's text rows): repeat a random
  sequence exactly (:func:`openk3.train.sft_tasks.gen_copy`), the copying curriculum for tool
  arguments.

Train / held-out split: every item's key (its user text) is hashed; held-out items are those with
``hash % 10 == 0``, training items the rest, so no held-out prompt is ever trained on whatever
the seeds. Eval sets additionally use other seeds (:data:`EVAL_SEED_OFFSET`).
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from collections.abc import Callable

from openk3.train.sft_tasks import Item, _effort, gen_copy, gen_json, gen_tool_call, gen_tool_none, reasoning

EFFORTS = ("low", "medium", "high", "max")
EVAL_SEED_OFFSET = 1_000_003
# Shares of the training mixture (sum 1). ``copy`` is last with share 0: a zero weight at the end
# leaves random.choices' draws unchanged, so the shipped text SFT data stays bit-identical.
MIXTURE = {"problems": 0.34, "tools": 0.2, "tools_none": 0.04, "json": 0.14, "chat": 0.08, "effort": 0.06,
           "partial": 0.06, "multi_turn": 0.08, "copy": 0.0}
EVAL_SUITES = ("problems", "tools", "json", "effort")


# ---------------------------------------------------------------------------------- problems
def _arith(rng: random.Random) -> tuple[str, list[str], int]:
    """A chain of 2-4 operations: (question, step lines, answer)."""
    n = rng.randint(2, 4)
    v = rng.randint(2, 60)
    expr, steps = str(v), []
    for _ in range(n):
        op = rng.choice("+-*") if v < 200 else rng.choice("+-")
        b = rng.randint(2, 9) if op == "*" else rng.randint(2, 50)
        nv = v + b if op == "+" else v - b if op == "-" else v * b
        steps.append(f"{v} {op} {b} = {nv}")
        expr = f"({expr} {op} {b})" if op == "*" and len(steps) > 1 else f"{expr} {op} {b}"
        v = nv
    return f"Compute {expr}.", steps, v


def _word(rng: random.Random) -> tuple[str, list[str], int]:
    """Someone has items, gets / gives some: (question, step lines, answer)."""
    who = rng.choice(("Ana", "Ben", "Chloe", "Dev", "Eva", "Femi", "Gus", "Ines"))
    thing = rng.choice(("apples", "books", "coins", "stickers", "marbles", "pencils"))
    v = rng.randint(3, 40)
    text, steps = f"{who} has {v} {thing}.", []
    for _ in range(rng.randint(2, 3)):
        if rng.random() < 0.5:
            b = rng.randint(1, 20)
            text += f" {who} gets {b} more."
            steps.append(f"{v} + {b} = {v + b}")
            v += b
        else:
            b = rng.randint(1, max(1, v - 1))
            text += f" {who} gives away {b}."
            steps.append(f"{v} - {b} = {v - b}")
            v -= b
    return f"{text} How many {thing} does {who} have now?", steps, v


def _count(rng: random.Random) -> tuple[str, list[str], int]:
    """Count a letter in a word, spelling it out."""
    word = rng.choice(("banana", "strawberry", "mississippi", "parallel", "committee", "bookkeeper", "assessment",
                       "letter", "balloon", "coffee", "success", "tomorrow"))
    letter = rng.choice(sorted(set(word)))
    hits = [f"{i + 1}:{c}" for i, c in enumerate(word) if c == letter]
    return (f"How many times does the letter '{letter}' appear in '{word}'?",
            [f"Spell it: {' '.join(word)}", f"Positions of '{letter}': {', '.join(hits)}"], len(hits))


def gen_problem(rng: random.Random, effort: str | None) -> Item:
    """A step-by-step problem; the reasoning lists the steps (length by effort), the answer ends
    with ``The answer is N.``"""
    question, steps, answer = rng.choice((_arith, _arith, _word, _count))(rng)
    request = {"messages": [{"role": "user", "content": question}]}
    _effort(request, effort)
    ref = {"role": "assistant", "content": f"The answer is {answer}."}
    if effort is not None:
        # low: the final step only; medium: the last half of the steps; high: every step; max:
        # the restated problem, every step and a check (steps >= 2, so lengths strictly grow).
        chosen = {"low": steps[-1:], "medium": steps[-max(1, len(steps) // 2):], "high": steps,
                  "max": [f"Problem: {question}", *steps, f"Check: the result is {answer}."]}[effort]
        ref["reasoning_content"] = "\n".join(chosen)
    return Item("problems", request, ref, {"answer": answer})


# ----------------------------------------------------------------------------------- chat
_GREETINGS = (("Hi!", "Hello! How can I help you today?"), ("Hello", "Hello! How can I help you today?"),
              ("Good morning!", "Good morning! How can I help?"), ("Thanks!", "You're welcome!"),
              ("Who are you?", "I am openk3-tiny, a small Kimi K3 model trained by openk3."),
              ("Bye", "Goodbye!"))
_ECHO = ("OK", "yes", "no", "done", "hello", "42", "ready", "blue")
_ECHO_FORMS = ("Say '{w}' and nothing else.", "Reply with just '{w}'.", "Answer only: {w}",
               "Respond with the single word '{w}'.")


def gen_chat(rng: random.Random, effort: str | None) -> Item:
    """A greeting or an exact-echo instruction."""
    if rng.random() < 0.5:
        user, answer = rng.choice(_GREETINGS)
        lines = ["A short social turn; answer briefly."]
    else:
        # The served model's acceptance check is exactly "Say 'OK' and nothing else.": weight it.
        w = "OK" if rng.random() < 0.4 else rng.choice(_ECHO)
        form = _ECHO_FORMS[0] if rng.random() < 0.5 else rng.choice(_ECHO_FORMS)
        user, answer = form.format(w=w), w
        lines = [f"The user wants exactly '{w}' and nothing else.", "No punctuation or extra words."]
    request = {"messages": [{"role": "user", "content": user}]}
    _effort(request, effort)
    ref = {"role": "assistant", "content": answer}
    r = reasoning(lines, effort)
    if r is not None:
        ref["reasoning_content"] = r
    return Item("chat", request, ref, {"content": answer})


_EFFORT_Q = ("What is your current thinking effort?", "Which thinking effort are you using?",
             "Tell me your thinking effort setting.", "How much are you set to think: low, medium, high or max?",
             "What thinking effort were you invoked with?", "State your thinking effort.")
_LEAD = ("", "Quick question. ", "Hi! ", "Before we start: ", "Hello there. ", "One thing: ", "Just curious. ",
         "Please tell me. ", "Out of interest, ", "Hey, ", "Simple check. ", "Thanks for helping. ",
         "Good day! ", "I wonder. ", "For my notes: ", "OK, ")


def gen_effort(rng: random.Random, effort: str | None) -> Item:
    """Report the request's ``thinking_effort`` (as rendered in the effort system message)."""
    effort = effort or rng.choice(EFFORTS)
    q = rng.choice(_LEAD) + rng.choice(_EFFORT_Q)
    request = {"messages": [{"role": "user", "content": q}], "reasoning_effort": effort}
    ref = {"role": "assistant", "content": f"My current thinking effort is {effort}.",
           "reasoning_content": reasoning([f"The system says thinking_effort={effort}.", "I report it."], effort)}
    return Item("effort", request, ref, {"effort": effort})


def gen_partial(rng: random.Random, effort: str | None) -> Item:
    """A partial-mode continuation: the assistant's answer starts with a given prefix."""
    base = gen_problem(rng, None)
    answer = base.expected["answer"]
    prefix = rng.choice(("The answer", "The answer is"))
    request = dict(base.request, messages=base.request["messages"]
                   + [{"role": "assistant", "content": prefix, "partial": True}])
    ref = {"role": "assistant", "content": f"The answer is {answer}."[len(prefix):]}
    return Item("partial", request, ref, {"answer": answer, "prefix": prefix})


def gen_multi_turn(rng: random.Random, effort: str | None) -> Item:
    """Two problem turns; the first assistant turn (with its reasoning) stays in the history."""
    first, second = gen_problem(rng, effort), gen_problem(rng, effort)
    msgs = first.request["messages"] + [first.reference] + second.request["messages"]
    return Item("multi_turn", dict(second.request, messages=msgs), second.reference, second.expected)


GENERATORS: dict[str, Callable[[random.Random, str | None], Item]] = {
    "problems": gen_problem, "tools": gen_tool_call, "tools_none": gen_tool_none, "json": gen_json,
    "chat": gen_chat, "effort": gen_effort, "partial": gen_partial, "multi_turn": gen_multi_turn,
    "copy": gen_copy,
}


# ---------------------------------------------------------------------------------- mixtures
def item_key(item: Item) -> str:
    """The text identifying an item for the train / held-out split: all user and system text (and
    the effort, for the effort suite, whose answer depends on it)."""
    key = json.dumps([m.get("content") for m in item.request["messages"] if m.get("role") in ("user", "system")])
    return key + item.request["reasoning_effort"] if item.suite == "effort" else key


def is_held_out(item: Item) -> bool:
    """True for the held-out tenth (by a hash of :func:`item_key`) of the eval suites' items; items
    of other suites (chat, partial, ...) are never held out (the exact "Say 'OK' and nothing else."
    turn must be trained on)."""
    if item.suite not in EVAL_SUITES:
        return False
    return int(hashlib.sha256(item_key(item).encode()).hexdigest()[:8], 16) % 10 == 0


def _draw(rng: random.Random, suite: str, thinking_off: float) -> Item:
    effort = None if rng.random() < thinking_off and suite != "effort" else rng.choice(EFFORTS)
    return GENERATORS[suite](rng, effort)


def normalise_mixture(shares: dict, name: str = "mixture", *, base: dict | None = None) -> dict[str, float]:
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


def sft_items(seed: int, n: int, *, thinking_off: float = 0.1, mixture: dict | None = None) -> list[Item]:
    """``n`` training items of the mixture (:data:`MIXTURE`), held-out keys excluded.

    Args:
        seed: the data seed (the recipe states it). n: number of items (>= 1).
        thinking_off: share of items with thinking disabled (instant mode).
        mixture: task -> weight used instead of :data:`MIXTURE` (None = MIXTURE); weights are
            relative (``random.choices``), e.g. the output of :func:`normalise_mixture`.
    Raises:
        ValueError: ``n`` < 1, ``thinking_off`` outside [0, 1], or a bad ``mixture`` (unknown
            task, negative / non-finite weight, all 0).
    """
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n={n!r}: must be a positive integer")
    if not 0.0 <= thinking_off <= 1.0:
        raise ValueError(f"thinking_off={thinking_off!r}: must lie in [0, 1]")
    if mixture is None:
        mixture = MIXTURE
    else:
        normalise_mixture(mixture, "mixture", base={k: 0.0 for k in MIXTURE})  # validation only
    rng = random.Random(seed)
    # The weights go to random.choices as given (not renormalised): MIXTURE keeps today's draws.
    suites, weights = list(mixture), list(mixture.values())
    out: list[Item] = []
    while len(out) < n:
        item = _draw(rng, rng.choices(suites, weights)[0], thinking_off)
        if not is_held_out(item):
            out.append(item)
    return out


def sft_conversations(seed: int, n: int, *, mixture: dict | None = None, **kw) -> list[dict]:
    """The training conversations of :func:`sft_items` (request dicts for ``render_training``);
    ``mixture`` as there (None = :data:`MIXTURE`)."""
    return [it.conversation() for it in sft_items(seed, n, mixture=mixture, **kw)]


def eval_items(suite: str, seed: int, n: int) -> list[Item]:
    """``n`` held-out items of ``suite`` (one of :data:`EVAL_SUITES`), from seed
    ``seed + EVAL_SEED_OFFSET``; efforts cycle low, medium, high, max (problems / effort) so each
    effort gets a quarter; tools always declared with ``tool_choice`` as drawn.

    Raises:
        ValueError: unknown ``suite`` or ``n`` < 1.
    """
    if suite not in EVAL_SUITES:
        raise ValueError(f"suite={suite!r}: must be one of {', '.join(EVAL_SUITES)}")
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n={n!r}: must be a positive integer")
    rng = random.Random(seed + EVAL_SEED_OFFSET + EVAL_SUITES.index(suite))
    out: list[Item] = []
    seen: set[str] = set()
    tries = 0
    while len(out) < n:
        tries += 1
        if tries > 200 * n:
            raise ValueError(f"suite={suite!r}: could not draw {n} distinct held-out items")
        item = GENERATORS[suite](rng, EFFORTS[len(out) % len(EFFORTS)])
        key = item_key(item)
        if is_held_out(item) and key not in seen:
            seen.add(key)
            out.append(item)
    return out


__all__ = ["EFFORTS", "MIXTURE", "normalise_mixture", "EVAL_SUITES", "EVAL_SEED_OFFSET", "GENERATORS", "Item",
           "gen_problem", "gen_chat", "gen_effort", "gen_partial", "gen_multi_turn", "item_key", "is_held_out",
           "sft_items", "sft_conversations", "eval_items"]
