"""Request and response schemas of the OpenAI-compatible API (pydantic).

Field names, types and defaults follow the OpenAI API reference (Completions, Chat
Completions, Models) plus vLLM's extra sampling fields (``top_k``, ``min_p``,
``repetition_penalty``, ``ignore_eos``, ...; ``vllm/entrypoints/openai/protocol.py``).
Types are strict (``"5"`` is not an integer, ``1`` is not a boolean; an integer written with a
zero fraction, ``2.0``, is one, as in JSON Schema); unknown request fields
are ignored, as OpenAI and vLLM do, but fields of features this server does not have
(beam search; tools on completions) are refused rather than silently ignored. The chat
schemas (messages, tools, the chat responses and chunks) are in
:mod:`jaxpaged.server.protocol_chat`.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BeforeValidator, ConfigDict, Field, StrictStr

from jaxpaged.server.api_model import ApiModel


def _integral(value):
    """An integral JSON number written with a fraction (``2.0``) as the int it is."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


#: An integer request field: a JSON integer, or a number with a zero fraction (JSON Schema's
#: "integer"); never a string, a bool, or a number with a fraction.
Int = Annotated[int, BeforeValidator(_integral)]


class _Request(ApiModel):
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
    #: most output tokens inside the <think> block, then </think> is forced (-1: no limit;
    #: null: the server's --reasoning-budget on chat)
    thinking_token_budget: Int | None = None
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


# ---- responses --------------------------------------------------------------------------


class PromptTokensDetails(ApiModel):
    cached_tokens: int | None = None


class UsageInfo(ApiModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(ApiModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(ApiModel):
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionChoice(ApiModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None
    prompt_token_ids: list[int] | None = None    # with return_token_ids
    token_ids: list[int] | None = None           # with return_token_ids


def unix_time() -> int:
    """Seconds since the epoch, as the responses' ``created``."""
    return int(time.time())


class CompletionResponse(ApiModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=unix_time)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    #: The engine's weight version that produced the choices (the newest, should a
    #: multi-prompt request span a weight update; ``docs/rl.md``).
    weight_version: int | None = None


class TopLogprob(ApiModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ModelCard(ApiModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=unix_time)
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


class ModelList(ApiModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(ApiModel):
    message: str
    type: str
    param: str | None = None
    #: The HTTP status (vLLM's ``ErrorInfo.code``).
    code: int


class ErrorResponse(ApiModel):
    error: ErrorInfo


class TokenizeResponse(ApiModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[Int]


class DetokenizeResponse(ApiModel):
    prompt: str


class VersionResponse(ApiModel):
    version: str
