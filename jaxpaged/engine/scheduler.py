"""Iteration-level scheduler with continuous batching, chunked prefill and preemption.

Each step spends a token budget (``max_num_batched_tokens``): running sequences first (a decode
costs one token, an unfinished prefill its next chunk), then waiting ones while the budget,
``max_num_seqs`` and free pages allow. A prompt longer than the remaining budget is split across
steps (chunked prefill); ``long_prefill_token_threshold`` caps one prefill's chunk and
``max_num_partial_prefills`` caps how many prompts are mid-prefill at once. New requests join at
the next step; finished ones leave at once. A waiting request first takes the longest cached
prefix of its tokens (automatic prefix caching) and computes only the rest.

When a running sequence cannot get a page, a victim is preempted by recompute — the newest
running sequence (``fcfs``), or the lowest-priority, newest one (``priority``): its pages are
released and it goes back to the waiting queue with ``num_computed_tokens = 0`` and its
generated tokens kept, so nothing is lost or doubled when it resumes.

References: Yu et al., "Orca: A Distributed Serving System for Transformer-Based Generative
Models" (OSDI 2022), section 3.2 (iteration-level scheduling); Agrawal et al., "Taming
Throughput-Latency Tradeoff in LLM Inference with Sarathi-Serve" (OSDI 2024) (chunked prefill,
decodes first); vLLM v1's scheduler (``vllm/v1/core/sched/scheduler.py``) for the token-budget
formulation, the policies and recompute preemption.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from jaxpaged.constants import SCHEDULING_POLICIES
from jaxpaged.engine.kv_cache_manager import KVCacheManager
from jaxpaged.engine.request import Request, RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits and policy of one step.

    Attributes:
        max_num_seqs: most sequences in one step.
        max_num_batched_tokens: most tokens (prefill + decode) in one step.
        max_model_len: most tokens (prompt + output) of one sequence.
        max_num_partial_prefills: most prompts mid-prefill at once.
        long_prefill_token_threshold: most prompt tokens one request prefills per step (0 = no cap).
        policy: ``fcfs`` or ``priority``.
    """

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    max_num_partial_prefills: int = 1
    long_prefill_token_threshold: int = 0
    policy: str = "fcfs"


@dataclass(frozen=True)
class ScheduledRequest:
    """One sequence's share of a step: tokens ``[start, start + num_new_tokens)``."""

    request: Request
    start: int
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the sequence's tokens, so its last
        position's logits give the next token."""
        return self.start + self.num_new_tokens == self.request.num_tokens


@dataclass(frozen=True)
class SchedulerOutput:
    """What one step runs, in batch order, and who was preempted to make room."""

    scheduled: list[ScheduledRequest]
    preempted: list[Request]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    """Continuous-batching scheduler over a :class:`KVCacheManager`."""

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager):
        if config.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"unknown scheduling policy {config.policy!r}; "
                             f"choose from {list(SCHEDULING_POLICIES)}")
        self.config = config
        self.kv = kv_cache_manager
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.num_preemptions = 0

    def _queue_key(self, req: Request):
        return (req.priority, req.arrival) if self.config.policy == "priority" else (req.arrival,)

    def _enqueue(self, req: Request) -> None:
        """Insert into the waiting queue in policy order (arrival order for fcfs, so a
        preempted request goes back in front of everything that arrived after it)."""
        keys = [self._queue_key(r) for r in self.waiting]
        self.waiting.insert(bisect.bisect(keys, self._queue_key(req)), req)

    def add_request(self, request: Request) -> None:
        """Queue a new request; it can run from the next step."""
        self._enqueue(request)

    def add_running(self, request: Request, after: Request) -> None:
        """Put an already-computed sequence (a parallel-sampling fork) into the running list
        right after ``after``."""
        request.status = RequestStatus.RUNNING
        self.running.insert(self.running.index(after) + 1, request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting_seqs(self) -> int:
        """Sequences waiting to be scheduled (a parallel-sampling request not yet forked
        counts its ``n``)."""
        return sum(r.n_samples for r in self.waiting)

    def _chunk(self, req: Request, budget: int) -> int:
        num_new = min(req.num_tokens - req.num_computed_tokens, budget)
        threshold = self.config.long_prefill_token_threshold
        if threshold and req.num_computed_tokens < req.num_prompt_tokens:
            num_new = min(num_new, threshold)
        return num_new

    def _allocate(self, req: Request, num_new: int) -> bool:
        return self.kv.allocate_slots(req.request_id, req.num_computed_tokens + num_new,
                                      req.all_token_ids, req.num_computed_tokens, req.extra_keys)

    def schedule(self) -> SchedulerOutput:
        """Pick this step's sequences and token counts, allocating their pages."""
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = self._chunk(req, budget)
            while not self._allocate(req, num_new):
                victim = self._pick_victim()
                if self.running.index(victim) < i:   # already scheduled this step: undo it
                    undone = next(s for s in scheduled if s.request is victim)
                    scheduled.remove(undone)
                    budget += undone.num_new_tokens
                    i -= 1
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                continue   # req itself was preempted; running[i] is now the next one
            scheduled.append(ScheduledRequest(req, req.num_computed_tokens, num_new))
            budget -= num_new
            i += 1
        partial = sum(1 for r in self.running if r.num_computed_tokens < r.num_prompt_tokens)
        while not preempted and self.waiting and budget > 0:
            req = self.waiting[0]
            # A parallel-sampling request not yet forked holds a seat for each sequence.
            seats = sum(r.n_samples for r in self.running)
            if seats + req.n_samples > self.config.max_num_seqs:
                break
            if req.num_computed_tokens == 0 and req.params.prompt_logprobs is None:
                req.num_computed_tokens = self.kv.find_cached_prefix(
                    req.request_id, req.all_token_ids, req.extra_keys)
            num_new = self._chunk(req, budget)
            completes_prompt = req.num_computed_tokens + num_new >= req.num_prompt_tokens
            if (not completes_prompt and partial >= self.config.max_num_partial_prefills) \
                    or not self._allocate(req, num_new):
                self.kv.free(req.request_id)   # give back any cached pages it took
                req.num_computed_tokens = 0
                break
            partial += not completes_prompt
            if req.num_cached_tokens is None:
                req.num_cached_tokens = req.num_computed_tokens
            self.kv.stats.queries += req.num_tokens
            self.kv.stats.hits += req.num_computed_tokens
            self.waiting.pop(0)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled.append(ScheduledRequest(req, req.num_computed_tokens, num_new))
            budget -= num_new
        return SchedulerOutput(scheduled, preempted)

    def _pick_victim(self) -> Request:
        if self.config.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival))
        return self.running[-1]

    def preempt_all(self) -> None:
        """Preempt every running sequence (the device lost their K/V): they recompute from
        the waiting queue."""
        for req in list(self.running):
            self._preempt(req)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req.request_id)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self._enqueue(req)
        self.num_preemptions += 1

    def finish_request(self, req: Request) -> None:
        """Remove a finished or aborted sequence and free its pages at once."""
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED
        self.kv.free(req.request_id)
