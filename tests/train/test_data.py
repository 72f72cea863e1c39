"""Training data pipeline: packing with document boundaries (issue 6 item 3), aligned labels, SFT
loss masks from the chat renderer, deterministic and resumable shuffling."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import openk3
from openk3.chat_format import render_assistant_output
from openk3.pretrained import build_model
from openk3.train.data import (
    IGNORE_INDEX, DataSource, DocumentStore, PackedLoader, chat_document, document_from_ids, text_document,
)
from openk3.train.tokenizer_train import train_tokenizer
from tests.conftest import assert_close


@pytest.fixture(scope="module")
def tok():
    """A byte-level tokenizer with the K3 special block at 256..511: the k3-test-tiny layout."""
    return train_tokenizer(["Hello world, the quick brown fox."] * 4, 512)


@pytest.fixture(scope="module")
def model():
    m = build_model(openk3.preset("k3-test-tiny"), seed=0)
    return m.eval()


def _range_docs(lengths):
    """Document i holds ids 100*i, 100*i+1, ...: a label's document is label // 100."""
    return [document_from_ids(range(100 * i, 100 * i + n)) for i, n in enumerate(lengths)]


def _token_loss_sum(model, **kw):
    out = model(**kw)
    return out.loss * out.n_tokens, out.n_tokens


# ----------------------------------------------------------------------------- document boundaries
@torch.no_grad()
def test_packed_loss_equals_sum_of_separate_losses(model):
    """Issue 6 acceptance: the loss of packed documents equals the sum of their separate losses
    (token-weighted). Lengths 45 + 40 put the second boundary inside a KDA chunk (64)."""
    g = torch.Generator().manual_seed(0)
    docs = [document_from_ids(torch.randint(0, 256, (n,), generator=g).tolist()) for n in (45, 40)]
    store = DocumentStore.from_documents(docs)
    batch = next(PackedLoader(store, seq_len=85, batch_size=1, shuffle=False, loop=False))
    assert batch.cu_seqlens.tolist() == [0, 45, 85]
    packed, n_packed = _token_loss_sum(model, **batch.packed())
    separate = [_token_loss_sum(model, input_ids=torch.from_numpy(d.ids)[None], labels=torch.from_numpy(d.labels)[None])
                for d in docs]
    assert n_packed == sum(n for _, n in separate) == 44 + 39
    assert_close(packed, sum(s for s, _ in separate), atol=1e-4, rtol=1e-5, what="packed vs separate loss")
    # Without the boundaries the second document sees the first: the check above can fail.
    leaky, _ = _token_loss_sum(model, input_ids=batch.input_ids, labels=batch.labels)
    assert abs(float(leaky) - float(packed)) > 1e-3


@torch.no_grad()
def test_batch_rows_equal_flattened_batch(model):
    """A B-row batch as one packed row == its rows run one by one (row starts are boundaries)."""
    store = DocumentStore.from_documents([document_from_ids(np.arange(n) % 200 + 3) for n in (30, 50, 17, 41)])
    batch = next(PackedLoader(store, seq_len=48, batch_size=2, seed=3))
    assert set(range(0, 96 + 1, 48)) <= set(batch.cu_seqlens.tolist())
    whole, n_whole = _token_loss_sum(model, **batch.packed())
    rows = [_token_loss_sum(model, **batch.row(r)) for r in range(2)]
    assert n_whole == sum(n for _, n in rows) == batch.n_tokens
    assert_close(whole, sum(s for s, _ in rows), atol=1e-4, rtol=1e-5, what="rows vs packed batch")


@pytest.mark.parametrize("split_documents", [True, False])
def test_no_label_crosses_a_document_boundary(split_documents):
    lengths = [5, 23, 9, 64, 1, 17, 40, 3, 12]
    store = DocumentStore.from_documents(_range_docs(lengths))
    loader = PackedLoader(store, seq_len=16, batch_size=3, seed=7, split_documents=split_documents, pad_id=99)
    seen_epochs = set()
    for _ in range(12):
        b = next(loader)
        ids, lab = b.input_ids.reshape(-1), b.labels.reshape(-1)
        cu = b.cu_seqlens.tolist()
        assert cu[0] == 0 and cu[-1] == ids.numel() and all(x < y for x, y in zip(cu, cu[1:]))
        for a, z in zip(cu, cu[1:]):
            seg, seg_lab = ids[a:z], lab[a:z]
            if (seg_lab == IGNORE_INDEX).all() and (seg == 99).all():
                continue  # padding segment
            doc = int(seg[0]) // 100
            assert ((seg // 100) == doc).all(), f"segment {a}:{z} mixes documents"
            assert (seg[1:] - seg[:-1] == 1).all(), "segment is not a contiguous piece of its document"
            end = 100 * doc + lengths[doc]
            for x, y in zip(seg.tolist(), seg_lab.tolist()):
                # the target is the next token of the same document, or nothing at its end
                assert y == (x + 1 if x + 1 < end else IGNORE_INDEX)
        seen_epochs.add(loader.epoch)
    assert len(seen_epochs) > 1  # the test crossed an epoch boundary


@pytest.mark.parametrize("split_documents", [True, False])
def test_one_pass_serves_every_token_once(split_documents):
    lengths = [5, 23, 9, 64, 1, 17]
    store = DocumentStore.from_documents(_range_docs(lengths))
    got = []
    for b in PackedLoader(store, seq_len=16, batch_size=2, seed=1, loop=False,
                          split_documents=split_documents, pad_id=99):
        got += [int(x) for x in b.input_ids.reshape(-1) if x != 99]
    assert sorted(got) == sorted(100 * i + j for i, n in enumerate(lengths) for j in range(n))


def test_whole_document_mode_never_splits_a_fitting_document():
    lengths = [10, 10, 7, 16, 3]
    store = DocumentStore.from_documents(_range_docs(lengths))
    for b in PackedLoader(store, seq_len=16, batch_size=1, seed=2, split_documents=False, loop=False, pad_id=99):
        ids = b.input_ids.reshape(-1)
        cu = b.cu_seqlens.tolist()
        for a, z in zip(cu, cu[1:]):
            if ids[a] != 99:
                doc = int(ids[a]) // 100
                assert z - a == lengths[doc] and int(ids[a]) == 100 * doc  # whole, from its start


# ----------------------------------------------------------------------------- shuffling / resume
def _take(loader, n):
    return [next(loader) for _ in range(n)]


def _same(a, b):
    return all(torch.equal(x.input_ids, y.input_ids) and torch.equal(x.labels, y.labels)
               and torch.equal(x.cu_seqlens, y.cu_seqlens) for x, y in zip(a, b)) and len(a) == len(b)


@pytest.mark.parametrize("split_documents", [True, False])
def test_resume_equals_uninterrupted(split_documents):
    store = DocumentStore.from_documents(_range_docs([7, 30, 2, 19, 11, 25, 4, 9]))
    kw = dict(seq_len=12, batch_size=2, seed=11, split_documents=split_documents)
    straight = _take(PackedLoader(store, **kw), 14)
    first = PackedLoader(store, **kw)
    head = _take(first, 5)
    state = json.loads(json.dumps(first.state_dict()))  # must survive a JSON checkpoint
    resumed = PackedLoader(store, **kw)
    resumed.load_state_dict(state)
    tail = _take(resumed, 9)
    assert _same(head + tail, straight)
    assert resumed.state_dict()["epoch"] >= 1 and resumed.batches == 14


def test_next_batch_is_the_packed_row():
    """The trainer protocol: ``next_batch()`` == ``next(loader).packed()`` and it advances the state."""
    store = DocumentStore.from_documents(_range_docs([7, 30, 2, 19]))
    a, b = PackedLoader(store, 12, 2, seed=4), PackedLoader(store, 12, 2, seed=4)
    for _ in range(3):
        x, y = a.next_batch(), next(b).packed()
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
        assert x["input_ids"].shape == (1, 24)
    assert a.state_dict() == b.state_dict()
    one_pass = PackedLoader(store, 64, 1, loop=False)
    one_pass.next_batch()
    with pytest.raises(StopIteration):
        one_pass.next_batch()


def test_the_trainer_sources_are_data_sources():
    """Every loader the recipes hand the trainer has the :class:`DataSource` methods; an object
    without ``load_state_dict`` (it could not resume) does not."""
    from openk3.recipes import get_recipe
    from openk3.train.mixed_data import CurriculumLoader, MixedLoader

    store = DocumentStore.from_documents(_range_docs([7, 30, 2, 19]))
    a, b = PackedLoader(store, 12, 1, seed=1), PackedLoader(store, 12, 1, seed=2)
    run = get_recipe("smoke")
    for source in (a, MixedLoader(a, b, 0.5), CurriculumLoader(a, b, 2), run.data(run, "train")):
        assert isinstance(source, DataSource), type(source).__name__

    class NoResume:
        def next_batch(self):
            return {}

        def state_dict(self):
            return {}

    assert not isinstance(NoResume(), DataSource)


def test_shuffle_is_seeded_and_varies_by_epoch():
    store = DocumentStore.from_documents(_range_docs([3] * 20))
    a, b, c = (PackedLoader(store, 8, 1, seed=s) for s in (5, 5, 6))
    assert np.array_equal(a.order(0), b.order(0)) and not np.array_equal(a.order(0), c.order(0))
    assert not np.array_equal(a.order(0), a.order(1))
    assert sorted(a.order(3).tolist()) == list(range(20))
    assert np.array_equal(PackedLoader(store, 8, 1, shuffle=False).order(4), np.arange(20))


def test_state_rejects_another_configuration():
    store = DocumentStore.from_documents(_range_docs([7, 30, 2]))
    state = PackedLoader(store, 12, 2, seed=1).state_dict()
    with pytest.raises(ValueError, match=r"state\.config\.seed"):
        PackedLoader(store, 12, 2, seed=2).load_state_dict(state)
    other = DocumentStore.from_documents(_range_docs([7, 30, 3]))
    with pytest.raises(ValueError, match=r"state\.config\.store"):
        PackedLoader(other, 12, 2, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="seq_len"):
        PackedLoader(store, 1, 2)


# ----------------------------------------------------------------------------- documents
def test_text_document_targets(tok):
    d = text_document("Hello world", tok)
    assert d.ids.tolist() == tok.encode_text("Hello world") + [tok.eos_id]
    assert d.labels.tolist() == d.ids.tolist()[1:] + [IGNORE_INDEX]
    with pytest.raises(ValueError, match="loss_mask"):
        document_from_ids([1, 2, 3], [1, 1])


def test_sft_loss_mask_covers_only_assistant_output(tok):
    convo = {"messages": [
        {"role": "system", "content": "SYSTEM-TEXT"},
        {"role": "user", "content": "USER-TEXT one"},
        {"role": "assistant", "reasoning_content": "THINK-A", "content": "ANSWER-A",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "x"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "TOOL-RESULT"},
        {"role": "assistant", "reasoning_content": "THINK-B", "content": "ANSWER-B"},
    ], "tools": [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]}
    doc = chat_document(convo, tok)
    assistants = [m for m in convo["messages"] if m["role"] == "assistant"]
    # Positions whose target is kept, shifted by one, are the generated tokens: group them in runs.
    targets = [t + 1 for t in np.flatnonzero(doc.labels != IGNORE_INDEX)]
    runs, cur = [], []
    for j in targets:
        if cur and j != cur[-1] + 1:
            runs.append(cur)
            cur = []
        cur.append(j)
    runs.append(cur)
    assert [[int(doc.ids[j]) for j in run] for run in runs] == [render_assistant_output(m, tok) for m in assistants]
    assert all(doc.labels[j - 1] == doc.ids[j] for j in targets)
    text = tok.decode(doc.ids[targets].tolist())
    for hidden in ("SYSTEM-TEXT", "USER-TEXT", "TOOL-RESULT", "JSONSchema", "thinking_effort"):
        assert hidden not in text
    for shown in ("THINK-A", "ANSWER-A", "THINK-B", "ANSWER-B", "<|end_of_msg|>"):
        assert shown in text
    last = chat_document(convo, tok, train_on="last")
    assert tok.decode(last.labels[last.labels != IGNORE_INDEX].tolist()).count("ANSWER") == 1


def test_store_round_trip(tmp_path, tok):
    store = DocumentStore.from_texts(["first text", "", "second, longer text"], tok)
    assert len(store) == 2 and store.num_tokens == len(tok.encode_text("first text")) + len(
        tok.encode_text("second, longer text")) + 2
    store.save(tmp_path / "s", meta={"tokenizer": "t"})
    again = DocumentStore.load(tmp_path / "s")
    assert again.fingerprint == store.fingerprint
    assert np.array_equal(again[1].ids, store[1].ids) and np.array_equal(again[1].labels, store[1].labels)
    ids = np.load(tmp_path / "s" / "ids.npy")
    ids[0] += 1
    np.save(tmp_path / "s" / "ids.npy", ids)
    with pytest.raises(ValueError, match="fingerprint"):
        DocumentStore.load(tmp_path / "s")
