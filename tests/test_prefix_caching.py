"""Automatic prefix caching: hits equal misses, eviction, collisions, logprobs."""

import os

import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.core import kv_cache_manager
from tests.conftest import STORIES_REFERENCE

PAGE = 16
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)


def prompt_of(length, seed=0):
    rng = np.random.default_rng(seed)
    return [1] + rng.integers(3, 512, size=length - 1).tolist()


def run(llm, prompt, params=GREEDY):
    return llm.generate([prompt], params, use_tqdm=False)[0]


def sampled_logprobs(out):
    c = out.outputs[0]
    return [c.logprobs[i][t].logprob for i, t in enumerate(c.token_ids)]


@pytest.fixture(scope="module")
def cached():
    return LLM(enforce_eager=True, block_size=PAGE, max_num_seqs=8, max_model_len=256)


@pytest.fixture(scope="module")
def uncached():
    return LLM(enforce_eager=True, block_size=PAGE, max_num_seqs=8, max_model_len=256,
               enable_prefix_caching=False)


@pytest.mark.parametrize("length", [PAGE - 1, PAGE, PAGE + 1, 2 * PAGE, 5 * PAGE + 3])
def test_hit_equals_miss_at_page_boundaries(cached, uncached, length):
    prompt = prompt_of(length, seed=length)
    reference = run(uncached, prompt)
    miss = run(cached, prompt)
    stats = cached.engine.stats()
    hit = run(cached, prompt)
    # A hit covers whole pages and always leaves at least one token to compute.
    assert miss.num_cached_tokens == 0
    assert hit.num_cached_tokens == (length - 1) // PAGE * PAGE
    after = cached.engine.stats()
    assert after.prefix_cache_queries - stats.prefix_cache_queries == length
    assert after.prefix_cache_hits - stats.prefix_cache_hits == hit.num_cached_tokens
    for out in (miss, hit):
        assert out.outputs[0].token_ids == reference.outputs[0].token_ids
        np.testing.assert_allclose(sampled_logprobs(out), sampled_logprobs(reference), atol=1e-5)


def test_shared_system_prompt_is_computed_once(cached):
    system = prompt_of(3 * PAGE + 5, seed=99)
    first = run(cached, system + [7, 8, 9])
    second = run(cached, system + [10, 11])
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 3 * PAGE


def test_cache_salt_isolates_entries(cached):
    prompt = prompt_of(3 * PAGE, seed=5)
    run(cached, {"prompt_token_ids": prompt, "cache_salt": "a"})
    assert run(cached, {"prompt_token_ids": prompt, "cache_salt": "b"}).num_cached_tokens == 0
    assert run(cached, {"prompt_token_ids": prompt, "cache_salt": "a"}).num_cached_tokens == 2 * PAGE


def test_evicted_pages_are_never_served():
    # 12 usable pages of 16 tokens: each 80-token request + 12 new tokens needs 6 pages.
    llm = LLM(enforce_eager=True, block_size=PAGE, max_num_seqs=2, max_model_len=96,
              num_gpu_blocks_override=13)
    a = prompt_of(80, seed=1)
    first = run(llm, a)
    assert run(llm, a).num_cached_tokens == 64                 # cached while the pool is idle
    for seed in range(2, 6):                                   # other prompts evict a's pages
        run(llm, prompt_of(80, seed=seed))
    kv = llm.engine.kv_cache_manager
    assert kv.stats.evictions > 0
    again = run(llm, a)
    assert again.num_cached_tokens < 64
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    np.testing.assert_allclose(sampled_logprobs(again), sampled_logprobs(first), atol=1e-5)
    assert kv.num_free_pages == kv.num_usable_pages


def test_forced_hash_collision_falls_back_to_recompute(monkeypatch, uncached):
    monkeypatch.setattr(kv_cache_manager, "hash_page", lambda *a: b"same-hash-for-every-page")
    llm = LLM(enforce_eager=True, block_size=PAGE, max_num_seqs=4, max_model_len=256)
    a, b = prompt_of(4 * PAGE, seed=7), prompt_of(4 * PAGE, seed=8)
    run(llm, a)
    out = run(llm, b)
    assert out.num_cached_tokens == 0                           # hash matched, tokens did not
    assert out.outputs[0].token_ids == run(uncached, b).outputs[0].token_ids
    assert run(llm, a).num_cached_tokens == PAGE                # a true match still hits once


def test_logprobs_equal_reference_distribution(uncached):
    ids = np.load(os.path.join(STORIES_REFERENCE, "reference_input_ids_bos_plus_63_greedy.npy"))
    ref = np.load(os.path.join(STORIES_REFERENCE, "reference_logits_bos_plus_63_greedy.npy"))
    ref_lp = ref - np.log(np.exp(ref - ref.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - ref.max(-1, keepdims=True)
    out = run(uncached, ids[:40].tolist(), SamplingParams(temperature=0, max_tokens=5, logprobs=3))
    c = out.outputs[0]
    assert c.token_ids == ids[40:45].tolist()
    for i, token in enumerate(c.token_ids):
        row = ref_lp[39 + i]
        top3 = np.argsort(-row)[:3].tolist()
        assert set(c.logprobs[i]) == set(top3) | {token}
        for t, lp in c.logprobs[i].items():
            assert abs(lp.logprob - row[t]) < 1e-4
            assert lp.rank == 1 + int((row > row[t]).sum())
    assert abs(c.cumulative_logprob - sum(ref_lp[39 + i][t] for i, t in enumerate(c.token_ids))) < 1e-3


@pytest.mark.parametrize("k", [2, 0])
def test_prompt_logprobs_match_reference_and_survive_chunking(k):
    """k = 0: only the prompt token's own logprob, so a chunk's last row (which predicts the
    next chunk's first token) cannot borrow a correct value from the top-k list."""
    ids = np.load(os.path.join(STORIES_REFERENCE, "reference_input_ids_bos_plus_63_greedy.npy"))
    ref = np.load(os.path.join(STORIES_REFERENCE, "reference_logits_bos_plus_63_greedy.npy"))
    ref_lp = ref - ref.max(-1, keepdims=True)
    ref_lp -= np.log(np.exp(ref_lp).sum(-1, keepdims=True))
    prompt = ids[:50].tolist()
    for budget in (512, 16):             # whole prompt in one step, or chunks of 16
        llm = LLM(enforce_eager=True, max_num_batched_tokens=budget, max_num_seqs=4)
        run(llm, prompt)                 # would fill the prefix cache: prompt_logprobs skip it
        out = run(llm, prompt, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=k))
        plp = out.prompt_logprobs
        assert out.num_cached_tokens == 0 and len(plp) == 50 and plp[0] is None
        for i in range(1, 50):
            row = ref_lp[i - 1]
            assert abs(plp[i][prompt[i]].logprob - row[prompt[i]]) < 1e-4
            assert set(plp[i]) == set(np.argsort(-row)[:k].tolist()) | {prompt[i]}
