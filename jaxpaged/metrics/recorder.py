"""`StatsRecorder`: one engine's statistics events, handed to its stat loggers after each step.

The engine tells it what happened (a request scheduled for the first time, tokens arriving, a
request ending); :meth:`StatsRecorder.record` then passes a :class:`SchedulerStats` snapshot
and the :class:`IterationStats` collected since the previous call to every logger, as vLLM
V1's engine core hands ``SchedulerStats`` / ``IterationStats`` to its stat loggers
(``vllm/v1/metrics/stats.py``). Pure Python.
"""

from __future__ import annotations

from jaxpaged.metrics.stats import (IterationStats, SchedulerStats, StatLogger,
                                    finished_request_stats)


class StatsRecorder:
    """Collects the events of the steps between two :meth:`record` calls.

    Attributes:
        loggers: the sinks :meth:`record` calls (``jaxpaged.metrics.loggers``); empty by
            default.
        iteration: the events since the last :meth:`record` (the engine adds its generated
            token counts here).
    """

    def __init__(self):
        self.loggers: list[StatLogger] = []
        self.iteration = IterationStats()
        self._reported = (0, 0, 0)   # prefix-cache queries, hits, preemptions already reported

    @staticmethod
    def note_scheduled(groups: dict, scheduled_new_reqs, now: float) -> None:
        """Queue time: when each request of ``scheduled_new_reqs`` (``Request``s; their
        ``RequestGroup`` in ``groups`` by id) first left the waiting queue, ``now`` in
        ``time.monotonic()`` seconds."""
        for req in scheduled_new_reqs:
            group = groups[req.group_id]
            if group.first_scheduled_time is None:
                group.first_scheduled_time = now

    def note_tokens(self, group, now: float) -> None:
        """Time-to-first-token or inter-token latency of a request (``RequestGroup``) that
        got tokens ``now``."""
        it = self.iteration
        if group.first_token_time is None:
            group.first_token_time = now
            it.time_to_first_tokens.append(now - group.arrival_time)
            it.num_prompt_tokens += group.seqs[0].request.num_prompt_tokens
        else:
            it.inter_token_latencies.append(now - group.last_token_time)
        group.last_token_time = now

    def note_finished(self, group, now: float, reason: str) -> None:
        """A request ended ``now`` with finish reason ``reason``."""
        self.iteration.finished_requests.append(finished_request_stats(group, now, reason))

    def record(self, scheduler, kv_cache_manager) -> None:
        """Hand the snapshot of ``scheduler`` and ``kv_cache_manager`` and the events since
        the last call to the loggers; the counters (prefix-cache queries and hits,
        preemptions) are reported as their increase since then."""
        kv, sched = kv_cache_manager, scheduler
        totals = (kv.stats.queries, kv.stats.hits, sched.num_preemptions)
        queries, hits, preemptions = (a - b for a, b in zip(totals, self._reported))
        self._reported = totals
        iteration, self.iteration = self.iteration, IterationStats()
        if sched.spec is not None:
            iteration.spec_decoding = sched.spec.take_stats()
        if not self.loggers:
            return
        snapshot = SchedulerStats(
            num_running_reqs=len({r.group_id for r in sched.running}),
            num_waiting_reqs=len({r.group_id for r in sched.waiting}),
            kv_cache_usage=1.0 - kv.num_free_pages / kv.num_usable_pages,
            prefix_cache_queries=queries, prefix_cache_hits=hits, num_preemptions=preemptions,
            lora_info=None if sched.lora is None else sched.lora.requests_info(sched.running,
                                                                               sched.waiting))
        for stat_logger in self.loggers:
            stat_logger.record(snapshot, iteration)
