"""The error type every route raises, the body checks every surface shares (wire-model errors as
field-named 400s, unpaired surrogates), the response models and the Anthropic wire models.

Sources: ``../shared/spec/api.md`` §2 (response shapes), §6 (errors, token counting, models), §7
(Anthropic messages) and the §11 server decisions; ``../shared/spec/k3-release-notes.md`` §2 (K3
platform contract). The chat-completions request models are in :mod:`openk3.server.request`.

Request models are deliberately *permissive* (:class:`OpenModel` ignores unknown keys, as the
platform does, api.md §1.1); each surface's parser validates its body with them and then builds
the one :class:`~openk3.server.request.ChatRequest` the server uses.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Strict, StrictBool, StrictInt

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

    def __init__(
        self,
        status: int,
        message: str,
        type: str | None = None,
        headers: dict | None = None,
        anthropic_message: str | None = None,
    ):
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
        return {
            "error": {
                "message": self._safe_message(),
                "type": self.type or KIMI_ERROR_TYPES.get(self.status, "server_error"),
            }
        }

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


# ------------------------------------------------------------------------- request validation


class OpenModel(BaseModel):
    """Base of request models: unknown keys are kept (and ignored), as the platform does."""

    model_config = ConfigDict(extra="allow")


# Pydantic names the branch of a union it tried in the error location ("str", "list[ContentPart]",
# "function-after[...]"); those are not fields the client wrote.
_UNION_TAGS = {"str", "int", "float", "bool", "none", "dict", "list"}


def _is_union_tag(part: object) -> bool:
    return isinstance(part, str) and (part in _UNION_TAGS or "[" in part)


def field_path(loc: Any) -> str:
    """``("body", "messages", 0, "content", "list[ContentPart]", 1, "image_url")`` ->
    ``messages[0].content[1].image_url`` (the rest of the API's error style)."""
    out = ""
    for part in loc:
        if part == "body" or _is_union_tag(part):
            continue
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _error_rank(err: dict) -> tuple:
    """Which of pydantic's errors to report: for a union (``content``: string or parts), the error
    of the branch the client evidently meant (not "should be a valid string" when a list was
    sent), then the deepest location."""
    loc = err.get("loc", ())
    plain_scalar_branch = any(p in _UNION_TAGS for p in loc)
    return (plain_scalar_branch, -len(loc))


def first_error(errors: list[dict]) -> dict:
    """The one of pydantic's `errors` a 400 reports (:func:`_error_rank`); ``{}`` for none."""
    return min(errors, key=_error_rank) if errors else {}


def invalid_body(errors: list[dict]) -> APIError:
    """The 400 for a body its wire model refuses: ``Invalid request: <field>: <pydantic's message>``,
    e.g. ``Invalid request: seed: Input should be less than or equal to 9223372036854775807``."""
    first = first_error(errors)
    return bad_request(
        f"Invalid request: {field_path(first.get('loc', ())) or 'body'}: "
        f"{first.get('msg', 'invalid request')}"
    )


_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def check_unicode(body: Any) -> None:
    """Every string of the body (object keys included) is valid Unicode: JSON's ``\\uXXXX`` escapes
    can spell a lone UTF-16 surrogate, which no tokenizer, grammar or UTF-8 response can carry.
    Iterative, any nesting depth.

    Raises:
        APIError: 400 naming the field path (``messages[0].content``) and the character index.
    """
    stack = [(body, "")]
    while stack:
        value, where = stack.pop()
        if isinstance(value, str):
            if not value.isascii():
                try:
                    value.encode("utf-8")
                except UnicodeEncodeError as e:
                    raise bad_request(
                        f"{where or 'body'}: unpaired UTF-16 surrogate U+{ord(value[e.start]):04X} at "
                        f"character {e.start}; text must be valid Unicode"
                    ) from None
        elif isinstance(value, dict):
            items = []  # pushed reversed: the first bad string in document order is reported
            for key, child in value.items():
                items.append((key, f"{where or 'body'} (an object key)"))
                if isinstance(key, str) and _IDENT.match(key):
                    items.append((child, f"{where}.{key}" if where else key))
                else:  # json.dumps escapes to ASCII: the key itself may hold the surrogate
                    items.append((child, f"{where}[{json.dumps(key)}]"))
            stack.extend(reversed(items))
        elif isinstance(value, list):
            stack.extend((child, f"{where}[{j}]") for j, child in reversed(list(enumerate(value))))


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


class AnthropicBlock(OpenModel):
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


class AnthropicMessage(OpenModel):
    """A Messages-API turn: string content or content blocks."""

    role: Literal["user", "assistant", "system"]
    content: Union[str, list[AnthropicBlock]]


class AnthropicTool(OpenModel):
    """An Anthropic tool: ``name``, ``description``, ``input_schema``, ``strict``."""

    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    strict: StrictBool | None = None


class AnthropicThinking(OpenModel):
    """Anthropic ``thinking``: ``{"type": "enabled", "budget_tokens": N}`` (N >= 1024 and below
    ``max_tokens``, checked in :func:`openk3.server.anthropic.check_thinking`), ``{"type":
    "disabled"}``, or the ``adaptive`` / ``between_tools`` forms (thinking on, no budget). The
    budget is validated but not enforced (api.md §7: not known to be enforced by Kimi)."""

    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: StrictInt | None = None


class AnthropicMessagesRequest(OpenModel):
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


class AnthropicCountRequest(OpenModel):
    """``POST /anthropic/v1/messages/count_tokens`` body."""

    model: str
    messages: list[AnthropicMessage]
    system: Union[str, list[AnthropicBlock], None] = None
    tools: list[AnthropicTool] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: AnthropicThinking | None = None
