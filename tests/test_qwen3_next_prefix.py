"""Prefix caching for Qwen3-Next (issue 45): recurrent states saved at page boundaries in
cached-state slots (``jaxpaged.core.state_slots``, ``jaxpaged.core.state_cache``), checked on
the host and through ``LLM.generate`` against transformers' references
(``tests/fixtures/qwen3_next/``): hits give transformers' tokens and logprobs, with chunked
prefill, preemption and both scheduling modes, and every slot is accounted for."""

from types import SimpleNamespace

import numpy as np
import pytest

from jaxpaged import SamplingParams
from jaxpaged.core.kv_cache_manager import KVCacheManager
from jaxpaged.core.state_cache import CachedStates
from jaxpaged.core.state_slots import StateSlotKVCacheManager
from tests.test_qwen3_next import GREEDY_32, assert_slots_free, engine, fixture


def request(rid, computed, prompt, prompt_logprobs=None):
    return SimpleNamespace(request_id=rid, num_computed_tokens=computed,
                           num_prompt_tokens=prompt, pooling=None,
                           params=SimpleNamespace(prompt_logprobs=prompt_logprobs))


def manager():
    """2 live slots (0, 1) and 3 cached ones (2, 3, 4) beside 19 pages of 4 tokens."""
    return StateSlotKVCacheManager(KVCacheManager(20, 4, enable_prefix_caching=True), 2, 3)


def test_chunks_end_on_page_boundaries():
    kv = manager()
    assert kv.align_prefill(request("a", 0, 10), 10) == 8      # the prompt's last full page
    assert kv.align_prefill(request("a", 0, 10), 6) == 4       # an unfinished chunk
    assert kv.align_prefill(request("a", 0, 10), 3) == 3       # no boundary inside
    assert kv.align_prefill(request("a", 8, 10), 2) == 2       # past the last full page
    assert kv.align_prefill(request("a", 0, 12), 12) == 12     # ends on one already
    assert kv.align_prefill(request("a", 0, 10, prompt_logprobs=0), 10) == 10


def test_saves_after_and_restores_before_the_step():
    kv, tokens = manager(), list(range(1, 11))
    assert kv.find_cached_prefix("a", tokens) == 0         # (hashes every full page)
    for start, chunk, copies in ((0, 6, [(0, 2)]), (4, 6, [(0, 3)]), (8, 2, [])):
        n = kv.align_prefill(request("a", start, 10), chunk)
        assert kv.allocate_slots("a", start + n, tokens, start)
        assert kv.take_state_copies() == ([], copies)    # live 0 -> cached, after the step
    assert kv.cached_states.num_cached == 2
    kv.free("a")
    other = tokens[:8] + [99, 98, 97]
    assert kv.find_cached_prefix("b", other) == 8 and kv.page_table("b") == [1, 2]
    assert kv.allocate_slots("b", 11, other, 8) and kv.state_slot("b") == 0
    assert kv.take_state_copies() == ([(3, 0)], [])     # cached 3 -> live 0, before it
    sevens = tokens[:4] + [7] * 5
    assert kv.find_cached_prefix("c", sevens) == 4       # the state saved at 4
    assert kv.allocate_slots("c", 9, sevens, 4)          # (an unaligned chunk: no save)
    assert kv.take_state_copies() == ([(2, 1)], [])
    kv.free("c")
    # Its page 1 is cached but no state ends there: the hit stops at page 0.
    assert kv.find_cached_prefix("d", sevens[:8] + [1]) == 4
    kv.free("d")
    # A save planned for a request freed in the same step (preempted, not admitted) is
    # dropped and its slot given back; so is a hit's restore.
    assert kv.allocate_slots("e", kv.align_prefill(request("e", 0, 7), 6), [9] * 7)
    assert kv.cached_states.num_free == 0
    assert kv.find_cached_prefix("f", tokens[:8] + [5]) == 8
    kv.free("e")
    kv.free("f")
    assert kv.take_state_copies() == ([], []) and kv.cached_states.num_free == 1
    # A failed step's saves are dropped with its pages; a reset forgets every state.
    kv.uncache_from("b", 4)
    assert kv.find_cached_prefix("g", tokens) == 4
    kv.free("b")
    kv.free("g")
    assert (kv.state_slots.num_free, kv.num_used_pages) == (2, 0)
    assert (kv.cached_states.num_free, kv.cached_states.num_cached) == (2, 1)
    kv.reset_prefix_cache()
    assert kv.cached_states.num_free == 3 and kv.find_cached_prefix("h", tokens) == 0


def test_decodes_save_at_page_ends_once_their_tokens_are_known():
    """A one-token step (a decode) reaching a page boundary saves the state there: keyed at
    once when its input token is known (synchronous scheduling), else into a reserved slot
    whose key the first allocation knowing the page's tokens publishes (async); a request
    freed or failed before then gives the slot back; a step with drafts saves nothing; a
    sequence keeps its latest decode-time state only (its prompt's stay)."""
    kv, tokens = manager(), list(range(1, 14))
    assert kv.find_cached_prefix("a", tokens[:4]) == 0
    assert kv.allocate_slots("a", kv.align_prefill(request("a", 0, 4), 4), tokens[:4])
    assert kv.take_state_copies() == ([], [(0, 2)])      # the prompt's page (prefill)
    for pos in range(4, 8):                               # token pos known: synchronous
        assert kv.allocate_slots("a", pos + 1, tokens[:pos + 1], pos)
        assert kv.take_state_copies() == ([], [(0, 3)] if pos == 7 else [])
    hashes = kv.page_hashes("a")
    assert kv.cached_states.get(hashes[1]) == 3
    for pos in range(8, 12):                              # token pos not known yet: async
        assert kv.allocate_slots("a", pos + 1, tokens[:pos], pos)
        assert kv.take_state_copies() == ([], [(0, 4)] if pos == 11 else [])
    assert (kv.cached_states.num_cached, kv.cached_states.num_free) == (2, 0)
    assert kv.find_cached_prefix("x", tokens) == 8        # not hittable before its key
    kv.free("x")
    assert kv.allocate_slots("a", 13, tokens[:12], 12)    # knows tokens 8..11: published
    assert [kv.cached_states.get(h) for h in kv.page_hashes("a")] == [2, None, 4]
    assert kv.allocate_slots("a", 16, tokens, 13)         # 3 tokens (drafts): no save
    assert kv.take_state_copies() == ([], [])
    assert kv.find_cached_prefix("b", tokens) == 12
    kv.free("b")
    # Freed (finished, aborted, preempted) or failed before the key is known: slot back.
    for rid, drop in (("c", kv.free), ("d", lambda rid: kv.uncache_from(rid, 3))):
        assert kv.allocate_slots(rid, 3, [5] * 3) and kv.allocate_slots(rid, 4, [5] * 3, 3)
        assert kv.take_state_copies() == ([], [(1, 3)]) and kv.cached_states.num_free == 0
        drop(rid)
        assert kv.cached_states.num_free == 1
    kv.free("d")
    kv.free("a")
    assert (kv.state_slots.num_free, kv.num_used_pages) == (2, 0)
    assert (kv.cached_states.num_free, kv.cached_states.num_cached) == (1, 2)


def test_cached_states_evict_least_recently_used():
    cache = CachedStates(first_slot=4, num_slots=2)
    a, b = cache.reserve(), cache.reserve()
    cache.publish(b"a", a)
    cache.publish(b"b", b)
    assert (a, b, cache.num_free, cache.num_cached) == (4, 5, 0, 2)
    cache.touch(b"a")
    assert cache.reserve() == 5 and cache.get(b"b") is None and cache.evictions == 1
    cache.publish(b"a", 5)          # "a" has an entry already: slot 5 goes back
    assert (cache.num_free, cache.get(b"a")) == (1, 4)
    assert cache.reserve() == 5 and cache.reserve() == 4 and cache.reserve() is None
    cache.release(5)
    assert cache.num_free == 1
    with pytest.raises(ValueError, match="num_slots"):
        CachedStates(0, 0)


def log_softmax(x):
    x = x.astype(np.float64) - x.max()
    return x - np.log(np.exp(x).sum())


@pytest.mark.slow
def test_hit_after_finish_matches_transformers():
    """8-token chunks over 4-token pages: the 41-id prompt hits the 20 tokens a finished
    request saved (its chunks stopped at 8, 16 and 20), and its next token and logprob are
    transformers'; the greedy prompt (its first 9 ids) hits 2 pages and gives transformers'
    32 tokens."""
    llm = engine()
    ids, ref = fixture("input_ids.npy").tolist(), fixture("logits.npy")[-1]
    first = llm.generate([ids[:20]], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, logprobs=0),
                       use_tqdm=False)[0]
    token = out.outputs[0].token_ids[0]
    assert out.num_cached_tokens == 20 and token == int(np.argmax(ref))
    assert abs(out.outputs[0].logprobs[0][token].logprob - log_softmax(ref)[token]) < 1e-4
    prompt, want = fixture("greedy_prompt.npy").tolist(), fixture("greedy_tokens.npy").tolist()
    # (the greedy prompt is the 41 ids' first 9)
    other = llm.generate([prompt[:8] + [5, 6]], GREEDY_32, use_tqdm=False)[0]
    out = llm.generate([prompt], GREEDY_32, use_tqdm=False)[0]
    assert other.num_cached_tokens == out.num_cached_tokens == 8
    assert out.outputs[0].token_ids == want
    assert llm.engine.kv_cache_manager.stats.hits == 20 + 8 + 8
    assert_slots_free(llm)


@pytest.mark.slow
def test_hits_with_preemption_synchronously():
    """Synchronous steps, a pool that preempts: three copies of the greedy prompt each hit
    the first run's 2 pages and give transformers' tokens."""
    llm = engine(async_scheduling=False)
    prompt, want = fixture("greedy_prompt.npy").tolist(), fixture("greedy_tokens.npy").tolist()
    assert llm.generate([prompt], GREEDY_32, use_tqdm=False)[0].outputs[0].token_ids == want
    outs = llm.generate([prompt] * 3, GREEDY_32, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [want] * 3
    assert [o.num_cached_tokens for o in outs] == [8, 8, 8]
    assert llm.engine.num_preemptions > 0
    assert_slots_free(llm)


@pytest.mark.slow
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_second_turn_hits_the_first_answer(async_scheduling):
    """A two-turn chat: turn 1 is the greedy prompt (9 ids) with 21 greedy tokens, turn 2's
    prompt turn 1's prompt and answer and 4 more of transformers' tokens (34 ids). Turn 2 hits
    28 tokens, the state its decodes saved at 28 (not only prefill's at 8), and its tokens
    are transformers' and its logprobs the uncached engine's."""
    prompt, want = fixture("greedy_prompt.npy").tolist(), fixture("greedy_tokens.npy").tolist()
    turn1 = SamplingParams(temperature=0, max_tokens=21, ignore_eos=True)
    turn2 = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True, logprobs=0)
    chat = prompt + want[:25]
    llm = engine(async_scheduling=async_scheduling)
    first = llm.generate([prompt], turn1, use_tqdm=False)[0]
    assert first.outputs[0].token_ids == want[:21] and first.num_cached_tokens == 0
    out = llm.generate([chat], turn2, use_tqdm=False)[0]
    miss = engine(async_scheduling=async_scheduling, enable_prefix_caching=False).generate(
        [chat], turn2, use_tqdm=False)[0]
    assert (out.num_cached_tokens, miss.num_cached_tokens) == (28, 0)
    assert out.outputs[0].token_ids == miss.outputs[0].token_ids == want[25:]
    got, ref = ([lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, want[25:])]
                for o in (out, miss))
    np.testing.assert_allclose(got, ref, atol=1e-5)
    assert llm.engine.kv_cache_manager.stats.hits == 28
    assert_slots_free(llm)


@pytest.mark.slow
def test_no_prefix_caching_keeps_no_cached_states():
    llm = engine(enable_prefix_caching=False)
    prompt, want = fixture("greedy_prompt.npy").tolist(), fixture("greedy_tokens.npy").tolist()
    outs = llm.generate([prompt, prompt], GREEDY_32, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [want] * 2
    assert [o.num_cached_tokens for o in outs] == [0, 0]
    kv = llm.engine.kv_cache_manager
    assert kv.cached_states is None and kv.state_slots.num_free == 3
    conv_state = llm.engine.runner._kv_caches[0][0]
    assert conv_state.shape[0] == 3 + 1        # live slots and the scratch row only


@pytest.mark.slow
def test_soak_hits_equal_misses_and_leaks_no_slot():
    """18 requests sharing an 8-token prefix (suffixes of 1 to 20 tokens) through a pool
    that preempts and a cached-state pool that evicts: every output is the uncached
    engine's, prefixes hit, and every live and cached state slot is accounted for."""
    rng = np.random.default_rng(2)
    shared = rng.integers(3, 256, 8).tolist()
    prompts = [shared + rng.integers(3, 256, n).tolist() for n in (1, 5, 9, 14, 3, 20)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    misses = engine(enable_prefix_caching=False).generate(prompts, params, use_tqdm=False)
    llm = engine(num_gpu_blocks_override=18)
    outs = llm.generate(prompts * 3, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids
                                                      for o in misses] * 3
    assert all(o.num_cached_tokens == 0 for o in misses)
    assert sum(o.num_cached_tokens > 0 for o in outs) >= 12
    kv = llm.engine.kv_cache_manager
    assert llm.engine.num_preemptions > 0 and kv.cached_states.evictions > 0
    assert_slots_free(llm)
