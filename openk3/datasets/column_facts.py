"""Column-fact drill documents: the one-digit facts that column arithmetic looks up, each drawn
uniformly over the facts rather than over problems.

A worked problem (:func:`openk3.datasets.sft_data.work`) is a chain of column lines such as
``tens: 7 + 5 + 1 = 13, write 3, carry 1``; every digit of a line but its result is copied from
the problem or the line before, and the result is a *fact* (a function of two or three digits)
that the model has to have memorised. In the default model's pretraining and SFT together each of
the ~1,100 distinct column facts is seen only some 20 times, and the SFT model copies every
operand digit right but writes one frequent result for most facts (``9 + 0 = 1``, ``8 * 8 = 12``).
These documents give each fact many exposures at the token cost of one line.

A document is 24-64 lines, each either

* a *fact line* (4 in 5): the tens line of a problem built so that the tens column holds the
  drawn fact (3 in 4; else the ones line of a problem with uniform ones digits), the line written by :func:`~openk3.datasets.sft_data.work` itself (so
  the drill's surface form is the SFT reasoning's, byte for byte). The facts:

  - ``+``: digits ``x, y`` and a carry-in 0 or 1, as a middle column (``write s % 10, carry``)
    or the top column (``write s``);
  - ``-``: digits ``x, y`` and a borrow-in 0 or 1, with or without a borrow out;
  - ``*``: a digit ``x`` times ``d`` in 2-9 plus every carry-in ``0 .. d - 1`` the ones column
    can produce, as a middle or the top column;

* a *worked problem* (1 in 5): ``Problem: a op b``, its column lines and ``so a op b = v``, the
  operands of the SFT problems (:func:`~openk3.datasets.sft_data.operands`), never a held-out
  eval problem (:func:`~openk3.datasets.sft_data.is_held_out_key`), so the facts are also seen
  in their place in the chain.

Every token is a next-token target (pretraining documents). Deterministic in ``(seed, index)``.
"""

from __future__ import annotations

import random

from openk3.datasets.sft_data import OPS, is_held_out_key, operands, work


def _carry_digits(d: int, carry: int, rng: random.Random) -> int:
    """A ones digit ``o`` with ``o * d // 10 == carry`` (one exists for every carry < d)."""
    choices = [o for o in range(10) if o * d // 10 == carry]
    return rng.choice(choices)


def fact_problem(rng: random.Random) -> tuple[int, str, int]:
    """Operands ``(a, op, b)`` whose tens column is a uniformly drawn column fact (module
    docstring); the fact is ``work(a, op, b)[0][1]``."""
    op = rng.choice(OPS)
    top = rng.random() < 0.5  # the tens column is the top one (two-digit operands)
    head = 0 if top else 100 * rng.randint(1, 9)
    x = rng.randint(0, 9)
    if op == "+":
        y = rng.randint(0, 9)
        ones = (9, 1) if rng.random() < 0.5 else (rng.randint(0, 4), rng.randint(0, 4))
        if top and x == 0 and y == 0:
            x = rng.randint(1, 9)  # "0 + 0" as a top column would be a one-digit problem
        return head + 10 * x + ones[0], op, 10 * y + ones[1]
    if op == "-":
        y = rng.randint(0, 9)
        borrow = rng.random() < 0.5
        ones = (0, rng.randint(1, 9)) if borrow else (rng.randint(5, 9), rng.randint(0, 4))
        a = 100 * rng.randint(1, 9) + 10 * x + ones[0]  # a > b always: the tens line is a fact
        return a, op, 10 * y + ones[1]
    d = rng.randint(2, 9)
    carry = rng.randint(0, d - 1)
    if top and x == 0:
        x = rng.randint(1, 9)
    return head + 10 * x + _carry_digits(d, carry, rng), op, d


def fact_line(rng: random.Random) -> str:
    """One column fact in the SFT reasoning's words (``tens: 6 * 7 = 42, 42 + 3 = 45, write 5,
    carry 4``): a tens fact (:func:`fact_problem`) 3 times in 4, else the ones column (no
    carry-in) of a problem with uniform ones digits."""
    if rng.random() < 0.75:
        a, op, b = fact_problem(rng)
        return work(a, op, b)[0][1]
    op = rng.choice(OPS)
    if op == "*":
        a, b = 10 * rng.randint(1, 9) + rng.randint(0, 9), rng.randint(2, 9)
    else:  # a > b: a subtraction's first line is then its ones column, not the negation
        a, b = (
            10 * rng.randint(5, 9) + rng.randint(0, 9),
            10 * rng.randint(1, 4) + rng.randint(0, 9),
        )
    return work(a, op, b)[0][0]


def worked_problem(rng: random.Random) -> str:
    """``Problem: a op b``, its column lines and ``so a op b = v`` (never a held-out problem)."""
    while True:
        op = rng.choice(OPS)
        a, b = operands(rng, op, wide=rng.random() < 0.2)
        if not is_held_out_key(f"{a} {op} {b}"):
            break
    lines, value = work(a, op, b)
    return "\n".join([f"Problem: {a} {op} {b}", *lines, f"so {a} {op} {b} = {value}"])


def column_facts_text(seed: int, index: int) -> str:
    """Drill document ``index`` of seed ``seed``: 24-64 lines, fact lines and worked problems
    (module docstring)."""
    rng = random.Random(seed * 1_000_003 + index)
    parts = [
        worked_problem(rng) if rng.random() < 0.2 else fact_line(rng)
        for _ in range(rng.randint(24, 64))
    ]
    return "\n".join(parts)


def column_facts_store(seed: int, n: int, tokenizer):
    """A :class:`~openk3.train.data.DocumentStore` of ``n`` drill documents (BOS, text, EOS;
    every next token a target)."""
    from openk3.train.data import DocumentStore, text_document

    return DocumentStore.from_documents(
        text_document(column_facts_text(seed, i), tokenizer) for i in range(n)
    )


__all__ = ["fact_problem", "fact_line", "worked_problem", "column_facts_text", "column_facts_store"]
