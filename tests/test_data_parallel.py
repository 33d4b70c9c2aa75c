"""Data parallelism (--data-parallel-size) on host CPU devices (tests/conftest.py sets 8)."""

import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.distributed.tensor_parallel import TensorParallelError
from jaxpaged.engine.data_parallel import DataParallelEngine
from jaxpaged.metrics.stats import IterationStats, SchedulerStats
from tests.test_continuous_batching import random_prompts

PROMPTS = random_prompts(7, 512, seed=5, max_len=40)


def outputs(llm, params):
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def make(dp, tp=1, **kw):
    return LLM(data_parallel_size=dp, tensor_parallel_size=tp, enforce_eager=True,
               max_num_seqs=8, max_num_batched_tokens=64, **kw)


def test_outputs_do_not_depend_on_the_replica_count():
    """Greedy and unseeded sampled tokens (seeds drawn in arrival order from one generator)
    are those of one engine; dp=2 with tp=2 uses 4 devices, 7 prompts split 4 / 3."""
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    sampled = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10, ignore_eos=True)
    one = make(1)
    ref = outputs(one, greedy), outputs(one, sampled)
    llm = make(2, 2)
    assert isinstance(llm.engine, DataParallelEngine)
    assert (outputs(llm, greedy), outputs(llm, sampled)) == ref


def test_requests_are_spread_over_the_replicas_and_aborts_reach_theirs():
    llm = make(2)
    engine = llm.engine
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    for i in range(5):
        engine.add_request(str(i), PROMPTS[i], params)
    assert [r.get_num_unfinished_requests() for r in engine.replicas] == [3, 2]
    engine.step()
    engine.abort_request(["0", "1", "unknown"])
    assert [r.get_num_unfinished_requests() for r in engine.replicas] == [2, 1]
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("2", PROMPTS[0], params)
    engine.abort_request(["2", "3", "4"])
    assert not engine.has_unfinished_requests()
    stats = engine.stats()
    assert stats.num_free_pages == stats.num_pages == sum(
        r.kv_cache_manager.num_usable_pages for r in engine.replicas)


def test_statistics_of_the_replicas_are_merged():
    reports: list[tuple[SchedulerStats, IterationStats]] = []

    class Recorder:
        def record(self, scheduler_stats, iteration_stats):
            reports.append((scheduler_stats, iteration_stats))

    llm = make(2)
    llm.engine.stat_loggers.append(Recorder())
    llm.engine.add_request("a", PROMPTS[0], SamplingParams(max_tokens=5, ignore_eos=True))
    llm.engine.add_request("b", PROMPTS[1], SamplingParams(max_tokens=5, ignore_eos=True))
    while not reports:         # both replicas prefill and sample their first token
        llm.engine.step()      # (reported one step later with async scheduling)
    last = reports[-1][0]
    assert last.num_running_reqs == 2
    assert sum(it.num_generation_tokens for _, it in reports) == 2
    assert sum(len(it.time_to_first_tokens) for _, it in reports) == 2
    usage = [1 - r.kv_cache_manager.num_free_pages / r.kv_cache_manager.num_usable_pages
             for r in llm.engine.replicas]
    assert last.kv_cache_usage == pytest.approx(sum(usage) / 2)


def test_too_few_devices_is_a_clear_error():
    with pytest.raises(TensorParallelError, match="data_parallel_size=3 x tensor_parallel_size"
                                                  "=4 needs 12 devices but this process has 8"):
        make(3, 4)
    with pytest.raises(ValueError, match="cannot be combined with num_processes > 1"):
        LLM(data_parallel_size=2, num_processes=2, tensor_parallel_size=2)
