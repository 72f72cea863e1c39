"""``default-model`` SFT knobs: ``extra.sft_mixture`` (task shares) and ``extra.sft_replay``
(corpus rows interleaved by :class:`openk3.train.mixed_data.MixedLoader`)."""

from __future__ import annotations

import json
import random
from collections import Counter

import numpy as np
import pytest
import torch

from openk3.recipes import default_model
from openk3.train.data import DocumentStore, PackedLoader, document_from_ids
from openk3.train.mixed_data import MixedLoader
from openk3.recipes import get_recipe
from openk3.datasets.sft_data import MIXTURE, _draw, is_held_out, normalise_mixture, sft_conversations, sft_items
from openk3.train.tokenizer_train import train_tokenizer

CORPUS_ID0 = 50_000  # corpus tokens live at >= this id; SFT tokens and pad ids (< 8192) below


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(["Hello world, the quick brown fox."] * 4, 512)


def _corpus_loader(run):
    rng = np.random.default_rng(7)
    docs = [document_from_ids(CORPUS_ID0 + rng.integers(0, 100, size=int(n))) for n in rng.integers(5, 90, size=30)]
    return PackedLoader(DocumentStore.from_documents(docs), run.seq_len, run.batch_size, seed=run.seed)


@pytest.fixture
def recipe(monkeypatch, tok):
    """``extra`` -> the default-model run with a byte-level tokenizer and a synthetic corpus."""
    monkeypatch.setattr(default_model, "_tokenizer", lambda run: tok)
    monkeypatch.setattr(default_model, "corpus_data", lambda run, split: _corpus_loader(run))
    return lambda **extra: get_recipe("default-model", seq_len=256, extra={"sft_items": 24, "sft_facts_share": 0.0, **extra})


def _take(source, n):
    return [source.next_batch() for _ in range(n)]


def _same(a, b):
    keys = ("input_ids", "labels", "cu_seqlens")
    return all(torch.equal(x[k], y[k]) for x, y in zip(a, b, strict=True) for k in keys)


def _old_sft_items(seed, n, thinking_off=0.1):
    """Independent reference of the pre-knob draw: ``random.choices`` over MIXTURE as declared."""
    rng, out = random.Random(seed), []
    while len(out) < n:
        item = _draw(rng, rng.choices(list(MIXTURE), list(MIXTURE.values()))[0], thinking_off)
        if not is_held_out(item):
            out.append(item)
    return out


def test_default_mixture_draws_exactly_the_old_items():
    assert [it.conversation() for it in _old_sft_items(1, 60)] == sft_conversations(1, 60)


def test_mixture_override_sets_the_shares():
    mix = normalise_mixture({**{k: 0 for k in MIXTURE}, "tools": 3.0, "tools_none": 1.0})
    assert mix["tools"] == pytest.approx(0.75) and mix["tools_none"] == pytest.approx(0.25)
    counts = Counter(it.suite for it in sft_items(3, 400, mixture=mix))
    assert set(counts) <= {"tools", "tools_none"}
    assert abs(counts["tools"] / 400 - 0.75) < 0.08
    # Merge semantics: unnamed tasks keep their MIXTURE share, then everything is rescaled.
    half = normalise_mixture({"chat": 0})
    assert half["chat"] == 0 and sum(half.values()) == pytest.approx(1.0)
    assert half["tools"] == pytest.approx(MIXTURE["tools"] / (sum(MIXTURE.values()) - MIXTURE["chat"]))


@pytest.mark.parametrize("bad, match", [({"toolz": 1}, "toolz"), ({"tools": -0.1}, "'tools'.*-0.1"),
                                        ({"tools": "x"}, "'tools'"), ({k: 0 for k in MIXTURE}, "all shares"),
                                        ([0.5], "dict")])
def test_bad_mixture_is_rejected_naming_the_key(recipe, bad, match):
    with pytest.raises(ValueError, match=f"extra.sft_mixture.*{match}"):
        default_model.settings(recipe(sft_mixture=bad))


@pytest.mark.parametrize("bad", [1.0, -0.1, "0.2", True])
def test_bad_replay_is_rejected(recipe, bad):
    with pytest.raises(ValueError, match="extra.sft_replay"):
        default_model.settings(recipe(sft_replay=bad))


def test_mixture_reaches_the_sft_train_data(recipe, tok):
    run = recipe(sft_mixture={"chat": 1.0})
    mix = default_model.settings(run).mixture
    expected = DocumentStore.from_conversations(sft_conversations(1, 24, mixture=mix), tok)
    assert default_model.sft_data(run, "train").store.fingerprint == expected.fingerprint
    plain_eval = default_model.sft_data(recipe(), "eval").store.fingerprint
    assert default_model.sft_data(run, "eval").store.fingerprint == plain_eval


def test_replay_zero_gives_exactly_the_old_batches(recipe, tok):
    run = recipe(sft_replay=0.0)
    src = default_model.sft_data(run, "train")
    assert isinstance(src, PackedLoader)
    store = DocumentStore.from_conversations([it.conversation() for it in _old_sft_items(1, 24)], tok)
    old = PackedLoader(store, 256, 1, seed=0, shuffle=True, split_documents=False,
                       pad_id=run.model_config().pad_token_id)
    assert _same(_take(src, 30), _take(old, 30))


def test_replay_quarter_mixes_corpus_rows_deterministically(recipe):
    run = recipe(sft_replay=0.25)
    a, b = default_model.sft_data(run, "train"), default_model.sft_data(run, "train")
    assert isinstance(a, MixedLoader)
    batches = _take(a, 400)
    assert _same(batches, _take(b, 400))
    is_corpus = [bool(x["input_ids"].min() >= CORPUS_ID0) for x in batches]
    sft_rows = [x for x, c in zip(batches, is_corpus) if not c]
    assert all(int(x["input_ids"].max()) < CORPUS_ID0 for x in sft_rows)  # rows are never mixed inside
    assert abs(sum(is_corpus) / 400 - 0.25) < 0.06 and a.served_secondary == sum(is_corpus)
    # Each source's rows are its own stream, in order: the SFT rows equal a plain SFT loader's.
    assert _same(sft_rows, _take(default_model.sft_data(recipe(), "train"), len(sft_rows)))
    assert _same([x for x, c in zip(batches, is_corpus) if c], _take(_corpus_loader(run), sum(is_corpus)))


def test_resume_from_state_dict_continues_identically(recipe):
    run = recipe(sft_replay=0.25)
    a = default_model.sft_data(run, "train")
    _take(a, 37)
    state = json.loads(json.dumps(a.state_dict()))
    tail = _take(a, 50)
    b = default_model.sft_data(run, "train")
    b.load_state_dict(state)
    assert _same(_take(b, 50), tail)
    other = default_model.sft_data(recipe(sft_replay=0.5), "train")
    with pytest.raises(ValueError, match="state.fraction"):
        other.load_state_dict(state)


def test_mixed_loader_rejects_a_bad_fraction():
    with pytest.raises(ValueError, match="fraction"):
        MixedLoader(None, None, 1.0)


def test_curriculum_loader_serves_first_then_the_rest_and_resumes():
    from openk3.train.mixed_data import CurriculumLoader

    def make():
        a = PackedLoader(DocumentStore.from_documents([document_from_ids([1] * 40)]), 16, 1)
        b = PackedLoader(DocumentStore.from_documents([document_from_ids([2] * 40)]), 16, 1)
        return CurriculumLoader(a, b, 3)

    data = make()
    rows = [int(data.next_batch()["input_ids"][0, 0]) for _ in range(6)]
    assert rows == [1, 1, 1, 2, 2, 2]
    data, again = make(), make()
    [data.next_batch() for _ in range(2)]
    again.load_state_dict(json.loads(json.dumps(data.state_dict())))
    assert all(torch.equal(data.next_batch()["input_ids"], again.next_batch()["input_ids"]) for _ in range(4))
    with pytest.raises(ValueError, match="state.steps: saved 3, this loader has 4"):
        CurriculumLoader(data.first, data.then, 4).load_state_dict(data.state_dict())
    with pytest.raises(ValueError, match="steps=-1"):
        CurriculumLoader(data.first, data.then, -1)
