"""Pages out of every layer's sliding window go back to the pool (jaxpaged.engine
.sliding_window_pages): host bookkeeping, and an all-sliding model (Mistral fixture, window 8)
giving transformers' tokens from a pool too small for its sequences' whole length."""

import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.constants import NULL_PAGE
from jaxpaged.core.hybrid_kv_cache_manager import HybridKVCacheManager
from jaxpaged.core.kv_cache_manager import KVCacheManager
from jaxpaged.core.sliding_window_pages import (SlidingWindowKVCacheManager, dead_pages,
                                                  make_kv_cache_manager, uniform_window)
from jaxpaged.arg_utils import DEFAULT_MODEL
from tests.test_model_families import fixture


def test_dead_pages_and_uniform_window():
    # window 8, pages of 4: a query at 11 reads 4..11, so page 0 (0..3) is dead
    assert [dead_pages(c, 8, 4) for c in (0, 7, 10, 11, 14, 15)] == [0, 0, 0, 1, 1, 2]
    assert uniform_window((8, 8, 16)) == 16
    assert uniform_window((8, None)) is None and uniform_window(()) is None
    assert type(make_kv_cache_manager(8, 4, True, (None, 8))) is KVCacheManager
    assert type(make_kv_cache_manager(8, 4, True, (8, 8), speculative=True)) is KVCacheManager
    assert make_kv_cache_manager(8, 4, True, (8, 8)).window == 8


def grow(kv, rid, ids, start=0):
    """Prefill 9 tokens, then one token a step up to len(ids); returns the most pages held."""
    most = 0
    kv.allocate_slots(rid, 9, ids, start)
    for n in range(9, len(ids)):
        assert kv.allocate_slots(rid, n + 1, ids, n)
        most = max(most, kv.num_used_pages)
    return most


@pytest.mark.parametrize("caching", [True, False])
def test_a_sequence_holds_only_its_window(caching):
    ids = list(range(3, 44))                                      # 41 tokens
    kv = SlidingWindowKVCacheManager(16, 4, caching, window=8)
    assert grow(kv, "a", ids) == 3          # keys p-7..p span at most 3 pages of 4
    table = kv.page_table("a")
    assert len(table) == 11 and table[:8] == [NULL_PAGE] * 8 and NULL_PAGE not in table[8:]
    assert kv.num_released_pages == 8
    kv.free("a")
    assert kv.num_free_pages == 15 and NULL_PAGE not in kv._free
    plain = KVCacheManager(16, 4, caching)
    assert grow(plain, "a", ids) == 11


def test_released_pages_stay_cached_and_shared_ones_stay_held():
    ids = list(range(3, 44))
    kv = SlidingWindowKVCacheManager(32, 4, True, window=8)
    grow(kv, "a", ids)
    assert kv.find_cached_prefix("b", ids[:9]) == 8            # released pages 0 and 1 hit
    kv.allocate_slots("b", 9, ids[:9], 8)
    kv.fork("b", "b2")                                         # parallel sampling
    held = kv.num_used_pages
    kv.release_dead_pages("b", 15)                             # page 0 shared by b2: kept
    assert kv.page_table("b")[:2] == [NULL_PAGE, NULL_PAGE]
    assert kv.num_used_pages == held
    kv.free("b2")
    kv.free("b")
    kv.free("a")
    assert kv.num_free_pages == 31 and NULL_PAGE not in kv._free


@pytest.mark.parametrize("backend", ["xla", "cpu", pytest.param("pallas",
                                                                marks=pytest.mark.slow)])
def test_all_sliding_model_runs_in_a_pool_smaller_than_its_sequences(backend):
    """Three 41-token sequences need 33 pages of 4 with every page kept; 12 usable pages (one
    48-token request's, which start-up insists on) do with the window's: no preemption,
    transformers' greedy tokens."""
    name = "mistral_sliding_window"
    llm = LLM(enforce_eager=True, model=fixture(name), tokenizer=DEFAULT_MODEL, max_num_seqs=3,
              block_size=4, max_model_len=48, num_gpu_blocks_override=13,
              attention_backend=backend)
    kv = llm.engine.kv_cache_manager
    assert isinstance(kv, SlidingWindowKVCacheManager) and kv.window == 8
    prompt = fixture(name, "greedy_prompt.npy").tolist()
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outs = llm.generate([prompt] * 3, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [fixture(name, "greedy_tokens.npy")
                                                      .tolist()] * 3
    assert llm.engine.num_preemptions == 0 and kv.num_released_pages >= 3 * 7
    assert kv.num_free_pages == 12


def test_mixed_layers_get_a_page_table_per_kind():
    """Gemma 2 (window-8 and full layers alternating): two KV cache groups of two layers
    (jaxpaged.core.kv_groups), each page two layers' K/V; greedy tokens stay transformers'."""
    name = "gemma2_softcap"
    llm = LLM(enforce_eager=True, model=fixture(name), tokenizer=DEFAULT_MODEL,
              max_num_seqs=2, block_size=4, max_model_len=64)
    kv = llm.engine.kv_cache_manager
    assert isinstance(kv, HybridKVCacheManager)
    assert [(g.window, g.layers) for g in kv.layout.groups] == [(None, (1, 3)), (8, (0, 2))]
    assert len(llm.engine.runner._kv_caches) == 2
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    out = llm.generate([fixture(name, "greedy_prompt.npy").tolist()], greedy, use_tqdm=False)
    assert out[0].outputs[0].token_ids == fixture(name, "greedy_tokens.npy").tolist()
    assert kv.num_released_pages >= 7 and kv.num_free_pages == kv.num_usable_pages
