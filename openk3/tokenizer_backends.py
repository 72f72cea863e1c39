"""Tokenizer backends: the Kimi BPE (tiktoken ranks + the Kimi pre-tokenisation regex + 256
special slots) and project-trained byte-level BPEs (a ``tokenizers`` ``tokenizer.json``).

Both expose the same small interface that :class:`openk3.tokenizer.Tokenizer` wraps: ``kind``,
``special`` (string -> id), ``n_vocab``, ``encode_ordinary(text) -> ids`` (special-token recognition
off, spec §1.3), ``decode_bytes(ids) -> bytes`` and ``save(directory, config)``. The Kimi backend
also converts itself to an equivalent ``tokenizer.json`` for transformers / vLLM / SGLang.

Source: ``../shared/spec/k3-chat-format.md`` §1.1-§1.3. The public names are re-exported by
:mod:`openk3.tokenizer`, which is where callers import them from.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import tiktoken

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
    prev, prev_ids = None, None
    for piece in encode_pieces(text):
        if piece != prev:
            prev, prev_ids = piece, encode(piece)
        yield prev_ids


def byte_level_alphabet() -> dict[str, int]:
    """Inverse of the GPT-2 byte-level map: printable Latin-1 bytes stand for themselves, the other
    bytes are shifted to code points 256+n (in byte order), so that every byte is a visible char."""
    keep = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    char_to_byte, extra = {}, 0
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
        best, at = rank, -1
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1], rank)
            if r < best:
                best, at = r, i
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
