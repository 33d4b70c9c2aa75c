"""A dispatched step's host results turned into a `ModelRunnerOutput`, per scheduled sequence.

The step's sampled ids (and, when asked, logprobs) come back as one row per sampling row;
each scheduled sequence owns ``max(num_samples, 1)`` consecutive rows
(``PreparedStep.row_starts``) and the prompt-logprob entries of its chunk's positions. Host
arrays only (numpy).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from jaxpaged.core.scheduler_output import SchedulerOutput
from jaxpaged.core.runner_output import ModelRunnerOutput, TokenLogprob

if TYPE_CHECKING:
    from jaxpaged.runner.input_batch import PreparedStep
    from jaxpaged.sampling.sampler import SamplerOutput


def read_output(sched: SchedulerOutput, prepared: PreparedStep, out: SamplerOutput,
                accepted: np.ndarray | None = None) -> ModelRunnerOutput:
    """The step's results (``out``, host arrays: ``token_ids`` [B] int32 and, when asked,
    logprobs [B] and prompt logprobs [T]), per scheduled sequence (see
    :class:`ModelRunnerOutput`). ``accepted`` ([B] bool, speculative decoding): whether each
    row's proposal was accepted; a speculating sequence then emits its rows up to and
    including the first one whose proposal was not (the resampled or bonus token)."""
    tokens = out.token_ids.tolist()
    starts = prepared.row_starts
    taken = [s.num_samples for s in sched.scheduled]
    if accepted is not None:
        for i, s in enumerate(sched.scheduled):
            if s.draft_token_ids:
                taken[i] = 1 + leading_true(accepted[starts[i]:starts[i + 1] - 1])
    sampled = [tokens[starts[i]:starts[i] + taken[i]] if s.samples else []
               for i, s in enumerate(sched.scheduled)]
    logprobs = None
    if out.logprobs is not None:
        lp = out.logprobs
        logprobs = [[(float(lp.logprobs[r]), int(lp.ranks[r]), lp.top_ids[r].tolist(),
                      lp.top_logprobs[r].tolist())
                     for r in range(starts[i], starts[i] + taken[i])]
                    for i, s in enumerate(sched.scheduled)]
    prompt = None
    if any(s.request.params.prompt_logprobs is not None for s in sched.scheduled):
        prompt = [prompt_logprobs_of(s, out.prompt_logprobs, int(q))
                  for s, q in zip(sched.scheduled, prepared.layout.query_start_loc)]
    return ModelRunnerOutput(sampled_token_ids=sampled, logprobs=logprobs,
                             prompt_logprobs=prompt)


def leading_true(flags: np.ndarray) -> int:
    """How many of ``flags`` ([m] bool) are True before the first False."""
    misses = np.flatnonzero(~flags)
    return int(misses[0]) if misses.size else len(flags)


def prompt_logprobs_of(s, scored, first_token: int) -> list[TokenLogprob] | None:
    """The prompt logprobs chunk ``s`` computed: one entry per position ``p`` of it that
    predicts a prompt token (``p + 1 <`` prompt length; none for a one-token prompt)."""
    if s.request.params.prompt_logprobs is None:
        return None
    end = min(s.end, s.request.num_prompt_tokens - 1)
    return [(float(scored.logprobs[t]), int(scored.ranks[t]), scored.top_ids[t].tolist(),
             scored.top_logprobs[t].tolist())
            for t in range(first_token, first_token + max(end - s.start, 0))]
