"""What the K3 output parser accepts: marker ids, tag vocabulary, argument typing.

Spec k3-chat-format.md §1.1/§1.3 (markers are single special ids; the ids
depend on the vocabulary), §2 (attribute escaping), §6 and §11 (output grammar
and argument typing). ``output_grammar`` describes the grammar for later
constrained-decoding work; ``parser_vocab`` adapts a tokenizer for
``openk3.chat_format.parser.OutputParser``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Callable, Literal, Union

MARKER_STRINGS = ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>")
ARGUMENT_TYPES = ("string", "number", "boolean", "null", "object", "array")


@dataclass(frozen=True)
class MarkupIds:
    """Token ids of the four XTML markers in a given vocabulary (spec §1.1, §1.3).

    Official BPE: open 163587, close 163588, sep 163589, end_of_msg 163586; a
    project-trained tokenizer has its own ids. ``extra_stop`` holds further ids
    that end generation (``[EOS]``, spec §11.2: harmless to stop on).
    """

    open: int
    close: int
    sep: int
    end_of_msg: int
    extra_stop: frozenset[int] = frozenset()


TokenBytes = Callable[[int], Union[bytes, None]]


def parser_vocab(tokenizer: Any) -> tuple[TokenBytes, MarkupIds]:
    """Extract what the parser needs from a tokenizer: id -> bytes, and the marker ids.

    Accepts an ``openk3.tokenizer.Tokenizer`` (markup ids from ``open_id`` …,
    extra stops from ``stop_token_ids``) or a ``tiktoken.Encoding`` whose
    special tokens include the four marker spellings. The returned function
    gives the bytes of an ordinary token and ``None`` for a special one that is
    not a marker (media, reserved, ``[BOS]`` …), which the parser drops. Raises
    ``ValueError`` for an id outside the vocabulary, a missing marker, or an
    unsupported tokenizer type.
    """
    if all(
        hasattr(tokenizer, a)
        for a in ("open_id", "close_id", "sep_id", "end_of_msg_id", "special_ids")
    ):
        eom = tokenizer.end_of_msg_id
        markup = MarkupIds(
            tokenizer.open_id,
            tokenizer.close_id,
            tokenizer.sep_id,
            eom,
            frozenset(getattr(tokenizer, "stop_token_ids", ())) - {eom},
        )
        special_ids = frozenset(tokenizer.special_ids)
        decode_one = lambda tid: tokenizer.decode_bytes([tid])  # noqa: E731
    elif hasattr(tokenizer, "special_tokens_set") and hasattr(
        tokenizer, "decode_single_token_bytes"
    ):
        special = {s: tokenizer.encode_single_token(s) for s in tokenizer.special_tokens_set}
        missing = [s for s in MARKER_STRINGS if s not in special]
        if missing:
            raise ValueError(f"tokenizer: special tokens {missing} are not in the vocabulary")
        markup = MarkupIds(
            special["<|open|>"],
            special["<|close|>"],
            special["<|sep|>"],
            special["<|end_of_msg|>"],
            frozenset(special[s] for s in ("[EOS]",) if s in special),
        )
        special_ids = frozenset(special.values())

        def decode_one(tid: int) -> bytes:
            try:
                return tokenizer.decode_single_token_bytes(tid)
            except KeyError:
                raise ValueError(f"token_ids: id {tid} is not in the vocabulary") from None
    else:
        raise ValueError(
            f"tokenizer: unsupported type {type(tokenizer).__name__}; "
            "need an openk3 Tokenizer or a tiktoken.Encoding"
        )
    cache: dict[int, bytes] = {}  # generation revisits the same few thousand ids

    def token_bytes(tid: int) -> bytes | None:
        if tid in special_ids:
            return None
        data = cache.get(tid)
        if data is None:
            data = cache[tid] = decode_one(tid)
        return data

    return token_bytes, markup


def unescape_attr(value: str) -> str:
    """Reverse the attribute escaping of spec §2 (``&quot;`` first, then ``&amp;``)."""
    return value.replace("&quot;", '"').replace("&amp;", "&")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-JSON constant {name}")


def _finite_float(text: str) -> float:
    x = float(text)
    if not math.isfinite(x):  # 1e400 would serialize as Infinity, which is not JSON
        raise ValueError(f"number out of range: {text}")
    return x


def typed_argument_value(body: str, arg_type: str | None) -> Any:
    """Python value of one ``argument`` body (spec §11.3).

    ``type="string"`` keeps the raw body; any other type is JSON-decoded
    (surrounding whitespace allowed), falling back to the raw text as a string
    when that fails or yields a non-finite number.
    """
    if arg_type is not None and arg_type.strip() == "string":
        return body
    try:
        return json.loads(body, parse_constant=_reject_constant, parse_float=_finite_float)
    except ValueError:
        return body


@dataclass(frozen=True)
class OutputGrammar:
    """The language the parser accepts (spec §11.1), for constrained decoding.

    ``markers``: the four marker spellings (each one special id, see ``marker_ids``).
    ``tags``: tag name -> attribute keys in their fixed order (§2).
    ``argument_types``: values of the ``argument`` tag's ``type`` attribute (§6).
    ``ebnf``: the grammar in EBNF, terminals quoted; ``<|open|>`` etc. denote the
    single special ids, never their text.
    """

    markers: tuple[str, ...]
    marker_ids: MarkupIds | None
    tags: dict[str, tuple[str, ...]]
    argument_types: tuple[str, ...]
    ebnf: str


_EBNF_COMMON = r"""
response_ch ::= "<|open|>" "response" "<|sep|>" text "<|close|>" "response" "<|sep|>"
tools_ch    ::= "<|open|>" "tools" "<|sep|>" call+ "<|close|>" "tools" "<|sep|>"
call        ::= "<|open|>" "call" ' tool="' attr_value '"' ' index="' digits '"' "<|sep|>"
                ( argument* | json_block ) "<|close|>" "call" "<|sep|>"
argument    ::= "<|open|>" "argument" ' key="' attr_value '"' ' type="' arg_type '"' "<|sep|>"
                text "<|close|>" "argument" "<|sep|>"
json_block  ::= "<|open|>" "json" ' type="object"' "<|sep|>" text "<|close|>" "json" "<|sep|>"
msg_end     ::= "<|close|>" "message" "<|sep|>" "<|end_of_msg|>"
arg_type    ::= "string" | "number" | "boolean" | "null" | "object" | "array"
attr_value  ::= { any character except '"' }      (& and " written as &amp; and &quot;)
text        ::= { ordinary token }                 (never a marker id)
digits      ::= [0-9]+
"""


def output_grammar(
    tokenizer: Any = None, start_channel: Literal["think", "response"] = "think"
) -> OutputGrammar:
    """Describe the output grammar for a generation that starts in ``start_channel``.

    With a tokenizer, ``marker_ids`` holds its marker ids (else None). Raises
    ``ValueError`` for an unknown ``start_channel`` or an unsupported tokenizer.
    """
    if start_channel == "think":
        top = 'output ::= text "<|close|>" "think" "<|sep|>" [response_ch] [tools_ch] msg_end'
    elif start_channel == "response":
        top = 'output ::= text "<|close|>" "response" "<|sep|>" [tools_ch] msg_end'
    else:
        raise ValueError(f"start_channel: must be 'think' or 'response', got {start_channel!r}")
    tags = {
        "message": ("role", "name"),
        "think": (),
        "response": (),
        "tools": (),
        "call": ("tool", "index"),
        "argument": ("key", "type"),
        "json": ("type",),
    }
    ids = parser_vocab(tokenizer)[1] if tokenizer is not None else None
    return OutputGrammar(MARKER_STRINGS, ids, tags, ARGUMENT_TYPES, top + _EBNF_COMMON)
