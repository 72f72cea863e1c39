"""Render chat requests into K3 prompt ids (inference and training) and assistant messages into the
ids the model generates.

Source: ``../shared/spec/k3-chat-format.md`` (§2 tag syntax, §3 layout, §4 messages, §5 internal
messages, §6 arguments, §7 canonical JSON, §9 generation prompt and partial prefill, §10 images,
§12 counting) and the server mapping in ``../shared/fixtures/k3-chat-format/README.md``.

Tokenisation is segment-wise (§1.3): markup (``<|open|>``, ``<|close|>``, ``<|sep|>``,
``<|end_of_msg|>``, one ``<|media_pad|>`` per image) becomes single special ids; every other piece is
BPE-encoded on its own with special tokens off: the tag name, each attribute's ``" key"``, ``="``,
escaped value and ``"``, the close-tag name, each internal-message body, each text part, the
reasoning, each argument value and json block. User text can therefore never produce markup.

Contract with the output parser (``parser.py``): :func:`render_assistant_output` gives exactly the
ids the model generates after the generation prompt for an assistant message (think text, think
close, response channel, tools channel, ``<|close|>message<|sep|><|end_of_msg|>``), and these ids
are the masked span of that message in :func:`render_training` and the tail of its history
rendering (except that the prompt leaves out the empty response channel of a message with tool calls
and no content, §12), so render -> parse -> render round-trips. ``Prompt.channel`` says which channel generation
starts inside (``"think"`` or ``"response"``) and ``Prompt.history_tool_calls`` how many calls the
history holds (the running index of ``functions.NAME:IDX`` ids).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from openk3.chat_format.request import (
    AssistantMessage,
    Conversation,
    DynamicTools,
    ImageSlot,
    Message,
    Parts,
    RequestOptions,
    SkippedMessage,
    TextMessage,
    ToolCall,
    ToolResult,
    parse_conversation,
    parse_message,
    tool_name,
)
from openk3.tokenizer import CLOSE, END_OF_MSG, OPEN, SEP, Tokenizer

IMAGE_PLACEHOLDER = (
    "<|kimi_image_placeholder|>"  # how an image slot is spelled in prompt text (§10)
)

# Internal system-message bodies (§5): exact text, they are training data.
TOOLS_HEADER = "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n"
DYNAMIC_TOOLS_HEADER = (
    "## New Tools Available\nThe system dynamically extends the toolset via lazy-loading.\n"
    "You have access to all existing and extended tools.\nHere are the specs for the extended tools.\n\n```json\n"
)
EFFORT_BODY = (
    "`thinking_effort` guides on how much to think in your thinking channel (not including the response "
    "channel), supported values include `low`, `medium`, `high`, and `max`.\n"
    "Now the system is invoked with `thinking_effort={effort}`."
)
TOOL_CHOICE_BODY = {
    "required": "The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next message.",
    "none": "The system is invoked with `tool_choice=none`.\nYou MUST NOT call any tools in the next message.",
}
JSON_RULE = (
    "Your response must be raw JSON data without markdown code blocks (```json) "
    "or any additional formatting."
)
RESPONSE_FORMAT_BODY = {
    "json_object": "The system is invoked with `response_format=json_object`.\n" + JSON_RULE,
    "json_schema": (
        "The system is invoked with `response_format=json_schema`.\n"
        + JSON_RULE
        + "\nThe JSON data must match the following schema:\n```json\n{schema}\n```"
    ),
}
STUB_TOKENS = (
    3  # <|open|>think<|sep|> or <|open|>response<|sep|>: the uncounted "pending" tokens (§12)
)


def canonical_json(value: Any, where: str = "value") -> str:
    """Compact JSON with every object's keys in code-point order, non-ASCII kept (§7).

    Raises:
        ValueError: `value` is not JSON data (a set, NaN / Infinity, mixed key types; named by `where`).
    """
    try:
        return json.dumps(
            value, ensure_ascii=False, sort_keys=True, separators=(",", ":"), allow_nan=False
        )
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: not JSON-serialisable ({e})") from e


def escape_attr(value: Any) -> str:
    """Attribute escaping (§2): ``&`` -> ``&amp;`` first, then ``"`` -> ``&quot;``; nothing else."""
    return str(value).replace("&", "&amp;").replace('"', "&quot;")


def argument_tag(value: Any) -> tuple[str, str]:
    """(type attribute, body) of one argument value (§6); booleans are tested before numbers."""
    if isinstance(value, bool):
        return "boolean", "true" if value else "false"
    if value is None:
        return "null", "null"
    if isinstance(value, (int, float)):
        return "number", json.dumps(value)
    if isinstance(value, str):
        return "string", value
    # Object / array values keep key order and the template engine's default separators (§6, §13).
    return ("object" if isinstance(value, dict) else "array"), json.dumps(value, ensure_ascii=False)


def _has_text(s: str | None) -> bool:
    return bool(s) and bool(s.strip())


class _Builder:
    """Accumulates ids, prompt text and image slots segment by segment (§1.3)."""

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self.ids: list[int] = []
        self.chunks: list[str] = []
        self.image_slots: list[int] = []
        self.images: list[dict] = []
        self.image_locations: list[str] = []
        self._markup = {
            OPEN: tok.open_id,
            CLOSE: tok.close_id,
            SEP: tok.sep_id,
            END_OF_MSG: tok.end_of_msg_id,
        }

    def markup(self, token: str) -> None:
        self.ids.append(self._markup[token])
        self.chunks.append(token)

    def text(self, s: str) -> None:
        if s:
            self.ids.extend(self.tok.encode_text(s))
            self.chunks.append(s)

    def parts(self, parts: Parts) -> None:
        for p in parts:
            if isinstance(p, ImageSlot):
                self.image_slots.append(len(self.ids))
                self.images.append(p.part)
                self.image_locations.append(p.where)
                self.ids.append(self.tok.media_pad_id)
                self.chunks.append(IMAGE_PLACEHOLDER)
            else:
                self.text(p)

    def open(self, name: str, attrs: Sequence[tuple[str, Any]] = ()) -> None:
        self.markup(OPEN)
        self.text(name)
        for key, value in attrs:
            self.text(" " + key)
            self.text('="')
            self.text(escape_attr(value))
            self.text('"')
        self.markup(SEP)

    def close(self, name: str) -> None:
        self.markup(CLOSE)
        self.text(name)
        self.markup(SEP)

    def end_message(self) -> None:
        self.close("message")
        self.markup(END_OF_MSG)

    def internal(self, kind: str, body: str) -> None:
        self.open("message", [("role", "system"), ("type", kind)])
        self.text(body.strip())
        self.end_message()

    def message_open(self, role: str, name: str | None) -> None:
        self.open("message", [("role", role)] + ([("name", name)] if name else []))

    @property
    def text_value(self) -> str:
        return "".join(self.chunks)


def _tool_declare(b: _Builder, tools: list, dynamic: bool, where: str) -> None:
    header = DYNAMIC_TOOLS_HEADER if dynamic else TOOLS_HEADER
    b.internal("tool-declare", header + canonical_json(tools, where) + "\n```")


def _tools_channel(b: _Builder, calls: list[ToolCall]) -> None:
    b.open("tools")
    for j, call in enumerate(calls, start=1):
        b.open("call", [("tool", call.name), ("index", j)])
        if call.arguments is not None:
            for key, value in call.arguments.items():
                kind, body = argument_tag(value)
                b.open("argument", [("key", key), ("type", kind)])
                b.text(body)
                b.close("argument")
        elif call.raw_json is not None:
            b.open("json", [("type", "object")])
            b.text(call.raw_json)
            b.close("json")
        b.close("call")
    b.close("tools")


def _assistant_output(b: _Builder, msg: AssistantMessage, thinking: bool) -> None:
    """What the model generates after the stub ``<|open|>think<|sep|>`` (or response, thinking off)."""
    if thinking:
        if _has_text(msg.reasoning):
            b.text(msg.reasoning)
        b.close("think")
        b.open("response")
    b.parts(msg.parts)
    b.close("response")
    if msg.calls:
        _tools_channel(b, msg.calls)
    b.end_message()


@dataclass
class _Rendered:
    builder: _Builder
    options: RequestOptions
    pending: int
    channel: str | None
    partial: bool
    history_tool_calls: int
    tool_names: tuple[str, ...] = ()
    output_spans: list[tuple[int, int]] = field(default_factory=list)


def _render(
    conv: Conversation, tok: Tokenizer, add_generation_prompt: bool, training: bool
) -> _Rendered:
    messages, opts = (
        list(conv.messages),
        conv.options,
    )  # a copy: the final partial message is popped
    partial: AssistantMessage | None = None
    if isinstance(messages[-1], AssistantMessage) and messages[-1].partial:
        if training:
            raise ValueError(
                f"messages[{messages[-1].index}].partial: not allowed in training rendering"
            )
        partial = messages.pop()
        if partial.calls:
            raise ValueError(
                f"messages[{partial.index}].tool_calls: a partial assistant message cannot carry "
                "tool calls"
            )

    b = _Builder(tok)
    if opts.tools:
        _tool_declare(b, opts.tools, dynamic=False, where="tools")
    if opts.thinking:
        b.internal("thinking-effort", EFFORT_BODY.format(effort=opts.thinking_effort))
    names = [tool_name(t) for t in opts.tools]
    names += [tool_name(t) for m in messages if isinstance(m, DynamicTools) for t in m.tools]
    out = _Rendered(
        b,
        opts,
        pending=0,
        channel=None,
        partial=partial is not None,
        history_tool_calls=0,
        tool_names=tuple(n for n in names if n is not None),
    )
    _conversation(b, messages, opts.thinking, not training, out)

    if opts.render_tool_choice:
        b.internal("tool-choice", TOOL_CHOICE_BODY[opts.tool_choice])
    if opts.response_format is not None:
        schema = canonical_json(opts.response_schema, "response_format.json_schema")
        b.internal(
            "response-format", RESPONSE_FORMAT_BODY[opts.response_format].format(schema=schema)
        )

    if partial is not None:
        _partial_prefix(b, partial, opts.thinking, out)
    elif add_generation_prompt:
        b.message_open("assistant", None)
        out.channel = "think" if opts.thinking else "response"
        b.open(out.channel)
        out.pending = STUB_TOKENS
    return out


def _conversation(
    b: _Builder, messages: list[Message], thinking: bool, prompt_history: bool, out: _Rendered
) -> None:
    """Render the conversation messages. `prompt_history`: an assistant message with tool calls and
    no content renders no response channel (§12: the rule that reproduces both Moonshot counts, the
    99-token README anchor and the 539-token groundtruth); training keeps the channel, as the model
    generates it (the output grammar always opens the response channel)."""
    calls: list[ToolCall] | None = None
    counter = 0
    i = 0
    while i < len(messages):
        m = messages[i]
        if isinstance(m, SkippedMessage):
            pass  # a role the template has no branch for renders nothing (§4.5)
        elif isinstance(m, TextMessage):
            b.message_open(m.role, m.name)
            b.parts(m.parts)
            b.end_message()
        elif isinstance(m, DynamicTools):
            _tool_declare(b, m.tools, dynamic=True, where=f"messages[{m.index}].tools")
        elif isinstance(m, AssistantMessage):
            calls = m.calls
            counter = 0
            out.history_tool_calls += len(m.calls)
            b.message_open("assistant", m.name)
            if prompt_history and m.calls and not m.parts:
                if thinking:
                    b.open("think")
                    if _has_text(m.reasoning):
                        b.text(m.reasoning)
                    b.close("think")
                _tools_channel(b, m.calls)
                b.end_message()
            else:
                b.open("think" if thinking else "response")
                start = len(b.ids)
                _assistant_output(b, m, thinking)
                out.output_spans.append((start, len(b.ids)))
        else:
            j = i
            while j < len(messages) and isinstance(messages[j], ToolResult):
                j += 1
            counter = _tool_run(b, messages[i:j], calls or [], counter)
            i = j
            continue
        i += 1


def _tool_run(b: _Builder, run: list[ToolResult], calls: list[ToolCall], counter: int) -> int:
    """Render a maximal run of tool results against the latest assistant's calls (§4.4): resolved
    (every result's id names a call) in call order, otherwise in the given order (the template's
    fallback; the server refuses such a history before it gets here). Results marked ``by_name``
    (a Responses output that answers no call) come after the others, named by ``fallback_name``.
    Returns the counter after the run."""
    call_ids = {str(c.id) for c in calls if c.id is not None}

    def emit(r: ToolResult, name: str, index: int) -> None:
        b.open("message", [("role", "tool"), ("tool", name), ("index", index)])
        b.parts(r.parts)
        b.end_message()

    named = [r for r in run if r.by_name]
    if named:  # results named by themselves follow the ones that answer calls, in run order
        answers = [r for r in run if not r.by_name]
        if answers:
            counter = _tool_run(b, answers, calls, counter)
        for r in named:
            counter += 1
            emit(r, r.fallback_name, counter)
        return counter

    if all(r.id is not None and str(r.id) in call_ids for r in run):
        done: set[str] = set()
        for c in calls:
            if c.id is None or str(c.id) in done:
                continue
            done.add(str(c.id))
            for r in run:
                if str(r.id) == str(c.id):
                    counter += 1
                    emit(r, c.name, counter)
        return counter
    for r in run:  # unresolved run: the template's fallback (given order, running index)
        counter += 1
        name = r.fallback_name
        if name is None and counter <= len(calls):
            name = calls[counter - 1].name
        if name is None:
            raise ValueError(
                f"messages[{r.index}].tool_call_id: missing, and no tool name can be resolved "
                "(no 'tool'/'name' field and no preceding call at this position)"
            )
        emit(r, name, counter)
    return counter


def _partial_prefix(b: _Builder, m: AssistantMessage, thinking: bool, out: _Rendered) -> None:
    """Partial prefill (§9, server convention): open the message like history and stop inside the
    channel being continued; the stub alone (nothing to continue) stays uncounted."""
    b.message_open("assistant", m.name)
    has_content = bool(m.parts)
    if thinking:
        b.open("think")
        if has_content:
            if _has_text(m.reasoning):
                b.text(m.reasoning)
            b.close("think")
            b.open("response")
            b.parts(m.parts)
            out.channel = "response"
        else:
            out.channel = "think"
            if _has_text(m.reasoning):
                b.text(m.reasoning)
            else:
                out.pending = STUB_TOKENS
    else:
        b.open("response")
        out.channel = "response"
        if has_content:
            b.parts(m.parts)
        else:
            out.pending = STUB_TOKENS


@dataclass(frozen=True)
class Prompt:
    """A rendered prompt.

    Attributes:
        token_ids: prompt ids [T], ending with the generation stub (or the partial prefix).
        text: the prompt text; markup spelled literally, images as ``<|kimi_image_placeholder|>``.
        pending_tokens: trailing stub ids not counted in usage (3 or 0, §12).
        image_slots: indices in ``token_ids`` of image slots (each one ``<|media_pad|>`` id, §10).
        images: the original image content parts, one per slot, in order.
        image_locations: where the client wrote each of them (``messages[i].content[j]``), one per slot.
        thinking: thinking on/off; thinking_effort: effective effort (None when thinking is off).
        tool_choice: the request's tool_choice (``auto``/``none``/``required``).
        response_format: ``json_object``, ``json_schema`` or None.
        channel: channel the model continues in (``think``/``response``), None without a prompt.
        partial: True when a partial assistant message was continued.
        tool_names: declared tool names (request-level, then dynamic, in order).
        history_tool_calls: number of tool calls in the rendered history.
    """

    token_ids: list[int]
    text: str
    pending_tokens: int
    image_slots: list[int]
    images: list[dict]
    thinking: bool
    thinking_effort: str | None
    tool_choice: str
    response_format: str | None
    channel: str | None
    partial: bool
    tool_names: tuple[str, ...]
    history_tool_calls: int
    image_locations: tuple[str, ...] = ()

    @property
    def num_tokens(self) -> int:
        """len(token_ids)."""
        return len(self.token_ids)

    @property
    def prompt_tokens(self) -> int | None:
        """``usage.prompt_tokens`` = len(ids) - pending stub (§12); None with images, whose size is
        only known after the server expands them (use :meth:`prompt_tokens_with_images`)."""
        return None if self.image_slots else self.num_tokens - self.pending_tokens

    @property
    def prompt_tokens_excluding_images(self) -> int:
        """Count with every image slot left out (fixture field of the same name)."""
        return self.num_tokens - self.pending_tokens - len(self.image_slots)

    def prompt_tokens_with_images(self, image_tokens: Sequence[int]) -> int:
        """Count after expansion, given each image's expanded length (``3 + len(encode('image WxH')) + N``).

        Raises:
            ValueError: ``len(image_tokens)`` differs from the number of image slots.
        """
        if len(image_tokens) != len(self.image_slots):
            raise ValueError(
                f"image_tokens: {len(image_tokens)} sizes for {len(self.image_slots)} image slots"
            )
        return self.prompt_tokens_excluding_images + sum(int(n) for n in image_tokens)


def render(
    conversation: Conversation, tokenizer: Tokenizer, *, add_generation_prompt: bool = True
) -> Prompt:
    """Render a parsed request (:class:`~openk3.chat_format.request.Conversation`, e.g. the server's
    ``ChatRequest``) into K3 prompt ids; `conversation` is not modified.

    Args:
        conversation: normalised messages and options (:func:`~openk3.chat_format.request.
            parse_conversation`). A final assistant message with ``partial`` is continued (§9).
        tokenizer: a :class:`~openk3.tokenizer.Tokenizer` (Kimi BPE or trained BPE).
        add_generation_prompt: append ``<|open|>message role="assistant"<|sep|>`` plus the think
            (or response) stub; ignored when a partial message is continued.

    A history assistant message with tool calls and no content has no response channel (§12: the
    rule that gives both of Moonshot's counts, 99 for the verifier README's example and 539 for its
    groundtruth payload); every other message is rendered as the template renders it.

    Returns:
        :class:`Prompt`.

    Raises:
        ValueError: what only rendering can find (a partial message with tool calls, a tool result
            whose tool cannot be resolved, values that are not JSON-serialisable), naming the field.
    """
    r = _render(conversation, tokenizer, add_generation_prompt, training=False)
    b = r.builder
    o = r.options
    return Prompt(
        token_ids=b.ids,
        text=b.text_value,
        pending_tokens=r.pending,
        image_slots=b.image_slots,
        images=b.images,
        thinking=o.thinking,
        thinking_effort=o.thinking_effort,
        tool_choice=o.tool_choice,
        response_format=o.response_format,
        channel=r.channel,
        partial=r.partial,
        tool_names=r.tool_names,
        history_tool_calls=r.history_tool_calls,
        image_locations=tuple(b.image_locations),
    )


def encode_request(
    request: dict, tokenizer: Tokenizer, *, add_generation_prompt: bool = True
) -> Prompt:
    """Render a chat-completions request body into K3 prompt ids: :func:`render` of its
    :func:`~openk3.chat_format.request.parse_conversation` (the template's leniency).

    Args:
        request: the JSON body (``messages``, ``tools``, ``tool_choice``, ``response_format``,
            ``thinking``, ``reasoning_effort``, ``chat_template_kwargs``; other keys are ignored).
            A final assistant message with ``"partial": true`` is continued (§9).
        tokenizer: a :class:`~openk3.tokenizer.Tokenizer` (Kimi BPE or trained BPE).
        add_generation_prompt: as :func:`render`.

    Returns:
        :class:`Prompt`.

    Raises:
        ValueError: a malformed request; the message names the field, e.g.
            ``messages[2].tool_calls[0].function.arguments: ...`` or ``reasoning_effort: ...``.
    """
    return render(
        parse_conversation(request), tokenizer, add_generation_prompt=add_generation_prompt
    )


@dataclass(frozen=True)
class TrainingExample:
    """A rendered conversation for training.

    Attributes:
        token_ids: ids [T], identical to :func:`encode_request` without the generation prompt, except
            that an assistant message with tool calls and no content keeps its empty response channel
            here (what the model generates; the prompt leaves it out, §12).
        loss_mask: [T] ints, 1 exactly on assistant output ids (everything the model generates after
            ``<|open|>think<|sep|>``, through ``<|end_of_msg|>``), 0 elsewhere.
        text: the rendered text.
        image_slots: indices of image slots in ``token_ids``.
    """

    token_ids: list[int]
    loss_mask: list[int]
    text: str
    image_slots: list[int]


def render_training(
    conversation: dict | list, tokenizer: Tokenizer, *, train_on: str = "all"
) -> TrainingExample:
    """Render a conversation with an assistant-only loss mask.

    Args:
        conversation: a request dict (``messages`` plus optional ``tools``, ``reasoning_effort``,
            ``thinking``, ``tool_choice``, ``response_format``) or a bare list of messages.
        tokenizer: the tokenizer.
        train_on: ``"all"`` assistant messages, or only the ``"last"`` one.

    Raises:
        ValueError: a malformed conversation, a partial message, or an unknown `train_on`.
    """
    if train_on not in ("all", "last"):
        raise ValueError(f"train_on: must be 'all' or 'last', got {train_on!r}")
    request = {"messages": conversation} if isinstance(conversation, list) else conversation
    r = _render(parse_conversation(request), tokenizer, add_generation_prompt=False, training=True)
    mask = [0] * len(r.builder.ids)
    spans = r.output_spans[-1:] if train_on == "last" else r.output_spans
    for start, end in spans:
        mask[start:end] = [1] * (end - start)
    return TrainingExample(r.builder.ids, mask, r.builder.text_value, r.builder.image_slots)


def render_assistant_output(
    message: dict, tokenizer: Tokenizer, *, thinking: bool = True
) -> list[int]:
    """Ids the model generates for `message` after the generation prompt (§11.1):
    ``REASONING <|close|>think<|sep|> <|open|>response<|sep|> CONTENT <|close|>response<|sep|>
    [TOOLS] <|close|>message<|sep|><|end_of_msg|>`` (thinking off: from CONTENT on).

    Tool-call ids are not rendered; arguments become typed argument tags (or a json block) as in history.

    Raises:
        ValueError: `message` is not a valid assistant message (errors name ``message.<field>``).
    """
    m = parse_message(message, 0, where="message")
    if not isinstance(m, AssistantMessage):
        raise ValueError("message.role: must be 'assistant'")
    b = _Builder(tokenizer)
    _assistant_output(b, m, thinking)
    return b.ids
