"""Train a byte-level BPE for openk3 models (``openk3 train-tokenizer``).

The trained tokenizer mirrors the Kimi vocabulary layout (``../shared/spec/k3-chat-format.md``
§1.1-§1.3) at a smaller size:

* ids ``0 .. R-1`` are BPE tokens (``R = vocab_size - 256``), learned with the ``tokenizers``
  library over the 256 byte symbols, so every input is encodable and decoding is lossless;
* ids ``R .. R+255`` are the 256 special slots, the named K3 tokens at the same offsets as in Kimi
  (``[BOS]`` at R+0, ``<|end_of_msg|>`` at R+2, ``<|open|>`` R+3, ``<|media_pad|>`` R+21,
  ``[PAD]`` R+255, ... :data:`K3_SPECIAL_SLOT_OFFSETS`), every other slot ``N`` named
  ``<|reserved_token_N|>``. With ``vocab_size=512`` this is exactly the layout the ``k3-test-tiny``
  preset assumes (bos 256, eos 258, pad 511, media placeholder 277).

Text is split by the Kimi pre-tokenisation regex (:data:`openk3.tokenizer.KIMI_PAT_STR`, run by the
``tokenizers`` Oniguruma engine) before the byte-level mapping, so merges never cross the chunk
boundaries K3 uses (Han runs, digit triples, a leading space on words). No learned token can spell a
special string (the regex cuts ``<|``, ``|>`` and ``[``/``]`` away from the letters), hence
:meth:`~openk3.tokenizer.Tokenizer.encode_text` never yields a special id.

Saved by :meth:`openk3.tokenizer.Tokenizer.save_pretrained` (``tokenizer.json``,
``tokenizer_config.json``, ``chat_template.jinja``) plus ``tokenizer_training.json`` (settings and
corpus fingerprint); :func:`openk3.tokenizer.load_tokenizer` loads the directory.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from openk3.tokenizer import (
    CLOSE,
    END_OF_MSG,
    KIMI_PAT_STR,
    MEDIA_BEGIN,
    MEDIA_CONTENT,
    MEDIA_END,
    MEDIA_PAD,
    NUM_SPECIAL_SLOTS,
    OPEN,
    SEP,
    Tokenizer,
    load_tokenizer,
)

# Offset of each named K3 special token inside the 256-slot block (Kimi id - 163584, spec §1.1).
K3_SPECIAL_SLOT_OFFSETS: dict[str, int] = {
    "[BOS]": 0,
    "[EOS]": 1,
    END_OF_MSG: 2,
    OPEN: 3,
    CLOSE: 4,
    SEP: 5,
    "[start_header_id]": 6,
    "[end_header_id]": 7,
    "[EOT]": 9,
    MEDIA_BEGIN: 18,
    MEDIA_CONTENT: 19,
    MEDIA_END: 20,
    MEDIA_PAD: 21,
    "<osagent_mode>": 65,
    "[UNK]": 254,
    "[PAD]": 255,
}
_NOT_SPECIAL = {OPEN, CLOSE, SEP}  # `"special": false` in the official tokenizer_config (spec §1.1)
MIN_VOCAB = 256 + NUM_SPECIAL_SLOTS  # every byte + the special block


def special_slot_names(num_ranks: int) -> list[str]:
    """The 256 special-slot strings for a vocabulary with `num_ranks` BPE tokens, in id order
    (slot ``i`` has id ``num_ranks + i``)."""
    by_offset = {o: s for s, o in K3_SPECIAL_SLOT_OFFSETS.items()}
    return [
        by_offset.get(i, f"<|reserved_token_{num_ranks + i}|>") for i in range(NUM_SPECIAL_SLOTS)
    ]


# The Kimi regex with numbers cut into single digits (LLaMA-style digit splitting): every number
# is spelled digit by digit, so column arithmetic and copying numbers work on ten digit tokens.
DIGIT_PAT_STR = KIMI_PAT_STR.replace(r"\p{N}{1,3}", r"\p{N}")
assert DIGIT_PAT_STR != KIMI_PAT_STR


def kimi_pre_tokenizer(byte_level: bool = True, split_digits: bool = False) -> Any:
    """The ``tokenizers`` pre-tokenizer: Kimi regex split (isolated chunks; numbers in runs of up to
    three digits, or single digits with `split_digits`), then (if `byte_level`) the GPT-2
    byte-to-char map without its own regex."""
    from tokenizers import Regex, pre_tokenizers

    split = pre_tokenizers.Split(
        Regex(DIGIT_PAT_STR if split_digits else KIMI_PAT_STR), behavior="isolated", invert=False
    )
    if not byte_level:
        return split
    return pre_tokenizers.Sequence(
        [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )


def _doc_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _corpus_texts(
    corpus: Any, max_bytes: int | None
) -> tuple[Iterator[str] | list[str], dict[str, Any]]:
    """Texts to train on and a description of where they came from."""
    if isinstance(corpus, (str, os.PathLike)):
        p = Path(corpus)
        if p.is_dir():
            from openk3.datasets.corpus import load_manifest, read_documents

            manifest_sha = (
                hashlib.sha256((p / "manifest.json").read_bytes()).hexdigest()
                if (p / "manifest.json").is_file()
                else None
            )
            load_manifest(p)  # raises a clear error for a directory that is not a corpus
            docs = read_documents(p, "train")
            if max_bytes is None:
                return (d["text"] for d in docs), {
                    "corpus": str(p),
                    "manifest_sha256": manifest_sha,
                }
            # A byte cap keeps documents in hash order, so every source is sampled, not the first ones.
            chosen = []
            total = 0
            for d in sorted(docs, key=lambda d: _doc_hash(d["id"])):
                n = len(d["text"].encode())
                if total + n <= max_bytes:
                    chosen.append(d["text"])
                    total += n
            return chosen, {
                "corpus": str(p),
                "manifest_sha256": manifest_sha,
                "max_bytes": max_bytes,
            }
        if p.is_file():
            text = p.read_text(encoding="utf-8", errors="replace")
            if max_bytes is not None:
                text = text.encode()[:max_bytes].decode("utf-8", errors="ignore")
            return [text], {"corpus": str(p), "sha256": hashlib.sha256(text.encode()).hexdigest()}
        raise ValueError(f"corpus: {str(p)!r} is neither a corpus directory nor a text file")
    if isinstance(corpus, Iterable):
        texts = [t for t in corpus]
        if not all(isinstance(t, str) for t in texts):
            raise ValueError("corpus: an iterable corpus must yield str")
        if max_bytes is not None:
            out = []
            total = 0
            for t in texts:
                n = len(t.encode())
                if total + n > max_bytes:
                    break
                out.append(t)
                total += n
            texts = out
        h = hashlib.sha256()
        for t in texts:
            h.update(hashlib.sha256(t.encode()).digest())
        return texts, {"corpus": "<iterable>", "documents": len(texts), "sha256": h.hexdigest()}
    raise ValueError(
        f"corpus: expected a corpus directory, a text file or an iterable of str, got "
        f"{type(corpus).__name__}"
    )


def _inputs_record(
    origin: dict[str, Any],
    vocab_size: int,
    min_frequency: int,
    max_token_length: int | None,
    split_digits: bool,
) -> dict[str, Any]:
    return {
        "requested_vocab_size": vocab_size,
        "min_frequency": min_frequency,
        "max_token_length": max_token_length,
        "pre_tokenizer": "kimi-regex"
        + (" (single digits)" if split_digits else "")
        + " + byte-level",
        **origin,
    }


def training_inputs(
    corpus: Any,
    vocab_size: int,
    *,
    min_frequency: int = 2,
    max_bytes: int | None = None,
    max_token_length: int | None = 32,
    split_digits: bool = False,
) -> dict[str, Any]:
    """The part of ``tokenizer_training.json`` that :func:`train_tokenizer` with these arguments
    would write before training: the settings and where the text came from (the corpus manifest's
    sha256, or for an iterable its document count and the sha256 over the texts' sha256s). Equal
    records and the same ``tokenizers`` version (recorded beside them, not part of this) mean the
    same BPE, as training is deterministic, so a saved tokenizer can be checked against the inputs
    a later run would train it on. Raises the ``corpus`` errors of :func:`train_tokenizer`."""
    _, origin = _corpus_texts(corpus, max_bytes)
    return _inputs_record(origin, vocab_size, min_frequency, max_token_length, split_digits)


def train_tokenizer(
    corpus: Any,
    vocab_size: int,
    out_dir: str | os.PathLike | None = None,
    *,
    min_frequency: int = 2,
    max_bytes: int | None = None,
    max_token_length: int | None = 32,
    show_progress: bool = False,
    split_digits: bool = False,
) -> Tokenizer:
    """Train a byte-level BPE with the K3 special-token block and (optionally) save it.

    Args:
        corpus: a corpus directory from :func:`openk3.datasets.corpus.build_corpus` (its train split), a
            UTF-8 text file, or an iterable of str.
        vocab_size: total vocabulary (BPE tokens + 256 special slots), >= 512. If the corpus has
            too few distinct pairs the BPE part comes out smaller; the returned tokenizer's
            ``vocab_size`` is authoritative (use it for the model config).
        out_dir: directory to save into (created); None = don't save.
        min_frequency: a pair must occur this often to be merged.
        max_bytes: train on at most this many bytes of text (documents in hash order).
        max_token_length: longest token in characters (None = unlimited).
        show_progress: the ``tokenizers`` progress bar.
        split_digits: pre-tokenize numbers into single digits (no multi-digit tokens are learned;
            the split is stored in ``tokenizer.json``, so it applies when the tokenizer is loaded).
    Returns:
        The :class:`~openk3.tokenizer.Tokenizer` (loaded back from `out_dir` when saving, so it is
        exactly what :func:`~openk3.tokenizer.load_tokenizer` gives).
    Raises:
        ValueError: `vocab_size` < 512, `min_frequency` < 0, a bad `corpus`, an empty corpus, or
            a special token that did not land at its slot.
    """
    from tokenizers import AddedToken, decoders, models, pre_tokenizers, trainers
    from tokenizers import Tokenizer as HFTokenizer

    if not isinstance(vocab_size, int) or vocab_size < MIN_VOCAB:
        raise ValueError(
            f"vocab_size: must be an int >= {MIN_VOCAB} (256 bytes + 256 special slots), got {vocab_size!r}"
        )
    if min_frequency < 0:
        raise ValueError(f"min_frequency: must be >= 0, got {min_frequency}")
    texts, origin = _corpus_texts(corpus, max_bytes)
    n_bytes = 0

    def counted(it: Iterable[str]) -> Iterator[str]:
        nonlocal n_bytes
        for t in it:
            n_bytes += len(t.encode())
            yield t

    bpe = HFTokenizer(models.BPE())  # no unk token: the 256-byte alphabet covers every input
    bpe.pre_tokenizer = kimi_pre_tokenizer(split_digits=split_digits)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - NUM_SPECIAL_SLOTS,
        min_frequency=min_frequency,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
        max_token_length=max_token_length,
    )
    bpe.train_from_iterator(counted(texts), trainer)
    if n_bytes == 0:
        raise ValueError("corpus: no text to train on")
    n_ranks = bpe.get_vocab_size()
    for name in special_slot_names(n_ranks):
        tok = AddedToken(name, special=name not in _NOT_SPECIAL, normalized=False)
        (bpe.add_tokens if name in _NOT_SPECIAL else bpe.add_special_tokens)([tok])
    for i, name in enumerate(special_slot_names(n_ranks)):
        if bpe.token_to_id(name) != n_ranks + i:
            raise ValueError(
                f"special token {name!r} landed at id {bpe.token_to_id(name)}, expected {n_ranks + i} "
                "(the BPE vocabulary already spells it)"
            )
    tok = Tokenizer.from_bpe(
        bpe, bos_token="[BOS]", eos_token="[EOS]", pad_token="[PAD]", unk_token="[UNK]"
    )
    if out_dir is None:
        return tok
    out = Path(out_dir)
    tok.save_pretrained(out)
    info = {
        "format": "openk3-bpe/1",
        "vocab_size": tok.vocab_size,
        "bpe_tokens": n_ranks,
        "special_slots": NUM_SPECIAL_SLOTS,
        "training_bytes": n_bytes,
        "tokenizers_version": __import__("tokenizers").__version__,
        **_inputs_record(origin, vocab_size, min_frequency, max_token_length, split_digits),
    }
    (out / "tokenizer_training.json").write_text(
        json.dumps(info, indent=2) + "\n", encoding="utf-8"
    )
    return load_tokenizer(out)


def cli_train_tokenizer(args: Any) -> int:
    """``openk3 train-tokenizer``: :func:`train_tokenizer` on ``--corpus`` into ``--out``. Returns
    the exit code (2 with a message on stderr for bad input)."""
    import sys

    if args.max_mb is not None and not args.max_mb > 0:
        print(f"openk3 train-tokenizer: --max-mb={args.max_mb}: must be > 0", file=sys.stderr)
        return 2
    max_bytes = None if args.max_mb is None else int(args.max_mb * (1 << 20))
    try:
        tok = train_tokenizer(
            args.corpus,
            args.vocab_size,
            args.out,
            min_frequency=args.min_frequency,
            max_bytes=max_bytes,
            split_digits=bool(getattr(args, "split_digits", False)),
        )
    except (ValueError, OSError) as e:
        print(f"openk3 train-tokenizer: {e}", file=sys.stderr)
        return 2
    info = json.loads((Path(args.out) / "tokenizer_training.json").read_text(encoding="utf-8"))
    print(
        f"{args.out}: vocab {tok.vocab_size} ({info['bpe_tokens']} BPE + {NUM_SPECIAL_SLOTS} special), "
        f"trained on {info['training_bytes'] / (1 << 20):.1f} MiB; <|end_of_msg|>={tok.end_of_msg_id}, "
        f"[PAD]={tok.pad_id}"
    )
    if tok.vocab_size < args.vocab_size:
        print(
            f"openk3 train-tokenizer: note: the corpus supports only {tok.vocab_size} ids, fewer than "
            f"--vocab-size {args.vocab_size} (no more merges to learn); use {tok.vocab_size} as the model's "
            f"vocab_size",
            file=sys.stderr,
        )
    return 0
