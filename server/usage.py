"""The ``usage`` block of completions and chat responses.

``prompt_tokens_details.cached_tokens`` is the number of prompt tokens served from the prefix
cache (the request's hits at its first scheduling, a multiple of the page size); it is present
whenever prefix caching is on (0 on a miss) and absent otherwise. vLLM's ``UsageInfo`` /
``PromptTokenUsageInfo`` (``vllm/entrypoints/openai/protocol.py``), filled from
``RequestOutput.num_cached_tokens`` as its ``serving_completion.py`` / ``serving_chat.py`` do.
"""

from __future__ import annotations

from collections.abc import Iterable

from jaxpaged.server.protocol import PromptTokensDetails, UsageInfo
from jaxpaged.server.serving import PreparedPrompt


def usage(prompts: list[PreparedPrompt], completion_tokens: int,
          cached_tokens: int | None = None) -> UsageInfo:
    """Token counts of a response (the prompts counted once each, whatever ``n``).

    Args:
        prompts: the request's prompts.
        completion_tokens: generated tokens over all choices.
        cached_tokens: prompt tokens served from the prefix cache, summed over the prompts
            (None: prefix caching is off, no ``prompt_tokens_details``).
    """
    num_prompt = sum(len(p.token_ids) for p in prompts)
    details = None if cached_tokens is None else PromptTokensDetails(cached_tokens=cached_tokens)
    return UsageInfo(prompt_tokens=num_prompt, completion_tokens=completion_tokens,
                     total_tokens=num_prompt + completion_tokens, prompt_tokens_details=details)


def cached_tokens(prefix_caching: bool, num_cached: Iterable[int]) -> int | None:
    """The ``cached_tokens`` of a response: the sum of its prompts' ``num_cached_tokens``
    (one per prompt), or None when prefix caching is off."""
    return sum(num_cached) if prefix_caching else None
