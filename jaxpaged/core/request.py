"""Host-side state of one sequence as it moves through the engine."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from jaxpaged.sampling_params import SamplingParams

if TYPE_CHECKING:   # (types only: each feature's module needs nothing of Request at run time)
    from jaxpaged.core.pooling import PoolingState
    from jaxpaged.core.spec_decode.adaptive import SpecState
    from jaxpaged.core.thinking_budget import ThinkingBudget
    from jaxpaged.lora.request import LoRARequest
    from jaxpaged.structured_output.manager import StructuredOutputRequest

#: Separates a request id from a parallel-sampling sequence index in internal sequence ids.
SEQ_SEP = "\x1f"


class RequestStatus(enum.Enum):
    """Lifecycle: WAITING -> RUNNING (-> WAITING again if preempted) -> FINISHED."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


#: (Read per token: a module global is cheaper than ``RequestStatus.FINISHED`` on 3.12.)
_FINISHED = RequestStatus.FINISHED


@dataclass(eq=False, slots=True)
class Request:
    """One sequence: its tokens, progress and finish state.

    A request with ``n > 1`` starts as one sequence that prefills the prompt once and samples
    ``n_samples`` first tokens; the engine then forks it into ``n`` sequences that share the
    prompt's pages (``group_id`` names the user's request, ``index`` the sequence in it).

    Attributes:
        request_id: unique id of this sequence (the user's id for ``index`` 0).
        group_id: the user's request id.
        index: the sequence's index within its request (``CompletionOutput.index``).
        prompt, prompt_token_ids: the prompt (text or None) and its ids.
        params: the request's sampling parameters.
        seed: the effective seed (the request's own plus ``index``, or engine-drawn).
        max_tokens: the resolved output-length limit.
        arrival: arrival order (ties in priority scheduling; the newest is preempted first).
        priority: lower runs first under ``--scheduling-policy priority``.
        cache_salt: extra key of this request's prefix-cache hashes.
        lora_request: the LoRA adapter it runs with (None: the base model); its name and
            id are an extra key of the prefix-cache hashes (vLLM keys the name).
        n_samples: first tokens to sample after the prompt (n before the fork, then 1).
        bad_words_ids: token sequences of ``params.bad_words``.
        all_token_ids: prompt + output ids.
        num_computed_tokens: tokens whose K/V are in the pool (0 again after preemption).
        num_cached_tokens: prompt tokens served by the prefix cache at first scheduling.
        num_preemptions: how often the sequence was preempted.
        num_output_placeholders: tokens scheduled to be sampled whose ids are not on the host
            yet (vLLM's name): 1 between a sampling step's scheduling and its result, 2
            briefly under async scheduling; 0 again after preemption.
        needs_output_tokens: its sampling reads its output ids on the host (penalties, bad
            words, ``min_tokens``, logit bias, allowed ids), so async scheduling does not run
            it ahead of its unknown tokens.
        structured_output_request: its grammar state when ``params.structured_outputs``
            is set (``jaxpaged.structured_output.manager.StructuredOutputRequest``: waits
            in the queue until compiled, advances by each appended token), else None.
        pooling: for a pooling (embedding) request, its
            ``jaxpaged.core.pooling.PoolingState`` (prefilled only, never sampled); else
            None.
        thinking: its ``jaxpaged.core.thinking_budget.ThinkingBudget`` when
            ``params.thinking_token_budget`` is set (the token the budget forces next), else
            None.
        spec_state: with speculative decoding, its drafting record
            (``jaxpaged.core.spec_decode.adaptive.SpecState``: acceptance rate, shadow
            proposal), made at its first decode; else None.
        finish_reason, stop_reason: set when it finishes (vLLM's meanings).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    max_tokens: int
    arrival: int = 0
    group_id: str = ""
    index: int = 0
    priority: int = 0
    cache_salt: str | None = None
    lora_request: LoRARequest | None = None
    n_samples: int = 1
    bad_words_ids: list[list[int]] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int | None = None
    num_preemptions: int = 0
    num_output_placeholders: int = 0
    needs_output_tokens: bool = False
    structured_output_request: StructuredOutputRequest | None = None
    pooling: PoolingState | None = None
    thinking: ThinkingBudget | None = None
    spec_state: SpecState | None = None
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def __post_init__(self) -> None:
        self.group_id = self.group_id or self.request_id
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus output length."""
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """Generated ids so far (a copy)."""
        return self.all_token_ids[len(self.prompt_token_ids):]

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def extra_keys(self) -> tuple:
        """Extra keys mixed into this request's prefix-cache page hashes."""
        keys = () if self.cache_salt is None else (self.cache_salt,)
        return keys if self.lora_request is None else keys + (
            ("lora", self.lora_request.lora_name, self.lora_request.lora_int_id),)

    @property
    def is_finished(self) -> bool:
        return self.status is _FINISHED

    def fork(self, index: int) -> Request:
        """Sequence ``index`` of this parallel-sampling request, forked after the prompt: the
        same tokens and progress, its own id and seed (``seed + index``, as vLLM seeds
        ``n > 1``)."""
        return Request(f"{self.group_id}{SEQ_SEP}{index}", self.prompt, self.prompt_token_ids,
                       self.params, seed=self.seed + index, max_tokens=self.max_tokens,
                       arrival=self.arrival, group_id=self.group_id, index=index,
                       priority=self.priority, cache_salt=self.cache_salt,
                       lora_request=self.lora_request,
                       bad_words_ids=self.bad_words_ids,
                       needs_output_tokens=self.needs_output_tokens,
                       structured_output_request=None if self.structured_output_request is None
                       else self.structured_output_request.fork(),
                       thinking=None if self.thinking is None else self.thinking.fork(),
                       all_token_ids=list(self.all_token_ids),
                       num_computed_tokens=self.num_computed_tokens,
                       num_cached_tokens=self.num_cached_tokens)
