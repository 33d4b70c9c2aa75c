"""Request and response schemas of ``POST /v1/responses`` (OpenAI's Responses API, pydantic).

Field names, types and defaults follow OpenAI's API reference and its ``openai`` Python
client's types (``openai.types.responses``: ``ResponseCreateParams``, ``Response``,
``ResponseOutputMessage``, ``ResponseFunctionToolCall``, ``ResponseReasoningItem``,
``ResponseUsage``), plus the vLLM sampling extras of vLLM's ``ResponsesRequest``
(``vllm/entrypoints/openai/protocol.py``: ``top_k``, ``min_p``, ``repetition_penalty``,
``seed``, ``stop``, ``ignore_eos``, ``request_id``, ``priority``, ``cache_salt``).

Unlike the other routes, an unknown request field is a 400 naming it (``extra="forbid"``):
the Responses API has many fields for hosted features (conversations, prompts, hosted tools,
encrypted reasoning) that would change the output, and none of them may be silently
ignored. Input items copied back from an earlier response (with their ``id``, ``status``,
``annotations``) are accepted.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, ConfigDict, Field
from pydantic_core import PydanticCustomError

from jaxpaged.server.api_model import ApiModel
from jaxpaged.server.protocol import Int


class _Strict(ApiModel):
    model_config = ConfigDict(extra="forbid", strict=True)


def _text_parts_only(value):
    """Refuse an image, file or audio part with a message that says why."""
    for part in value if isinstance(value, list) else ():
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text"):
            raise PydanticCustomError("text_only", "a content part of type '{kind}' is not "
                                      "supported: this model accepts text only", {"kind": kind})
    return value


class InputTextPart(_Strict):
    """A text part of an input message (``output_text`` parts of an earlier answer too,
    with the ``annotations`` / ``logprobs`` the response gave them)."""

    type: Literal["input_text", "output_text", "text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class MessageItem(_Strict):
    """A conversation turn (``EasyInputMessage`` / ``ResponseInputMessageItem`` /
    ``ResponseOutputMessage``)."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Annotated[str | list[InputTextPart], BeforeValidator(_text_parts_only)]
    id: str | None = None
    status: str | None = None
    phase: str | None = None


class FunctionCallItem(_Strict):
    """A call the model made in an earlier turn (``ResponseFunctionToolCall``)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Strict):
    """The caller's result of a call (``FunctionCallOutput``)."""

    type: Literal["function_call_output"]
    call_id: str
    output: Annotated[str | list[InputTextPart], BeforeValidator(_text_parts_only)]
    id: str | None = None
    status: str | None = None


class ReasoningText(_Strict):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItemIn(_Strict):
    """An earlier turn's reasoning (``ResponseReasoningItem``); given to the template as the
    next assistant turn's ``reasoning_content``."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    status: str | None = None


InputItem = Annotated[MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItemIn,
                      Field(discriminator="type")]


def _default_message_type(value):
    """``{"role", "content"}`` without ``type`` is a message (``EasyInputMessage``)."""
    if isinstance(value, list):
        return [dict(v, type="message") if isinstance(v, dict) and "type" not in v else v
                for v in value]
    return value


class FunctionTool(_Strict):
    """A flat function tool (``FunctionToolParam``): ``name`` at the top level."""

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionToolChoice(_Strict):
    """``tool_choice`` naming the one function to call (``ToolChoiceFunction``)."""

    type: Literal["function"]
    name: str


class TextFormat(_Strict):
    """``text.format``: ``text``, ``json_object``, or ``json_schema`` with the schema at
    this level (``ResponseFormatTextJSONSchemaConfig``)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None
    #: Only OpenAI's default (``medium``) is accepted: the model has no verbosity control.
    verbosity: Literal["medium"] | None = None


class ReasoningConfig(_Strict):
    """``reasoning``: ``effort`` goes to the chat template as ``reasoning_effort`` (vLLM's
    name); ``summary`` is accepted, but reasoning items carry the full reasoning text
    (``content``) and an empty ``summary``."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class StreamOptions(_Strict):
    include_obfuscation: bool | None = None      # no obfuscation field is ever sent


class ResponsesRequest(_Strict):
    """``POST /v1/responses`` (OpenAI's ``ResponseCreateParams`` subset this server runs).

    ``max_output_tokens`` null or absent means "the room left in the context".
    ``store`` null means true (OpenAI's default) when the server keeps a store
    (``--responses-store-size``), otherwise nothing is stored.
    """

    model: str | None = None
    #: (the list first: an invalid item's error is the one reported, not "not a string")
    input: Annotated[list[InputItem], BeforeValidator(_default_message_type)] | str
    instructions: str | None = None
    max_output_tokens: Int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    background: bool | None = None
    truncation: Literal["disabled"] | None = None     # "auto" (dropping turns) is refused
    # accepted only with the values that ask for nothing (clients send them by default)
    include: Annotated[list[str], Field(max_length=0)] | None = None
    top_logprobs: Literal[0] | None = None
    max_tool_calls: None = None
    conversation: None = None
    prompt: None = None
    # fields that change nothing here
    user: str | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # vLLM's sampling extras
    top_k: Int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: Int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    request_id: str | None = None
    priority: Int = 0
    cache_salt: str | None = None
    thinking_token_budget: Int | None = None     # vLLM's; null: --reasoning-budget


# ---- the response -----------------------------------------------------------------------


class OutputText(ApiModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(ApiModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText] = Field(default_factory=list)


class FunctionCallOutput(ApiModel):
    """A call the model made (``ResponseFunctionToolCall``): ``call_id`` is what the
    caller's ``function_call_output`` names."""

    id: str
    type: Literal["function_call"] = "function_call"
    status: Literal["in_progress", "completed", "incomplete"]
    call_id: str
    name: str
    arguments: str


class ReasoningTextPart(ApiModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningOutput(ApiModel):
    """The ``--reasoning-parser``'s reasoning (``ResponseReasoningItem``)."""

    id: str
    type: Literal["reasoning"] = "reasoning"
    status: Literal["in_progress", "completed", "incomplete"]
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningTextPart] = Field(default_factory=list)


OutputItem = OutputMessage | FunctionCallOutput | ReasoningOutput


class InputTokensDetails(ApiModel):
    cached_tokens: int = 0


class OutputTokensDetails(ApiModel):
    reasoning_tokens: int = 0


class ResponseUsage(ApiModel):
    """Token counts; ``cached_tokens`` the prompt's prefix-cache hits (0 on a miss or with
    caching off), ``reasoning_tokens`` the output tokens spent inside the reasoning."""

    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(ApiModel):
    reason: Literal["max_output_tokens"]


class ResponseError(ApiModel):
    code: str
    message: str


class ResponseObject(ApiModel):
    """The ``response`` object (OpenAI's ``Response``): the request's settings echoed, the
    ``output`` items, ``usage`` once finished."""

    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    incomplete_details: IncompleteDetails | None = None
    error: ResponseError | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    store: bool = False
    background: bool = False
    temperature: float | None = None
    top_p: float | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: Any = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
