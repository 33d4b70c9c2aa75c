"""What the engine reports after each step: scheduler gauges and per-iteration events.

The engine fills these (``jaxpaged/engine/engine.py``) and hands them to its stat loggers
(``jaxpaged/metrics/loggers.py``). The split follows vLLM v1 (``vllm/v1/metrics/stats.py``):
``SchedulerStats`` is a snapshot, ``IterationStats`` holds the events since the last report.
All times are seconds of ``time.monotonic()``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class SchedulerStats:
    """A snapshot after a step.

    Attributes:
        num_running_reqs, num_waiting_reqs: user requests (a request with ``n > 1`` counts
            once) running / waiting.
        kv_cache_usage: fraction in [0, 1] of usable KV pages held by requests (pages kept
            only for the prefix cache count as free).
        prefix_cache_queries, prefix_cache_hits: prompt tokens looked up / found in the prefix
            cache since the previous report.
        num_preemptions: sequences preempted since the previous report.
        lora_info: with LoRA, ``(max_loras, running adapter names, waiting adapter names)``
            (names comma-joined, sorted: vLLM's ``lora_requests_info`` labels); else None.
    """

    num_running_reqs: int
    num_waiting_reqs: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    lora_info: tuple[int, str, str] | None = None


@dataclass(frozen=True)
class FinishedRequestStats:
    """One finished user request.

    Attributes:
        finish_reason: ``stop``, ``length`` or ``abort`` (of its first sequence).
        e2e_latency: arrival to finish.
        queue_time: arrival to first scheduling (None if it never ran).
        num_prompt_tokens: prompt length.
        num_generation_tokens: tokens generated over all its sequences.
        prefill_time: first scheduling to first token (vLLM's ``request_prefill_time``);
        decode_time: first token to finish; inference_time: first scheduling to finish
            (each None when the request never reached that point).
    """

    finish_reason: str
    e2e_latency: float
    queue_time: float | None
    num_prompt_tokens: int
    num_generation_tokens: int
    prefill_time: float | None = None
    decode_time: float | None = None
    inference_time: float | None = None


@dataclass(slots=True)
class IterationStats:
    """Events since the previous report.

    Attributes:
        num_prompt_tokens: prompt tokens of requests that produced their first token.
        num_generation_tokens: tokens sampled.
        time_to_first_tokens: arrival to first token, one per request that got it.
        inter_token_latencies: time between consecutive tokens of a request, one per request
            per step in which it produced tokens after its first.
        finished_requests: requests that finished (aborted ones included).
        step_tokens: tokens (prefill and decode) of each engine step dispatched
            (vLLM's ``iteration_tokens_total``).
        spec_decoding: speculative decoding's acceptance counters
            (``jaxpaged.core.spec_decode.scheduling.SpecDecodingStats``), None when no sequence
            drafted.
    """

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)
    step_tokens: list[int] = field(default_factory=list)
    spec_decoding: object | None = None


class StatLogger(Protocol):
    """What the engine calls after each step (``jaxpaged/metrics/loggers.py`` has the
    implementations)."""

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        ...


@dataclass
class EngineStats:
    """Counters since start-up (vLLM's metric names where they exist).

    Attributes:
        num_preemptions: sequences preempted (``vllm:num_preemptions``).
        num_compilations: model-step shapes compiled (a rise while serving = a recompile).
        prefix_cache_queries, prefix_cache_hits: prompt tokens looked up / found in the prefix
            cache (``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits``).
        num_running, num_waiting: sequences now running / waiting.
        num_free_pages, num_pages: free and total KV pages (null page excluded).
    """

    num_preemptions: int
    num_compilations: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_running: int
    num_waiting: int
    num_free_pages: int
    num_pages: int


def finished_request_stats(group, now: float, reason: str) -> FinishedRequestStats:
    """The statistics of a request (a ``core.output_processor.RequestGroup``) that
    ended at ``now`` with ``reason``."""
    scheduled, first = group.first_scheduled_time, group.first_token_time
    return FinishedRequestStats(
        finish_reason=reason, e2e_latency=now - group.arrival_time,
        queue_time=None if scheduled is None else scheduled - group.arrival_time,
        num_prompt_tokens=group.seqs[0].request.num_prompt_tokens,
        num_generation_tokens=sum(s.request.num_output_tokens for s in group.seqs),
        prefill_time=None if scheduled is None or first is None else first - scheduled,
        decode_time=None if first is None else now - first,
        inference_time=None if scheduled is None else now - scheduled)
