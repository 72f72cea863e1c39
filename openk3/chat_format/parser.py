"""Incremental parser for K3 model output: token ids -> reasoning, content, tool calls.

Implements spec k3-chat-format.md §11 (output grammar, mapping back to the
OpenAI message, streaming rules) and §2 (attribute escaping). Generation starts
inside the channel opened by the generation prompt (``think``, or ``response``
when thinking is off or a partial prefill continues the answer):

    OUTPUT := REASONING ⟨close⟩think⟨sep⟩ [RESPONSE] [TOOLS] ⟨close⟩message⟨sep⟩ ⟨eom⟩

Markers are recognised on the special ids only (``<|open|>``, ``<|close|>``,
``<|sep|>``, ``<|end_of_msg|>``), never on decoded text, so marker spellings
produced as ordinary BPE text stay text (§11.3) and markup ids can never leak
into a field. Tag names and attributes (the ordinary tokens between an
open/close id and ``<|sep|>``) are buffered whole and never emitted. Text is
decoded with an incremental UTF-8 decoder, so every delta is whole characters.

Tolerance (§11.1, release notes §1.11): whitespace inside a tag
(``<|close|> think <|sep|>``, ``key = "v"``) and between structural elements
(between channels, calls and arguments) is ignored; bodies are verbatim.
Also accepted: a tools channel right after the think close or ending the
response body, the think/response opener repeated by the model, a call,
argument or json block ended implicitly by the next structural tag, and text
after the think close without a response opener (taken as content from its first
non-whitespace character). Unknown tags and non-text special ids are dropped.

Streaming contract: for every field, the concatenation of its deltas equals
the final value; a tool call's argument deltas concatenate to its final
``arguments``. A call that is still open when the stream stops (max tokens) has
had a start event but no end event, and is not in the final message.
"""

from __future__ import annotations

import codecs
import json
import operator
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Literal, Union

from openk3.chat_format.output_grammar import (  # noqa: F401 - re-exported for parser users
    MARKER_STRINGS,
    MarkupIds,
    TokenBytes,
    parser_vocab,
    typed_argument_value,
    unescape_attr,
)
from openk3.chat_format.tool_ids import make_tool_call_id

_MAX_TAG_BYTES = 16384  # bounds memory if the model never closes a tag
_ATTR = re.compile(r'([^\s="]+)\s*=\s*"([^"]*)"')
_TAG = re.compile(r"\s*(\S*)(.*)", re.DOTALL)


@dataclass(frozen=True)
class ReasoningDelta:
    """Think-channel text to append to ``reasoning_content``."""

    text: str


@dataclass(frozen=True)
class ContentDelta:
    """Response-channel text to append to ``content``."""

    text: str


@dataclass(frozen=True)
class ToolCallStart:
    """A call opened: ``index`` is 0-based within this response (OpenAI stream index)."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArgumentsDelta:
    """A fragment of the call's ``arguments`` JSON string."""

    index: int
    text: str


@dataclass(frozen=True)
class ToolCallEnd:
    """A call completed; ``arguments`` equals the concatenation of its deltas."""

    index: int
    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class MessageEnd:
    """The message ended (end marker, stop id, or ``finish()``)."""

    finish_reason: Literal["stop", "length", "tool_calls"]


Event = Union[
    ReasoningDelta, ContentDelta, ToolCallStart, ToolCallArgumentsDelta, ToolCallEnd, MessageEnd
]


@dataclass
class ParsedMessage:
    """The final assistant message (spec §11.3, api.md §2.1).

    ``reasoning_content`` is ``None`` when the output started in the response
    channel (thinking off), else the think text (possibly ``""``). ``content``
    is ``None`` when the response body is empty. ``tool_calls`` holds complete
    calls only, as OpenAI dicts ``{"id", "type": "function", "function":
    {"name", "arguments"}}``. ``ended`` is whether the end of the message was seen.
    """

    reasoning_content: str | None
    content: str | None
    tool_calls: list[dict[str, Any]]
    finish_reason: Literal["stop", "length", "tool_calls"]
    ended: bool

    def to_openai(self) -> dict[str, Any]:
        """The chat-completions ``message`` object; keys absent when they carry nothing."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning_content is not None:
            msg["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            msg["tool_calls"] = [dict(c, function=dict(c["function"])) for c in self.tool_calls]
        return msg


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


@dataclass
class _Call:
    """A call being parsed. ``index`` is None for a call without a name (dropped)."""

    index: int | None
    id: str = ""
    name: str = ""
    source: Literal["args", "json"] | None = None
    parts: list[str] = field(default_factory=list)
    held: list[Event] = field(default_factory=list)


@dataclass
class _Arg:
    """The argument or json block being parsed; ``active`` False means its body is ignored."""

    active: bool
    is_string: bool = False
    arg_type: str | None = None
    body: list[str] = field(default_factory=list)


class OutputParser:
    """Incremental state machine over generated ids (spec §11); one instance per response.

    Args:
        tokenizer: see ``parser_vocab``; or pass ``vocab=(token_bytes, MarkupIds)``.
        start_channel: ``"think"`` when the prompt ended with the think opener,
            ``"response"`` when thinking is off or a partial prefill continues
            the answer.
        tool_index_start: running index of the first call of this response (the
            number of calls already in the conversation, see
            ``tool_ids.next_tool_call_index``); ids are ``functions.NAME:IDX``.
        stream_tool_arguments: emit argument deltas as they are parsed; if
            False, a call's start/delta/end events are released together when
            the call completes (spec §11.3 "emit a tool call once its close
            arrives").
        tools_enabled: False for ``tool_choice="none"``: calls are parsed but
            dropped, as vLLM does (§11.3).

    Usage: ``events = p.feed(ids)`` any number of times (ints or iterables of
    ints), then ``p.finish()``; ``p.message()`` gives the ``ParsedMessage``.
    Raises ``ValueError`` for a negative / non-integer / unknown id or bad arguments.
    """

    def __init__(
        self,
        tokenizer: Any = None,
        *,
        vocab: tuple[TokenBytes, MarkupIds] | None = None,
        start_channel: Literal["think", "response"] = "think",
        tool_index_start: int = 0,
        stream_tool_arguments: bool = True,
        tools_enabled: bool = True,
    ) -> None:
        if (tokenizer is None) == (vocab is None):
            raise ValueError("tokenizer/vocab: pass exactly one of them")
        if start_channel not in ("think", "response"):
            raise ValueError(f"start_channel: must be 'think' or 'response', got {start_channel!r}")
        if (
            isinstance(tool_index_start, bool)
            or not isinstance(tool_index_start, int)
            or tool_index_start < 0
        ):
            raise ValueError(f"tool_index_start: must be an int >= 0, got {tool_index_start!r}")
        self._token_bytes, self._ids = vocab if vocab is not None else parser_vocab(tokenizer)
        self._stops = frozenset({self._ids.end_of_msg}) | self._ids.extra_stop
        self._thinking = start_channel == "think"
        self._mode = "think" if self._thinking else "response"
        self._tool_base = tool_index_start
        self._stream_args = stream_tool_arguments
        self._tools_enabled = tools_enabled
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._tag: bytearray | None = None  # bytes of the open/close tag being read
        self._tag_is_close = False
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self._calls: list[dict[str, Any]] = []
        self._n_started = 0
        self._call: _Call | None = None
        self._arg: _Arg | None = None
        self._seen_response = not self._thinking
        self._seen_tools = False
        self._ended = False
        self._finished = False

    # ----------------------------------------------------------------- public

    def feed(self, token_ids: int | Iterable[int]) -> list[Event]:
        """Consume one id or a sequence of ids; returns the events they complete.

        Args:
            token_ids: an integer id, or an iterable of them (list, tuple, numpy array, torch
                tensor of shape [] or [T]).

        Raises:
            ValueError: `token_ids` is neither an integer nor an iterable of integers (a float,
                None, a string, bytes, a bool), or an id is negative / outside the vocabulary.
                Bad input is a value error like every other malformed input of the chat format;
                no ``TypeError`` escapes.
        """
        if hasattr(token_ids, "tolist"):  # numpy / torch: [] -> int, [T] -> list
            token_ids = token_ids.tolist()
        ids: Iterable[Any]
        if isinstance(token_ids, (str, bytes, bytearray, dict, set, frozenset)):
            # Iterable, but not a sequence of ids (bytes would iterate as small ints).
            raise ValueError(
                f"token_ids: expected an integer id or a sequence of ids, got "
                f"{type(token_ids).__name__}"
            )
        try:
            ids = [self._index(token_ids)]
        except ValueError:
            try:
                ids = iter(token_ids)  # type: ignore[call-overload]
            except TypeError:
                raise ValueError(
                    f"token_ids: expected an integer id or a sequence of ids, got {token_ids!r:.60}"
                ) from None
        out: list[Event] = []
        for raw in ids:
            tid = self._index(raw)
            if tid < 0:
                raise ValueError(f"token_ids: negative id {tid}")
            if self._ended or self._finished:
                continue  # anything after the end of the message is ignored (§11.2)
            self._step(tid, out)
        return out

    @staticmethod
    def _index(raw: Any) -> int:
        # bool is an int subclass, but True is never meant as token id 1.
        if isinstance(raw, bool):
            raise ValueError(f"token_ids: expected integer ids, got {raw!r}")
        try:
            return operator.index(raw)
        except TypeError:
            raise ValueError(f"token_ids: expected integer ids, got {raw!r:.60}") from None

    def finish(self) -> list[Event]:
        """Generation stopped: close the parse and return the final events.

        If no end of message was seen (max tokens), text is kept up to the last
        whole character, and a pending tag or an unfinished call is dropped.
        Calling it again returns ``[]``.
        """
        if self._finished:
            return []
        self._finished = True
        out: list[Event] = []
        if not self._ended:
            self._decoder.reset()  # an incomplete trailing character is not a complete part
            self._tag = None
            self._call = None
            self._arg = None
            out.append(MessageEnd(self.finish_reason))
        return out

    @property
    def in_reasoning(self) -> bool:
        """Whether the next id is read inside the think channel (its closing tag included): the
        ids a client bills as reasoning tokens."""
        return self._mode == "think"

    @property
    def finish_reason(self) -> Literal["stop", "length", "tool_calls"]:
        """``tool_calls`` if a complete call was parsed (and tools are enabled),
        else ``length`` while the message has not ended, else ``stop`` (spec §11.2)."""
        if self._calls:
            return "tool_calls"
        return "stop" if self._ended else "length"

    def message(self) -> ParsedMessage:
        """The message as parsed so far; call after ``finish()`` for the final one."""
        content = "".join(self._content)
        return ParsedMessage(
            reasoning_content="".join(self._reasoning) if self._thinking else None,
            content=content or None,
            tool_calls=[dict(c, function=dict(c["function"])) for c in self._calls],
            finish_reason=self.finish_reason,
            ended=self._ended,
        )

    # ---------------------------------------------------------------- tokens

    def _step(self, tid: int, out: list[Event]) -> None:
        ids = self._ids
        if tid in self._stops:
            self._end_message(out)
        elif tid == ids.open or tid == ids.close:
            if self._tag is None:
                self._flush_text(out)
            # an unterminated earlier tag is malformed: dropped, never shown as text
            self._tag = bytearray()
            self._tag_is_close = tid == ids.close
        elif tid == ids.sep:
            if self._tag is not None:
                raw = self._tag
                self._tag = None
                self._on_tag(self._tag_is_close, raw, out)
        else:
            data = self._token_bytes(tid)
            if data is None:
                return
            if self._tag is not None:
                if len(self._tag) < _MAX_TAG_BYTES:
                    self._tag += data
            else:
                self._on_text(self._decoder.decode(data), out)

    def _flush_text(self, out: list[Event]) -> None:
        # A multi-byte character cannot span a marker; dangling bytes become U+FFFD.
        tail = self._decoder.decode(b"", final=True)
        self._decoder.reset()
        if tail:
            self._on_text(tail, out)

    def _on_text(self, text: str, out: list[Event]) -> None:
        if not text:
            return
        mode = self._mode
        if mode == "between":
            if self._seen_response or self._seen_tools:
                return
            text = text.lstrip()  # whitespace after the think close is not content
            if not text:
                return
            self._mode = mode = "response"  # the response opener was left out
            self._seen_response = True
        if mode == "think":
            self._reasoning.append(text)
            out.append(ReasoningDelta(text))
        elif mode == "response":
            self._content.append(text)
            out.append(ContentDelta(text))
        elif mode == "arg" and self._arg is not None and self._arg.active:
            if self._arg.is_string:
                self._args_text(_dumps(text)[1:-1], out)  # JSON escaping is per character
            else:
                self._arg.body.append(text)
        elif mode == "json" and self._arg is not None and self._arg.active:
            self._args_text(text, out)
        # text inside tools/call (between elements) is ignored

    # ------------------------------------------------------------------ tags

    def _on_tag(self, is_close: bool, raw: bytes, out: list[Event]) -> None:
        m = _TAG.match(raw.decode("utf-8", errors="replace"))
        name = m.group(1)
        rest = m.group(2)
        attrs = {k: unescape_attr(v) for k, v in _ATTR.findall(rest)}
        if is_close:
            self._on_close(name, out)
        else:
            self._on_open(name, attrs, out)

    def _on_open(self, name: str, attrs: dict[str, str], out: list[Event]) -> None:
        mode = self._mode
        if name == "think":
            if mode == "between" and not self._seen_response and not self._seen_tools:
                self._mode = "think"
            return  # a repeated opener at the start of the think channel is ignored
        if name == "response":
            if mode in ("think", "between"):
                self._mode = "response"
                self._seen_response = True
            return
        if name == "tools":
            if mode in ("think", "response", "between"):
                self._mode = "tools"
                self._seen_tools = True
            return
        if name == "call":
            if mode in ("call", "arg", "json"):
                self._complete_call(out)
            if mode in ("think", "response", "between", "tools", "call", "arg", "json"):
                self._seen_tools = True
                self._start_call(attrs.get("tool", "").strip(), out)
            return
        if name in ("argument", "json") and mode in ("call", "arg", "json"):
            self._end_arg(out)
            self._start_arg(name, attrs, out)
        # unknown tags and tags out of place are dropped

    def _on_close(self, name: str, out: list[Event]) -> None:
        mode = self._mode
        if name == "think" and mode == "think":
            self._mode = "between"
        elif name == "response" and mode == "response":
            self._mode = "between"
        elif name == "tools" and mode in ("tools", "call", "arg", "json"):
            if mode != "tools":
                self._complete_call(out)
            self._mode = "between"
        elif name == "call" and mode in ("call", "arg", "json"):
            self._complete_call(out)
            self._mode = "tools"
        elif (name == "argument" and mode == "arg") or (name == "json" and mode == "json"):
            self._end_arg(out)
            self._mode = "call"
        elif name == "message":
            if mode in ("call", "arg", "json"):
                self._complete_call(out)
            self._end_message(out)

    # ----------------------------------------------------------------- calls

    def _emit(self, event: Event, out: list[Event]) -> None:
        call = self._call
        if call is None or call.index is None or not self._tools_enabled:
            return
        (out if self._stream_args else call.held).append(event)

    def _start_call(self, name: str, out: list[Event]) -> None:
        self._mode = "call"
        self._arg = None
        if not name:
            self._call = _Call(index=None)  # spec §11.3: a call without a name is dropped
            return
        index = self._n_started
        self._n_started += 1
        self._call = _Call(
            index=index, id=make_tool_call_id(name, self._tool_base + index), name=name
        )
        self._emit(ToolCallStart(index, self._call.id, name), out)

    def _args_text(self, text: str, out: list[Event]) -> None:
        call = self._call
        if call is None or call.index is None or not text:
            return
        call.parts.append(text)
        self._emit(ToolCallArgumentsDelta(call.index, text), out)

    def _start_arg(self, kind: str, attrs: dict[str, str], out: list[Event]) -> None:
        call = self._call
        self._mode = "arg" if kind == "argument" else "json"
        if call is None or call.index is None:
            ok = False
        elif kind == "argument":  # a value without a key cannot go into the object
            ok = call.source in (None, "args") and "key" in attrs
        else:  # the first of json block / argument tags decides the call's form
            ok = call.source is None
        if not ok:
            self._arg = _Arg(active=False)
            return
        arg_type = attrs.get("type")
        is_string = arg_type is not None and arg_type.strip() == "string"
        self._arg = _Arg(active=True, is_string=is_string, arg_type=arg_type)
        if kind == "argument":
            prefix = "{" if call.source is None else ", "
            call.source = "args"
            self._args_text(prefix + _dumps(attrs["key"]) + ": " + ('"' if is_string else ""), out)
        else:
            call.source = "json"

    def _end_arg(self, out: list[Event]) -> None:
        if self._mode not in ("arg", "json"):
            return
        self._flush_text(out)
        arg = self._arg
        self._arg = None
        if arg is None or not arg.active or self._mode == "json":
            return
        if arg.is_string:
            self._args_text('"', out)
        else:
            self._args_text(_dumps(typed_argument_value("".join(arg.body), arg.arg_type)), out)

    def _complete_call(self, out: list[Event]) -> None:
        self._end_arg(out)
        call = self._call
        self._call = None
        self._mode = "tools"
        if call is None or call.index is None:
            return
        self._call = call  # so that _emit sees it
        if call.source is None or (call.source == "json" and not call.parts):
            self._args_text("{}", out)  # no arguments at all (§6: rendered with no tags)
        elif call.source == "args":
            self._args_text("}", out)
        arguments = "".join(call.parts)
        self._emit(ToolCallEnd(call.index, call.id, call.name, arguments), out)
        self._call = None
        if not self._tools_enabled:
            return
        out.extend(call.held)
        self._calls.append(
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": arguments},
            }
        )

    # --------------------------------------------------------------- message

    def _end_message(self, out: list[Event]) -> None:
        self._flush_text(out)
        self._tag = None
        if self._mode in ("call", "arg", "json"):
            self._complete_call(out)
        self._ended = True
        self._mode = "done"
        out.append(MessageEnd(self.finish_reason))
