"""`HybridKVCacheManager`: one page table per KV cache group, every group drawing on one pool.

For a model whose layers mix full attention and sliding windows (``jaxpaged.core.kv_groups``),
each group has its own :class:`KVCacheManager`: a plain one for a full-attention group, a
:class:`SlidingWindowKVCacheManager` for a sliding one (its pages that slide out of the window
go back to the free queue, keeping their prefix-cache entry: evictable, as any freed page).
The groups share the pages, the LRU free queue and the prefix-cache index
(:meth:`KVCacheManager.share_pool`); a group's pages are cached under its own keys (the
request's extra keys plus the group), so a page of one group is never a hit for another.

The manager answers the scheduler exactly as a :class:`KVCacheManager` does: an allocation
takes pages in every group or in none (the free pages it needs are counted over all groups
first), :meth:`page_table` is group 0's (a full-attention group's) and
:meth:`group_page_tables` the others', which the runner gives each layer of those groups.

Prefix caching stays exact: a hit of ``n`` pages needs group 0's pages ``0 .. n-1`` (every
full group's) and, in each sliding group, the pages that the query at ``n * page_size`` can
see; the longest ``n`` all groups agree on is found by lowering it until each accepts it
(vLLM's ``HybridKVCacheCoordinator.find_longest_cache_hit``, ``SlidingWindowManager``: a
sliding group accepts ``n`` when its window's pages before ``n`` are all cached).

Pure Python, no JAX (host side).
"""

from __future__ import annotations

from jaxpaged.constants import NULL_PAGE
from jaxpaged.core.kv_cache_manager import KVCacheManager, PrefixCacheStats
from jaxpaged.core.kv_groups import KVLayout
from jaxpaged.core.sliding_window_pages import (SlidingWindowKVCacheManager, dead_pages,
                                                make_kv_cache_manager)


def longest_window_hit(found: list[int | None], limit: int, window: int | None,
                       page_size: int) -> int:
    """The most leading pages ``n <= limit`` a group can take from a lookup ``found`` (per
    page: cached page id or None): a full group (``window`` None) needs pages ``0 .. n-1``; a
    sliding one those from :func:`dead_pages` ``(n * page_size, window, page_size)`` to
    ``n - 1``. 0 is always possible."""
    if window is None:
        n = 0
        while n < limit and found[n] is not None:
            n += 1
        return n
    run = 0                     # cached pages ending at page m - 1
    runs = []
    for page_id in found[:limit]:
        run = run + 1 if page_id is not None else 0
        runs.append(run)
    for n in range(limit, 0, -1):
        if runs[n - 1] >= n - dead_pages(n * page_size, window, page_size):
            return n
    return 0


class HybridKVCacheManager:
    """Page tables per KV cache group over one pool of ``num_pages`` pages (module docstring).

    Args:
        num_pages: pages in the pool, the null page included; a page spans
            ``layout.slots`` layers' K/V.
        page_size: tokens per page.
        enable_prefix_caching: reuse cached full pages across requests.
        layout: the model's groups (``jaxpaged.core.kv_groups.kv_layout``).

    Raises:
        ValueError: as :class:`KVCacheManager`.
    """

    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool,
                 layout: KVLayout):
        self.layout = layout
        self.groups: list[KVCacheManager] = []
        for group in layout.groups:
            manager = (KVCacheManager(num_pages, page_size, enable_prefix_caching)
                       if group.window is None else SlidingWindowKVCacheManager(
                           num_pages, page_size, enable_prefix_caching, window=group.window))
            if self.groups:
                manager.share_pool(self.groups[0])
            self.groups.append(manager)
        self.num_pages, self.page_size = num_pages, page_size
        self.enable_prefix_caching = enable_prefix_caching
        self._windows = [g.window for g in layout.groups]

    def _keys(self, k: int, extra_keys: tuple) -> tuple:
        """Group ``k``'s prefix-cache extra keys (group 0 keeps the request's own)."""
        return extra_keys + (("kv_group", k),) if k else extra_keys

    # ---- the pool --------------------------------------------------------------------------

    @property
    def stats(self) -> PrefixCacheStats:
        """The shared prefix-cache counters."""
        return self.groups[0].stats

    @property
    def num_free_pages(self) -> int:
        """Pages not held by any request of any group."""
        return self.groups[0].num_free_pages

    @property
    def num_usable_pages(self) -> int:
        return self.groups[0].num_usable_pages

    @property
    def num_used_pages(self) -> int:
        return self.groups[0].num_used_pages

    @property
    def num_released_pages(self) -> int:
        """Sliding groups' pages given back before their request ended, since start-up."""
        return sum(getattr(g, "num_released_pages", 0) for g in self.groups)

    def page_table(self, request_id: str) -> list[int]:
        """Group 0's page table of the request (a full-attention group's)."""
        return self.groups[0].page_table(request_id)

    def group_page_tables(self, request_id: str) -> list[list[int]]:
        """Copies of groups 1.. page tables, in group order (each as long as group 0's;
        a sliding group's entries out of its window point at the null page)."""
        return [g.page_table(request_id).copy() for g in self.groups[1:]]

    def state_slot(self, request_id: str) -> int:
        """As :meth:`KVCacheManager.state_slot` (-1: no group is recurrent)."""
        return self.groups[0].state_slot(request_id)

    def step_tables(self, request_id: str) -> tuple[list[int], list[list[int]], int]:
        """As :meth:`KVCacheManager.step_tables`: group 0's table, the other groups'
        (:meth:`group_page_tables`) and the state slot."""
        return (self.page_table(request_id).copy(), self.group_page_tables(request_id),
                self.state_slot(request_id))

    def num_held_pages(self, request_id: str) -> int:
        """Pool pages the request's tables point at, all groups (shared pages counted in
        each table that holds them): its share of the pool, in pages of ``layout.slots``
        layers."""
        return sum(len(t) - t.count(NULL_PAGE)
                   for t in (g.page_table(request_id) for g in self.groups))

    def group_usage(self) -> list[int]:
        """Per group, the distinct pages its requests hold now."""
        return [len({p for t in g._tables.values() for p in t.pages if p != NULL_PAGE})
                for g in self.groups]

    # ---- prefix cache ----------------------------------------------------------------------

    def find_cached_prefix(self, request_id: str, token_ids: list[int],
                           extra_keys: tuple = ()) -> int:
        """:meth:`KVCacheManager.find_cached_prefix` over every group (module docstring):
        the pages of the longest prefix all groups hold become the request's."""
        if not self.enable_prefix_caching:
            for g in self.groups:
                g.find_cached_prefix(request_id, token_ids, extra_keys)
            return 0
        n = (len(token_ids) - 1) // self.page_size
        found = [g.lookup_cached(request_id, token_ids, self._keys(k, extra_keys), n)
                 for k, g in enumerate(self.groups)]
        while True:
            agreed = min(longest_window_hit(f, n, w, self.page_size)
                         for f, w in zip(found, self._windows))
            if agreed == n:
                break
            n = agreed
        for g, f, w in zip(self.groups, found, self._windows):
            first = 0 if w is None else min(dead_pages(n * self.page_size, w, self.page_size),
                                            n)
            g.adopt_cached(request_id, f[:n], first)
        return n * self.page_size

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int,
                             preempted: bool = False) -> None:
        """:meth:`KVCacheManager.record_prefix_lookup` (one count per request)."""
        self.groups[0].record_prefix_lookup(num_tokens, num_hit_tokens, preempted)

    # ---- allocation ------------------------------------------------------------------------

    def allocate_slots(self, request_id: str, num_tokens: int, token_ids: list[int] | None = None,
                       num_computed_tokens: int = 0, extra_keys: tuple = ()) -> bool:
        """:meth:`KVCacheManager.allocate_slots` in every group, or in none: the sliding
        groups first give back their pages out of the window, then the free pages all groups
        need are counted.

        Returns:
            False, allocating nothing, if the pool lacks the pages.
        """
        if num_tokens == num_computed_tokens + 1 and self._decodes_in_place(
                request_id, num_computed_tokens, token_ids is not None):
            return True
        need = 0
        for g, window in zip(self.groups, self._windows):
            if window is not None:
                g.release_dead_pages(request_id, num_computed_tokens)
            need += g.pages_to_allocate(request_id, num_tokens, num_computed_tokens)
        if need > self.num_free_pages:
            for g in self.groups:
                table = g._tables.get(request_id)
                if table is not None and not table.pages:
                    del g._tables[request_id]
            return False
        for k, g in enumerate(self.groups):     # (the sliding groups' release is done)
            done = KVCacheManager.allocate_slots(g, request_id, num_tokens, token_ids,
                                                 num_computed_tokens, self._keys(k, extra_keys))
            assert done, "a group's allocation failed after the pool was counted"
        return True

    def _decodes_in_place(self, request_id: str, position: int, registers: bool) -> bool:
        """Whether a decode at ``position`` changes nothing in any group (checked once rather
        than per group: the host cost of a step): it neither starts nor fills a page, no
        window boundary passes and no page out of a window waits to go back, every group's
        page it writes is its own, and no full page waits to be registered."""
        s = self.page_size
        if not position % s or not (position + 1) % s:
            return False
        i = position // s
        first = self.groups[0]._tables.get(request_id)
        if first is None or len(first.pages) <= i or (
                registers and self.enable_prefix_caching and first.num_cached_pages < i):
            return False
        pages = self.groups[0]._pages
        for g, w in zip(self.groups, self._windows):
            table = g._tables.get(request_id)
            if table is None or pages[table.pages[i]].ref_cnt != 1 or (
                    w is not None and g._released.get(request_id, 0)
                    < dead_pages(position, w, s)):      # (a release a prefill left to do)
                return False
        return True

    def fork(self, parent_id: str, child_id: str) -> None:
        """:meth:`KVCacheManager.fork` in every group."""
        for g in self.groups:
            g.fork(parent_id, child_id)

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """Every group's copy-on-write ``(source, destination)`` pairs (page ids are the
        pool's: the device copies all of a page's slots)."""
        return [c for g in self.groups for c in g.take_pending_copies()]

    def uncache_from(self, request_id: str, num_tokens: int) -> None:
        """:meth:`KVCacheManager.uncache_from` in every group."""
        for g in self.groups:
            g.uncache_from(request_id, num_tokens)

    def reset_prefix_cache(self) -> None:
        """:meth:`KVCacheManager.reset_prefix_cache` of the shared pool.

        Raises:
            RuntimeError: a request still holds pages.
        """
        for g in self.groups:
            g.reset_prefix_cache()

    def free(self, request_id: str) -> None:
        """Release the request's pages in every group."""
        for g in self.groups:
            g.free(request_id)


def kv_cache_manager_for(num_pages: int, page_size: int, enable_prefix_caching: bool,
                         sliding_windows, layout: KVLayout | None = None,
                         speculative: bool = False):
    """The engine's page manager: :class:`HybridKVCacheManager` when the runner laid the
    pool out by ``layout``, else :func:`make_kv_cache_manager`'s."""
    if layout is not None:
        return HybridKVCacheManager(num_pages, page_size, enable_prefix_caching, layout)
    return make_kv_cache_manager(num_pages, page_size, enable_prefix_caching, sliding_windows,
                                 speculative)
