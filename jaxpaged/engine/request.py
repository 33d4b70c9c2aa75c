"""Host-side state of one request as it moves through the engine."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from jaxpaged.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    """Lifecycle: WAITING -> RUNNING (-> WAITING again if preempted) -> FINISHED."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One request: its tokens, progress and finish state.

    Attributes:
        request_id: caller's id, unique among unfinished requests.
        prompt: prompt text, or None if given as token ids.
        prompt_token_ids: the prompt's ids (BOS included when the tokenizer adds it).
        params: the request's sampling parameters.
        seed: the effective seed (the request's own, or one drawn by the engine).
        max_tokens: the resolved output-length limit.
        output_token_ids: generated ids so far.
        num_computed_tokens: tokens whose K/V are in the pool (0 again after preemption).
        num_preemptions: how often the request was preempted.
        finish_reason, stop_reason: set when the request finishes (vLLM's meanings).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    max_tokens: int
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def num_tokens(self) -> int:
        """Prompt plus output length."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Ids of prompt + output in ``[start, end)``."""
        n_prompt = len(self.prompt_token_ids)
        if end <= n_prompt:
            return self.prompt_token_ids[start:end]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt:end - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n_prompt]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
