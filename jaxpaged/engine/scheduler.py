"""Iteration-level scheduler with continuous batching, chunked prefill and preemption.

Each step spends a token budget (``max_num_batched_tokens``): running requests first, in
arrival order (a decode costs one token, an unfinished prefill the rest of its prompt up to the
budget), then waiting requests while the budget, ``max_num_seqs`` and free pages allow. New
requests join at the next step; finished ones leave at once. When a running request cannot get
a page, the newest running request is preempted by recompute: its pages are freed and it goes
back to the front of the waiting queue with ``num_computed_tokens = 0``, keeping its generated
tokens, so nothing is lost or doubled when it resumes.

Reference: Yu et al., "Orca: A Distributed Serving System for Transformer-Based Generative
Models" (OSDI 2022), section 3.2 (iteration-level scheduling); vLLM v1's scheduler
(``vllm/v1/core/sched/scheduler.py``) for the token-budget formulation and recompute preemption.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from jaxpaged.engine.kv_cache_manager import KVCacheManager
from jaxpaged.engine.request import Request, RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one step.

    Attributes:
        max_num_seqs: most requests in one step.
        max_num_batched_tokens: most tokens (prefill + decode) in one step.
        max_model_len: most tokens (prompt + output) of one request.
    """

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step: tokens ``[start, start + num_new_tokens)``."""

    request: Request
    start: int
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the request's tokens, so its last
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
        self.config = config
        self.kv = kv_cache_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add_request(self, request: Request) -> None:
        """Queue a new request; it can run from the next step."""
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests and token counts, allocating their pages."""
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv.allocate_slots(req.request_id, req.num_computed_tokens + num_new):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                break
            scheduled.append(ScheduledRequest(req, req.num_computed_tokens, num_new))
            budget -= num_new
            i += 1
        while (not preempted and self.waiting and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            req = self.waiting[0]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self.kv.allocate_slots(req.request_id, req.num_computed_tokens + num_new):
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled.append(ScheduledRequest(req, req.num_computed_tokens, num_new))
            budget -= num_new
        return SchedulerOutput(scheduled, preempted)

    def _preempt(self, req: Request) -> None:
        self.kv.free(req.request_id)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def finish_request(self, req: Request) -> None:
        """Remove a finished or aborted request and free its pages at once."""
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED
        self.kv.free(req.request_id)
