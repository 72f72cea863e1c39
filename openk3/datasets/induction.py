"""Synthetic pretraining documents where copying and lookup are necessary from the first step.

Plain-text documents (next-token loss on every token) built from the value pools of
:mod:`openk3.datasets.pools` (training parts only), four kinds drawn uniformly:

* ``repeat``: a random sequence of 8-40 pool values (words, names, cities, numbers, codes,
  addresses), then the same sequence once or twice more: every token of a repeat is predictable
  only by finding the earlier occurrence (the induction-head pattern);
* ``lookup``: 4-16 ``key = value`` lines, then the keys queried again in random order, each
  followed by its value;
* ``columns``: two-operand problems worked in columns (:func:`openk3.datasets.sft_data.work`), the
  digits of each column copied from the problem line (held-out eval problems excluded);
* ``echo``: ``Say 'X'. -> X`` pairs with fresh values.

Why: a tiny model trained only on chat rows sees a copying target on a few tokens per row (the
assistant's argument values); these documents make half of their tokens copy targets, so the
copying circuit forms early and the chat stage can use it. Deterministic in ``(seed, index)``.
"""

from __future__ import annotations

import random

from openk3.datasets.pools import draw, draw_date
from openk3.datasets.sft_data import OPS, is_held_out_key, operands, work

KINDS = ("repeat", "lookup", "columns", "echo")


def _value(rng: random.Random) -> str:
    u = rng.random()
    if u < 0.2:
        return draw(rng, "word")
    if u < 0.4:
        return str(rng.randint(0, 99999))
    if u < 0.55:
        return draw(rng, "first_name")
    if u < 0.7:
        return draw(rng, "city")
    if u < 0.8:
        return draw(rng, "symbol")
    if u < 0.9:
        return draw_date(rng)
    return draw(rng, "email")


def induction_text(seed: int, index: int, kind: str | None = None) -> str:
    """Document ``index`` of the synthetic induction corpus ``seed`` (``kind`` drawn if None).

    Raises:
        ValueError: an unknown ``kind``.
    """
    rng = random.Random(seed * 1_000_003 + index)
    kind = kind or rng.choice(KINDS)
    if kind == "repeat":
        seq = " ".join(_value(rng) for _ in range(rng.randint(8, 40)))
        return "\n".join([seq] * rng.randint(2, 3))
    if kind == "lookup":
        keys: list[str] = []
        while len(keys) < rng.randint(4, 16):
            k = draw(rng, rng.choice(("first_name", "city", "word")))
            if k not in keys:
                keys.append(k)
        vals = {k: _value(rng) for k in keys}
        lines = [f"{k} = {vals[k]}" for k in keys]
        asked = rng.sample(keys, len(keys))
        return "\n".join(lines + ["Lookup:"] + [f"{k} = {vals[k]}" for k in asked])
    if kind == "columns":
        out = []
        for _ in range(rng.randint(2, 5)):
            op = rng.choice(OPS)
            a, b = operands(rng, op, wide=rng.random() < 0.2)
            while is_held_out_key(f"{a} {op} {b}"):  # never an eval problem
                a, b = operands(rng, op, wide=rng.random() < 0.2)
            lines, value = work(a, op, b)
            out.append("\n".join([f"Problem: {a} {op} {b}", *lines, f"so {a} {op} {b} = {value}"]))
        return "\n\n".join(out)
    if kind == "echo":
        pairs = []
        for _ in range(rng.randint(4, 12)):
            v = _value(rng)
            pairs.append(f"Say '{v}'. -> {v}")
        return "\n".join(pairs)
    raise ValueError(f"kind={kind!r}: must be one of {KINDS}")


def span_ids(
    seed: int, index: int, ordinary: int, lengths: tuple[int, int] = (4, 20), ids: int | None = None
) -> list[int]:
    """Random-span copy document ``index`` of seed ``seed``: a span of ``L`` ids drawn uniformly
    from ``[256, ordinary)`` (the BPE's merged tokens: byte ids excluded, as in the induction
    probe), or from the first ``ids`` of them (``[256, min(ordinary, 256 + ids))``), ``L`` uniform
    in ``lengths`` (inclusive), written twice: ``span + span``.

    Why: in a ``repeat`` document of pool values the second copy is also predictable from the
    values' own statistics (the model learns them: 6.9 -> 3.2 nats without copying); in a random
    span only the first copy predicts the second, so copying is the one way to lower the loss.
    Deterministic in ``(seed, index)``.

    Why ``ids``: over the 7.7K ordinary ids of the shipped BPE the circuit does not form (each id is
    seen too rarely for its embedding to be told apart); over 128 ids it does, and then carries
    over to every id within a few hundred steps (README, "Pretraining evidence").

    Raises:
        ValueError: ``ordinary`` <= 257, ``ids`` < 2, or ``lengths`` not ``1 <= lo <= hi``, naming
            the value.
    """
    lo, hi = lengths
    if not 1 <= lo <= hi:
        raise ValueError(f"lengths={lengths!r}: must be (lo, hi) with 1 <= lo <= hi")
    if ordinary <= 257:
        raise ValueError(f"ordinary={ordinary!r}: must be > 257 (ids 256..ordinary-1 are drawn)")
    if ids is not None and (isinstance(ids, bool) or not isinstance(ids, int) or ids < 2):
        raise ValueError(f"ids={ids!r}: must be an integer >= 2 (None: every ordinary id)")
    top = ordinary if ids is None else min(ordinary, 256 + ids)
    rng = random.Random(seed * 1_000_003 + index)
    span = [rng.randrange(256, top) for _ in range(rng.randint(lo, hi))]
    return span + span


def span_store(
    seed: int, n: int, tokenizer, lengths: tuple[int, int] = (4, 20), ids: int | None = None
):
    """A :class:`~openk3.train.data.DocumentStore` of ``n`` random-span copy documents
    (:func:`span_ids`; ``[BOS] span span [EOS]``, every next token a target) over the tokenizer's
    ordinary ids (``256 .. min(special_ids) - 1``; only the first ``ids`` of them if given)."""
    from openk3.train.data import DocumentStore, document_from_ids

    ordinary = min(tokenizer.special_ids) if tokenizer.special_ids else tokenizer.vocab_size
    head = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
    tail = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
    return DocumentStore.from_documents(
        document_from_ids(head + span_ids(seed, i, ordinary, lengths, ids) + tail) for i in range(n)
    )


def induction_store(seed: int, n: int, tokenizer):
    """A :class:`~openk3.train.data.DocumentStore` of ``n`` documents (BOS, text, EOS; every
    next token a target)."""
    from openk3.train.data import DocumentStore, text_document

    return DocumentStore.from_documents(
        text_document(induction_text(seed, i), tokenizer) for i in range(n)
    )


__all__ = ["KINDS", "induction_text", "induction_store", "span_ids", "span_store"]
