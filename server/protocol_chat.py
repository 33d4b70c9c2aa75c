"""Chat Completions schemas (pydantic): messages, tools, the chat response and its chunks.

Fields follow OpenAI's Chat Completions reference; tool and reasoning fields vLLM's
``ChatCompletionRequest`` / ``ChatMessage`` / ``DeltaMessage``
(``vllm/entrypoints/openai/protocol.py``). The shared sampling fields and the strict typing
rules are :mod:`jaxpaged.server.protocol`'s.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BeforeValidator, Field
from pydantic_core import PydanticCustomError

from jaxpaged.server.api_model import ApiModel
from jaxpaged.server.protocol import (Int, PromptLogprob, SamplingFields, TopLogprob,
                                      UsageInfo, _Request, unix_time)


class TextPart(_Request):
    type: Literal["text"]
    text: str


class FunctionDefinition(_Request):
    """A function the model may call: ``parameters`` is its arguments' JSON Schema."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(_Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    """``tool_choice`` naming the one function to call."""

    type: Literal["function"] = "function"
    function: NamedFunction


class FunctionCallIn(_Request):
    name: str
    arguments: str | dict[str, Any]


class ToolCallIn(_Request):
    """A call of an earlier assistant turn (``arguments`` a JSON string, as OpenAI
    returns it)."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


def _text_parts_only(value):
    """Refuse a non-text content part with a message that says why (not a union's error)."""
    for part in value if isinstance(value, list) else ():
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in (None, "text"):
            raise PydanticCustomError("text_only", "a content part of type '{kind}' is not "
                                      "supported: this model accepts text only", {"kind": kind})
    return value


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[str | list[TextPart] | None, BeforeValidator(_text_parts_only)] = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``. ``max_completion_tokens`` (or the older ``max_tokens``)
    null or absent means "the room left in the context"."""

    messages: list[ChatMessage]
    max_tokens: Int | None = None
    max_completion_tokens: Int | None = None
    logprobs: bool = False
    top_logprobs: Int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = False
    # vLLM's extras (echo the final message, prompt logprobs); output kinds other than text
    # and fields of features this server lacks are refused
    echo: bool = False
    prompt_logprobs: Int | None = None
    include_reasoning: bool = True               # False: the reasoning is left out
    documents: list[dict[str, Any]] | None = None   # the template's ``documents`` (RAG)
    modalities: list[str] | None = None
    audio: Any = None
    web_search_options: Any = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    refuses_tools: ClassVar[bool] = False


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(ApiModel):
    content: list[TokenLogprob] | None = None


class FunctionCall(ApiModel):
    name: str
    arguments: str


class ToolCall(ApiModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(ApiModel):
    """The answer; ``reasoning`` (and its other name ``reasoning_content``) with
    ``--reasoning-parser``, ``tool_calls`` with tools."""

    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(ApiModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None           # with return_token_ids


class ChatCompletionResponse(ApiModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=unix_time)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None
    prompt_token_ids: list[int] | None = None    # with return_token_ids
    weight_version: int | None = None    # the weights that produced it (docs/rl.md)


class DeltaFunctionCall(ApiModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(ApiModel):
    """A piece of a streamed call: ``id``, ``type`` and ``function.name`` on its first
    piece, ``function.arguments`` fragments after."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(ApiModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(ApiModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None           # with return_token_ids


class ChatCompletionChunk(ApiModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=unix_time)
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None    # the first chunk's, with return_token_ids
    #: The weights that produced the chunk's tokens (docs/rl.md); null on the first chunk
    #: (the role, sent before any token) and the usage chunk.
    weight_version: int | None = None


class TokenizeRequest(_Request):
    """``POST /tokenize``: a ``prompt`` or chat ``messages``, rendered with every rendering
    argument the chat route takes (vLLM's ``TokenizeChatRequest``), so the ids are the ones
    chat runs."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None
    documents: list[dict[str, Any]] | None = None
