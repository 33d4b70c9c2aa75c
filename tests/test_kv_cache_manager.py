"""Host-side page bookkeeping: free list, growth one page at a time, freeing."""

import pytest

from jaxpaged.core.kv_cache_manager import KVCacheManager
from jaxpaged.layers.attention import NULL_PAGE


def test_growth_one_page_at_a_time_and_free():
    kv = KVCacheManager(num_pages=6, page_size=4)
    assert kv.num_usable_pages == 5 and kv.num_free_pages == 5
    assert kv.allocate_slots("a", 3)
    assert kv.page_table("a") == [1]
    assert kv.allocate_slots("a", 4)          # still fits page 1
    assert kv.page_table("a") == [1]
    assert kv.allocate_slots("a", 5)          # the 5th token opens page 2
    assert kv.page_table("a") == [1, 2]
    assert kv.slots("a", 3, 6) == [1 * 4 + 3, 2 * 4 + 0, 2 * 4 + 1]
    assert kv.allocate_slots("b", 12)
    assert kv.page_table("b") == [3, 4, 5] and kv.num_free_pages == 0
    assert not kv.allocate_slots("c", 1)      # pool exhausted: nothing changes
    assert kv.page_table("c") == [] and kv.num_free_pages == 0
    assert not kv.allocate_slots("a", 9)
    assert kv.page_table("a") == [1, 2]
    kv.free("a")
    assert kv.num_free_pages == 2
    assert kv.allocate_slots("c", 8)
    assert kv.page_table("c") == [2, 1]       # freed tail first: the tail is reused first
    kv.free("b"), kv.free("c"), kv.free("unknown")
    assert kv.num_free_pages == 5
    assert NULL_PAGE not in kv.page_table("c")


def test_null_page_never_allocated():
    kv = KVCacheManager(num_pages=3, page_size=2)
    assert kv.allocate_slots("a", 4)
    assert sorted(kv.page_table("a")) == [1, 2]


def test_rejects_degenerate_pools():
    with pytest.raises(ValueError, match="at least 2 pages"):
        KVCacheManager(num_pages=1, page_size=16)
    with pytest.raises(ValueError, match="page_size"):
        KVCacheManager(num_pages=4, page_size=0)
