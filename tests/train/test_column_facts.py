"""Column-fact drill documents: every line's arithmetic is right, every one-digit fact is drawn,
no held-out eval problem appears, and documents are deterministic."""

from __future__ import annotations

import random
import re

from openk3.datasets.column_facts import column_facts_text, fact_line, worked_problem
from openk3.datasets.sft_data import is_held_out_key, work

_ADD = re.compile(r"^(ones|tens): (\d) \+ (\d)(?: \+ (1))? = (\d+), write (\d+)(?:, carry (1))?$")
_SUB = re.compile(r"^(ones|tens): (\d) - (?:(1) - )?(\d)(?: = (\d)| needs a borrow, (\d+) - (\d) = (\d))$")
_MUL = re.compile(r"^(ones|tens): (\d) \* (\d) = (\d+)(?:, (\d+) \+ (\d) = (\d+))?, write (\d+)(?:, carry (\d))?$")


def _check(line: str) -> tuple[str, tuple[int, ...]]:
    """The fact a line states, after checking its arithmetic (AssertionError if wrong)."""
    if m := _ADD.match(line):
        x, y, c = int(m[2]), int(m[3]), int(m[4] or 0)
        s = x + y + c
        assert int(m[5]) == s
        assert (int(m[6]), int(m[7] or 0)) in ((s % 10, s // 10), (s, 0)), line  # middle or top column
        return "+", (x, y, c)
    if m := _SUB.match(line):
        x, b, y = int(m[2]), int(m[3] or 0), int(m[4])
        if m[5] is not None:
            assert x - b >= y and int(m[5]) == x - b - y, line
        else:
            assert x - b < y and int(m[6]) == x - b + 10 and int(m[7]) == y and int(m[8]) == x - b + 10 - y, line
        return "-", (x, y, b)
    if m := _MUL.match(line):
        x, d, p = int(m[2]), int(m[3]), int(m[4])
        assert p == x * d, line
        s = p
        c = 0
        if m[5] is not None:
            c = int(m[6])
            s = p + c
            assert int(m[5]) == p and int(m[7]) == s, line
        assert (int(m[8]), int(m[9] or 0)) in ((s % 10, s // 10), (s, 0)), line
        return "*", (x, d, c)
    raise AssertionError(f"not a column line: {line!r}")


def test_every_fact_line_is_right_and_every_fact_is_drawn():
    rng = random.Random(0)
    seen = {"+": set(), "-": set(), "*": set()}
    for _ in range(30000):
        op, fact = _check(fact_line(rng))
        seen[op].add(fact)
    assert len(seen["+"]) == 200  # x + y with carry-in 0 and 1
    assert len(seen["-"]) == 200  # x - y with borrow-in 0 and 1
    # x * d (d 2-9) plus every carry-in the ones column of a * d can produce (0 .. d - 1)
    assert seen["*"] == {(x, d, c) for x in range(10) for d in range(2, 10) for c in range(d)}


def test_worked_problems_match_work_and_are_never_held_out():
    rng = random.Random(3)
    for _ in range(3000):
        lines = worked_problem(rng).split("\n")
        a, op, b = lines[0].removeprefix("Problem: ").split(" ")
        assert not is_held_out_key(f"{a} {op} {b}")
        cols, value = work(int(a), op, int(b))
        assert lines[1:] == [*cols, f"so {a} {op} {b} = {value}"]


def test_documents_are_deterministic_and_line_counts_bounded():
    doc = column_facts_text(5, 17)
    assert doc == column_facts_text(5, 17) and doc != column_facts_text(5, 18)
    parts = 0
    inside = False
    for line in doc.split("\n"):
        if line.startswith("Problem: "):
            inside = True
            parts += 1
        elif line.startswith("so "):
            inside = False
        elif not inside:  # a drill line between problems
            _check(line)
            parts += 1
    assert not inside and 24 <= parts <= 64
