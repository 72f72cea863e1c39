"""Wire models of the Kimi-compatible API (pydantic) and the error type every route raises.

Sources: ``../shared/spec/api.md`` §1 (chat request fields), §2 (response shapes), §6 (errors,
token counting, models), §7 (Anthropic messages) and the §11 server decisions;
``../shared/spec/k3-release-notes.md`` §2 (K3 platform contract).

The request models are deliberately *permissive*: every model ignores unknown keys (the platform
silently ignores them, api.md §1.1), and fields whose invalid values must produce a specific
platform message (``thinking`` given as a bool, the fixed sampling parameters, ``tool_choice``)
are typed loosely here and checked in :mod:`openk3.server.serving`, which owns the messages. The
models exist for three reasons: typed validation with field-named 400s, the OpenAPI document
(which the schemathesis fuzz run is generated from), and documentation. Handlers keep working on
the original JSON dict, so nothing the client sent is lost or coerced before rendering.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, Strict, StrictBool, StrictInt

# JSON types are not coerced: "1", true or "yes" for a number / boolean field is a 400 naming the
# field (a JSON integer is still a valid number).
StrictFloat = Annotated[float, Strict()]

# --------------------------------------------------------------------------------------- errors

# Kimi error ``type`` per HTTP status (api.md §6.1).
KIMI_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_authentication_error",
    403: "permission_denied_error",
    404: "resource_not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "engine_overloaded_error",
    500: "server_error",
    503: "engine_overloaded_error",
}
# Anthropic error ``type`` per HTTP status (the Anthropic SDK maps on status; types are for humans).
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


class APIError(Exception):
    """An error answered with an HTTP status and the Kimi envelope ``{"error": {"message", "type"}}``
    (or the Anthropic envelope on ``/anthropic``).

    Args:
        status: HTTP status code.
        message: client-facing text (never internals).
        type: error type; default from :data:`KIMI_ERROR_TYPES`.
        headers: extra response headers (``Retry-After`` on 429).
        anthropic_message: the text on the Anthropic surface when Anthropic words the same error
            differently and clients match on it (context-limit errors); default `message`.
    """

    def __init__(self, status: int, message: str, type: str | None = None, headers: dict | None = None,
                 anthropic_message: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.headers = dict(headers or {})
        self.anthropic_message = anthropic_message

    def _safe_message(self) -> str:
        # a message may quote client text (a model id) holding a lone surrogate: escape it, or
        # encoding the UTF-8 response would fail
        return self.message.encode("utf-8", "backslashreplace").decode("utf-8")

    def kimi_body(self) -> dict:
        """``{"error": {"message", "type"}}`` (api.md §6.1)."""
        return {"error": {"message": self._safe_message(),
                          "type": self.type or KIMI_ERROR_TYPES.get(self.status, "server_error")}}

    def anthropic_body(self) -> dict:
        """``{"type": "error", "error": {"type", "message"}}`` (api.md §7)."""
        kind = ANTHROPIC_ERROR_TYPES.get(self.status, "api_error")
        return {"type": "error", "error": {"type": kind, "message": self._safe_message()}}


def show_int(value: int) -> str:
    """An integer for an error message: its digits, or its size when it has more than 30 digits
    (Python refuses to print ints over 4,300 digits, and nobody reads 30)."""
    if abs(value) < 10**30:
        return str(value)
    return f"{'-' if value < 0 else ''}an integer of about {int(abs(value).bit_length() * 0.30103) + 1} digits"


def bad_request(message: str) -> APIError:
    """A 400 ``invalid_request_error``."""
    return APIError(400, message)


# ------------------------------------------------------------------------------- chat request


class _Open(BaseModel):
    """Base of request models: unknown keys are kept (and ignored), as the platform does."""

    model_config = ConfigDict(extra="allow")


class ImageURL(_Open):
    """An image reference: a base64 ``data:`` URL (http(s) URLs are refused, api.md §11)."""

    url: str
    detail: str | None = None


class ContentPart(_Open):
    """``{"type": "text", "text"}`` or ``{"type": "image_url", "image_url": {"url"} | "<url>"}``."""

    type: str = "text"
    text: str | None = None
    image_url: Union[ImageURL, str, None] = None


class FunctionCall(_Open):
    """``function`` of an assistant tool call; ``arguments`` a JSON-object string (or object)."""

    name: str
    arguments: Union[str, dict[str, Any], None] = None


class ToolCallIn(_Open):
    """An assistant tool call sent back in history (OpenAI shape)."""

    id: str | None = None
    type: str | None = "function"
    function: FunctionCall


class FunctionDef(_Open):
    """A function tool: name (api.md §1.1 pattern), description, JSON-Schema ``parameters``."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class Tool(_Open):
    """``{"type": "function", "function": {"name", "description", "parameters", "strict"}}``."""

    type: str = "function"
    function: FunctionDef


class ChatMessage(_Open):
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


class StreamOptions(_Open):
    """``stream_options``: ``include_usage`` adds the empty-choices usage chunk (api.md §2.2)."""

    include_usage: StrictBool | None = None


class JSONSchemaFormat(_Open):
    """``response_format.json_schema``: ``name`` (required), ``schema``, ``strict`` (default true,
    api.md §1.6). ``name`` is required as in the official OpenAPI document (``required: [name,
    schema]``) and OpenAI; a missing one is a 400 naming ``response_format.json_schema.name``."""

    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(_Open):
    """``response_format``: text, json_object or json_schema (api.md §1.6)."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: JSONSchemaFormat | None = None


class ChatCompletionRequest(_Open):
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
    seed: Annotated[StrictInt, Field(ge=-2**63, le=2**63 - 1)] | None = None  # int64, as OpenAI documents
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    user: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class TokenCountRequest(_Open):
    """``POST /v1/tokenizers/estimate-token-count`` body (api.md §6.2); same rendering rules as
    completions (tools, thinking and response_format included when given)."""

    model: str
    messages: list[ChatMessage]
    tools: list[Tool] | None = None
    thinking: Union[dict[str, Any], bool, None] = None
    reasoning_effort: str | None = None
    tool_choice: Union[str, dict[str, Any], None] = None
    response_format: ResponseFormat | None = None


# ------------------------------------------------------------------------------ chat response
# Response models document the OpenAPI output; handlers build plain dicts of the same shape.


class ToolCallFunction(BaseModel):
    """Name and JSON-string arguments of a generated tool call."""

    name: str
    arguments: str


class ToolCallOut(BaseModel):
    """A generated tool call; ``id`` is ``functions.NAME:IDX`` (api.md §2.1)."""

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class PromptTokensDetails(BaseModel):
    """OpenAI location of ``cached_tokens``."""

    cached_tokens: int


class Usage(BaseModel):
    """Moonshot puts ``cached_tokens`` at the top of ``usage``; the OpenAI location is mirrored
    (api.md §11)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    cached_tokens: int
    prompt_tokens_details: PromptTokensDetails


class AssistantMessageOut(BaseModel):
    """``choices[].message``: content, reasoning_content (thinking on), tool_calls."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class Choice(BaseModel):
    """One choice of a completion (``n`` is always 1)."""

    index: int
    message: AssistantMessageOut
    finish_reason: Literal["stop", "length", "tool_calls"]
    logprobs: dict | None = None


class ChatCompletion(BaseModel):
    """``chat.completion`` response object (api.md §2.1)."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage


class ModelCard(BaseModel):
    """One ``/v1/models`` entry with Kimi's capability flags (api.md §6.3)."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    context_length: int
    supports_image_in: bool
    supports_video_in: bool
    supports_reasoning: bool


class ModelList(BaseModel):
    """``GET /v1/models``."""

    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenCountData(BaseModel):
    """``data`` of the token-count response."""

    total_tokens: int


class TokenCountResponse(BaseModel):
    """``{"data": {"total_tokens": N}}`` (api.md §6.2)."""

    data: TokenCountData


class ErrorDetail(BaseModel):
    """``error`` of the Kimi envelope."""

    message: str
    type: str


class ErrorResponse(BaseModel):
    """The Kimi error envelope (api.md §6.1)."""

    error: ErrorDetail


# -------------------------------------------------------------------------- anthropic request


class AnthropicBlock(_Open):
    """A content block: ``text``, ``image`` (``source``), ``tool_use``, ``tool_result``,
    ``thinking`` / ``redacted_thinking``."""

    type: str
    text: str | None = None
    source: dict[str, Any] | None = None
    id: str | None = None
    name: str | None = None
    input: Any = None
    tool_use_id: str | None = None
    content: Union[str, list[dict[str, Any]], None] = None
    is_error: bool | None = None
    thinking: str | None = None
    signature: str | None = None


class AnthropicMessage(_Open):
    """A Messages-API turn: string content or content blocks."""

    role: Literal["user", "assistant", "system"]
    content: Union[str, list[AnthropicBlock]]


class AnthropicTool(_Open):
    """An Anthropic tool: ``name``, ``description``, ``input_schema``, ``strict``."""

    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    strict: StrictBool | None = None


class AnthropicThinking(_Open):
    """Anthropic ``thinking``: ``{"type": "enabled", "budget_tokens": N}`` (N >= 1024 and below
    ``max_tokens``, checked in :func:`openk3.server.anthropic.check_thinking`), ``{"type":
    "disabled"}``, or the ``adaptive`` / ``between_tools`` forms (thinking on, no budget). The
    budget is validated but not enforced (api.md §7: not known to be enforced by Kimi)."""

    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: StrictInt | None = None


class AnthropicMessagesRequest(_Open):
    """``POST /anthropic/v1/messages`` body (api.md §7)."""

    model: str
    max_tokens: StrictInt
    messages: list[AnthropicMessage]
    system: Union[str, list[AnthropicBlock], None] = None
    tools: list[AnthropicTool] | None = None
    tool_choice: dict[str, Any] | None = None
    stop_sequences: list[str] | None = None
    stream: StrictBool | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    top_k: StrictInt | None = None
    metadata: dict[str, Any] | None = None
    thinking: AnthropicThinking | None = None


class AnthropicCountRequest(_Open):
    """``POST /anthropic/v1/messages/count_tokens`` body."""

    model: str
    messages: list[AnthropicMessage]
    system: Union[str, list[AnthropicBlock], None] = None
    tools: list[AnthropicTool] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: AnthropicThinking | None = None
