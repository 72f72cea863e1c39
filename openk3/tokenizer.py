"""Tokenizers for openk3: the official Kimi BPE (tiktoken) and project-trained byte-level BPEs.

Two backends sit behind one :class:`Tokenizer` API:

* **Kimi BPE** (a directory holding ``tiktoken.model`` + ``tokenizer_config.json``): 163,584 BPE
  ranks (rank = id) split by the Kimi pre-tokenisation regex, followed by 256 special slots
  (ids 163,584 ... 163,839). Named slots come from ``added_tokens_decoder`` in
  ``tokenizer_config.json``; every other slot ``N`` is ``<|reserved_token_N|>``.
  Source: ``../shared/spec/k3-chat-format.md`` §1.1-§1.2.
* **Trained BPE** (``tokenizer.json`` from the ``tokenizers`` library, byte-level): the project's own
  small vocabularies. They carry the same special-token *strings* (:data:`K3_SPECIAL_TOKENS`) at
  their own ids, listed in ``tokenizer.json``'s ``added_tokens`` and/or ``tokenizer_config.json``.

Text and markup are encoded separately (spec §1.3): :meth:`Tokenizer.encode_text` never yields a
special id, whatever the text contains (``<|open|>`` typed by a user is plain BPE tokens); markup ids
come from :meth:`Tokenizer.special_id` or the ``*_id`` attributes. Streaming detokenisation is
:class:`IncrementalDecoder` (UTF-8 safe: never emits a partial character, never drops a byte).
Both backends expose the same small interface that :class:`Tokenizer` wraps: ``kind``,
``special`` (string -> id), ``n_vocab``, ``encode_ordinary(text) -> ids`` (special-token recognition
off, spec §1.3), ``decode_bytes(ids) -> bytes`` and ``save(directory, config)``. The Kimi backend
also converts itself to an equivalent ``tokenizer.json`` for transformers / vLLM / SGLang.
"""

from __future__ import annotations

import base64
import codecs
import json
import os
import re
from collections.abc import Iterable
from importlib import resources
from pathlib import Path
from typing import Any

import tiktoken

from openk3.files import MAX_TOKENIZER_BYTES, check_regular, read_json, read_text

# Chat markup and media strings (spec §1.1, §1.3, §10).
END_OF_MSG = "<|end_of_msg|>"
OPEN = "<|open|>"
CLOSE = "<|close|>"
SEP = "<|sep|>"
MEDIA_BEGIN = "<|media_begin|>"
MEDIA_CONTENT = "<|media_content|>"
MEDIA_END = "<|media_end|>"
MEDIA_PAD = "<|media_pad|>"

# The named K3 special tokens in official id order; a trained BPE should add (at least) these.
K3_SPECIAL_TOKENS = (
    "[BOS]",
    "[EOS]",
    END_OF_MSG,
    OPEN,
    CLOSE,
    SEP,
    "[start_header_id]",
    "[end_header_id]",
    "[EOT]",
    MEDIA_BEGIN,
    MEDIA_CONTENT,
    MEDIA_END,
    MEDIA_PAD,
    "<osagent_mode>",
    "[UNK]",
    "[PAD]",
)
# In the official tokenizer_config the tag markers are `"special": false` (spec §1.1).
_NOT_SPECIAL_FLAG = {OPEN, CLOSE, SEP}

_CACHE_MAX_CHARS = (
    64  # tag names, attribute keys and values repeat constantly: memoise short segments
)
_CACHE_MAX_ENTRIES = 8192


# ------------------------------------------------------------------ backends
# Kimi pre-tokenisation regex (spec §1.2): eight alternatives, in order. `&&` is a class
# intersection, which tiktoken's fancy-regex engine understands (Python's `re` does not).
KIMI_PAT_STR = "|".join(
    [
        r"[\p{Han}]+",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
        r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
        r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)
NUM_SPECIAL_SLOTS = 256  # special slots after the Kimi BPE ranks (spec §1.1)

# Moonshot's encoder feeds tiktoken at most 400k characters at a time and cuts runs of more than
# 25k whitespace / non-whitespace characters (spec §1.2); both cuts can change ids at the seam,
# so they are reproduced for parity on pathological inputs.
_MAX_ENCODE_CHARS = 400_000
_MAX_RUN_CHARS = 25_000


def split_runs(s: str, max_run: int) -> Iterable[str]:
    """Cut `s` so that no piece has more than `max_run` consecutive whitespace (or non-whitespace)
    chars: a longer run is cut every `max_run` characters from its start. Whitespace is
    ``str.isspace`` (the same predicate as ``re``'s ``\\s`` on str patterns); the runs are found by
    one regex scan in C, so tens of MiB cost milliseconds, not a Python loop per character."""
    start = 0
    for m in _long_runs(max_run).finditer(s):
        run_start, run_end = m.span()
        for cut in range(run_start + max_run, run_end, max_run):
            yield s[start:cut]
            start = cut
    yield s[start:]


_LONG_RUNS: dict[int, Any] = {}


def _long_runs(max_run: int) -> Any:
    pat = _LONG_RUNS.get(max_run)
    if pat is None:
        pat = _LONG_RUNS[max_run] = re.compile(rf"\s{{{max_run + 1},}}|\S{{{max_run + 1},}}")
    return pat


def encode_pieces(text: str) -> Iterable[str]:
    """The pieces Moonshot's encoder tokenizes independently (spec §1.2): windows of at most
    400,000 characters, each cut so that no run of whitespace / non-whitespace exceeds 25,000.
    A text's ids are the concatenation of its pieces' ids, so a count can stop at any piece."""
    for i in range(0, len(text), _MAX_ENCODE_CHARS):
        yield from split_runs(text[i : i + _MAX_ENCODE_CHARS], _MAX_RUN_CHARS)


def iter_encode(encode: Any, text: str) -> Iterable[list[int]]:
    """``encode(piece)`` for each of :func:`encode_pieces`, in order; a piece equal to the one
    before it (a long run cut into equal pieces) reuses its ids instead of being encoded again."""
    prev = None
    prev_ids = None
    for piece in encode_pieces(text):
        if piece != prev:
            prev = piece
            prev_ids = encode(piece)
        yield prev_ids


def byte_level_alphabet() -> dict[str, int]:
    """Inverse of the GPT-2 byte-level map: printable Latin-1 bytes stand for themselves, the other
    bytes are shifted to code points 256+n (in byte order), so that every byte is a visible char."""
    keep = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    char_to_byte = {}
    extra = 0
    for b in range(256):
        if b in keep:
            char_to_byte[chr(b)] = b
        else:
            char_to_byte[chr(256 + extra)] = b
            extra += 1
    return char_to_byte


def last_merge(token: bytes, rank: int, ranks: dict[bytes, int]) -> tuple[bytes, bytes] | None:
    """The pair whose merge creates `token` when byte-pair encoding runs over its bytes with only
    lower ranks (tiktoken's procedure); None if BPE cannot build it (tiktoken then only emits it for
    a pre-token equal to it, which ``ignore_merges`` reproduces)."""
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best = rank
        at = -1
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1], rank)
            if r < best:
                best = r
                at = i
        if at < 0:
            return None
        parts[at : at + 2] = [parts[at] + parts[at + 1]]
    return parts[0], parts[1]


class TiktokenBackend:
    """Kimi BPE: ranks file + regex + 256 special slots (spec §1.1-§1.2).

    Args:
        model_file: ``tiktoken.model`` (one ``<base64 bytes> <rank>`` per line; rank = id).
        slot_names: special-slot id -> name (``added_tokens_decoder``); unnamed slots N become
            ``<|reserved_token_N|>``.
    Raises:
        ValueError: a malformed line, ranks that are not exactly ``0..n-1``, or a named id outside
            the special slots.
    """

    kind = "tiktoken"

    def __init__(self, model_file: Path, slot_names: dict[int, str]):
        ranks: dict[bytes, int] = {}
        for n, line in enumerate(model_file.read_bytes().splitlines()):
            if not line.strip():
                continue
            try:
                tok, rank = line.split()
                ranks[base64.b64decode(tok, validate=True)] = int(rank)
            except Exception as e:  # noqa: BLE001 - any parse failure is a malformed file
                raise ValueError(
                    f"{model_file}: line {n + 1} is not '<base64> <rank>': {line[:60]!r}"
                ) from e
        n_ranks = len(ranks)
        if sorted(ranks.values()) != list(range(n_ranks)):
            raise ValueError(
                f"{model_file}: ranks must be exactly 0..{n_ranks - 1} (they are the token ids)"
            )
        for i in slot_names:
            if not n_ranks <= i < n_ranks + NUM_SPECIAL_SLOTS:
                raise ValueError(
                    f"tokenizer_config.json: added token id {i} is outside the special slots "
                    f"[{n_ranks}, {n_ranks + NUM_SPECIAL_SLOTS})"
                )
        self.special = {
            slot_names.get(i, f"<|reserved_token_{i}|>"): i
            for i in range(n_ranks, n_ranks + NUM_SPECIAL_SLOTS)
        }
        self.ranks = ranks
        self.enc = tiktoken.Encoding(
            name=f"kimi:{model_file}",
            pat_str=KIMI_PAT_STR,
            mergeable_ranks=ranks,
            special_tokens=self.special,
        )
        self.n_vocab = n_ranks + NUM_SPECIAL_SLOTS
        self._hf_json: str | None = None

    def encode_ordinary(self, text: str) -> list[int]:
        """Ids of `text` with special-token recognition off, cut as Moonshot's encoder cuts it."""
        out: list[int] = []
        for ids in self.iter_encode(text):
            out.extend(ids)
        return out

    def iter_encode(self, text: str) -> Iterable[list[int]]:
        """The ids of `text` piece by piece (:func:`encode_pieces`); their concatenation is
        :meth:`encode_ordinary`'s."""
        return iter_encode(self.enc.encode_ordinary, text)

    def decode_bytes(self, ids: list[int]) -> bytes:
        """Raw bytes of `ids` (already range-checked by the caller); special ids give their spelling."""
        return self.enc.decode_bytes(ids)

    def hf_tokenizer_json(self, config: dict[str, Any]) -> str:
        """The same tokenizer as a `tokenizers` ``tokenizer.json``: byte-level BPE over the ranks
        (merges in rank order, ``ignore_merges`` like tiktoken's whole-piece lookup), the Kimi regex
        as pre-tokenizer, the 256 slots as added tokens (flags from ``added_tokens_decoder``).

        transformers converts a bare ``tiktoken.model`` with its own default regex, which splits
        text differently (``it's`` -> ``it`` + ``'s``), so without this file AutoTokenizer, vLLM and
        SGLang would load different ids. The 400k-character / 25k-run cuts of :meth:`encode_ordinary`
        are not reproduced (they matter only for pathological inputs)."""
        if self._hf_json is None:  # ~4 s for the Kimi vocabulary: computed once per tokenizer
            from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
            from tokenizers import Tokenizer as HFTokenizer

            to_char = {b: c for c, b in byte_level_alphabet().items()}

            def spell(b: bytes) -> str:
                return "".join(to_char[x] for x in b)

            merges = []
            for tok, rank in sorted(self.ranks.items(), key=lambda kv: kv[1]):
                pair = last_merge(tok, rank, self.ranks) if len(tok) > 1 else None
                if pair is not None:
                    merges.append((spell(pair[0]), spell(pair[1])))
            hf = HFTokenizer(
                models.BPE(
                    vocab={spell(t): r for t, r in self.ranks.items()},
                    merges=merges,
                    ignore_merges=True,
                )
            )
            hf.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(KIMI_PAT_STR), behavior="isolated"),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                ]
            )
            hf.decoder = decoders.ByteLevel()
            flags = {
                int(k): v
                for k, v in (config.get("added_tokens_decoder") or {}).items()
                if isinstance(v, dict)
            }
            # Added in id order, so each lands on its slot (they follow the ranks without gaps).
            hf.add_tokens(
                [
                    AddedToken(
                        name, special=flags.get(i, {}).get("special", True), normalized=False
                    )
                    for name, i in sorted(self.special.items(), key=lambda kv: kv[1])
                ]
            )
            moved = [(n, i) for n, i in self.special.items() if hf.token_to_id(n) != i]
            if moved:  # a slot name that is also a BPE token would keep the BPE id
                raise ValueError(
                    f"tokenizer.json: special token {moved[0][0]!r} would not get id {moved[0][1]}"
                )
            self._hf_json = hf.to_str()
        return self._hf_json

    def save(self, directory: Path, config: dict[str, Any]) -> None:
        """Write ``tiktoken.model`` and the equivalent ``tokenizer.json`` into `directory`."""
        lines = [
            base64.b64encode(tok) + b" " + str(rank).encode()
            for tok, rank in sorted(self.ranks.items(), key=lambda kv: kv[1])
        ]
        (directory / "tiktoken.model").write_bytes(b"\n".join(lines) + b"\n")
        (directory / "tokenizer.json").write_text(self.hf_tokenizer_json(config), encoding="utf-8")


class ByteLevelBPEBackend:
    """A `tokenizers` byte-level BPE (tokenizer.json) with the K3 special strings as added tokens.

    Args:
        tokenizer_json: the ``tokenizer.json`` text.
        special: special-token string -> id.
    Raises:
        ValueError: a decoder that is not byte-level, or a special id outside the vocabulary.
    """

    kind = "tokenizers"

    def __init__(self, tokenizer_json: str, special: dict[str, int]):
        from tokenizers import Tokenizer as HFTokenizer

        self.json = tokenizer_json
        spec = json.loads(tokenizer_json)
        if (spec.get("decoder") or {}).get("type") != "ByteLevel":
            raise ValueError(
                "tokenizer.json: decoder.type must be 'ByteLevel' (openk3 loads byte-level BPEs only), "
                f"got {(spec.get('decoder') or {}).get('type')!r}"
            )
        full = HFTokenizer.from_str(tokenizer_json)
        # A copy without added tokens can never split out a special string, so user text that spells
        # one is BPE-encoded like any other text (spec §1.3).
        spec["added_tokens"] = []
        spec["post_processor"] = None
        self.plain = HFTokenizer.from_str(json.dumps(spec))
        self.special = dict(special)
        self.n_vocab = full.get_vocab_size(with_added_tokens=True)
        for tok, i in self.special.items():
            if not 0 <= i < self.n_vocab:
                raise ValueError(
                    f"tokenizer: special token {tok!r} has id {i} outside [0, {self.n_vocab})"
                )
        to_byte = byte_level_alphabet()
        self.token_bytes: list[bytes] = [b""] * self.n_vocab
        for tok, i in full.get_vocab(with_added_tokens=True).items():
            if 0 <= i < self.n_vocab:
                self.token_bytes[i] = (
                    bytes(to_byte[c] for c in tok)
                    if all(c in to_byte for c in tok)
                    else tok.encode()
                )
        for tok, i in self.special.items():
            self.token_bytes[i] = tok.encode()
        self._special_ids = frozenset(self.special.values())

    def encode_ordinary(self, text: str) -> list[int]:
        """Ids of `text` with the added tokens off (a special string in `text` is plain BPE).

        Raises:
            RuntimeError: the vocabulary merges a special-token string into an ordinary token.
        """
        out: list[int] = []
        for ids in self.iter_encode(text):
            out.extend(ids)
        return out

    def iter_encode(self, text: str) -> Iterable[list[int]]:
        """The ids of `text` piece by piece, cut as Moonshot's encoder cuts (:func:`encode_pieces`;
        one contract for both backends, and a run of millions of equal characters costs one
        25,000-character encode instead of a BPE over the whole run); their concatenation is
        :meth:`encode_ordinary`'s.

        Raises:
            RuntimeError: the vocabulary merges a special-token string into an ordinary token.
        """
        return iter_encode(self._encode_piece, text)

    def _encode_piece(self, piece: str) -> list[int]:
        # encode_batch releases the GIL while it works (encode holds it: 0.7 s for a 190k-character
        # prompt, during which the server's event loop and every other thread stand still); same ids.
        ids = self.plain.encode_batch([piece], add_special_tokens=False)[0].ids
        if self._special_ids.intersection(ids):
            raise RuntimeError(
                "trained BPE produced a special id from ordinary text: its vocabulary spells a "
                "special-token string as a mergeable token; retrain without it"
            )
        return ids

    def decode_bytes(self, ids: list[int]) -> bytes:
        """Raw bytes of `ids` (already range-checked by the caller); special ids give their spelling."""
        return b"".join(self.token_bytes[i] for i in ids)

    def save(self, directory: Path, config: dict[str, Any]) -> None:
        """Write ``tokenizer.json`` into `directory` (`config` is written by the caller)."""
        (directory / "tokenizer.json").write_text(self.json, encoding="utf-8")


# ------------------------------------------------------------------ the tokenizer
class Tokenizer:
    """One tokenizer API over the Kimi BPE and trained byte-level BPEs.

    Attributes:
        vocab_size: number of ids (BPE ranks + special slots; 163,840 for Kimi).
        special_tokens: special-token string -> id (all 256 slots for Kimi, reserved ones included).
        special_ids: frozenset of those ids.
        end_of_msg_id, open_id, close_id, sep_id, media_pad_id: the chat markup ids (spec §1.1);
            always present. ``end_of_msg_id`` is the generation stop token.
        media_begin_id, media_content_id, media_end_id: image-block ids, or None if absent.
        bos_id, eos_id, pad_id, unk_id: from ``tokenizer_config.json`` (``bos_token`` ...), or None.
        config: the ``tokenizer_config.json`` dict (written back by :meth:`save_pretrained`).
        backend: ``"tiktoken"`` or ``"tokenizers"``.

    Build with :func:`load_tokenizer` or :meth:`from_bpe`.
    """

    def __init__(self, backend: TiktokenBackend | ByteLevelBPEBackend, config: dict[str, Any]):
        self._b = backend
        self.backend = backend.kind
        self.config = config
        self.vocab_size: int = backend.n_vocab
        self.special_tokens: dict[str, int] = dict(backend.special)
        self.special_ids = frozenset(self.special_tokens.values())
        self._special_by_id = {i: s for s, i in self.special_tokens.items()}
        missing = [
            t for t in (END_OF_MSG, OPEN, CLOSE, SEP, MEDIA_PAD) if t not in self.special_tokens
        ]
        if missing:
            raise ValueError(f"tokenizer: required special token {missing[0]!r} is missing")
        self.end_of_msg_id: int = self.special_tokens[END_OF_MSG]
        self.open_id: int = self.special_tokens[OPEN]
        self.close_id: int = self.special_tokens[CLOSE]
        self.sep_id: int = self.special_tokens[SEP]
        self.media_pad_id: int = self.special_tokens[MEDIA_PAD]
        self.media_begin_id: int | None = self.special_tokens.get(MEDIA_BEGIN)
        self.media_content_id: int | None = self.special_tokens.get(MEDIA_CONTENT)
        self.media_end_id: int | None = self.special_tokens.get(MEDIA_END)
        self.bos_id: int | None = self._config_token("bos_token")
        self.eos_id: int | None = self._config_token("eos_token")
        self.pad_id: int | None = self._config_token("pad_token")
        self.unk_id: int | None = self._config_token("unk_token")
        self._cache: dict[str, list[int]] = {}

    def _config_token(self, key: str) -> int | None:
        name = self.config.get(key)
        if isinstance(name, dict):  # HF AddedToken serialisation
            name = name.get("content")
        if name is None:
            return None
        if name not in self.special_tokens:
            raise ValueError(f"tokenizer_config.json: {key} {name!r} is not a special token")
        return self.special_tokens[name]

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def from_bpe(
        cls,
        bpe: Any,
        bos_token: str | None = "[BOS]",
        eos_token: str | None = "[EOS]",
        pad_token: str | None = "[PAD]",
        unk_token: str | None = None,
    ) -> Tokenizer:
        """Wrap an in-memory `tokenizers.Tokenizer` (byte-level BPE) whose added tokens include the
        K3 chat markup strings; the tokenizer-training code uses this, then :meth:`save_pretrained`.

        Raises:
            ValueError: decoder not byte-level, a required markup token missing, or a named
                bos/eos/pad/unk token that is not an added token (pass None to omit it).
        """
        added = {t.content: i for i, t in bpe.get_added_tokens_decoder().items()}
        config = {
            "added_tokens_decoder": {
                str(i): {
                    "content": s,
                    "lstrip": False,
                    "normalized": False,
                    "rstrip": False,
                    "single_word": False,
                    "special": s not in _NOT_SPECIAL_FLAG,
                }
                for s, i in sorted(added.items(), key=lambda kv: kv[1])
            },
            "clean_up_tokenization_spaces": False,
            "model_max_length": 1048576,
            "tokenizer_class": "PreTrainedTokenizerFast",
        }
        for attr, name in (
            ("bos", bos_token),
            ("eos", eos_token),
            ("pad", pad_token),
            ("unk", unk_token),
        ):
            if name is not None:
                config[f"{attr}_token"] = name
        return cls(ByteLevelBPEBackend(bpe.to_str(), added), config)

    # -- encoding -----------------------------------------------------------------------------
    def encode_text(self, text: str) -> list[int]:
        """BPE-encode ordinary text with special-token recognition off (spec §1.3).

        Returns ids that are never in :attr:`special_ids`, even if `text` spells a special token.

        Raises:
            TypeError: `text` is not a str.
            RuntimeError: a trained BPE whose merges spell a special-token string (unusable vocab).
        """
        if not isinstance(text, str):
            raise TypeError(f"encode_text: text must be str, got {type(text).__name__}")
        if not text:
            return []
        if len(text) <= _CACHE_MAX_CHARS:
            hit = self._cache.get(text)
            if hit is None:
                hit = self._b.encode_ordinary(text)
                if len(self._cache) < _CACHE_MAX_ENTRIES:
                    self._cache[text] = hit
            return list(hit)
        return self._b.encode_ordinary(text)

    def iter_encode_text(self, text: str) -> Iterable[list[int]]:
        """:meth:`encode_text`'s ids piece by piece (the pieces Moonshot's encoder cuts a long text
        into, spec §1.2; their concatenation is ``encode_text(text)``), so that a count can stop
        as soon as it passes a limit instead of encoding megabytes first.

        Raises:
            TypeError / RuntimeError: as :meth:`encode_text`.
        """
        if not isinstance(text, str):
            raise TypeError(f"encode_text: text must be str, got {type(text).__name__}")
        if len(text) <= _CACHE_MAX_CHARS:
            if text:
                yield self.encode_text(text)
            return
        yield from self._b.iter_encode(text)

    def special_id(self, token: str) -> int:
        """Id of a special-token string such as ``"<|open|>"``.

        Raises:
            ValueError: `token` is not a special token of this tokenizer.
        """
        try:
            return self.special_tokens[token]
        except KeyError:
            raise ValueError(
                f"special_id: {token!r} is not a special token of this tokenizer"
            ) from None

    def is_special(self, token_id: int) -> bool:
        """True when `token_id` is one of the special slots (markup, media, reserved...)."""
        return token_id in self.special_ids

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Ids that end generation: ``<|end_of_msg|>`` (generation_config ``eos_token_id``), plus
        ``[EOS]`` when present (harmless extra stop, spec §11.2)."""
        return (self.end_of_msg_id,) + ((self.eos_id,) if self.eos_id is not None else ())

    # -- decoding -----------------------------------------------------------------------------
    def _check_ids(self, ids: Iterable[int]) -> list[int]:
        out = [int(i) for i in ids]
        for i in out:
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"decode: token id {i} is outside [0, {self.vocab_size})")
        return out

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """Raw bytes of `ids`; special ids decode to their spelling.

        Raises:
            ValueError: an id outside ``[0, vocab_size)``.
        """
        return self._b.decode_bytes(self._check_ids(ids))

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids` (invalid UTF-8 becomes U+FFFD). Special ids decode to their spelling unless
        `skip_special_tokens`.

        Raises:
            ValueError: an id outside ``[0, vocab_size)``.
        """
        ids = self._check_ids(ids)
        if skip_special_tokens:
            ids = [i for i in ids if i not in self.special_ids]
        return self._b.decode_bytes(ids).decode("utf-8", errors="replace")

    def token_to_string(self, token_id: int) -> str | None:
        """Spelling of a special id, or None for an ordinary BPE id."""
        return self._special_by_id.get(token_id)

    # -- saving -------------------------------------------------------------------------------
    def save_pretrained(self, directory: str | os.PathLike) -> list[Path]:
        """Write the tokenizer files and ``chat_template.jinja`` into `directory` (created if needed).

        Kimi BPE: ``tiktoken.model`` + an equivalent ``tokenizer.json`` (for transformers / vLLM /
        SGLang, see below) + ``tokenizer_config.json``; trained BPE: ``tokenizer.json`` +
        ``tokenizer_config.json``. The template is openk3's K3 template
        (``openk3/chat_format/template.jinja``). Returns the written paths; :func:`load_tokenizer`
        reads them back to an identical tokenizer (it prefers ``tiktoken.model``).

        The written config leaves out ``auto_map`` (the official Kimi config has one pointing at
        ``tokenization_kimi.py``): openk3 ships no remote code, and an ``auto_map`` naming a file
        that is not there makes transformers' ``AutoTokenizer`` demand ``trust_remote_code`` and
        then fail. Without remote code, transformers reads ``tokenizer.json``, which carries the
        Kimi pre-tokenisation regex (its own conversion of ``tiktoken.model`` would not).
        ``self.config`` itself is not changed.

        Raises:
            ValueError: (Kimi BPE) a special-slot name is also a BPE token, so ``tokenizer.json``
                could not give it its slot id.
        """
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        self._b.save(d, self.config)
        config = {k: v for k, v in self.config.items() if k != "auto_map"}
        (d / "tokenizer_config.json").write_text(
            json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
        )
        template = (
            resources.files("openk3.chat_format")
            .joinpath("template.jinja")
            .read_text(encoding="utf-8")
        )
        (d / "chat_template.jinja").write_text(template, encoding="utf-8")
        model_files = (
            ["tiktoken.model", "tokenizer.json"]
            if self.backend == "tiktoken"
            else ["tokenizer.json"]
        )
        return [d / f for f in model_files] + [
            d / "tokenizer_config.json",
            d / "chat_template.jinja",
        ]

    def __repr__(self) -> str:
        return f"Tokenizer(backend={self.backend!r}, vocab_size={self.vocab_size})"


class IncrementalDecoder:
    """Streaming detokeniser: feed ids, get text deltas that never split a UTF-8 character.

    Bytes of an incomplete multi-byte character are held back until the next ids complete it;
    bytes that can never form a valid character are emitted as U+FFFD exactly where a one-shot
    ``tokenizer.decode(all_ids)`` puts them. Hence ``"".join(deltas) + flush() == decode(all_ids)``
    for every way of splitting the stream.

    Args:
        tokenizer: the :class:`Tokenizer` the ids come from.
        skip_special_tokens: drop special ids instead of emitting their spelling.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, ids: int | Iterable[int]) -> str:
        """Add one id or a sequence of ids (ints, a list, a numpy array or a torch tensor of shape
        [] or [T]); return the newly complete text (possibly "").

        Raises:
            ValueError: an id outside the vocabulary.
        """
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        ids = [ids] if isinstance(ids, int) else list(ids)
        if self.skip_special_tokens:
            ids = [i for i in ids if i not in self.tokenizer.special_ids]
        return self._utf8.decode(self.tokenizer.decode_bytes(ids), final=False)

    def flush(self) -> str:
        """End of stream: return held-back bytes (an unfinished character becomes U+FFFD) and reset."""
        out = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return out

    @property
    def pending_bytes(self) -> bytes:
        """Bytes held back because they may start a multi-byte character."""
        return self._utf8.getstate()[0]


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Load a tokenizer directory: ``tiktoken.model`` (Kimi BPE) or ``tokenizer.json`` (trained BPE),
    plus ``tokenizer_config.json``. ``path`` may also name a shipped model (``"openk3-tiny"``,
    :mod:`openk3.shipped`).

    For ``tiktoken.model`` the config is required (its ``added_tokens_decoder`` names the special
    slots). For ``tokenizer.json`` the config is optional; special tokens are the union of the
    config's ``added_tokens_decoder`` and the file's ``added_tokens``.

    Raises:
        ValueError: no tokenizer file, missing/invalid config, malformed ranks file, special ids
            out of range, or a required chat markup token (``<|open|>`` ...) missing.
    """
    from openk3.shipped import resolve_model_path

    d = Path(resolve_model_path(path))  # a shipped model's name ("openk3-tiny") loads its tokenizer
    if not d.is_dir():
        raise ValueError(f"load_tokenizer: path {str(d)!r} is not a directory")
    cfg_file = d / "tokenizer_config.json"
    config: dict[str, Any] = {}
    if cfg_file.exists():
        config = read_json(cfg_file)
        if not isinstance(config, dict):
            raise ValueError(
                f"{cfg_file}: cannot load: expected a JSON object, got {type(config).__name__}"
            )
    added: dict[int, str] = {}
    try:
        for k, v in (config.get("added_tokens_decoder") or {}).items():
            content = v.get("content") if isinstance(v, dict) else v
            if not isinstance(content, str):
                raise ValueError(f"added_tokens_decoder[{k!r}] has no string 'content'")
            added[int(k)] = content
    except (ValueError, TypeError, AttributeError) as e:
        raise ValueError(f"{cfg_file}: cannot load: {e}") from None
    ranks = d / "tiktoken.model"
    spec = d / "tokenizer.json"
    if ranks.exists():
        if not cfg_file.exists():
            raise ValueError(
                f"load_tokenizer: {cfg_file} is required next to tiktoken.model "
                "(it names the special slots)"
            )
        check_regular(ranks, MAX_TOKENIZER_BYTES)
        try:
            return Tokenizer(TiktokenBackend(ranks, added), config)
        except (ValueError, TypeError, KeyError, IndexError, UnicodeError) as e:
            raise ValueError(f"{ranks}: cannot load: {e}") from None
    if spec.exists():
        text = read_text(spec, MAX_TOKENIZER_BYTES)
        try:
            for t in json.loads(text).get("added_tokens") or []:
                added.setdefault(int(t["id"]), t["content"])
            return Tokenizer(ByteLevelBPEBackend(text, {s: i for i, s in added.items()}), config)
        except Exception as e:  # noqa: BLE001 - the tokenizers library raises its own exception types
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ValueError(f"{spec}: cannot load: {first}") from None
    raise ValueError(f"load_tokenizer: {str(d)!r} holds neither tiktoken.model nor tokenizer.json")
