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
The two backends live in :mod:`openk3.tokenizer_backends`; ``KIMI_PAT_STR`` and
``NUM_SPECIAL_SLOTS`` are re-exported here.
"""

from __future__ import annotations

import codecs
import json
import os
from collections.abc import Iterable
from importlib import resources
from pathlib import Path
from typing import Any

from openk3.files import MAX_TOKENIZER_BYTES, check_regular, read_json, read_text
from openk3.tokenizer_backends import (  # noqa: F401 - KIMI_PAT_STR, NUM_SPECIAL_SLOTS, _split_runs re-exported
    KIMI_PAT_STR,
    NUM_SPECIAL_SLOTS,
    ByteLevelBPEBackend,
    TiktokenBackend,
)
from openk3.tokenizer_backends import split_runs as _split_runs  # noqa: F401 - tests import it from here

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
    ranks, spec = d / "tiktoken.model", d / "tokenizer.json"
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
