"""The Kimi K3 chat format: request -> prompt ids, training rendering, and the chat template.

Public entry points (``../shared/spec/k3-chat-format.md``):

* :func:`encode_request` (request dict, tokenizer) -> :class:`Prompt` (``token_ids``, ``text``,
  ``prompt_tokens``, ``image_slots``, ``channel``, ...); :func:`render` the same from a parsed
  :class:`Conversation` (:func:`parse_conversation`; the server's ``ChatRequest`` is one);
* :func:`render_training` -> :class:`TrainingExample` (ids + assistant-only loss mask);
* :func:`render_assistant_output`: the ids a model generates for an assistant message (the output
  parser's round-trip partner);
* :func:`template_variables`, :func:`chat_template`, :func:`render_template`: the project's Jinja
  chat template (``template.jinja``), whose text equals :attr:`Prompt.text`;
* :class:`OutputParser`: generated ids -> typed events and the final message
  (``OutputParser(tok, start_channel=prompt.channel, tool_index_start=prompt.history_tool_calls)``).
"""

from openk3.chat_format.render import (
    IMAGE_PLACEHOLDER,
    Prompt,
    TrainingExample,
    canonical_json,
    encode_request,
    render,
    render_assistant_output,
    render_training,
)
from openk3.chat_format.request import Conversation, parse_conversation
from openk3.chat_format.parser import OutputParser, ParsedMessage
from openk3.chat_format.template import chat_template, render_template, template_variables
from openk3.chat_format.tool_ids import make_tool_call_id, next_tool_call_index

__all__ = [
    "Conversation",
    "IMAGE_PLACEHOLDER",
    "OutputParser",
    "ParsedMessage",
    "make_tool_call_id",
    "next_tool_call_index",
    "Prompt",
    "TrainingExample",
    "canonical_json",
    "chat_template",
    "encode_request",
    "parse_conversation",
    "render",
    "render_assistant_output",
    "render_template",
    "render_training",
    "template_variables",
]
