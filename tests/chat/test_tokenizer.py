"""Tokenizer: the Kimi BPE table and ids (spec k3-chat-format.md §1), text/markup separation,
UTF-8-safe incremental decoding, trained byte-level BPEs, save/load round trips."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from openk3.chat_format import chat_template, encode_request
from openk3.tokenizer import (
    K3_SPECIAL_TOKENS,
    IncrementalDecoder,
    Tokenizer,
    split_runs as _split_runs,
    load_tokenizer,
)
from tests.conftest import kimi_tokenizer, shared_path

SPECIAL_STRINGS = ["<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>", "[EOS]", "[BOS]", "<|media_pad|>",
                   "<|kimi_image_placeholder|>", "<|reserved_token_163600|>", "<osagent_mode>", "[PAD]"]
HYP = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def kimi() -> Tokenizer:
    # The session-wide instance: it caches the ~4 s tokenizer.json conversion of save_pretrained.
    return kimi_tokenizer()


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Tokenizer:
    """A tiny byte-level BPE trained here with the K3 special strings, saved and loaded back."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    bpe = HFTokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=list(K3_SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    corpus = ["The quick brown fox jumps over the lazy dog. 你好，世界！ Café naïve 🍜 12345."] * 50
    corpus += [f"message role user assistant think response tools call argument {i}" for i in range(200)]
    bpe.train_from_iterator(corpus, trainer)
    d = tmp_path_factory.mktemp("trained")
    Tokenizer.from_bpe(bpe).save_pretrained(d)
    return load_tokenizer(d)


# ----------------------------------------------------------------------------- Kimi BPE table

def test_kimi_special_table(kimi):
    """Spec §1.1: 163,584 ranks + 256 slots; named slots; reserved naming; chat attributes."""
    assert kimi.vocab_size == 163840 and kimi.backend == "tiktoken"
    expected = {"[BOS]": 163584, "[EOS]": 163585, "<|end_of_msg|>": 163586, "<|open|>": 163587,
                "<|close|>": 163588, "<|sep|>": 163589, "[start_header_id]": 163590, "[end_header_id]": 163591,
                "[EOT]": 163593, "<|media_begin|>": 163602, "<|media_content|>": 163603, "<|media_end|>": 163604,
                "<|media_pad|>": 163605, "<osagent_mode>": 163649, "[UNK]": 163838, "[PAD]": 163839}
    for s, i in expected.items():
        assert kimi.special_id(s) == i
    assert kimi.special_id("<|reserved_token_163592|>") == 163592
    assert len(kimi.special_tokens) == 256 and kimi.special_ids == frozenset(range(163584, 163840))
    assert (kimi.end_of_msg_id, kimi.open_id, kimi.close_id, kimi.sep_id, kimi.media_pad_id) == (
        163586, 163587, 163588, 163589, 163605)
    assert (kimi.bos_id, kimi.eos_id, kimi.pad_id, kimi.unk_id) == (163584, 163585, 163839, 163838)
    assert kimi.stop_token_ids == (163586, 163585)
    with pytest.raises(ValueError, match="<\\|im_end\\|>"):
        kimi.special_id("<|im_end|>")


@pytest.mark.parametrize("text, ids", [
    # api.md §8.1 sanity ids (same tiktoken.model) and spec §1.3's frequently seen ids.
    ("Hello world", [19180, 2695]), ("Hello, world!", [19180, 11, 2695, 0]), ("你好世界", [33845, 2243]),
    ("1234567890", [6694, 12972, 16242, 15]), ("中文English混合", [16717, 44372, 13935]),
    ("message", [2778]), ("think", [39964]), ("response", [12092]), ("tools", [25385]), (" role", [6244]),
    ('="', [878]), ('"', [1]), ("assistant", [69702]), ("system", [14062]), ("tool", [20960]),
])
def test_known_ids(kimi, text, ids):
    assert kimi.encode_text(text) == ids
    assert kimi.decode(ids) == text


def test_markup_strings_in_text_are_plain_tokens(kimi):
    """Spec §1.3: markup spelled in text is BPE text; decode restores it exactly."""
    for s in SPECIAL_STRINGS:
        ids = kimi.encode_text(f"x {s} y{s}")
        assert not set(ids) & kimi.special_ids and len(ids) > 3
        assert kimi.decode(ids) == f"x {s} y{s}"
    assert kimi.decode([163587, 2778, 163589]) == "<|open|>message<|sep|>"
    assert kimi.decode([163587, 2778, 163586], skip_special_tokens=True) == "message"


_texty = st.text(st.characters(codec="utf-8"), max_size=60)
_with_markup = st.lists(_texty | st.sampled_from(SPECIAL_STRINGS), max_size=8).map("".join)


@HYP
@given(_with_markup)
def test_property_text_never_yields_special_ids(text):
    tok = _kimi_cached()
    ids = tok.encode_text(text)
    assert not any(i in tok.special_ids for i in ids)
    assert tok.decode(ids) == text


def test_encode_text_rejects_non_str(kimi):
    with pytest.raises(TypeError):
        kimi.encode_text(b"bytes")  # type: ignore[arg-type]


@HYP
@given(st.text(st.sampled_from(" \t\nab"), max_size=80), st.integers(1, 6))
def test_split_runs_bounds_runs(s, max_run):
    """Long-input guard (spec §1.2): pieces rejoin to the input and no piece has a same-class run > max."""
    pieces = list(_split_runs(s, max_run))
    assert "".join(pieces) == s
    for p in pieces:
        run, prev = 0, None
        for ch in p:
            run = run + 1 if prev is not None and ch.isspace() == prev else 1
            prev = ch.isspace()
            assert run <= max_run


def _split_runs_reference(s: str, max_run: int) -> list[str]:
    """The cut written as a loop over characters (spec §1.2's rule, as Moonshot's encoder applies it)."""
    out, start, run, in_space = [], 0, 0, s[:1].isspace()
    for i, ch in enumerate(s):
        if ch.isspace() != in_space:
            run, in_space = 1, ch.isspace()
        else:
            run += 1
            if run > max_run:
                out.append(s[start:i])
                start, run = i, 1
    return out + [s[start:]]


@HYP
@given(st.text(st.sampled_from(" \t\nab\u00a0\u2003\x1c\x85"), max_size=80), st.integers(1, 6))
def test_split_runs_cuts_where_the_character_loop_cuts(s, max_run):
    """The regex scan cuts exactly where the per-character rule does (Unicode whitespace included)."""
    assert list(_split_runs(s, max_run)) == _split_runs_reference(s, max_run)


@pytest.mark.parametrize("which", ["kimi", "trained"])
def test_encoding_piece_by_piece_is_the_encoding(which, request):
    """Both backends encode a long text as Moonshot's encoder does (spec §1.2: 400,000-character
    windows, runs cut at 25,000): the ids of ``iter_encode_text``'s pieces, joined, are
    ``encode_text``'s, and each piece is the encoding of its own slice of the text."""
    tok = request.getfixturevalue(which)
    text = "Hello, world! " * 40_000 + "x" * 60_000 + " " * 30_000 + "déjà vu\n" * 3_000
    pieces = list(tok.iter_encode_text(text))
    assert len(pieces) > 3
    joined = [i for p in pieces for i in p]
    assert joined == tok.encode_text(text)
    assert tok.decode(joined) == text
    run = "y" * 80_000  # cut into 25,000-character pieces, the equal ones encoded once
    assert [len(tok.decode(p)) for p in tok.iter_encode_text(run)] == [25_000, 25_000, 25_000, 5_000]
    assert tok.encode_text(run) == tok.encode_text("y" * 25_000) * 3 + tok.encode_text("y" * 5_000)


def test_long_whitespace_run_round_trips(kimi):
    s = "a" + " " * 30000 + "b" + "x" * 26000
    assert kimi.decode(kimi.encode_text(s)) == s


# ----------------------------------------------------------------------------- streaming decode

def _kimi_cached() -> Tokenizer:
    return kimi_tokenizer()


@st.composite
def _streams(draw):
    """Token streams mixing real text (emoji / CJK split across tokens), arbitrary ordinary ids
    (many are partial UTF-8 sequences), and special ids; plus arbitrary chunk boundaries."""
    tok = _kimi_cached()
    pieces = draw(st.lists(st.one_of(
        st.text(st.characters(codec="utf-8"), max_size=12).map(tok.encode_text),
        st.lists(st.integers(0, 163583), min_size=1, max_size=3),
        st.lists(st.sampled_from(sorted(tok.special_ids)), min_size=1, max_size=2),
    ), max_size=8))
    ids = [i for p in pieces for i in p]
    cuts = sorted(set(draw(st.lists(st.integers(0, len(ids)), max_size=6))))
    return ids, cuts


@HYP
@given(_streams(), st.booleans())
def test_property_incremental_decoder(stream, skip):
    """Deltas are always a prefix of the one-shot decode (so no replacement char the full stream
    lacks, no broken character), and deltas + flush equal it exactly, for any chunking."""
    tok = _kimi_cached()
    ids, cuts = stream
    full = tok.decode(ids, skip_special_tokens=skip)
    dec = IncrementalDecoder(tok, skip_special_tokens=skip)
    emitted = ""
    bounds = [0, *cuts, len(ids)]
    for a, b in zip(bounds, bounds[1:]):
        emitted += dec.feed(ids[a:b])
        assert full.startswith(emitted)
    # token by token as well
    dec2, one = IncrementalDecoder(tok, skip_special_tokens=skip), ""
    for i in ids:
        one += dec2.feed(i)
        assert full.startswith(one)
    assert emitted + dec.flush() == full and one + dec2.flush() == full


def test_incremental_decoder_holds_partial_character(kimi):
    """An emoji whose 4 bytes arrive over several single-byte ids appears only once complete."""
    byte_ids = [kimi._b.enc.encode_single_token(bytes([b])) for b in "🍜".encode()]
    dec = IncrementalDecoder(kimi)
    outs = [dec.feed(i) for i in byte_ids]
    assert outs == ["", "", "", "🍜"] and dec.pending_bytes == b""
    assert dec.feed(byte_ids[:2]) == "" and dec.pending_bytes == "🍜".encode()[:2]
    assert dec.flush() == "\ufffd" and dec.feed(kimi.encode_text("ok")) == "ok"


def test_decode_rejects_out_of_range(kimi):
    with pytest.raises(ValueError, match="163840"):
        kimi.decode([163840])
    with pytest.raises(ValueError, match="-1"):
        IncrementalDecoder(kimi).feed([-1])


# ----------------------------------------------------------------------------- save / load

def test_kimi_save_pretrained_round_trip(kimi, tmp_path):
    paths = kimi.save_pretrained(tmp_path)
    assert {p.name for p in paths} == {"tiktoken.model", "tokenizer.json", "tokenizer_config.json",
                                       "chat_template.jinja"}
    assert (tmp_path / "tiktoken.model").read_bytes() == shared_path("kimi-tokenizer", "tiktoken.model").read_bytes()
    assert (tmp_path / "chat_template.jinja").read_text() == chat_template()
    again = load_tokenizer(tmp_path)
    assert again.special_tokens == kimi.special_tokens and again.vocab_size == kimi.vocab_size
    text = "Café ☕️ 拉面 <|open|> 1234567"
    assert again.encode_text(text) == kimi.encode_text(text)


@pytest.mark.slow
def test_kimi_save_pretrained_loads_in_transformers_without_remote_code(kimi, tmp_path):
    """The official config's ``auto_map`` names ``tokenization_kimi.py``, which openk3 does not ship;
    it is left out of the written config, and the written ``tokenizer.json`` carries the Kimi regex,
    so AutoTokenizer loads the directory without remote code and gives openk3's ids (transformers'
    own conversion of ``tiktoken.model`` splits ``it's`` as ``it`` + ``'s``)."""
    transformers = pytest.importorskip("transformers")
    assert "auto_map" in kimi.config  # the source config has it; only the written copy drops it
    kimi.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert written == {k: v for k, v in kimi.config.items() if k != "auto_map"}
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path), trust_remote_code=False)
    rng = random.Random(0)
    alphabet = "aZq'sTé中文拉面 \n\t\r0123.,!?😀Ωßǅ\u0301ـ한"
    texts = ["it's", "THEY'LL ve'd", "Café ☕️ 拉面 1234567\n\n  x\tÿ", "中文English混合テスト한국어 iPhone's",
             "def f(x):\n    return x**2  # ok\r\n"]
    texts += ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30))) for _ in range(300)]
    for text in texts:  # plain text: HF (like any HF tokenizer) would map a typed <|open|> to markup
        assert hf.encode(text, add_special_tokens=False) == kimi.encode_text(text), text
    assert hf.decode(kimi.encode_text(texts[2])) == texts[2]
    names = sorted(kimi.special_tokens, key=kimi.special_tokens.get)
    assert hf.convert_tokens_to_ids(names) == sorted(kimi.special_ids) and len(hf) == kimi.vocab_size
    assert hf.chat_template == chat_template()


def test_trained_bpe(trained, tmp_path):
    """A project-trained BPE: own ids for the same strings, same guarantees, renders requests."""
    assert trained.backend == "tokenizers" and trained.vocab_size <= 600
    assert trained.special_id("<|open|>") == K3_SPECIAL_TOKENS.index("<|open|>")
    assert trained.end_of_msg_id == K3_SPECIAL_TOKENS.index("<|end_of_msg|>")
    assert (trained.bos_id, trained.eos_id, trained.pad_id) == (0, 1, 15)
    for s in SPECIAL_STRINGS + ["naïve 🍜 你好 \n\t x"]:
        ids = trained.encode_text(f"a{s}b")
        assert not set(ids) & trained.special_ids and trained.decode(ids) == f"a{s}b"
    req = {"messages": [{"role": "user", "content": "Hi <|end_of_msg|> 🍜"}], "reasoning_effort": "low"}
    p = encode_request(req, trained)
    assert trained.decode(p.token_ids) == p.text
    assert sum(i in trained.special_ids for i in p.token_ids) == p.text.count("<|") - 1  # the user's one is text
    dec, out = IncrementalDecoder(trained), ""
    for i in p.token_ids:
        out += dec.feed(i)
    assert out + dec.flush() == p.text
    paths = trained.save_pretrained(tmp_path)
    assert {p.name for p in paths} == {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"}
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["added_tokens_decoder"]["3"] == {"content": "<|open|>", "lstrip": False, "normalized": False,
                                                   "rstrip": False, "single_word": False, "special": False}
    assert load_tokenizer(tmp_path).encode_text("quick fox") == trained.encode_text("quick fox")


def test_load_errors(tmp_path, kimi):
    with pytest.raises(ValueError, match="not a directory"):
        load_tokenizer(tmp_path / "missing")
    with pytest.raises(ValueError, match="neither tiktoken.model nor tokenizer.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "tiktoken.model").write_bytes(b"IQ== 0\nIg== 1\n")
    with pytest.raises(ValueError, match="tokenizer_config.json is required"):
        load_tokenizer(tmp_path)
    only_open = {"added_tokens_decoder": {"2": {"content": "<|open|>"}}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(only_open))
    with pytest.raises(ValueError, match="'<\\|end_of_msg\\|>' is missing"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": {"999": {"content": "x"}}}))
    with pytest.raises(ValueError, match="outside the special slots"):
        load_tokenizer(tmp_path)
    (tmp_path / "tiktoken.model").write_bytes(b"IQ== 0\nIg== 5\n")
    with pytest.raises(ValueError, match="ranks must be exactly"):
        load_tokenizer(tmp_path)
