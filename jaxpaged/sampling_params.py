"""`SamplingParams`: how one request is decoded, with vLLM's field names and defaults.

Reference: vLLM ``vllm/sampling_params.py`` (fields, defaults and valid ranges are those of
vLLM's public API so that code written against vLLM keeps working).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from jaxpaged.errors import SamplingParamsError, check_param as _check  # noqa: F401
from jaxpaged.structured_output.params import StructuredOutputsParams

# (SamplingParamsError and StructuredOutputsParams are this module's public names too; they
# live in leaves that the grammar validator imports, so that it does not import this module.)

#: Temperatures below this are treated as greedy decoding (vLLM's ``_SAMPLING_EPS``).
GREEDY_TEMPERATURE_EPS = 1e-5
#: Most top log-probabilities a request can ask for (vLLM's default ``max_logprobs``).
MAX_LOGPROBS = 20
#: Most ``bad_words`` a request can give (each is tokenized twice when the request is added,
#: on the engine's thread, and checked at every step).
MAX_BAD_WORDS = 1024
#: The fields a model's ``generation_config.json`` can default (vLLM's ``--generation-config
#: auto``; ``max_new_tokens`` is ``max_tokens``), by ``SamplingParams`` name.
MODEL_DEFAULT_FIELDS = frozenset({"temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                                  "max_tokens"})
#: float32's largest value: sampling runs in float32, so a larger temperature or penalty
#: would become infinite.
FLOAT32_MAX = 3.4028234663852886e38


class RequestOutputKind(enum.IntEnum):
    """What each ``RequestOutput`` of a running request carries (vLLM's names)."""

    CUMULATIVE = 0   #: everything generated so far
    DELTA = 1        #: only what is new since the previous output
    FINAL_ONLY = 2   #: nothing until the request finishes


@dataclass(slots=True)
class SamplingParams:
    """Decoding parameters of one request.

    Attributes:
        n: sequences to generate for the prompt (they share the prompt's KV pages).
        presence_penalty: subtracted from the logit of every token already generated, [-2, 2].
        frequency_penalty: subtracted once per earlier occurrence in the output, [-2, 2].
        repetition_penalty: > 0; divides positive / multiplies negative logits of tokens in
            the prompt or output (1 = off).
        temperature: softmax temperature, >= 0; below 1e-5 the request is decoded greedily.
        top_p: nucleus sampling mass in (0, 1]; 1 keeps every token.
        top_k: keep the k most likely tokens; 0 or -1 turns it off (k beyond the vocabulary
            keeps everything).
        min_p: drop tokens whose probability is below ``min_p`` times the top token's, in [0, 1].
        seed: per-request seed in [-2**63, 2**64); the same seed gives the same tokens
            whatever else is batched with the request (the key is derived from the seed and
            the token position).
        max_tokens: the most tokens to generate (>= 1); None means up to ``max_model_len``.
        min_tokens: EOS, ``stop_token_ids`` and stop strings cannot end the request before
            this many tokens exist (EOS and stop ids are masked until then).
        stop: strings that end generation; the text is cut before them.
        stop_token_ids: token ids that end generation (kept in ``token_ids``, not in text).
        ignore_eos: keep generating past the model's EOS tokens.
        include_stop_str_in_output: keep the matched stop string at the end of the text.
        skip_special_tokens: drop special tokens (BOS, EOS, ...) from the output text.
        spaces_between_special_tokens: put spaces between special tokens in the text.
        logprobs: return the log-probability of each sampled token and of the ``logprobs``
            most likely tokens (0 to 20), from the raw model distribution; None for none.
        prompt_logprobs: return, for every prompt token after the first, its log-probability
            given the tokens before it and the ``prompt_logprobs`` most likely tokens there
            (0 to 20); such requests do not use the prefix cache (vLLM's rule).
        logit_bias: ``{token_id: bias}`` added to the logits (clamped to [-100, 100]).
        allowed_token_ids: if set, only these tokens can be sampled.
        bad_words: words that must not be generated (each as tokenized with and without a
            leading space; its last token is banned when the output ends with the rest).
        output_kind: cumulative (default), delta or final-only outputs while running.
        structured_outputs: a grammar the output must match (:class:`StructuredOutputsParams`);
            None for free text. An invalid schema, regex or grammar is refused when the
            request is added (``jaxpaged.core.input_processor``), with llguidance's message.
        thinking_token_budget: most output tokens inside the ``<think>`` reasoning block
            (vLLM's name): once they are spent the end-of-think marker's tokens are forced and
            the answer follows (``jaxpaged.core.thinking_budget``); 0: no reasoning at all.
            None or -1 (normalised to None): unlimited.
        model_default_fields: fields of :data:`MODEL_DEFAULT_FIELDS` the caller left to the
            model (a server request that leaves ``temperature`` null): when the request is
            added, the engine's input processor sets each one the model's
            ``generation_config.json`` gives; the others keep their value here.

    The fields are checked on construction and again when a request is added (so a field
    changed afterwards is checked too).

    Raises:
        SamplingParamsError (a ValueError): for any value out of range or of the wrong type;
            the message and its ``param`` name the field.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    thinking_token_budget: int | None = None
    model_default_fields: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        self.verify()

    def verify(self) -> None:
        """Check every field and normalise aliases (``top_k=-1`` -> 0,
        ``thinking_token_budget=-1`` -> None; greedy decoding resets
        ``top_p``, ``top_k`` and ``min_p`` as vLLM does).

        Raises:
            ValueError: naming the first bad field.
        """
        unset = self.model_default_fields
        _check(isinstance(unset, (set, frozenset)) and unset <= MODEL_DEFAULT_FIELDS,
               "model_default_fields", f"must be a set of names from "
                                       f"{sorted(MODEL_DEFAULT_FIELDS)}, got {unset!r}")
        self.model_default_fields = frozenset(unset)
        _check(_is_int(self.n) and self.n >= 1, "n", f"must be an integer >= 1, got {self.n!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_real(value) and -2 <= value <= 2, name, f"must be in [-2, 2], got {value!r}")
        _check(_is_real(self.repetition_penalty) and 0 < self.repetition_penalty <= FLOAT32_MAX,
               "repetition_penalty", f"must be a number > 0 (and at most {FLOAT32_MAX:.4g}, "
                                     f"float32's largest), got {self.repetition_penalty!r}")
        _check(_is_real(self.temperature) and 0 <= self.temperature <= FLOAT32_MAX,
               "temperature", f"must be a finite number >= 0 (and at most {FLOAT32_MAX:.4g}, "
                              f"float32's largest), got {self.temperature!r}")
        _check(_is_real(self.top_p) and 0 < self.top_p <= 1,
               "top_p", f"must be in (0, 1], got {self.top_p!r}")
        _check(_is_int(self.top_k) and self.top_k >= -1,
               "top_k", f"must be an integer >= -1 (0 or -1 disables), got {self.top_k!r}")
        _check(_is_real(self.min_p) and 0 <= self.min_p <= 1,
               "min_p", f"must be in [0, 1], got {self.min_p!r}")
        _check(self.seed is None or (_is_int(self.seed) and -2**63 <= self.seed < 2**64),
               "seed", f"must be an integer in [-2**63, 2**64) or None, got {self.seed!r}")
        _check(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
               "max_tokens", f"must be an integer >= 1 or None, got {self.max_tokens!r}")
        _check(_is_int(self.min_tokens) and self.min_tokens >= 0,
               "min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and "max_tokens" not in unset:   # (else once applied)
            _check(self.min_tokens <= self.max_tokens, "min_tokens",
                   f"must be <= max_tokens={self.max_tokens}, got {self.min_tokens}")
        stop = self.stop
        _check(stop is None or (isinstance(stop, str) and stop != "") or (
            isinstance(stop, (list, tuple)) and all(isinstance(s, str) and s for s in stop)),
            "stop", f"must be a non-empty string or a list of them, got {stop!r}")
        ids = self.stop_token_ids
        _check(ids is None or (isinstance(ids, (list, tuple)) and all(
            _is_int(t) and t >= 0 for t in ids)), "stop_token_ids",
            f"must be a list of non-negative integers, got {ids!r}")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
                     "spaces_between_special_tokens"):
            _check(isinstance(getattr(self, name), bool), name,
                   f"must be a bool, got {getattr(self, name)!r}")
        _check(self.logprobs is None or (_is_int(self.logprobs)
                                         and 0 <= self.logprobs <= MAX_LOGPROBS),
               "logprobs", f"must be an integer in [0, {MAX_LOGPROBS}] or None, "
                           f"got {self.logprobs!r}")
        _check(self.prompt_logprobs is None or (_is_int(self.prompt_logprobs)
                                                and 0 <= self.prompt_logprobs <= MAX_LOGPROBS),
               "prompt_logprobs", f"must be an integer in [0, {MAX_LOGPROBS}] or None, "
                                  f"got {self.prompt_logprobs!r}")
        bias = self.logit_bias
        _check(bias is None or (isinstance(bias, dict) and all(
            _is_int(int(k) if isinstance(k, str) and k.isdigit() else k) and _is_real(v)
            for k, v in bias.items())), "logit_bias",
            f"must map token ids to finite numbers, got {bias!r}")
        if bias:
            self.logit_bias = {int(k): max(-100.0, min(100.0, float(v))) for k, v in bias.items()}
        allowed = self.allowed_token_ids
        _check(allowed is None or (isinstance(allowed, (list, tuple)) and allowed and all(
            _is_int(t) and t >= 0 for t in allowed)), "allowed_token_ids",
            f"must be a non-empty list of non-negative integers, got {allowed!r}")
        words = self.bad_words
        _check(words is None or (isinstance(words, (list, tuple)) and all(
            isinstance(w, str) and w for w in words)), "bad_words",
            f"must be a list of non-empty strings, got {words!r}")
        _check(words is None or len(words) <= MAX_BAD_WORDS, "bad_words",
               f"may hold at most {MAX_BAD_WORDS} words, got {len(words or ())}")
        try:
            self.output_kind = RequestOutputKind(self.output_kind)
        except ValueError:
            _check(False, "output_kind", f"must be a RequestOutputKind, got {self.output_kind!r}")
        so = self.structured_outputs
        _check(so is None or isinstance(so, StructuredOutputsParams), "structured_outputs",
               f"must be a StructuredOutputsParams or None, got {so!r}")
        if so is not None:
            so.verify()         # its fields; the grammar is compiled by the input processor
        budget = self.thinking_token_budget
        _check(budget is None or (_is_int(budget) and budget >= -1), "thinking_token_budget",
               f"must be an integer >= 0, or -1 or None for no limit, got {budget!r}")
        if budget == -1:
            self.thinking_token_budget = None
        if self.top_k == -1:
            self.top_k = 0
        if self.is_greedy:
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    @property
    def is_greedy(self) -> bool:
        """True when the request is decoded by argmax."""
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """``stop`` as a tuple of strings."""
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def stop_token_id_set(self) -> frozenset[int]:
        """``stop_token_ids`` as a set."""
        return frozenset(self.stop_token_ids or ())


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
