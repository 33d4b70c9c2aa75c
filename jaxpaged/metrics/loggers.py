"""Stat loggers: sinks for the engine's per-step statistics.

* :class:`PrometheusStatLogger` keeps vLLM's metric names (``vllm/v1/metrics/loggers.py``)
  under a ``jaxpaged:`` prefix, labelled by ``model_name``, in its own registry.
* :class:`LoggingStatLogger` writes vLLM's periodic one-line summary (throughput, running and
  waiting requests, KV cache usage, prefix-cache hit rate).

Both are called from the engine's thread after every step (``record``).
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily

from jaxpaged.metrics.stats import IterationStats, SchedulerStats

logger = logging.getLogger("jaxpaged.metrics")

#: Histogram buckets in seconds, as vLLM's (``vllm/v1/metrics/loggers.py``).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort", "error")


def token_buckets(max_model_len: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_model_len`` (vLLM's ``build_1_2_5_buckets``)."""
    buckets, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return buckets
            buckets.append(m * scale)
        scale *= 10


class PrometheusStatLogger:
    """Prometheus metrics of one engine.

    Args:
        model_name: the ``model_name`` label (the served model name).
        max_model_len: top of the request-length histograms' buckets.
        registry: where the metrics live (a fresh ``CollectorRegistry`` by default, so that
            several engines in one process do not collide).
        max_num_batched_tokens: top of ``iteration_tokens_total``'s buckets (default
            ``max_model_len``).
    """

    PREFIX = "jaxpaged:"

    def __init__(self, model_name: str, max_model_len: int,
                 registry: CollectorRegistry | None = None,
                 max_num_batched_tokens: int | None = None):
        self.registry = registry or CollectorRegistry()
        p, labels = self.PREFIX, ["model_name"]

        def make(kind, name, doc, **kw):
            return kind(p + name, doc, labels + kw.pop("extra", []), registry=self.registry, **kw)

        self.running = make(Gauge, "num_requests_running", "Requests running on the engine.")
        self.waiting = make(Gauge, "num_requests_waiting", "Requests waiting to run.")
        self.kv_usage = make(Gauge, "kv_cache_usage_perc",
                             "Fraction of KV-cache pages in use (1 = all).")
        self.prefix_queries = make(Counter, "prefix_cache_queries",
                                   "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = make(Counter, "prefix_cache_hits",
                                "Prompt tokens found in the prefix cache.")
        self.preemptions = make(Counter, "num_preemptions", "Sequences preempted.")
        self.prompt_tokens = make(Counter, "prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = make(Counter, "generation_tokens", "Tokens generated.")
        self.success = make(Counter, "request_success", "Finished requests by finish reason.",
                            extra=["finished_reason"])
        self.ttft = make(Histogram, "time_to_first_token_seconds",
                         "Time to first token (arrival to first token).", buckets=TTFT_BUCKETS)
        self.itl = make(Histogram, "inter_token_latency_seconds",
                        "Time between consecutive tokens of a request.", buckets=ITL_BUCKETS)
        self.e2e = make(Histogram, "e2e_request_latency_seconds",
                        "Arrival to finish of a request.", buckets=REQUEST_LATENCY_BUCKETS)
        self.queue_time = make(Histogram, "request_queue_time_seconds",
                               "Arrival to first scheduling of a request.",
                               buckets=REQUEST_LATENCY_BUCKETS)
        length_buckets = token_buckets(max_model_len)
        self.prompt_len = make(Histogram, "request_prompt_tokens",
                               "Prompt length of finished requests.", buckets=length_buckets)
        self.generation_len = make(Histogram, "request_generation_tokens",
                                   "Generated tokens of finished requests.",
                                   buckets=length_buckets)
        self.iteration_tokens = make(Histogram, "iteration_tokens_total",
                                     "Tokens (prefill and decode) per engine step.",
                                     buckets=token_buckets(max_num_batched_tokens
                                                           or max_model_len))
        self.batched_tokens = make(Gauge, "num_batched_tokens",
                                   "Tokens in the latest engine step (0: none since the "
                                   "previous report).")
        self.phase_times = {phase: make(Histogram, f"request_{phase}_time_seconds", doc,
                                        buckets=REQUEST_LATENCY_BUCKETS) for phase, doc in (
            ("prefill", "First scheduling to first token of a request."),
            ("decode", "First token to finish of a request."),
            ("inference", "First scheduling to finish of a request."))}
        self.spec_drafts = make(Counter, "spec_decode_num_drafts",
                                "Sequence-steps that verified speculative proposals.")
        self.spec_draft_tokens = make(Counter, "spec_decode_num_draft_tokens",
                                      "Speculative proposals verified.")
        self.spec_accepted = make(Counter, "spec_decode_num_accepted_tokens",
                                  "Speculative proposals accepted.")
        self.spec_accepted_per_pos = make(Counter, "spec_decode_num_accepted_tokens_per_pos",
                                          "Speculative proposals accepted, by position.",
                                          extra=["position"])
        self.lora_info = make(Gauge, "lora_requests_info",
                              "Running and waiting LoRA adapters (value: the time of the "
                              "report; only with --enable-lora).",
                              extra=["max_lora", "running_lora_adapters",
                                     "waiting_lora_adapters"])
        self._model = model_name
        for reason in FINISH_REASONS:   # present (at 0) from the start
            self.success.labels(model_name, reason)

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        m, s, it = self._model, scheduler_stats, iteration_stats
        self.running.labels(m).set(s.num_running_reqs)
        self.waiting.labels(m).set(s.num_waiting_reqs)
        self.kv_usage.labels(m).set(s.kv_cache_usage)
        self.prefix_queries.labels(m).inc(s.prefix_cache_queries)
        self.prefix_hits.labels(m).inc(s.prefix_cache_hits)
        self.preemptions.labels(m).inc(s.num_preemptions)
        self.prompt_tokens.labels(m).inc(it.num_prompt_tokens)
        self.generation_tokens.labels(m).inc(it.num_generation_tokens)
        for t in it.time_to_first_tokens:
            self.ttft.labels(m).observe(t)
        for t in it.inter_token_latencies:
            self.itl.labels(m).observe(t)
        for n in it.step_tokens:
            self.iteration_tokens.labels(m).observe(n)
        self.batched_tokens.labels(m).set(it.step_tokens[-1] if it.step_tokens else 0)
        for f in it.finished_requests:
            self.success.labels(m, f.finish_reason).inc()
            self.e2e.labels(m).observe(f.e2e_latency)
            if f.queue_time is not None:
                self.queue_time.labels(m).observe(f.queue_time)
            self.prompt_len.labels(m).observe(f.num_prompt_tokens)
            self.generation_len.labels(m).observe(f.num_generation_tokens)
            for phase, seconds in (("prefill", f.prefill_time), ("decode", f.decode_time),
                                   ("inference", f.inference_time)):
                if seconds is not None:
                    self.phase_times[phase].labels(m).observe(seconds)
        if s.lora_info is not None:
            max_lora, running, waiting = s.lora_info
            self.lora_info.clear()      # one sample: the adapters now
            self.lora_info.labels(m, str(max_lora), running, waiting).set_to_current_time()
        spec = it.spec_decoding
        if spec is not None:
            self.spec_drafts.labels(m).inc(spec.num_drafts)
            self.spec_draft_tokens.labels(m).inc(spec.num_draft_tokens)
            self.spec_accepted.labels(m).inc(spec.num_accepted_tokens)
            for pos, n in enumerate(spec.num_accepted_tokens_per_pos):
                self.spec_accepted_per_pos.labels(m, str(pos)).inc(n)

    def watch_device_memory(self, used: Callable[[], dict[str, int]]) -> None:
        """Export ``jaxpaged:device_memory_used_bytes`` (labels ``model_name``, ``device``),
        read from ``used()`` (device name -> bytes in use; ``Engine.device_memory_used``)
        at every scrape."""
        logger_self = self

        class DeviceMemory:
            def collect(self):
                family = GaugeMetricFamily(
                    logger_self.PREFIX + "device_memory_used_bytes",
                    "Device memory in use (the runtime's count; on a CPU, the live arrays).",
                    labels=["model_name", "device"])
                for device, value in used().items():
                    family.add_metric([logger_self._model, device], value)
                yield family

        self.registry.register(DeviceMemory())


class LoggingStatLogger:
    """Logs vLLM's summary line at most once per ``interval`` seconds while there is activity.

    Example line: ``Avg prompt throughput: 120.0 tokens/s, Avg generation throughput: 850.3
    tokens/s, Running: 12 reqs, Waiting: 0 reqs, KV cache usage: 8.1%, Prefix cache hit rate:
    41.0%``; with speculative decoding it goes on ``, Mean acceptance length: 2.41,
    Draft acceptance rate: 35.3%`` (vLLM's ``SpecDecodingLogging`` figures: 1 + accepted /
    drafts, and accepted / proposed tokens).
    """

    def __init__(self, interval: float = 10.0):
        self.interval = interval
        self._reset(time.monotonic())

    def _reset(self, now: float) -> None:
        self._since = now
        self._prompt = self._generation = self._queries = self._hits = 0
        self._drafts = self._draft_tokens = self._accepted = 0

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        self._prompt += iteration_stats.num_prompt_tokens
        self._generation += iteration_stats.num_generation_tokens
        self._queries += scheduler_stats.prefix_cache_queries
        self._hits += scheduler_stats.prefix_cache_hits
        if (spec := iteration_stats.spec_decoding) is not None:
            self._drafts += spec.num_drafts
            self._draft_tokens += spec.num_draft_tokens
            self._accepted += spec.num_accepted_tokens
        now = time.monotonic()
        elapsed = now - self._since
        if elapsed < self.interval:
            return
        s = scheduler_stats
        hit_rate = 100.0 * self._hits / self._queries if self._queries else 0.0
        logger.info("Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f "
                    "tokens/s, Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, "
                    "Prefix cache hit rate: %.1f%%%s", self._prompt / elapsed,
                    self._generation / elapsed, s.num_running_reqs, s.num_waiting_reqs,
                    100.0 * s.kv_cache_usage, hit_rate, self._spec_summary())
        self._reset(now)

    def _spec_summary(self) -> str:
        if not self._drafts:
            return ""
        return (f", Mean acceptance length: {1 + self._accepted / self._drafts:.2f}, "
                f"Draft acceptance rate: {100.0 * self._accepted / self._draft_tokens:.1f}%")
