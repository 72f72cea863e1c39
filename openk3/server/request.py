"""A chat request, parsed once: the chat-completions wire models, :class:`ChatRequest` and
:func:`parse_request`.

Sources: ``../shared/spec/api.md`` §1 (chat request fields), §6.2 (token counting);
``../shared/spec/k3-chat-format.md`` §4-§9 (what the messages and options mean).

Every surface turns its body into one :class:`ChatRequest` (messages plus every option the server
uses): this module for ``/v1/chat/completions`` and the token-count endpoint, the Anthropic adapter
(:mod:`openk3.server.anthropic`) for ``/anthropic/v1/messages``. The platform's checks take that
object (:mod:`openk3.server.validation`), the renderer renders it
(:func:`openk3.chat_format.render`), and :meth:`ChatRequest.to_sampling_params` makes the engine's
sampling parameters. Adding a request field means: a field on the wire model, one on
:class:`ChatRequest` filled in :func:`parse_request`, and its use (for a sampling parameter, in
:meth:`~ChatRequest.to_sampling_params` and the engine's ``SamplingParams``).

The wire models are deliberately *permissive*: every model ignores unknown keys (the platform
silently ignores them, api.md §1.1), and fields whose invalid values must produce a specific
platform message (``thinking`` given as a bool, the fixed sampling parameters, ``tool_choice``)
are typed loosely here and checked in :mod:`openk3.server.validation`, which owns the messages. They
give typed validation with field-named 400s and the OpenAPI document (which the schemathesis fuzz
run is generated from); the messages are then parsed from the JSON as sent
(:func:`openk3.chat_format.request.parse_conversation`, ``strict=True``), so nothing the client sent
is coerced before rendering.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, Field, StrictBool, StrictInt, ValidationError

from openk3.chat_format.request import Conversation, parse_conversation
from openk3.server.protocol import OpenModel, StrictFloat, bad_request, check_unicode, invalid_body

THINKING_BOOL = "the thinking field in the request (expected type object) is illegal, and bool is not acceptable"


# ------------------------------------------------------------------------------ wire models


class ImageURL(OpenModel):
    """An image reference: a base64 ``data:`` URL (http(s) URLs are refused, api.md §11)."""

    url: str
    detail: str | None = None


class ContentPart(OpenModel):
    """``{"type": "text", "text"}`` or ``{"type": "image_url", "image_url": {"url"} | "<url>"}``."""

    type: str = "text"
    text: str | None = None
    image_url: Union[ImageURL, str, None] = None


class FunctionCall(OpenModel):
    """``function`` of an assistant tool call; ``arguments`` a JSON-object string (or object)."""

    name: str
    arguments: Union[str, dict[str, Any], None] = None


class ToolCallIn(OpenModel):
    """An assistant tool call sent back in history (OpenAI shape)."""

    id: str | None = None
    type: str | None = "function"
    function: FunctionCall


class FunctionDef(OpenModel):
    """A function tool: name (api.md §1.1 pattern), description, JSON-Schema ``parameters``."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class Tool(OpenModel):
    """``{"type": "function", "function": {"name", "description", "parameters", "strict"}}``."""

    type: str = "function"
    function: FunctionDef


class ChatMessage(OpenModel):
    """One message (api.md §1.2). ``tools`` makes a system message a dynamic tool declaration (K3);
    ``partial`` on the last assistant message asks for prefill continuation (§1.8)."""

    role: str
    content: Union[str, list[ContentPart], None] = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    partial: bool | None = None
    tools: list[Tool] | None = None


class StreamOptions(OpenModel):
    """``stream_options``: ``include_usage`` adds the empty-choices usage chunk (api.md §2.2)."""

    include_usage: StrictBool | None = None


class JSONSchemaFormat(OpenModel):
    """``response_format.json_schema``: ``name`` (required), ``schema``, ``strict`` (default true,
    api.md §1.6). ``name`` is required as in the official OpenAPI document (``required: [name,
    schema]``) and OpenAI; a missing one is a 400 naming ``response_format.json_schema.name``."""

    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(OpenModel):
    """``response_format``: text, json_object or json_schema (api.md §1.6)."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: JSONSchemaFormat | None = None


class ChatCompletionRequest(OpenModel):
    """``POST /v1/chat/completions`` body (api.md §1.1). ``thinking`` is an object
    ``{type, keep, effort}``; it is typed loosely so that a bool gets the platform's message."""

    model: str
    messages: list[ChatMessage]
    max_completion_tokens: StrictInt | None = None
    max_tokens: StrictInt | None = None
    thinking: Union[dict[str, Any], bool, None] = None
    reasoning_effort: str | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    # openk3 extension (vLLM's / SGLang's min_p; the Kimi platform documents no such field):
    # typed and bounded here, so a bad value is a 400 naming min_p.
    min_p: Annotated[StrictFloat, Field(ge=0, le=1)] | None = None
    n: StrictInt | None = None
    presence_penalty: StrictFloat | None = None
    frequency_penalty: StrictFloat | None = None
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None
    # OpenAI field, not in Kimi's schema: typed strictly so that "yes" is a 400, not coerced
    parallel_tool_calls: StrictBool | None = None
    stop: Union[str, list[str], None] = None
    seed: Annotated[StrictInt, Field(ge=-(2**63), le=2**63 - 1)] | None = (
        None  # int64, as OpenAI documents
    )
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    user: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class TokenCountRequest(OpenModel):
    """``POST /v1/tokenizers/estimate-token-count`` body (api.md §6.2); same rendering rules as
    completions (tools, thinking and response_format included when given)."""

    model: str
    messages: list[ChatMessage]
    tools: list[Tool] | None = None
    thinking: Union[dict[str, Any], bool, None] = None
    reasoning_effort: str | None = None
    tool_choice: Union[str, dict[str, Any], None] = None
    response_format: ResponseFormat | None = None


# ------------------------------------------------------------------------------ the request


@dataclass
class ChatRequest(Conversation):
    """One request as the server uses it, whatever surface it came from.

    ``messages`` and ``options`` (from :class:`~openk3.chat_format.request.Conversation`) are what
    the renderer renders: the normalised messages (image parts, tool calls and results, dynamic
    tool declarations) and thinking / effort / tools / tool_choice / response_format. The rest are
    the request's other fields as sent (None: absent), and the surface's policy.

    Attributes:
        model: the requested model id.
        max_tokens: ``max_completion_tokens`` (else ``max_tokens``); None: the server's default.
        temperature, top_p, n, presence_penalty, frequency_penalty: as sent; K3 accepts only its
            fixed values (:func:`openk3.server.validation.check_sampling`) and samples at them.
        min_p: an openk3 extension (vLLM's / SGLang's meaning), in [0, 1]; applied on top of
            the fixed sampling. None (absent) or 0: off.
        reasoning_effort: as sent (the platform refuses ``"none"``, which the renderer reads as
            instant mode).
        named_tool_choice: a ``tool_choice`` object as sent (the renderer reads any object as
            ``auto``; its shape is checked by :func:`openk3.server.validation.check_tool_choice`).
        stop: stop strings (a single string as a list of one).
        seed, logprobs, top_logprobs: as sent (``logprobs`` False when absent).
        stream, include_usage: SSE response; ``stream_options.include_usage``.
        parallel_tool_calls: False allows one tool call per reply.
        schema_name, schema_strict: ``name`` and ``strict`` of a ``json_schema`` response format.
        schema_where: the field that holds the response schema, for error messages.
        tool_images: image parts are also allowed in tool results (the Anthropic surface).
        strict_tools: whether a tool without a boolean ``strict`` is strict (the platform's
            default, true; the Anthropic surface: false, Anthropic's default).
    """

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    min_p: float | None = None
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    reasoning_effort: str | None = None
    named_tool_choice: dict | None = None
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    stream: bool = False
    include_usage: bool = False
    parallel_tool_calls: bool | None = None
    schema_name: Any = None
    schema_strict: bool | None = None
    schema_where: str = "response_format.json_schema.schema"
    tool_images: bool = False
    strict_tools: bool = True

    @property
    def thinking(self) -> bool:
        """Thinking on (the reply starts in the think channel)."""
        return self.options.thinking

    def to_sampling_params(self, *, max_tokens: int, stop_token_ids: list[int]) -> Any:
        """The engine's ``SamplingParams`` for this request: K3's fixed sampling (release notes §2:
        temperature 1.0 with thinking, 0.6 without; top_p 0.95; no top-k), the request's ``min_p``
        (the extension; off when absent), seed, stop strings and logprobs.

        Args:
            max_tokens: the output budget (the request's, or the server's default capped by the
                context left).
            stop_token_ids: the tokenizer's end-of-message ids.
        """
        from openk3.engine.sampling import SamplingParams  # torch: imported only when generating

        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.thinking else 0.6,
            top_p=0.95,
            top_k=0,
            min_p=self.min_p or 0.0,
            seed=self.seed,
            stop_token_ids=list(stop_token_ids),
            stop=list(self.stop),
            logprobs=(self.top_logprobs or 0) if self.logprobs else None,
        )


def parse_request(body: Any, wire: type[BaseModel] = ChatCompletionRequest) -> ChatRequest:
    """Parse a chat-completions body (or, with ``wire=TokenCountRequest``, a token-count body) into
    a :class:`ChatRequest`, in the platform's order: unpaired surrogates anywhere (named by path),
    the wire model's types (field-named 400s), ``thinking`` as a bool (the platform's message),
    then the messages and options (the renderer's parse with the platform's strictness,
    :data:`~openk3.chat_format.request.PLATFORM_RULES`).

    The model id is not checked here (the server does it first: an unknown model is a 404 before
    any 400).

    Raises:
        APIError: 400 naming the field.
    """
    check_unicode(body)
    try:
        sent = wire.model_validate(
            body, from_attributes=True
        )  # as FastAPI validates (its error texts)
    except ValidationError as e:
        raise invalid_body(e.errors()) from None
    if isinstance(body.get("thinking"), bool):
        raise bad_request(THINKING_BOOL)
    try:
        conv = parse_conversation(body, strict=True)
    except (ValueError, TypeError, RecursionError) as e:
        raise bad_request(f"Invalid request: {e}") from None

    def get(name: str) -> Any:
        return getattr(sent, name, None)

    max_tokens = get("max_completion_tokens")
    stop = get("stop")
    rf = body.get("response_format")
    wrapper = (
        rf.get("json_schema") if isinstance(rf, dict) and rf.get("type") == "json_schema" else None
    )
    schema_where = "response_format.json_schema.schema"
    if isinstance(wrapper, dict):
        key = next((k for k in ("schema", "json_schema") if k in wrapper), None)
        schema_where = "response_format.json_schema" + (f".{key}" if key else "")
    else:
        wrapper = {}
    choice = body.get("tool_choice")
    stream_options = get("stream_options")
    return ChatRequest(
        conv.messages,
        conv.options,
        model=sent.model,
        max_tokens=max_tokens if max_tokens is not None else get("max_tokens"),
        temperature=get("temperature"),
        top_p=get("top_p"),
        min_p=get("min_p"),
        n=get("n"),
        presence_penalty=get("presence_penalty"),
        frequency_penalty=get("frequency_penalty"),
        reasoning_effort=get("reasoning_effort"),
        named_tool_choice=choice if isinstance(choice, dict) else None,
        stop=[stop] if isinstance(stop, str) else list(stop or ()),
        seed=get("seed"),
        logprobs=bool(get("logprobs")),
        top_logprobs=get("top_logprobs"),
        stream=bool(get("stream")),
        include_usage=bool(stream_options and stream_options.include_usage),
        parallel_tool_calls=get("parallel_tool_calls"),
        schema_name=wrapper.get("name"),
        schema_strict=wrapper.get("strict"),
        schema_where=schema_where,
    )
