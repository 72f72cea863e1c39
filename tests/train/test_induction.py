"""Induction pretraining documents: deterministic, copy targets really repeat, no eval problem."""

from __future__ import annotations

import re

import pytest

from openk3.datasets.induction import KINDS, induction_store, induction_text
from openk3.datasets.sft_data import eval_items, is_held_out_key


def test_documents_are_deterministic_and_their_copies_repeat():
    assert induction_text(0, 5) == induction_text(0, 5) and induction_text(0, 5) != induction_text(1, 5)
    for i in range(40):
        rep = induction_text(3, i, "repeat").split("\n")
        assert len(rep) in (2, 3) and len(set(rep)) == 1
        lk = induction_text(3, i, "lookup").split("\n")
        cut = lk.index("Lookup:")
        assert sorted(lk[:cut]) == sorted(lk[cut + 1:])  # every key queried once, with its value
        echo = induction_text(3, i, "echo").split("\n")
        assert all(re.fullmatch(r"Say '(.+)'\. -> \1", line) for line in echo)
    with pytest.raises(ValueError, match="kind"):
        induction_text(0, 0, "poem")


def test_column_documents_never_hold_an_eval_problem():
    held = {it.expected["key"] for it in eval_items("arithmetic", 0, 300)}
    seen = set()
    for i in range(400):
        for m in re.finditer(r"Problem: (\d+ [-+*] \d+)", induction_text(7, i, "columns")):
            seen.add(m.group(1))
    assert len(seen) > 500 and not seen & held and not any(is_held_out_key(k) for k in seen)
    assert set(KINDS) == {"repeat", "lookup", "columns", "echo"}


def test_store_targets_every_token():
    from openk3.recipes import synthetic_document
    from openk3.train.tokenizer_train import train_tokenizer

    tok = train_tokenizer([synthetic_document(0, i) for i in range(30)], 600, split_digits=True)
    store = induction_store(0, 10, tok)
    assert len(store) == 10 and (store.labels != -100).sum() >= store.num_tokens - 10


def test_span_documents_are_two_equal_random_spans_of_ordinary_ids():
    from openk3.datasets.induction import span_ids, span_store
    from openk3.recipes import synthetic_document
    from openk3.train.tokenizer_train import train_tokenizer

    assert span_ids(0, 3, 8000) == span_ids(0, 3, 8000) != span_ids(1, 3, 8000)
    lengths = set()
    for i in range(200):
        ids = span_ids(5, i, 700, (4, 10))
        half = len(ids) // 2
        assert ids[:half] == ids[half:] and all(256 <= t < 700 for t in ids)
        lengths.add(half)
    assert lengths == set(range(4, 11))
    with pytest.raises(ValueError, match=r"lengths=\(5, 4\)"):
        span_ids(0, 0, 8000, (5, 4))
    with pytest.raises(ValueError, match="ordinary=200"):
        span_ids(0, 0, 200)
    narrow = [t for i in range(100) for t in span_ids(5, i, 8000, (4, 10), ids=8)]
    assert set(narrow) == set(range(256, 264))  # the first 8 ordinary ids, each drawn
    assert set(t for i in range(50) for t in span_ids(5, i, 260, (4, 10), ids=8)) == set(range(256, 260))
    with pytest.raises(ValueError, match="ids=1"):
        span_ids(0, 0, 8000, ids=1)
    tok = train_tokenizer([synthetic_document(0, i) for i in range(30)], 600, split_digits=True)
    store = span_store(2, 20, tok, (3, 3))
    first = store.ids[store.offsets[0]:store.offsets[1]].tolist()
    assert len(store) == 20 and first[0] == tok.bos_id and first[-1] == tok.eos_id and first[1:4] == first[4:7]
    assert max(store.ids[store.ids < min(tok.special_ids)]) < min(tok.special_ids)
    assert not set(store.ids.tolist()) & (tok.special_ids - {tok.bos_id, tok.eos_id})
