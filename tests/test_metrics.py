"""Stat loggers: the periodic log line and the Prometheus families, from hand-made stats."""

import logging

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from jaxpaged.metrics.loggers import LoggingStatLogger, PrometheusStatLogger, token_buckets
from jaxpaged.metrics.stats import FinishedRequestStats, IterationStats, SchedulerStats

SNAPSHOT = SchedulerStats(num_running_reqs=3, num_waiting_reqs=2, kv_cache_usage=0.25,
                          prefix_cache_queries=40, prefix_cache_hits=10, num_preemptions=1)


def iteration():
    return IterationStats(num_prompt_tokens=100, num_generation_tokens=7,
                          time_to_first_tokens=[0.05], inter_token_latencies=[0.02, 0.03],
                          finished_requests=[FinishedRequestStats("stop", 1.5, 0.01, 100, 7,
                                                                  prefill_time=0.04,
                                                                  decode_time=1.45,
                                                                  inference_time=1.49)],
                          step_tokens=[120, 3, 3])


def test_log_line(caplog):
    stat_logger = LoggingStatLogger(interval=0.0)
    stat_logger._since -= 2.0        # two seconds of activity
    with caplog.at_level(logging.INFO, logger="jaxpaged.metrics"):
        stat_logger.record(SNAPSHOT, iteration())
    (line,) = [r.getMessage() for r in caplog.records]
    assert "Running: 3 reqs, Waiting: 2 reqs, KV cache usage: 25.0%" in line
    assert "Prefix cache hit rate: 25.0%" in line
    rate = float(line.split("Avg prompt throughput: ")[1].split(" ")[0])
    assert 45 < rate <= 50       # 100 tokens over a little more than 2 s


def test_prometheus_families():
    stat_logger = PrometheusStatLogger("m", 512)
    stat_logger.record(SNAPSHOT, iteration())
    stat_logger.record(SNAPSHOT, IterationStats())
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(generate_latest(stat_logger.registry).decode())
               for s in f.samples}
    m = (("model_name", "m"),)
    assert samples[("jaxpaged:num_requests_running", m)] == 3
    assert samples[("jaxpaged:kv_cache_usage_perc", m)] == 0.25
    assert samples[("jaxpaged:prefix_cache_queries_total", m)] == 80     # deltas add up
    assert samples[("jaxpaged:prompt_tokens_total", m)] == 100
    assert samples[("jaxpaged:request_success_total",
                    (("finished_reason", "stop"), ("model_name", "m")))] == 1
    assert samples[("jaxpaged:request_success_total",
                    (("finished_reason", "abort"), ("model_name", "m")))] == 0
    assert samples[("jaxpaged:inter_token_latency_seconds_count", m)] == 2
    assert samples[("jaxpaged:request_generation_tokens_sum", m)] == 7
    assert samples[("jaxpaged:iteration_tokens_total_count", m)] == 3
    assert samples[("jaxpaged:iteration_tokens_total_sum", m)] == 126
    assert samples[("jaxpaged:iteration_tokens_total_bucket", (("le", "5.0"),) + m)] == 2
    assert samples[("jaxpaged:num_batched_tokens", m)] == 0     # no step in the 2nd report
    for phase, seconds in (("prefill", 0.04), ("decode", 1.45), ("inference", 1.49)):
        assert samples[(f"jaxpaged:request_{phase}_time_seconds_sum", m)] == seconds
    stat_logger.watch_device_memory(lambda: {"cpu:0": 123, "cpu:1": 456})
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(generate_latest(stat_logger.registry).decode())
               for s in f.samples}
    assert samples[("jaxpaged:device_memory_used_bytes",
                    (("device", "cpu:1"), ("model_name", "m")))] == 456


def test_token_buckets():
    assert token_buckets(512) == [1, 2, 5, 10, 20, 50, 100, 200, 500]
    assert token_buckets(4) == [1, 2]
