"""vLLM's request extensions that change the output, honoured as vLLM does, and the fields
this server refuses rather than ignore (issue 24 part 5).

Honoured (``vllm/entrypoints/openai/protocol.py`` and ``serving_*.py``):

- ``truncate_prompt_tokens`` (completions and chat): keep the last N prompt tokens (``-1``:
  ``max_model_len``), after tokenization or template rendering, before the length rules;
- ``return_token_ids``: ``prompt_token_ids`` (per completions choice; on a chat response and
  its first chunk) and each choice's or chunk's generated ``token_ids``;
- ``stream_options.continuous_usage_stats`` (with ``include_usage``): every chunk carries
  the usage so far;
- chat ``echo``: the final message's content, when it is the assistant's (the message being
  continued), put in front of each choice's content (a stream sends it as the first content);
- chat ``prompt_logprobs``: ``prompt_logprobs`` on the response (refused when streaming, as
  vLLM does);
- chat ``include_reasoning: false``: the ``--reasoning-parser``'s reasoning left out of the
  message and the stream; chat ``documents``: the template's ``documents`` variable.

Refused with a 400 naming the field: output modalities other than text, ``audio``, non-text
content parts ("this model accepts text only", checked by the schema), ``prompt_embeds``,
``web_search_options``, ``logits_processors``, ``vllm_xargs``.
"""

from __future__ import annotations

from jaxpaged.outputs import Logprob
from jaxpaged.server.errors import bad_request
from jaxpaged.server.protocol import PromptLogprob, SamplingFields
from jaxpaged.server.protocol_chat import ChatMessage
from jaxpaged.server.serving import clamp_logprob


def check_refused(body: SamplingFields) -> None:
    """Refuse the fields of output kinds and features this server lacks.

    Raises:
        APIError 400: naming the field and why.
    """
    modalities = getattr(body, "modalities", None)
    if modalities is not None and set(modalities) - {"text"}:
        raise bad_request(f"modalities {modalities} are not supported: this model accepts "
                          "text only", "modalities")
    if getattr(body, "audio", None) is not None:
        raise bad_request("audio output is not supported: this model accepts text only",
                          "audio")
    for name, why in (("prompt_embeds", "prompts are text or token ids"),
                      ("web_search_options", "this server has no web search"),
                      ("logits_processors", "this server runs no custom logits processors"),
                      ("vllm_xargs", "this server runs no custom logits processors")):
        if getattr(body, name, None) is not None:
            raise bad_request(f"{name} is not supported: {why}", name)
    n = body.truncate_prompt_tokens
    if n is not None and n != -1 and n < 1:
        raise bad_request(f"truncate_prompt_tokens must be -1 (the context length) or an "
                          f"integer >= 1, got {n}", "truncate_prompt_tokens")


def truncate_prompt(token_ids: list[int], n: int | None, max_model_len: int) -> list[int]:
    """The last ``n`` prompt tokens (vLLM's left truncation; ``-1`` means ``max_model_len``,
    None keeps them all).

    Raises:
        APIError 400: ``n`` greater than ``max_model_len`` (vLLM's rule).
    """
    if n is None:
        return token_ids
    if n == -1:
        n = max_model_len
    if n > max_model_len:
        raise bad_request(f"truncate_prompt_tokens value ({n}) is greater than max_model_len "
                          f"({max_model_len}); select a smaller truncation size",
                          "truncate_prompt_tokens")
    return token_ids[-n:]


def prompt_logprobs_json(entries: list[dict[int, Logprob] | None]
                         ) -> list[dict[str, PromptLogprob] | None]:
    """vLLM's ``prompt_logprobs`` shape: per prompt token None (the first) or
    ``{token id as a string: {logprob, rank, decoded_token}}``."""
    return [None if e is None else {
        str(t): PromptLogprob(logprob=clamp_logprob(v.logprob), rank=v.rank,
                              decoded_token=v.decoded_token) for t, v in e.items()}
        for e in entries]


def echo_text(messages: list[ChatMessage]) -> str:
    """What chat ``echo`` puts in front of the content: the final message's text when it is
    the assistant's (vLLM compares its role with the response's), else nothing."""
    last = messages[-1]
    if last.role != "assistant" or last.content is None:
        return ""
    return last.content if isinstance(last.content, str) else \
        "".join(part.text for part in last.content)


def continuous_usage(body: SamplingFields) -> bool:
    """Whether every chunk carries the usage so far (``continuous_usage_stats`` with
    ``include_usage``, vLLM's condition)."""
    opts = body.stream_options
    return bool(opts and opts.include_usage and opts.continuous_usage_stats)
