"""How :class:`jaxpaged.engine.engine.Engine` runs a step: schedule, dispatch to the runner,
apply the result, make outputs; the synchronous form (vLLM's ``EngineCore.step``) and the
asynchronous one (``EngineCore.step_with_batch_queue``: step N is dispatched before step N-1's
tokens are applied), chosen once when the engine is built. Failures of a model step fail only
the requests it ran (``Engine.step``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from jaxpaged.core.output_processor import RequestGroup
from jaxpaged.core.runner_output import ModelRunnerOutput
from jaxpaged.core.scheduler_output import SchedulerOutput
from jaxpaged.engine.rollout import tag_version
from jaxpaged.outputs import RequestOutput

logger = logging.getLogger(__name__)


@dataclass
class InFlightStep:
    """A dispatched step: its plan, a call that waits for and returns its
    ``ModelRunnerOutput``, when it was dispatched (``time.monotonic()`` seconds), whether it
    samples a parallel-sampling prompt (the next step must wait for its fork), and whether
    it was failed already (with the step before it)."""

    scheduler_output: SchedulerOutput
    result: Callable[[], ModelRunnerOutput]
    scheduled_at: float
    forks: bool
    failed: bool = False


class EngineSteps:
    """The step half of ``Engine`` (a base class: the scheduler, runner, output processor,
    statistics and flags it reads are built by ``Engine.__init__``)."""

    def _step_sync(self) -> list[RequestOutput]:
        """One step, finished before it returns: schedule, dispatch, wait, apply, output."""
        outputs, self._early_outputs = self._early_outputs, []
        scheduler_output = self.scheduler.schedule()
        if not scheduler_output.scheduled:
            self._idle()
            return outputs
        try:
            current = self._dispatch(scheduler_output)
        except Exception as e:
            if self.args.num_processes > 1:
                raise
            return outputs + self._fail_step(scheduler_output, e)
        return outputs + self._finish(current)

    def _step_async(self) -> list[RequestOutput]:
        """Schedule and dispatch this step, then apply the previous one's tokens while this
        one runs; this step stays in flight unless it must be finished now."""
        outputs, self._early_outputs = self._early_outputs, []
        previous, self._in_flight = self._in_flight, None
        spec = self.scheduler.spec
        if previous is not None and (previous.forks or (
                spec is not None and spec.wants_speculation(self.scheduler.running))):
            outputs += self._finish(previous)    # (proposals need the last tokens)
            previous = None
        scheduler_output = self.scheduler.schedule()
        current = None
        if scheduler_output.scheduled:
            try:
                current = self._dispatch(scheduler_output)
            except Exception as e:  # noqa: BLE001 - a failed step fails only its requests
                if previous is not None:    # its tokens first, as the synchronous engine
                    outputs += self._finish(previous)
                return outputs + self._fail_step(scheduler_output, e)
        elif previous is None:
            self._idle()
        if previous is not None:
            outputs += self._finish(previous, scheduler_output, current)
        if current is not None and not current.failed:
            scheduled = current.scheduler_output.scheduled
            # (A structured-output sequence's next mask needs this step's token on the host.)
            if any(not s.request.is_finished for s in scheduled) and not any(
                    s.request.structured_output_request or s.draft_token_ids for s in scheduled):
                self._in_flight = current
            else:   # (a grammar or proposals need its tokens, or all its requests finished)
                outputs += self._finish(current)
        return outputs

    def _idle(self) -> None:
        """Nothing to run and nothing in flight: let grammars still compiling progress, and
        never spin silently on requests that cannot be scheduled."""
        if not self.scheduler.running and (compiling := self.scheduler.waiting_for_grammars()):
            compiling[0].wait(timeout=0.05)     # nothing else to run: let grammars compile
        elif self.scheduler.waiting and not self.scheduler.running:
            # Unreachable while add_request's checks hold.
            raise RuntimeError(f"no waiting request can be scheduled "
                               f"({len(self.scheduler.waiting)} waiting, {self.stats()})")

    def _dispatch(self, scheduler_output: SchedulerOutput) -> InFlightStep:
        """Start the device step, after the test hook :attr:`fault_injector`."""
        step_index, self._num_steps = self._num_steps, self._num_steps + 1
        if self.fault_injector is not None:
            self.fault_injector(step_index, list(dict.fromkeys(
                s.request.group_id for s in scheduler_output.scheduled)))
        scheduled_at = time.monotonic()
        self._stats.iteration.step_tokens.append(scheduler_output.num_tokens)
        if self.drafter is not None:    # fills the step's draft placeholders
            self.drafter.propose(scheduler_output)
        pending = self.runner.dispatch(scheduler_output)
        return InFlightStep(scheduler_output, pending.result, scheduled_at, scheduler_output.forks)

    def _finish(self, step: InFlightStep, next_output: SchedulerOutput | None = None,
                next_step: InFlightStep | None = None) -> list[RequestOutput]:
        """Wait for a dispatched step, apply its tokens and make its outputs.

        Args:
            step: the step.
            next_output: the step scheduled since (async scheduling), whose preemptions are
                left out of the counts these outputs report (they came after this step).
            next_step: that step, if dispatched: it fails too if this one fails.
        """
        try:
            runner_output = step.result()
        except Exception as e:
            if self.args.num_processes > 1:
                raise
            outputs = self._fail_step(step.scheduler_output, e)
            if next_step is not None:    # it read this step's tokens
                next_step.failed = True
                with contextlib.suppress(Exception):
                    next_step.result()
                outputs += self._fail_step(next_step.scheduler_output, e)
            return outputs
        self._stats.note_scheduled(self.output_processor.groups,
                                   step.scheduler_output.scheduled_new_reqs, step.scheduled_at)
        generated = self.scheduler.num_generation_tokens
        groups = self.scheduler.update_from_output(step.scheduler_output, runner_output)
        self._stats.iteration.num_generation_tokens += \
            self.scheduler.num_generation_tokens - generated
        return self._outputs(groups, None if next_output is None else Counter(
            req.group_id for req in next_output.preempted))

    def _outputs(self, groups: list[RequestGroup],
                 preempted: dict[str, int] | None = None) -> list[RequestOutput]:
        """The outputs of the requests that got tokens; finished ones are retired.
        ``preempted``: preemptions since, by request id, left out of the counts reported."""
        outputs, now = [], time.monotonic()
        note_tokens, make_output = self._stats.note_tokens, self.output_processor.make_output
        version = self.weight_version    # (outputs carry 0 unless weights were updated)
        for group in groups:
            note_tokens(group, now)
            since = preempted.get(group.request_id) if preempted else None
            out = make_output(group, None if since is None else sum(
                seq.request.num_preemptions for seq in group.seqs) - since)
            if out is not None:
                if version:
                    tag_version(out, version)
                outputs.append(out)
            if out.finished if out is not None else group.finished:
                self._retire(group, now, group.seqs[0].request.finish_reason)
        self.record_stats()
        self._heap.update(self.runner.num_compilations)   # after a step that compiled
        return outputs

    def _fail_step(self, scheduler_output: SchedulerOutput,
                   error: Exception) -> list[RequestOutput]:
        """Fail every request that the step ran, after the step raised ``error`` (see
        :meth:`step`); returns their final outputs."""
        groups = self.scheduler.fail_step(scheduler_output)
        logger.error("a model step failed; failing the requests it ran: %s",
                     [g.request_id for g in groups], exc_info=error)
        message = f"the model step running this request failed: {type(error).__name__}: {error}"
        outputs, now = [], time.monotonic()
        for group in groups:
            group.error = message
            outputs.append(self.output_processor.make_output(group))
            tag_version(outputs[-1], self.weight_version)
            self._retire(group, now, "error")
        if self.runner.kv_pool_lost:
            logger.error("the failed step consumed the KV pool: reallocating it; %d running "
                         "sequences recompute, the prefix cache is emptied",
                         self.scheduler.reset_kv_cache())
            self.runner.reallocate_kv_pool()
        self.record_stats()
        return outputs

    def _retire(self, group: RequestGroup, now: float, reason: str) -> None:
        """Forget a finished request and record its statistics."""
        self.output_processor.remove_request(group.request_id)
        self._stats.note_finished(group, now, reason)
