"""Request and response schemas of the OpenAI-compatible API (pydantic).

Field names, types and defaults follow the OpenAI API reference (Completions, Chat
Completions, Models) plus vLLM's extra sampling fields (``top_k``, ``min_p``,
``repetition_penalty``, ``ignore_eos``, ...; ``vllm/entrypoints/openai/protocol.py``).
Types are strict (``"5"`` is not an integer, ``1`` is not a boolean; an integer written with a
zero fraction, ``2.0``, is one, as in JSON Schema); unknown request fields
are ignored, as OpenAI and vLLM do, but fields of features this server does not have
(beam search; tools on completions) are refused rather than silently ignored. Tool and
reasoning fields: vLLM's ``ChatCompletionRequest`` / ``ChatMessage`` / ``DeltaMessage``.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictStr
from pydantic_core import PydanticCustomError


def _integral(value):
    """An integral JSON number written with a fraction (``2.0``) as the int it is."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


#: An integer request field: a JSON integer, or a number with a zero fraction (JSON Schema's
#: "integer"); never a string, a bool, or a number with a fraction.
Int = Annotated[int, BeforeValidator(_integral)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Request):
    include_usage: bool | None = None
    #: vLLM's: with ``include_usage``, every chunk carries the usage so far.
    continuous_usage_stats: bool | None = None


class JsonSchemaFormat(_Request):
    """``response_format.json_schema`` (OpenAI's): the schema under ``schema``."""

    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    """``response_format``: ``text`` (free), ``json_object`` or ``json_schema``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingFields(_Request):
    """Sampling fields shared by completions and chat (OpenAI's, then vLLM's extras).

    None means "the model's generation_config.json default, else vLLM's default".
    """

    model: str | None = None
    n: Int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: Int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extras
    top_k: Int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: Int = 0
    stop_token_ids: list[Int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    allowed_token_ids: list[Int] | None = None
    bad_words: list[str] | None = None
    return_tokens_as_token_ids: bool = False
    truncate_prompt_tokens: Int | None = None    # keep the last N prompt tokens (-1: the context)
    return_token_ids: bool = False               # prompt_token_ids and each choice's token_ids
    logits_processors: Any = None                # refused: no custom logits processors
    vllm_xargs: Any = None                       # refused: their arguments
    request_id: str | None = None                # the id, unless X-Request-Id names it
    cache_salt: str | None = None
    priority: Int = 0
    # Structured outputs (server/structured.py): OpenAI's field, vLLM's, and vLLM's older ones.
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    # Known fields of features this server lacks: refused with a 400 when set.
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    use_beam_search: bool = False
    #: Whether ``tools`` / ``tool_choice`` are refused (chat has them).
    refuses_tools: ClassVar[bool] = True

    def unsupported(self) -> str | None:
        """The first set field of a feature this server does not have, if any."""
        if self.refuses_tools and (self.tool_choice not in (None, "none") or self.tools):
            return "tools" if self.tools else "tool_choice"
        for name in ("functions", "function_call"):
            if getattr(self, name) is not None:
                return name
        return "use_beam_search" if self.use_beam_search else None


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``. ``max_tokens`` null or absent means 16 (OpenAI's default),
    capped by the room left in the context."""

    prompt: StrictStr | list[StrictStr] | list[Int] | list[list[Int]]
    max_tokens: Int | None = None
    echo: bool = False
    logprobs: Int | None = None
    best_of: Int | None = None
    suffix: str | None = None
    prompt_logprobs: Int | None = None
    add_special_tokens: bool = True
    prompt_embeds: Any = None                    # refused: prompts are text or token ids


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


# ---- responses --------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int | None = None


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None
    prompt_token_ids: list[int] | None = None    # with return_token_ids
    token_ids: list[int] | None = None           # with return_token_ids


def _now() -> int:
    return int(time.time())


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    """The answer; ``reasoning`` (and its other name ``reasoning_content``) with
    ``--reasoning-parser``, ``tool_calls`` with tools."""

    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None           # with return_token_ids


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None
    prompt_token_ids: list[int] | None = None    # with return_token_ids


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A piece of a streamed call: ``id``, ``type`` and ``function.name`` on its first
    piece, ``function.arguments`` fragments after."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None           # with return_token_ids


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None    # the first chunk's, with return_token_ids


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "jaxpaged"
    root: str | None = None
    #: The base model an adapter applies to (vLLM's field); None for a base model.
    parent: str | None = None
    max_model_len: int | None = None
    #: Extra fields (jaxpaged's, in vLLM's style): every id that ends a sequence (the model
    #: config's, generation config's and tokenizer's EOS ids, sorted) and the model's
    #: vocabulary size (valid token ids are ``[0, vocab_size)``); null while loading.
    eos_token_ids: list[int] | None = None
    vocab_size: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    #: The HTTP status (vLLM's ``ErrorInfo.code``).
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo


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


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[Int]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str
