"""The scheduler's side of speculative decoding: which sequences draft, how many tokens, and
what a verified step does to their progress and to the acceptance counters.

A decoding sequence that may speculate gets up to ``num_speculative_tokens`` proposals
(:class:`~jaxpaged.core.spec_decode.ngram.NgramProposer`; with a draft model, placeholders that
the engine's ``DraftModelProposer`` fills once the step is scheduled, because the draft
writes its K/V into the pages allocated here) appended to its one decode token, so the
step computes ``1 + m`` tokens for it and samples ``1 + m`` rows (one per position, vLLM v1's
layout, ``vllm/v1/core/sched/scheduler.py``: ``num_scheduled_tokens = 1 + len(spec_token_ids)``).
The proposals live only in the ``ScheduledRequest`` (never in the request's tokens), so the
prefix cache, which hashes only known token ids, never caches an unverified token. After the
step ``a`` of the ``m`` proposals are accepted and ``a + 1`` tokens emitted; the sequence's
``num_computed_tokens`` steps back over the ``m - a`` rejected positions, whose slots the next
step writes again before attending (attention reads only up to each sequence's length, so the
stale K/V there are never read). Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jaxpaged.core.request import Request
from jaxpaged.core.scheduler_output import ScheduledRequest
from jaxpaged.core.spec_decode.adaptive import AdaptiveSpeculation, SpecState, expected_tokens
from jaxpaged.core.spec_decode.config import SpeculativeConfig
from jaxpaged.core.spec_decode.ngram import NgramProposer


@dataclass
class SpecDecodingStats:
    """Acceptance counters since the last report (vLLM's ``SpecDecodingStats``,
    ``vllm/v1/spec_decode/metrics.py``).

    Attributes:
        num_spec_tokens: k (the length of ``num_accepted_tokens_per_pos``).
        num_drafts: sequence-steps that verified at least one proposal.
        num_draft_tokens: proposals verified.
        num_accepted_tokens: proposals accepted.
        num_accepted_tokens_per_pos: accepted proposals by their position 0 .. k-1.
    """

    num_spec_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self):
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per drafting sequence-step, ``1 + accepted / drafts`` (vLLM's
        "Mean acceptance length"); 0.0 before any draft."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


class SpecDecodeScheduling:
    """Drafting decisions of one scheduler, which calls it twice a step: :meth:`drafts` for
    each running sequence while it plans, and :meth:`finish_step` once on the final plan
    (a sequence preempted or dropped from the plan meanwhile takes its proposals with it).

    A step speculates only when it is a verification step (every scheduled sequence
    decodes one token, ``n = 1``) and the rule of :meth:`wants_speculation` says so. A
    step that also prefills (an admitted request, a prompt's next chunk) drops its
    proposals (:meth:`finish_step`): its sequences decode plainly that step, so steps with
    prefill chunks keep their own shapes. Proposals take no seats: a verification step has
    a row per token.

    Args:
        config: the speculative config.
        max_model_len: most tokens of a sequence.
    """

    def __init__(self, config: SpeculativeConfig, max_model_len: int):
        self.config = config
        self.proposer = None if config.method == "draft_model" else NgramProposer(
            config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)
        self.max_model_len = max_model_len
        #: Whether the step being planned speculates (None: not decided yet).
        self._speculate: bool | None = None
        self._decision: bool | None = None
        self._adaptive = None if config.disable_by_batch_size is not None else \
            AdaptiveSpeculation(acceptance_is_free=self.proposer is not None)
        self.stats = SpecDecodingStats(config.num_speculative_tokens)
        #: Totals since start-up (the benchmarks' acceptance rate).
        self.totals = SpecDecodingStats(config.num_speculative_tokens)

    def wants_speculation(self, running: list[Request]) -> bool:
        """Whether the next step over ``running`` speculates (decided once, and kept for
        the step's first :meth:`drafts` call): with ``disable_by_batch_size``, when there are at most that
        many; else when :class:`~jaxpaged.core.spec_decode.adaptive.AdaptiveSpeculation`
        expects it to pay, from the sequences' acceptance rates. The engine asks before
        scheduling, to finish an in-flight step first (proposals need the last tokens on
        the host)."""
        if self._decision is None:
            limit = self.config.disable_by_batch_size
            if limit is not None:
                self._decision = len(running) <= limit
            else:
                k = self.config.num_speculative_tokens
                self._decision = self._adaptive.choose(
                    [expected_tokens(self._state(r).alpha, k) if self._may_draft(r) else 1.0
                     for r in running])
        return self._decision

    @staticmethod
    def _may_draft(req: Request) -> bool:
        """Whether ``req``'s sampling allows proposals (one sample, no prompt logprobs,
        no grammar)."""
        return (req.n_samples == 1 and req.params.prompt_logprobs is None
                and req.structured_output_request is None)

    @staticmethod
    def _state(req: Request) -> SpecState:
        if req.spec_state is None:
            req.spec_state = SpecState()
        return req.spec_state

    def drafts(self, req: Request, num_new: int, budget: int,
               running: list[Request]) -> list[int] | None:
        """The proposals to verify after ``req``'s ``num_new`` scheduled tokens, within
        ``budget`` more tokens; None when it does not speculate this step (the step does not:
        :meth:`wants_speculation` over ``running``, asked at the step's first call; not a
        plain decode, ``n > 1``, prompt logprobs, structured outputs, or no n-gram match).
        Each proposal is capped so the emitted run stays within ``max_tokens`` and
        ``max_model_len``. With a draft model the list holds ``-1`` placeholders, as many
        as the draft is to propose (``DraftModelProposer.propose`` fills it in place
        after :meth:`finish_step`, before the step is dispatched)."""
        if self._speculate is None:
            self._speculate = self.wants_speculation(running)
        total = len(req.all_token_ids)
        if (not self._speculate or num_new != 1 or req.num_computed_tokens != total - 1
                or req.num_output_placeholders or not self._may_draft(req)):
            return None
        limit = min(budget, req.max_tokens - (total - len(req.prompt_token_ids)) - 1,
                    self.max_model_len - total - 1)
        if limit <= 0:
            return None
        proposal = ([-1] * min(limit, self.config.num_speculative_tokens)
                    if self.proposer is None else self.proposer.propose(req.all_token_ids, limit))
        return proposal or None

    def finish_step(self, scheduled: list[ScheduledRequest], num_running: int) -> None:
        """The step's final plan ``scheduled``, made over ``num_running`` running sequences:
        drop every proposal of a step that is not a verification step (some sequence
        prefills or draws ``n > 1`` samples); the pages allocated for them stay in their
        sequence's page table and take its next tokens. A step of decodes alone is timed
        for the adaptive rule (steps with prefill chunks are not). The next step decides
        afresh whether it speculates."""
        self._speculate = self._decision = None
        drafted = any(s.draft_token_ids for s in scheduled)
        decodes = all(s.num_new_tokens == 1 + len(s.draft_token_ids or ()) and s.num_samples <= 1
                      for s in scheduled)
        if decodes and scheduled and self._adaptive is not None:
            self._adaptive.scheduled(id(scheduled), num_running, len(scheduled), drafted)
        if not drafted or decodes:
            return
        for s in scheduled:
            if s.draft_token_ids:
                s.num_new_tokens -= len(s.draft_token_ids)
                s.draft_token_ids = None

    def step_done(self, scheduled: list[ScheduledRequest], idle: bool) -> None:
        """The step ``scheduled`` (its list, as :meth:`finish_step` saw it) is applied;
        ``idle``: no sequence is left running."""
        if self._adaptive is not None:
            self._adaptive.done(id(scheduled), idle)

    def observe(self, req: Request) -> None:
        """``req`` emitted a token in a plain step: check its shadow n-gram proposal
        against it (its acceptance, ``adaptive``), and make the next one when that is done.
        Only under the adaptive rule with n-gram proposals (they are free; a draft
        model's are not)."""
        if self._adaptive is None or self.proposer is None:
            return
        self._state(req).observe(req.all_token_ids, self.proposer.propose,
                                 self.config.num_speculative_tokens)

    def apply_verified(self, req: Request, drafts: list[int], tokens: list[int],
                       logprobs: list | None, append) -> int:
        """Apply a verified run: ``tokens`` are the accepted proposals, then the resampled
        or bonus token. Moves ``req.num_computed_tokens`` back over the rejected positions,
        counts, and hands the tokens in order to ``append`` (``Scheduler.append_token``,
        which returns True once one stops the sequence); returns how many tokens were
        dropped after the stop."""
        self._count(req, drafts, len(tokens))
        for j, token in enumerate(tokens):
            if append(req, token, None if logprobs is None else logprobs[j]):
                return len(tokens) - j - 1
        return 0

    def _count(self, req: Request, drafts: list[int], num_emitted: int) -> None:
        accepted = num_emitted - 1
        req.num_computed_tokens -= len(drafts) - accepted
        state = self._state(req)
        state.record(accepted, len(drafts))
        state.shadow = None
        for s in (self.stats, self.totals):
            s.num_drafts += 1
            s.num_draft_tokens += len(drafts)
            s.num_accepted_tokens += accepted
            for pos in range(accepted):
                s.num_accepted_tokens_per_pos[pos] += 1

    def take_stats(self) -> SpecDecodingStats | None:
        """The counters since the last call (None if no sequence drafted)."""
        stats = self.stats
        if not stats.num_drafts:
            return None
        self.stats = SpecDecodingStats(self.config.num_speculative_tokens)
        return stats
