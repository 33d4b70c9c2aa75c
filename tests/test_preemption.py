"""Preemption by recompute when the KV pool runs out: nothing lost, nothing doubled."""

from jaxpaged import LLM, SamplingParams
from tests.test_continuous_batching import random_prompts


def test_small_pool_preempts_and_matches_large_pool():
    prompts = random_prompts(16, 512, seed=3, max_len=40)
    params = [SamplingParams(temperature=0, max_tokens=48, ignore_eos=True),
              SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=48, ignore_eos=True)]
    params = [params[i % 2] for i in range(len(prompts))]
    large = LLM(enforce_eager=True, max_num_seqs=16, max_model_len=128, block_size=8)
    expected = large.generate(prompts, params, use_tqdm=False)
    assert large.engine.num_preemptions == 0

    # 20 usable pages of 8 tokens = 160 tokens for 16 requests of up to ~90 tokens each.
    small = LLM(enforce_eager=True, max_num_seqs=16, max_model_len=128, block_size=8, num_gpu_blocks_override=21)
    got = small.generate(prompts, params, use_tqdm=False)
    assert small.engine.num_preemptions > 0
    assert sum(o.num_preemptions for o in got) == small.engine.num_preemptions
    for e, g in zip(expected, got):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids
        assert g.outputs[0].text == e.outputs[0].text
        assert len(g.outputs[0].token_ids) == 48
    kv = small.engine.kv_cache_manager
    assert kv.num_free_pages == kv.num_usable_pages == 20
    # A resumed sequence's own recomputed pages are not prefix-cache hits (issue 24): the
    # counters and cached_tokens equal the large pool's, the resumptions counted apart.
    large_stats, stats = large.engine.kv_cache_manager.stats, kv.stats
    assert stats.preempted_queries > 0 and stats.preempted_hits > 0
    assert (stats.queries, stats.hits) == (large_stats.queries, large_stats.hits)
    assert stats.queries == sum(len(g.prompt_token_ids) for g in got)
    assert [g.num_cached_tokens for g in got] == [e.num_cached_tokens for e in expected]
