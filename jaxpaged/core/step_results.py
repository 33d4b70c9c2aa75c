"""The result half of :class:`jaxpaged.core.scheduler.Scheduler`: applying a finished step.

``update_from_output`` resolves each sampling sequence's placeholder with its token, forks
parallel-sampling requests after their prompt and appends every token through
``append_token``, the one place that decides whether a sequence stops (the token-id rules of
``jaxpaged.core.stop_check``, then the output processor's stop strings); ``finish_request``
is the one writer of ``finish_reason``; ``fail_step`` fails the requests a failed step ran.
vLLM v1 keeps these in its scheduler (``Scheduler.update_from_output`` in
``vllm/v1/core/sched/scheduler.py``); here they are a base class of ``Scheduler``, as
``jaxpaged.engine.engine_step`` is of ``Engine``. Pure Python.
"""

from __future__ import annotations

from jaxpaged.core.output_processor import RequestGroup
from jaxpaged.core.request import Request, RequestStatus
from jaxpaged.core.runner_output import ModelRunnerOutput, TokenLogprob
from jaxpaged.core.scheduler_output import SchedulerOutput
from jaxpaged.core.stop_check import check_stop


class StepResults:
    """The result half of ``Scheduler`` (a base class: the queues, the KV cache manager, the
    output processor, the speculation rules and the helpers bound once that it reads are
    built by ``Scheduler.__init__``)."""

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> list[RequestGroup]:
        """Apply a finished step: resolve every sampling sequence's placeholder with its
        token, fork parallel-sampling requests after their prompt, and append each token
        (:meth:`append_token`, which finishes the sequences it stops). The one place that
        moves tokens forward after a step (``num_computed_tokens`` moved at scheduling).

        Under async scheduling the next step may have been scheduled in between: a sequence
        finished since (a stop found in the step before, an abort) drops its token; one
        preempted since keeps it (it recomputes with it, as if preempted after this step).

        Returns:
            The requests that got tokens (or prompt logprobs) this step, in batch order.
        """
        op, append = self.output_processor, self.append_token
        touched: dict[str, None] = {}
        logprobs, prompt_logprobs = runner_output.logprobs, runner_output.prompt_logprobs
        finished = RequestStatus.FINISHED
        num_generated = 0
        for i, (s, tokens) in enumerate(zip(scheduler_output.scheduled,
                                            runner_output.sampled_token_ids, strict=True)):
            req = s.request
            if req.status is finished:
                continue
            if prompt_logprobs is not None and prompt_logprobs[i] is not None:
                op.add_prompt_logprobs(req.group_id, s.start, prompt_logprobs[i])
            if req.pooling is not None:    # a pooling request ends with its prompt
                if req.pooling.add_chunk(s.start, s.end, req.num_prompt_tokens,
                                         runner_output.pooled[i]):
                    req.num_output_placeholders = 0
                    self.finish_request(req, "stop")
                    touched[req.group_id] = None
                continue
            num_tokens = len(tokens)
            if not num_tokens:
                continue
            if req.num_output_placeholders:
                req.num_output_placeholders -= 1
            num_generated += num_tokens
            if s.draft_token_ids:    # a verified run: its tokens in order, up to a stop
                num_generated -= self.spec.apply_verified(
                    req, s.draft_token_ids, tokens, None if logprobs is None else logprobs[i],
                    append)
            elif num_tokens == 1:     # the common case
                if not append(req, tokens[0], None if logprobs is None else logprobs[i][0]) \
                        and self.spec is not None:
                    self.spec.observe(req)
            else:   # (children forked before any token is applied: each copies the grammar)
                for j, seq in enumerate([req] + self._fork(req, num_tokens - 1)):
                    append(seq, tokens[j], None if logprobs is None else logprobs[i][j])
            touched[req.group_id] = None
        self.num_generation_tokens += num_generated
        if self.spec is not None:
            self.spec.step_done(scheduler_output.scheduled, not self.running)
        groups = op.groups
        return [groups[g] for g in touched]

    def append_token(self, req: Request, token: int, logprob: TokenLogprob | None) -> bool:
        """Append one sampled token to sequence ``req`` and decide whether it stops (the one
        place that does): advance its grammar, append the id, check the token-id rules
        (:func:`~jaxpaged.core.stop_check.check_stop`: EOS, stop ids, length), have the
        output processor add its logprob and text and match stop strings (which outrank the
        length limit), and finish the sequence when a rule fired. Returns whether it did."""
        if req.structured_output_request is not None:
            req.structured_output_request.accept(token)
        ids = req.all_token_ids
        ids.append(token)
        num_ids = len(ids)
        # check_stop's rules fire only on an EOS or stop id or at a length limit: a token
        # meeting none of these (most tokens) skips the call (kept in step with its rules).
        eos, max_model_len = self.output_processor.eos_token_ids, self.config.max_model_len
        stop = check_stop(req, eos, max_model_len) if (
            token in eos or req.params.stop_token_ids or num_ids >= max_model_len
            or num_ids - len(req.prompt_token_ids) >= req.max_tokens) else None
        matched = self._add_token(req, token, logprob, stop)
        if matched is not None:
            stop = ("stop", matched)
        elif stop is None:
            return False
        self.finish_request(req, *stop)
        return True

    def _fork(self, leader: Request, count: int) -> list[Request]:
        """Split a parallel-sampling request after its prompt into ``count`` more sequences
        that share the leader's pages (copy-on-write for the partly filled last page), each
        running right after the previous one."""
        children, after = [], leader
        for j in range(1, count + 1):
            child = leader.fork(j)
            self.kv.fork(leader.request_id, child.request_id)
            child.status = RequestStatus.RUNNING
            self.running.insert(self.running.index(after) + 1, child)
            self.output_processor.add_sequence(child)
            children.append(child)
            after = child
        leader.n_samples = 1
        return children

    def finish_request(self, req: Request, finish_reason: str,
                       stop_reason: int | str | None = None) -> None:
        """Finish a sequence (a stop rule, ``"abort"``, ``"error"``): the one place that sets
        ``finish_reason``; removes it from its queue and frees its pages at once."""
        req.finish_reason, req.stop_reason = finish_reason, stop_reason
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED
        self.kv.free(req.request_id)

    def fail_step(self, scheduler_output: SchedulerOutput) -> list[RequestGroup]:
        """Finish with ``"error"`` every request that a failed step ran (all its sequences),
        after dropping from the prefix cache the pages the step was to fill; returns them.
        Sequences finished since it was scheduled (async scheduling) are left alone."""
        op = self.output_processor
        live = [s for s in scheduler_output.scheduled if not s.request.is_finished]
        groups = {s.request.group_id: op.groups[s.request.group_id] for s in live}
        for s in live:    # the step did not (fully) write these pages
            self.kv.uncache_from(s.request.request_id, s.start)
        for group in groups.values():
            for seq in group.seqs:
                if not seq.request.is_finished:
                    self.finish_request(seq.request, "error")
        return list(groups.values())
