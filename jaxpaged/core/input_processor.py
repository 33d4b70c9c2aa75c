"""Request inputs checked and turned into what the scheduler runs: the prompt tokenized (or its
token ids checked), the sampling parameters verified against the model, bad words tokenized.

Every check raises before anything is queued, so a bad request never reaches a step. The job is
vLLM's ``Processor`` (``vllm/v1/engine/processor.py``): prompt and parameter validation on the
way into the engine core.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from jaxpaged.core.generation_config import apply_generation_defaults
from jaxpaged.core.request import Request
from jaxpaged.core.thinking_budget import ThinkingBudget, prompt_opens_block, think_markers
from jaxpaged.sampling_params import SamplingParams, SamplingParamsError
from jaxpaged.structured_output.grammar import validate as validate_grammar

#: A prompt: text, token ids, or vLLM's ``{"prompt": ...}`` / ``{"prompt_token_ids": [...]}``
#: dict (with an optional ``"cache_salt"``).
Prompt = str | list[int] | dict


class InputProcessor:
    """Checks one engine's request inputs.

    Args:
        tokenizer: a transformers tokenizer (``encode``).
        vocab_size: token ids must lie in ``[0, vocab_size)``.
        max_model_len: longest prompt, in tokens.
        max_num_seqs: most sequences a step runs (``n`` may not exceed it).
        structured_outputs: the engine's ``StructuredOutputManager``
            (``jaxpaged.structured_output.manager``), which gives a request with
            ``structured_outputs`` its grammar state; None: such requests are refused.
        generation_defaults: the model's default sampling fields
            (``core.generation_config.generation_defaults``), given to the fields a request
            leaves to the model (``SamplingParams.model_default_fields``).
    """

    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, max_num_seqs: int,
                 structured_outputs=None, generation_defaults: Mapping[str, Any] | None = None):
        self.tokenizer = tokenizer
        self.generation_defaults = dict(generation_defaults or {})
        self.structured_outputs = structured_outputs
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        #: False for a model whose recurrent state a fork cannot share (``n > 1`` refused).
        self.parallel_sampling = True
        self._think_markers = None      # tokenized at the first thinking budget

    def thinking_budget(self, params: SamplingParams, prompt_ids: list[int]
                        ) -> ThinkingBudget | None:
        """The tracker of ``params.thinking_token_budget`` for a sequence of ``prompt_ids``
        (inside a block from its first token when the prompt leaves ``<think>`` open), or
        None without a budget."""
        if params.thinking_token_budget is None:
            return None
        if self._think_markers is None:
            self._think_markers = think_markers(self.tokenizer)
        markers = self._think_markers
        return ThinkingBudget(params.thinking_token_budget, markers, len(prompt_ids),
                              prompt_opens_block(self.tokenizer, prompt_ids, markers.start_text,
                                                 markers.end_text))

    def check_params(self, params: SamplingParams | None) -> SamplingParams:
        """``params`` verified (``SamplingParams()`` for None), with the model's defaults in the
        fields it leaves to the model (a copy then: ``params`` itself is not changed).

        Raises:
            TypeError: not a SamplingParams.
            SamplingParamsError: (a ValueError) a field out of range, ``n`` beyond
                ``max_num_seqs``, token ids outside the vocabulary in ``logit_bias``,
                ``allowed_token_ids`` or ``stop_token_ids``, or a ``structured_outputs``
                schema, regex or grammar that does not compile (naming
                ``structured_outputs.<kind>``, with llguidance's message; vLLM's processor
                validates structured outputs at the same point).
        """
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        params.verify()
        params = apply_generation_defaults(params, self.generation_defaults)
        if params.structured_outputs is not None:
            validate_grammar(params.structured_outputs)
        if params.n > self.max_num_seqs:
            raise SamplingParamsError("n", f"={params.n} exceeds max_num_seqs="
                                      f"{self.max_num_seqs}: its sequences could never run "
                                      "together")
        if params.n > 1 and not self.parallel_sampling:
            raise SamplingParamsError("n", f"={params.n}: parallel sampling is not supported "
                                      "for models with recurrent layers")
        for name, tokens in (("logit_bias", params.logit_bias or {}),
                             ("allowed_token_ids", params.allowed_token_ids or ()),
                             ("stop_token_ids", params.stop_token_ids or ())):
            bad = [t for t in tokens if not 0 <= t < self.vocab_size]
            if bad:
                raise SamplingParamsError(name, f"has token ids {bad[:8]} outside the "
                                                f"vocabulary [0, {self.vocab_size})")
        return params

    def bad_words_ids(self, params: SamplingParams) -> list[list[int]]:
        """Token sequences of each bad word, without duplicates, by vLLM's rule
        (``SamplingParams.update_from_tokenizer``): the word without leading spaces, and
        with one leading space when that encodes to as many tokens with another first token
        (the word's form after a space on tokenizers without a dummy prefix). A word written
        with a leading space is the same word: a sentencepiece tokenizer encodes " girl" as
        a lone space piece and "girl", which generated text never holds."""
        seqs: dict[tuple[int, ...], None] = {}     # an ordered set
        for word in params.bad_words or ():
            bare = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            if not bare:
                continue
            seqs[tuple(bare)] = None
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            if len(spaced) == len(bare) and spaced[0] != bare[0]:
                seqs[tuple(spaced)] = None
        return [list(ids) for ids in seqs]

    def tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """The prompt's text (None for token ids) and its token ids.

        Raises:
            ValueError: an empty or untokenizable prompt, a dict without ``prompt`` or
                ``prompt_token_ids``, ids outside the vocabulary, or more than
                ``max_model_len`` tokens.
            TypeError: not text, a list of integers (or a 1-D integer array) or a dict.
        """
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a dict prompt needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, np.ndarray) and prompt.ndim == 1:
            prompt = prompt.tolist()
        if isinstance(prompt, str):
            try:
                text, ids = prompt, self.tokenizer.encode(prompt)
            except (TypeError, ValueError) as e:
                raise ValueError(f"the prompt cannot be tokenized: {e}") from e
        elif isinstance(prompt, (list, tuple)):
            if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool)
                       for t in prompt):
                raise TypeError("a token-id prompt must be a list of integers")
            text, ids = None, [int(t) for t in prompt]
        else:
            raise TypeError(f"prompt must be a string, a list of token ids or a dict, "
                            f"got {type(prompt).__name__}")
        if not ids:
            raise ValueError("the prompt is empty (no tokens)")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:8]} are outside the vocabulary "
                             f"[0, {self.vocab_size})")
        if len(ids) > self.max_model_len:
            raise ValueError(f"the prompt (length {len(ids)}) is longer than the maximum "
                             f"model length of {self.max_model_len}")
        return text, ids

    def make_request(self, request_id: str, prompt: Prompt, params: SamplingParams, *,
                     priority: int, arrival: int, seed_rng: np.random.Generator) -> Request:
        """The :class:`Request` the scheduler runs for a checked ``params``: the prompt
        tokenized, the seed resolved (the request's, else one drawn from ``seed_rng``),
        ``max_tokens`` capped by ``max_model_len``, bad words tokenized, the grammar state
        of ``params.structured_outputs`` requested (its grammar compiles meanwhile), the
        thinking budget's tracker made (:meth:`thinking_budget`).

        Raises:
            TypeError: a priority that is not an int, or a prompt of the wrong type.
            ValueError: an empty, untokenizable or too long prompt, ids outside the
                vocabulary, or structured outputs this engine cannot serve.
        """
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise TypeError(f"priority must be an integer, got {priority!r}")
        cache_salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        text, ids = self.tokenize(prompt)
        seed = params.seed if params.seed is not None else int(seed_rng.integers(2**62))
        max_tokens = self.max_model_len - len(ids)
        if params.max_tokens is not None:
            max_tokens = min(max_tokens, params.max_tokens)
        grammar = None
        if params.structured_outputs is not None:
            if self.structured_outputs is None:
                raise SamplingParamsError("structured_outputs", "is not served by this engine")
            grammar = self.structured_outputs.request(params.structured_outputs)
        return Request(request_id, text, ids, params, seed=seed, max_tokens=max(max_tokens, 1),
                       arrival=arrival, priority=priority, cache_salt=cache_salt,
                       n_samples=params.n, bad_words_ids=self.bad_words_ids(params),
                       structured_output_request=grammar,
                       thinking=self.thinking_budget(params, ids))
