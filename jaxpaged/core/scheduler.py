"""Iteration-level scheduler with continuous batching, chunked prefill and preemption.

Each step spends a token budget (``max_num_batched_tokens``): running sequences first (a decode
costs one token, an unfinished prefill its next chunk), then waiting ones while the budget,
``max_num_seqs`` and free pages allow. A prompt longer than the remaining budget is split across
steps (chunked prefill); ``long_prefill_token_threshold`` caps one prefill's chunk and
``max_num_partial_prefills`` caps how many prompts are mid-prefill at once. New requests join at
the next step; finished ones leave at once. A waiting request first takes the longest cached
prefix of its tokens (automatic prefix caching) and computes only the rest.

When a running sequence cannot get a page, a victim is preempted by recompute, chosen by
the scheduling policy (``jaxpaged.core.queue_policy``: the newest running sequence under
``fcfs``): its pages are released and it goes back to the waiting queue, in the policy's order,
with ``num_computed_tokens = 0`` and its generated tokens kept, so nothing is lost or doubled
when it resumes.

References: Yu et al., "Orca: A Distributed Serving System for Transformer-Based Generative
Models" (OSDI 2022), section 3.2 (iteration-level scheduling); Agrawal et al., "Taming
Throughput-Latency Tradeoff in LLM Inference with Sarathi-Serve" (OSDI 2024) (chunked prefill,
decodes first); vLLM v1's scheduler (``vllm/v1/core/sched/scheduler.py``) for the token-budget
formulation, the policies and recompute preemption.
"""

from __future__ import annotations

import bisect

from jaxpaged.core.kv_cache_manager import KVCacheManager
from jaxpaged.core.output_processor import OutputProcessor
from jaxpaged.core.queue_policy import QueuePolicy
from jaxpaged.core.request import Request, RequestStatus
from jaxpaged.core.scheduler_config import SchedulerConfig
from jaxpaged.core.scheduler_output import ScheduledRequest, SchedulerOutput
from jaxpaged.core.step_results import StepResults
from jaxpaged.lora.scheduling import LoRAScheduling
from jaxpaged.core.spec_decode.config import SpeculativeConfig
from jaxpaged.core.spec_decode.scheduling import SpecDecodeScheduling


class Scheduler(StepResults):
    """Continuous-batching scheduler over a :class:`KVCacheManager`: decides each step
    (:meth:`schedule`) and applies its result (``update_from_output``, from its base class
    :class:`~jaxpaged.core.step_results.StepResults`).

    Args:
        config: the step's limits and policy.
        kv_cache_manager: the page pool it allocates from (only the scheduler calls it).
        output_processor: detokenization, stop strings and the requests' output state;
            the scheduler hands it every sampled token, and checks the token-id stop rules
            against its ``eos_token_ids``.
        speculative_config: speculative decoding (None: off); decoding sequences then get
            proposals to verify (``jaxpaged.core.spec_decode.scheduling``).
        lora: multi-LoRA rules (None: off; ``jaxpaged.lora.scheduling``).

    Raises:
        ValueError: an unknown policy.
    """

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager,
                 output_processor: OutputProcessor,
                 speculative_config: SpeculativeConfig | None = None,
                 lora: LoRAScheduling | None = None):
        self.policy = QueuePolicy(config.policy, config.max_model_len,
                                  config.sjf_aging_requests)
        self.config = config
        self.kv = kv_cache_manager
        self.output_processor = output_processor
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.num_preemptions = 0
        #: Sampled tokens applied to unfinished sequences since start-up.
        self.num_generation_tokens = 0
        self.spec = None if speculative_config is None else SpecDecodeScheduling(
            speculative_config, config.max_model_len)
        self.lora = lora
        # (recurrent states cached at page boundaries: jaxpaged.core.state_slots)
        self._align = getattr(kv_cache_manager, "align_prefill", None)
        self._take_states = getattr(kv_cache_manager, "take_state_copies", None)
        self._cuts_prefill = bool(config.long_prefill_token_threshold) or self._align is not None
        kv, op = kv_cache_manager, output_processor    # (bound once: read for every sequence)
        self._allocate, self._add_token = kv.allocate_slots, op.add_token
        self._page_table = kv.page_table if getattr(kv, "page_table_only", False) else None

    def _enqueue(self, req: Request) -> None:
        """Insert into the waiting queue in policy order (arrival order for fcfs, so a
        preempted request goes back in front of everything that arrived after it)."""
        key = self.policy.key
        self.waiting.insert(bisect.bisect(self.waiting, key(req), key=key), req)

    def add_request(self, request: Request) -> None:
        """Queue a new request; it can run from the next step."""
        self._enqueue(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting_seqs(self) -> int:
        """Sequences waiting to be scheduled (a parallel-sampling request not yet forked
        counts its ``n``)."""
        return sum(r.n_samples for r in self.waiting)

    # Hot helpers (_cut for every prefill chunk, _scheduled for every sequence of every
    # step): fields read directly, not through properties.
    def _cut(self, req: Request, num_new: int, budget: int) -> int:
        """The chunk of ``num_new`` uncomputed tokens that runs: at most ``budget``, the
        long-prefill threshold, and (recurrent states) up to a page boundary."""
        if num_new > budget:    # (not min(): a builtin call costs more, once per sequence)
            num_new = budget
        if self._cuts_prefill and req.num_computed_tokens < len(req.prompt_token_ids):
            threshold = self.config.long_prefill_token_threshold
            num_new = min(num_new, threshold or num_new)
            if self._align:     # (recurrent states saved at page boundaries)
                num_new = self._align(req, num_new)
        return num_new

    def _scheduled(self, req: Request, num_new: int,
                   drafts: list[int] | None = None) -> ScheduledRequest:
        """``num_new``: the tokens the step computes, ``drafts`` (proposals) included."""
        start = req.num_computed_tokens
        end = start + num_new - len(drafts) if drafts else start + num_new
        samples = end == len(req.all_token_ids) + req.num_output_placeholders
        num_samples = req.n_samples if samples and req.pooling is None else 0
        if self._page_table is not None:    # one table, no state slot: no tuple to build
            return ScheduledRequest(req, start, num_new, self._page_table(req.request_id).copy(),
                                    samples, num_samples, drafts)
        pages, group_pages, state_slot = self.kv.step_tables(req.request_id)
        return ScheduledRequest(req, start, num_new, pages, samples, num_samples, drafts,
                                group_pages, state_slot)

    # ---- deciding a step -------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Pick this step's sequences and token counts, allocating their pages; the result
        holds everything the device step needs.

        Scheduling advances each scheduled sequence's ``num_computed_tokens`` by its chunk at
        once and counts a sampling chunk's coming token in ``num_output_placeholders`` (as
        vLLM V1's ``_update_after_schedule``), so the next step can be scheduled before this
        one's tokens are known (async scheduling): a sequence with a placeholder then decodes
        that unknown token (the runner takes it from the previous step's device output). A
        sequence is not run ahead of its placeholders when its sampling needs its output ids
        on the host, when it is a parallel-sampling prompt not yet forked, or when its
        placeholders already reach its length limit (it finishes when they resolve).
        """
        budget = self.config.max_num_batched_tokens
        running_status = RequestStatus.RUNNING   # (a local: cheaper than the enum lookup)
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []
        spec = self.spec
        num_running = len(self.running)
        drafts = None
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.num_output_placeholders and not self._can_run_ahead(req):
                i += 1
                continue
            computed = req.num_computed_tokens
            num_new = len(req.all_token_ids) + req.num_output_placeholders - computed
            if num_new != 1 or self._cuts_prefill:    # (a decode's one token needs no cut)
                num_new = self._cut(req, num_new, budget)
            if spec is not None:    # proposals to verify ride along as extra tokens
                drafts = spec.drafts(req, num_new, budget - num_new, self.running)
                num_new += len(drafts) if drafts else 0
            while not self._allocate(req.request_id, computed + num_new, req.all_token_ids,
                                     computed, req.extra_keys):
                if drafts:     # speculation never costs another sequence its pages
                    num_new, drafts = num_new - len(drafts), None
                    continue
                victim = self.policy.victim(self.running)
                if self.running.index(victim) < i:   # already scheduled this step: undo it
                    undone = next(s for s in scheduled if s.request is victim)
                    scheduled.remove(undone)
                    budget += undone.num_new_tokens
                    i -= 1
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if req.status is not running_status:
                continue   # req itself was preempted; running[i] is now the next one
            scheduled.append(self._scheduled(req, num_new, drafts))
            budget -= num_new
            i += 1
        admitted = [] if preempted else self._admit_waiting(scheduled, budget)
        if spec is not None:    # (the final plan: a verification step or none)
            spec.finish_step(scheduled, num_running)
        forks = False
        for s in scheduled:
            req = s.request
            req.num_computed_tokens = s.start + s.num_new_tokens
            if s.samples:
                req.num_output_placeholders += 1
                forks = forks or s.num_samples > 1
        lora = () if self.lora is None else self.lora.take_step()
        return SchedulerOutput(scheduled, preempted, admitted, self.kv.take_pending_copies(),
                               forks, *lora, state_copies=self._take_states()
                               if self._take_states else ((), ()))

    def _can_run_ahead(self, req: Request) -> bool:
        """Whether a sequence whose last sampled token(s) are not known yet can be scheduled
        (see :meth:`schedule`)."""
        if req.needs_output_tokens or req.n_samples > 1:
            return False
        known = len(req.all_token_ids) + req.num_output_placeholders
        return (known - len(req.prompt_token_ids) < req.max_tokens
                and known < self.config.max_model_len)

    def _admit_waiting(self, scheduled: list[ScheduledRequest], budget: int) -> list[Request]:
        """Move waiting requests into the step while the budget, the seats and the pages
        allow (appending to ``scheduled``); returns them."""
        if not self.waiting or budget <= 0:   # skip the counts over every running sequence
            return []
        partial = sum(1 for r in self.running if r.num_computed_tokens < r.num_prompt_tokens)
        # A parallel-sampling request not yet forked holds a seat for each sequence.
        seats = sum(r.n_samples for r in self.running)
        admitted = []
        loras = None if self.lora is None else self.lora.adapter_ids(self.running)
        j = 0       # the first waiting request not skipped for its grammar
        while j < len(self.waiting) and budget > 0:
            req = self.waiting[j]
            grammar = req.structured_output_request
            if grammar is not None and not grammar.is_ready():
                j += 1      # its grammar still compiles: later requests go first (vLLM)
                continue
            if seats + req.n_samples > self.config.max_num_seqs:
                break
            if loras is not None and not self.lora.admit(req, loras):
                j += 1      # max_loras adapters run already: it waits, others go first
                continue
            if req.num_computed_tokens == 0 and req.params.prompt_logprobs is None \
                    and req.pooling is None:    # (a mean needs every token computed)
                req.num_computed_tokens = self.kv.find_cached_prefix(
                    req.request_id, req.all_token_ids, req.extra_keys)
            computed = req.num_computed_tokens
            num_new = self._cut(req, len(req.all_token_ids) + req.num_output_placeholders
                                - computed, budget)
            completes_prompt = computed + num_new >= req.num_prompt_tokens
            if (not completes_prompt and partial >= self.config.max_num_partial_prefills) \
                    or not self._allocate(req.request_id, computed + num_new, req.all_token_ids,
                                          computed, req.extra_keys):
                self.kv.free(req.request_id)   # give back any cached pages it took
                req.num_computed_tokens = 0
                break
            partial += not completes_prompt
            if req.num_cached_tokens is None:
                req.num_cached_tokens = req.num_computed_tokens
            self.kv.record_prefix_lookup(req.num_tokens, req.num_computed_tokens,
                                         preempted=req.num_preemptions > 0)
            self.waiting.pop(j)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            seats += req.n_samples
            admitted.append(req)
            scheduled.append(self._scheduled(req, num_new))
            budget -= num_new
        return admitted

    def waiting_for_grammars(self) -> list:
        """The grammar states of waiting requests whose grammar still compiles."""
        return [r.structured_output_request for r in self.waiting
                if r.structured_output_request is not None
                and not r.structured_output_request.is_ready()]

    def preempt_all(self) -> int:
        """Preempt every running sequence (the device lost their K/V): they recompute from
        the waiting queue. Returns how many were preempted."""
        running = list(self.running)
        for req in running:
            self._preempt(req)
        return len(running)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req.request_id)
        req.num_computed_tokens = 0
        req.num_output_placeholders = 0    # an in-flight token still arrives and is kept
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self._enqueue(req)
        self.num_preemptions += 1

    def reset_kv_cache(self) -> int:
        """The device lost the pool's contents: preempt every running sequence (they
        recompute from the waiting queue) and empty the prefix cache; returns how many were
        preempted."""
        preempted = self.preempt_all()
        self.kv.reset_prefix_cache()
        return preempted
