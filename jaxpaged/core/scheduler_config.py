"""The scheduler's limits and policy (vLLM's ``SchedulerConfig``), built from ``EngineArgs`` by
the engine and read by :class:`jaxpaged.core.scheduler.Scheduler`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """Limits and policy of one step.

    Attributes:
        max_num_seqs: most sequences in one step.
        max_num_batched_tokens: most tokens (prefill + decode) in one step.
        max_model_len: most tokens (prompt + output) of one sequence.
        max_num_partial_prefills: most prompts mid-prefill at once.
        long_prefill_token_threshold: most prompt tokens one request prefills per step (0 = no cap).
        policy: ``fcfs``, ``priority`` or ``sjf``.
        sjf_aging_requests: ``sjf``'s K (``jaxpaged.core.queue_policy``).
    """

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    max_num_partial_prefills: int = 1
    long_prefill_token_threshold: int = 0
    policy: str = "fcfs"
    sjf_aging_requests: int = 64
