"""Anthropic Messages API schemas (pydantic): ``POST /v1/messages`` and
``POST /v1/messages/count_tokens`` requests, the message answer, its usage and Anthropic's
error body.

Field names, types and defaults follow Anthropic's API reference and the official
``anthropic`` client's ``types`` (``MessageCreateParams``, ``Message``, ``Usage``,
``ToolChoice*``, ``ThinkingConfig*``); vLLM serves the same routes
(``vllm/entrypoints/anthropic/protocol.py``). As the OpenAI schemas
(:mod:`jaxpaged.server.protocol`), types are strict and unknown fields are ignored
(``cache_control``, ``citations``, ``service_tier``...), but content this text-only server
cannot read (images, documents) and Anthropic's server-run tools are refused with a 400 that
says so. Besides Anthropic's fields a request may carry a few of chat's extras
(``chat_template_kwargs``, ``seed``, ``min_p``, ``repetition_penalty``, ``ignore_eos``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field
from pydantic_core import PydanticCustomError

from jaxpaged.server.api_model import ApiModel
from jaxpaged.server.protocol import Int, _Request

#: The content block types a request's messages may hold.
READABLE_BLOCKS = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")


def _readable_blocks(value):
    """Refuse a block this server cannot read with a message that says why (not a union's
    error)."""
    for block in value if isinstance(value, list) else ():
        kind = block.get("type") if isinstance(block, dict) else None
        if isinstance(kind, str) and kind not in READABLE_BLOCKS:
            raise PydanticCustomError(
                "text_only", "a content block of type '{kind}' is not supported: this model "
                "accepts text, and content blocks of type {readable}",
                {"kind": kind, "readable": ", ".join(READABLE_BLOCKS)})
    return value


def _custom_tool(value):
    """Refuse Anthropic's server-run tools (``web_search_...``, ``bash_...``): only custom
    tools, run by the client, can be offered to the model here."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in (None, "custom"):
        raise PydanticCustomError(
            "server_tool", "tools of type '{kind}' are run by Anthropic's servers, not by "
            "this one: give custom tools (name, description, input_schema)", {"kind": kind})
    return value


class TextBlock(_Request):
    """A text block of a message (or of ``system``)."""

    type: Literal["text"]
    text: str


class ToolUseBlock(_Request):
    """A call the assistant made in an earlier turn: ``input`` is its arguments."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Request):
    """The client's result for the call ``tool_use_id`` (in a user message)."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: Annotated[str | list[TextBlock] | None, BeforeValidator(_readable_blocks)] = None
    is_error: bool = False


class ThinkingBlock(_Request):
    """An earlier turn's reasoning (its ``signature`` is not checked)."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Request):
    """Reasoning another server withheld: accepted and left out of the prompt."""

    type: Literal["redacted_thinking"]
    data: str | None = None


ContentBlock = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock |
                         RedactedThinkingBlock, Field(discriminator="type")]


class AnthropicMessage(_Request):
    """One turn: text, or content blocks."""

    role: Literal["user", "assistant"]
    content: Annotated[str | list[ContentBlock], BeforeValidator(_readable_blocks)]


class AnthropicTool(_Request):
    """A custom tool: ``input_schema`` is its input's JSON Schema."""

    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None


class AnthropicToolChoice(_Request):
    """``auto`` (the model decides), ``any`` (some tool must be called), ``tool`` (the tool
    ``name`` must be called) or ``none``."""

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class ThinkingConfig(_Request):
    """``thinking``: ``enabled`` / ``adaptive`` turn the template's thinking on, ``disabled``
    off; ``display: omitted`` returns thinking blocks without their text."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Int | None = None
    display: Literal["summarized", "omitted"] | None = None


class Metadata(_Request):
    user_id: str | None = None


class JsonOutputFormat(_Request):
    """``output_config.format``: the answer is JSON following ``schema``."""

    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Request):
    """``output_config``: ``effort`` (the template's ``reasoning_effort``) and ``format``
    (structured output)."""

    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: JsonOutputFormat | None = None


class ConversationFields(_Request):
    """What ``/v1/messages`` and its ``count_tokens`` share: the prompt's parts."""

    model: str
    messages: list[AnthropicMessage]
    system: str | list[TextBlock] | None = None
    tools: list[Annotated[AnthropicTool, BeforeValidator(_custom_tool)]] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: ThinkingConfig | None = None
    chat_template_kwargs: dict[str, Any] | None = None      # chat's extra, as vLLM's


class MessagesRequest(ConversationFields):
    """``POST /v1/messages``."""

    max_tokens: Int
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int | None = None
    metadata: Metadata | None = None
    output_config: OutputConfig | None = None
    # chat's sampling extras (not Anthropic's): a seeded sample is reproducible
    seed: Int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False


class CountTokensRequest(ConversationFields):
    """``POST /v1/messages/count_tokens``."""


# ---- answers ------------------------------------------------------------------------------


class TextOut(ApiModel):
    type: Literal["text"] = "text"
    text: str


class ThinkingOut(ApiModel):
    """Reasoning split off by the ``--reasoning-parser``; ``signature`` is a digest of the
    text (this server signs nothing)."""

    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str


class ToolUseOut(ApiModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


ContentOut = TextOut | ThinkingOut | ToolUseOut


class OutputTokensDetails(ApiModel):
    thinking_tokens: int


class MessagesUsage(ApiModel):
    """Token counts, as Anthropic's: ``input_tokens`` are the prompt tokens not read from
    the prefix cache, ``cache_read_input_tokens`` those that were (their sum is the prompt);
    nothing is written to a cache on request (``cache_creation_input_tokens`` 0)."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0
    output_tokens_details: OutputTokensDetails | None = None


class MessagesResponse(ApiModel):
    """The answer of ``/v1/messages`` (and the ``message`` of a stream's
    ``message_start``)."""

    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    content: list[ContentOut] = Field(default_factory=list)
    model: str
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None = None
    stop_sequence: str | None = None
    usage: MessagesUsage


class CountTokensResponse(ApiModel):
    input_tokens: int


class AnthropicErrorInfo(ApiModel):
    type: str
    message: str


class AnthropicErrorResponse(ApiModel):
    """Anthropic's error body: ``{"type": "error", "error": {"type", "message"}}``."""

    type: Literal["error"] = "error"
    error: AnthropicErrorInfo
