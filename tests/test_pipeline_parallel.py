"""Pipeline parallelism on host CPU devices (tests/conftest.py sets XLA_FLAGS to 8)."""

import jax
import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.config import ModelConfig
from jaxpaged.distributed.pipeline_parallel import (PipelineParallel, PipelineParallelError,
                                                    stage_layer_ranges)
from jaxpaged.arg_utils import EngineArgs, cli_error_message
from jaxpaged.core.scheduler_output import ScheduledRequest, SchedulerOutput
from jaxpaged.core.runner_output import ModelRunnerOutput
from jaxpaged.runner.pipeline_runner import merge_outputs, split_micro_batches
from tests.conftest import STORIES
from tests.helpers.random_llama import write_random_llama

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def shared_prefix_prompts(n, vocab, seed):
    """``n`` prompts sharing a 32-token (two-page) prefix, with random tails."""
    rng = np.random.default_rng(seed)
    prefix = [1] + rng.integers(3, vocab, size=31).tolist()
    return [prefix + rng.integers(3, vocab, size=int(k)).tolist()
            for k in rng.integers(1, 30, size=n)]


def run(model, prompts, **kw):
    """Greedy and seeded-sampled token ids on a pool small enough to preempt."""
    llm = LLM(model=model, tokenizer=STORIES, enforce_eager=True, max_num_seqs=8,
              max_num_batched_tokens=64, max_model_len=128, num_gpu_blocks_override=14, **kw)
    greedy = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    sampled = llm.generate(prompts, [SamplingParams(temperature=0.9, seed=i, max_tokens=8)
                                     for i in range(len(prompts))], use_tqdm=False)
    return greedy, [o.outputs[0].token_ids for o in sampled], llm


@pytest.fixture(scope="module")
def random_llama(tmp_path_factory):
    """A random untied Llama of 3 layers (uneven over 2 stages), 8 query and 8 KV heads."""
    return write_random_llama(tmp_path_factory.mktemp("pp_llama"), hidden_size=64,
                              intermediate_size=128, num_hidden_layers=3,
                              num_attention_heads=8)


def test_stage_layer_ranges():
    assert stage_layer_ranges(5, 2) == [(0, 3), (3, 5)]
    assert stage_layer_ranges(10, 4) == [(0, 2), (2, 5), (5, 8), (8, 10)]
    assert stage_layer_ranges(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert stage_layer_ranges(7, 1) == [(0, 7)]
    with pytest.raises(PipelineParallelError, match="exceeds the model's 3 decoder layers"):
        stage_layer_ranges(3, 4)


def test_micro_batches_split_by_tokens_and_merge_in_order():
    sizes = [40, 1, 1, 30, 8]
    sched = SchedulerOutput(scheduled=[ScheduledRequest(None, 0, n, [1], True, 1)
                                       for n in sizes])
    parts = split_micro_batches(sched, 2)
    assert [[s.num_new_tokens for s in p.scheduled] for p in parts] == [[40], [1, 1, 30, 8]]
    parts = split_micro_batches(sched, 4)
    assert [[s.num_new_tokens for s in p.scheduled] for p in parts] == [[40], [1, 1, 30], [8]]
    assert len(split_micro_batches(SchedulerOutput(scheduled=sched.scheduled[:1]), 2)) == 1
    merged = merge_outputs([
        ModelRunnerOutput(sampled_token_ids=[[5]]),
        ModelRunnerOutput(sampled_token_ids=[[6], [7, 8]],
                          logprobs=[[(-1.0, 1, [6], [-1.0])], [(-2.0, 1, [7], [-2.0])] * 2])])
    assert merged.sampled_token_ids == [[5], [6], [7, 8]]
    assert merged.logprobs == [[None], [(-1.0, 1, [6], [-1.0])], [(-2.0, 1, [7], [-2.0])] * 2]
    assert merged.prompt_logprobs is None and merged.pooled is None


def check_pipeline(model, prompts, pp, tp, layer_ranges, **kw):
    """pp x tp greedy and seeded tokens equal one device's, with preemption and
    prefix-cache hits on the way; every layer's pool and weights on its stage's devices."""
    ref_greedy, ref_sampled, ref = run(model, prompts, **kw)
    assert ref.engine.scheduler.num_preemptions > 0
    greedy, sampled, llm = run(model, prompts, pipeline_parallel_size=pp,
                               tensor_parallel_size=tp, **kw)
    assert greedy == ref_greedy
    assert sampled == ref_sampled
    engine = llm.engine
    assert engine.scheduler.num_preemptions > 0
    assert engine.kv_cache_manager.stats.hits > 0
    runner = engine.runner
    assert runner.pipeline.layer_ranges == layer_ranges
    devices = jax.devices()
    stage_devices = [set(devices[s * tp:(s + 1) * tp]) for s in range(pp)]
    assert [set(k.sharding.device_set) for k, _ in runner._kv_caches] == \
        [stage_devices[runner.pipeline.stage_of_layer(i)] for i in range(len(runner._kv_caches))]
    for s, state in enumerate(runner._state):
        assert all(set(x.sharding.device_set) == stage_devices[s]
                   for x in jax.tree.leaves(state))
    return runner


def test_bundled_model_pp2_tp2_equals_single_device():
    """4 devices: two stages of 3 and 2 layers, each split over 2 devices by KV head."""
    runner = check_pipeline(STORIES, shared_prefix_prompts(6, 512, seed=4), 2, 2,
                            ((0, 3), (3, 5)))
    assert {sh.data.shape[2] for sh in runner._kv_caches[4][0].addressable_shards} == {2}


@pytest.mark.slow
def test_bundled_model_pp2_equals_single_device():
    check_pipeline(STORIES, shared_prefix_prompts(6, 512, seed=4), 2, 1, ((0, 3), (3, 5)))


@pytest.mark.slow
@pytest.mark.parametrize("pp, tp", [(2, 1), (2, 2)])
def test_random_llama_pipeline_equals_single_device(random_llama, pp, tp):
    check_pipeline(random_llama, shared_prefix_prompts(5, 512, seed=5), pp, tp,
                   ((0, 2), (2, 3)), load_format="dummy", seed=7)


def test_too_few_devices_names_both_flags():
    cfg = ModelConfig.from_pretrained(STORIES)
    with pytest.raises(PipelineParallelError,
                       match=r"pipeline_parallel_size=3 x tensor_parallel_size=4 needs 12 "
                             r"devices but this process has 8"):
        PipelineParallel.create(3, 4, cfg)
    with pytest.raises(PipelineParallelError, match="exceeds the model's 5 decoder layers"):
        PipelineParallel.create(6, 1, cfg)


@pytest.mark.parametrize("field, value, named", [
    ("speculative_config", {"method": "ngram", "num_speculative_tokens": 2}, "speculative_config"),
    ("enable_expert_parallel", True, "enable_expert_parallel"),
    ("data_parallel_size", 2, "data_parallel_size > 1"),
])
def test_unsupported_combinations_refused_by_name(field, value, named):
    with pytest.raises(PipelineParallelError) as e:
        EngineArgs(pipeline_parallel_size=2, **{field: value})
    assert f"cannot be combined with {named}" in str(e.value)
    assert "--pipeline-parallel-size" in cli_error_message(e.value)
    with pytest.raises(ValueError, match="pipeline_parallel_size must be a positive integer"):
        EngineArgs(pipeline_parallel_size=0)


def test_cli_flag():
    import argparse
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = EngineArgs.from_cli_args(parser.parse_args(["--pipeline-parallel-size", "2",
                                                       "-tp", "2"]))
    assert (args.pipeline_parallel_size, args.tensor_parallel_size) == (2, 2)


def test_embeddings_through_the_pipeline_equal_single_device():
    """Pooling rows come from the last stage: MEAN pooling over several micro-batches."""
    prompts = shared_prefix_prompts(5, 512, seed=6)
    kw = dict(runner="pooling", pooler_config={"pooling_type": "MEAN", "normalize": True},
              enforce_eager=True, max_num_batched_tokens=64)
    ref = LLM(**kw).embed(prompts, use_tqdm=False)
    out = LLM(pipeline_parallel_size=2, **kw).embed(prompts, use_tqdm=False)
    for a, b in zip(ref, out):
        np.testing.assert_allclose(b.outputs.embedding, a.outputs.embedding, atol=1e-5)
