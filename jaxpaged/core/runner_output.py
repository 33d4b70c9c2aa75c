"""`ModelRunnerOutput`: what one device step returns to the scheduler (host types only).

vLLM V1's ``ModelRunnerOutput`` (``vllm/v1/outputs.py``): per scheduled sequence, in the
``SchedulerOutput``'s batch order, the sampled token ids and, when asked, their log
probabilities. Pure Python (no JAX), so the scheduler can consume it.
"""

from __future__ import annotations

from dataclasses import dataclass

#: One position's distribution: (the scored token's logprob, its rank (1 = most likely), the
#: ``MAX_LOGPROBS`` most likely ids, their logprobs), all of the raw model distribution.
TokenLogprob = tuple[float, int, list[int], list[float]]


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelRunnerOutput:
    """The result of ``ModelRunner.execute(scheduler_output)``.

    Attributes:
        sampled_token_ids: per scheduled sequence, the tokens drawn (empty for a prefill
            chunk that does not reach the end of its tokens; ``num_samples`` of them for a
            parallel-sampling prompt).
        logprobs: None unless a sequence of the step asked for logprobs; then per sequence,
            one :data:`TokenLogprob` per sampled token.
        prompt_logprobs: None unless a sequence of the step scores its prompt; then per
            sequence None or, for each position of its chunk that predicts a prompt token,
            that token's :data:`TokenLogprob`.
        pooled: None unless the step ran a pooling request; then per sequence None or, for
            a pooling request, ([H] float32 hidden state of its chunk's last token, [H]
            float32 sum of its chunk's hidden states) (``jaxpaged.runner.pooling``).
    """

    sampled_token_ids: list[list[int]]
    logprobs: list[list[TokenLogprob]] | None = None
    prompt_logprobs: list[list[TokenLogprob] | None] | None = None
    pooled: list | None = None

    @property
    def num_sampled_tokens(self) -> int:
        return sum(map(len, self.sampled_token_ids))
