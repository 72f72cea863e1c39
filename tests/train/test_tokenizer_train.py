"""Tokenizer training (issue 6 item 4): a byte-level BPE with the K3 special block, saved in the
format `load_tokenizer` reads, splitting text exactly like the Kimi pre-tokenizer."""

from __future__ import annotations

import json

import pytest
import tiktoken
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import openk3
from openk3.chat_format import encode_request, render_template, template_variables
from openk3.tokenizer import K3_SPECIAL_TOKENS, KIMI_PAT_STR, load_tokenizer
from openk3.train.tokenizer_train import (
    K3_SPECIAL_SLOT_OFFSETS, kimi_pre_tokenizer, special_slot_names, train_tokenizer, training_inputs,
)
from tests.conftest import shared_path

HYP = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
PARAGRAPHS = [
    "The database keeps every table in a single file. A transaction either commits completely or not at all.",
    "Use the function to open a connection, then call execute() with the statement and its parameters.",
    "In 2024 the project shipped version 3.14.159 with 2,718 changes; see the release notes for details.",
    "Don't forget: they're parsing the user's input, and it'll fail if the quote isn't closed.",
    "Graphs are made of nodes and edges. A directed graph stores, for each node, its successors.",
    "Les élèves naïfs ont mangé une crème brûlée au café. 你好，世界！ Ein Straßenbahn-Fahrplan.",
]
CORPUS = [f"{p} Section {i}: {PARAGRAPHS[(i * 7) % len(PARAGRAPHS)].lower()}" for i in range(300)
          for p in PARAGRAPHS[i % 3:i % 3 + 2]]
MARKUP = ["<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>", "[EOS]", "[BOS]", "<|media_pad|>", "[PAD]",
          "<|reserved_token_300|>", "<osagent_mode>", "<|kimi_image_placeholder|>"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    d = tmp_path_factory.mktemp("bpe")
    tok = train_tokenizer(CORPUS, 1024, d)
    return tok, d


def test_special_block_layout(trained):
    """Kimi's layout at a small size: BPE ids first, then the 256 special slots at Kimi's offsets."""
    tok, d = trained
    n_ranks = tok.vocab_size - 256
    assert tok.vocab_size == 1024  # the corpus has enough pairs for every requested merge
    for name, off in K3_SPECIAL_SLOT_OFFSETS.items():
        assert tok.special_id(name) == n_ranks + off
    assert set(K3_SPECIAL_TOKENS) <= set(tok.special_tokens)
    assert tok.special_id(f"<|reserved_token_{n_ranks + 8}|>") == n_ranks + 8
    assert tok.special_ids == frozenset(range(n_ranks, n_ranks + 256))
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.unk_id) == (n_ranks, n_ranks + 1, n_ranks + 255, n_ranks + 254)
    assert tok.stop_token_ids == (n_ranks + 2, n_ranks + 1)
    info = json.loads((d / "tokenizer_training.json").read_text())
    assert info["bpe_tokens"] == n_ranks and info["training_bytes"] == sum(len(t.encode()) for t in CORPUS)


def test_layout_matches_the_tiny_preset():
    """vocab 512 (bytes only) gives exactly the special ids the k3-test-tiny config names."""
    cfg = openk3.preset("k3-test-tiny")
    tok = train_tokenizer(["abc"], cfg.vocab_size)
    assert tok.vocab_size == cfg.vocab_size
    assert (tok.bos_id, tok.end_of_msg_id, tok.pad_id, tok.media_pad_id) == (
        cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id, cfg.media_placeholder_token_id)
    assert special_slot_names(256)[8] == "<|reserved_token_264|>"


def test_slot_offsets_equal_kimi_ids():
    kimi = load_tokenizer(shared_path("kimi-tokenizer"))
    base = kimi.vocab_size - 256
    assert {s: kimi.special_id(s) - base for s in K3_SPECIAL_SLOT_OFFSETS} == K3_SPECIAL_SLOT_OFFSETS


@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=80)
       | st.sampled_from(MARKUP).map(lambda s: f"x{s}y "))
@HYP
def test_round_trip_and_no_special_ids_from_text(trained, text):
    tok, _ = trained
    ids = tok.encode_text(text)
    assert tok.decode(ids) == text
    assert not set(ids) & tok.special_ids


def test_merges_compress_text(trained):
    tok, _ = trained
    text = " ".join(PARAGRAPHS[:5])
    assert len(tok.encode_text(text)) < len(text.encode()) / 3  # trained merges, not bytes


def test_markup_is_single_ids_and_loads_back(trained, tmp_path):
    tok, d = trained
    again = load_tokenizer(d)
    assert again.vocab_size == tok.vocab_size and again.special_tokens == tok.special_tokens
    assert again.encode_text(CORPUS[5]) == tok.encode_text(CORPUS[5])
    req = {"messages": [{"role": "user", "content": "Spell <|open|> and [EOS] for me"}], "reasoning_effort": "low"}
    p = encode_request(req, again)
    assert again.decode(p.token_ids) == p.text
    # Every markup token of the prompt is one special id; the user's spelled ones stay text.
    n_markup = sum(p.text.count(m) for m in ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"))
    assert sum(i in again.special_ids for i in p.token_ids) == n_markup - 1
    # The saved chat template renders the same prompt text.
    source = (d / "chat_template.jinja").read_text(encoding="utf-8")
    assert render_template(template_variables(req), source=source) == p.text
    # Hugging Face tooling reading tokenizer.json also sees markup as single ids.
    from tokenizers import Tokenizer as HFTokenizer

    hf = HFTokenizer.from_file(str(d / "tokenizer.json"))
    assert hf.encode("<|open|>message<|sep|>", add_special_tokens=False).ids[0] == again.open_id
    assert hf.decode(again.encode_text(CORPUS[7])) == CORPUS[7]


def test_training_is_deterministic(tmp_path):
    a = train_tokenizer(CORPUS[:200], 700, tmp_path / "a")
    b = train_tokenizer(CORPUS[:200], 700, tmp_path / "b")
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "b" / "tokenizer.json").read_bytes()
    assert a.encode_text(PARAGRAPHS[4]) == b.encode_text(PARAGRAPHS[4])



def test_training_inputs_is_the_saved_record_of_the_inputs(tmp_path):
    """``training_inputs`` gives, before any training, the settings and origin that
    ``tokenizer_training.json`` records, so a saved BPE can be checked against a later run's texts."""
    train_tokenizer(CORPUS[:200], 700, tmp_path / "a", split_digits=True)
    saved = json.loads((tmp_path / "a" / "tokenizer_training.json").read_text())
    want = training_inputs(CORPUS[:200], 700, split_digits=True)
    assert want == {k: saved[k] for k in want}
    assert (want["documents"], want["requested_vocab_size"], want["pre_tokenizer"]) == (
        200, 700, "kimi-regex (single digits) + byte-level")
    assert saved["vocab_size"] == 700 and saved["bpe_tokens"] + saved["special_slots"] == 700
    edited = [*CORPUS[:199], CORPUS[199] + "!"]  # one character in one text
    assert training_inputs(edited, 700, split_digits=True)["sha256"] != want["sha256"]
    assert training_inputs(CORPUS[:200], 700)["pre_tokenizer"] == "kimi-regex + byte-level"
    with pytest.raises(ValueError, match="corpus"):
        training_inputs(tmp_path / "missing", 700)

def _kimi_chunks(text: str) -> list[bytes]:
    """Reference chunks from tiktoken with the Kimi regex: give every substring of `text` a rank, so
    BPE merges each regex chunk into exactly one token, whose bytes are the chunk."""
    b = text.encode()
    ranks = {bytes([i]): i for i in range(256)}
    for s in sorted({b[i:j] for i in range(len(b)) for j in range(i + 2, len(b) + 1)}, key=lambda s: (len(s), s)):
        ranks.setdefault(s, len(ranks))
    enc = tiktoken.Encoding("chunks", pat_str=KIMI_PAT_STR, mergeable_ranks=ranks, special_tokens={})
    return [enc.decode_single_token_bytes(t) for t in enc.encode_ordinary(text)]


_PIECES = st.sampled_from(["Hello", " world", "'s", "'LL", " DON'T", "123456", " 7", "你好", "世界", "Café", "é",
                           "\u0301", "  ", "\n", "\r\n", "\t", " \n ", "!!", " <|", "|>", "[EOS]", "ǅa", "٣٤",
                           "🍜", "x", "_", "-", ".", "\u00a0", "Ⅻ"])


@given(st.lists(_PIECES, max_size=12).map("".join))
@settings(max_examples=50, deadline=None)
def test_pre_tokenizer_matches_kimi_regex(text):
    """The tokenizers (Oniguruma) split equals tiktoken's (fancy-regex) split of the Kimi pattern."""
    ours = [s.encode() for s, _ in kimi_pre_tokenizer(byte_level=False).pre_tokenize_str(text)]
    assert ours == _kimi_chunks(text)


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(CORPUS, 300)
    with pytest.raises(ValueError, match="no text"):
        train_tokenizer([], 512)
    with pytest.raises(ValueError, match="corpus"):
        train_tokenizer(tmp_path / "missing", 512)
    with pytest.raises(ValueError, match="manifest"):
        train_tokenizer(tmp_path, 512)


def test_cli_max_mb_and_vocab_shortfall(tmp_path, capsys):
    """``--max-mb`` <= 0 names the flag; a corpus too small for ``--vocab-size`` trains, reports
    the real size and says so."""
    from openk3.cli import main

    text = tmp_path / "t.txt"
    text.write_text("the cat sat on the mat. " * 50)
    assert main(["train-tokenizer", "--corpus", str(text), "--vocab-size", "600", "--out", str(tmp_path / "a"),
                 "--max-mb", "0"]) == 2
    assert "--max-mb=0.0: must be > 0" in capsys.readouterr().err
    assert main(["train-tokenizer", "--corpus", str(text), "--vocab-size", "100000", "--out", str(tmp_path / "b")]) == 0
    err = capsys.readouterr().err
    assert "fewer than --vocab-size 100000" in err
