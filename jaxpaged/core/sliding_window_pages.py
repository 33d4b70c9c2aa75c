"""Give back the pages a sliding-window model can no longer read.

With a window of W tokens on every layer (Mistral, Mixtral, Phi-3-mini-4k, Qwen2 with every
layer sliding), the query at position p reads only keys ``p - W + 1 .. p``: once a sequence's
next query is at position c, every key below ``c - W + 1`` is dead. The pages wholly below it
are returned to the pool as the sequence grows (vLLM's ``SlidingWindowManager`` does the same
per KV-cache group, Kwon et al.'s PagedAttention paper, section 4.5, notes it for Mistral): the
page table keeps its length, the dead entries pointing at the null page, which the attention
backends never read inside the window, so a sequence holds about ``W / page_size + 1`` pages
instead of ``len / page_size``. With prefix caching a released page keeps its contents and
its hash on the free queue (evictable, as any freed page): a later request with the same
prefix still hits it until it is reused. Pages are released only once registered in the cache
(their token ids known), so a released page is never hashed afterwards.

A model mixing full-attention and sliding layers (Gemma 2 and 3) has one such manager per
sliding group of its layers, beside the full groups' plain ones, all drawing from one pool
(``jaxpaged.core.kv_groups``, ``jaxpaged.core.hybrid_kv_cache_manager``). Speculative
decoding turns it off (a draft model may attend over the whole sequence, and rejected drafts
move a sequence's next query back).

Pure Python, no JAX (host side).
"""

from __future__ import annotations

from jaxpaged.constants import NULL_PAGE
from jaxpaged.core.kv_cache_manager import KVCacheManager

#: The null page's reference count, so that sharing and freeing tables that point at it
#: (released entries) never puts it on the free queue.
_NULL_REFS = 1 << 60


def dead_pages(next_position: int, window: int, page_size: int) -> int:
    """Leading pages of a sequence that no query at ``next_position`` or later reads.

    Args:
        next_position: the sequence's next query position (its computed tokens).
        window: W, keys per query including its own (a query at p reads ``p - W + 1 .. p``).
        page_size: tokens per page.

    Returns:
        ``(next_position - W + 1) // page_size`` pages, at least 0.
    """
    return max(0, (next_position - window + 1) // page_size)


def uniform_window(sliding_windows) -> int | None:
    """The window a shared page table may slide by: the largest window when every layer has
    one, None when any layer attends over the whole sequence (or there are no layers)."""
    windows = tuple(sliding_windows)
    if not windows or any(w is None for w in windows):
        return None
    return max(windows)


class SlidingWindowKVCacheManager(KVCacheManager):
    """:class:`KVCacheManager` that releases pages out of every layer's window (module
    docstring) at each allocation.

    Args:
        num_pages, page_size, enable_prefix_caching: as :class:`KVCacheManager`.
        window: W of every layer (:func:`uniform_window`), >= 1.

    Raises:
        ValueError: as :class:`KVCacheManager`, or a window below 1.
    """

    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True, *,
                 window: int):
        super().__init__(num_pages, page_size, enable_prefix_caching)
        if window < 1:
            raise ValueError(f"the sliding window must be >= 1 token, got {window}")
        self.window = window
        self._pages[NULL_PAGE].ref_cnt = _NULL_REFS
        self._released: dict[str, int] = {}     # request -> leading entries released
        #: Pages given back before their request ended, since start-up.
        self.num_released_pages = 0

    def release_dead_pages(self, request_id: str, next_position: int) -> int:
        """Return the request's pages that no query at ``next_position`` or later reads
        (:func:`dead_pages`; with prefix caching only those already registered) to the free
        queue, their page-table entries set to the null page; returns how many."""
        table = self._tables.get(request_id)
        if table is None:
            return 0
        end = min(dead_pages(next_position, self.window, self.page_size), len(table.pages))
        if self.enable_prefix_caching:
            end = min(end, table.num_cached_pages)
        start = self._released.get(request_id, 0)
        for i in range(start, end):
            page = self._pages[table.pages[i]]
            table.pages[i] = NULL_PAGE
            page.ref_cnt -= 1
            if page.ref_cnt == 0:
                self._free[page.page_id] = None
        if end > start:
            self._released[request_id] = end
            self.num_released_pages += end - start
        return max(0, end - start)

    def share_pool(self, other: KVCacheManager) -> None:
        """:meth:`KVCacheManager.share_pool`, the shared null page made unfreeable."""
        super().share_pool(other)
        self._pages[NULL_PAGE].ref_cnt = _NULL_REFS

    def adopt_cached(self, request_id: str, page_ids: list[int], first: int = 0) -> None:
        """:meth:`KVCacheManager.adopt_cached`; the entries before ``first`` count as
        released."""
        super().adopt_cached(request_id, page_ids, first)
        if first:
            self._released[request_id] = first

    def allocate_slots(self, request_id: str, num_tokens: int, token_ids: list[int] | None = None,
                       num_computed_tokens: int = 0, extra_keys: tuple = ()) -> bool:
        """:meth:`KVCacheManager.allocate_slots` after releasing the pages that the step's
        first query (at ``num_computed_tokens``) and every later one cannot see."""
        self.release_dead_pages(request_id, num_computed_tokens)
        return super().allocate_slots(request_id, num_tokens, token_ids, num_computed_tokens,
                                      extra_keys)

    def fork(self, parent_id: str, child_id: str) -> None:
        """:meth:`KVCacheManager.fork`; the child's released entries are the parent's."""
        super().fork(parent_id, child_id)
        if parent_id in self._released:
            self._released[child_id] = self._released[parent_id]

    def free(self, request_id: str) -> None:
        """:meth:`KVCacheManager.free` (released entries point at the null page, which is
        never freed)."""
        self._released.pop(request_id, None)
        super().free(request_id)


def make_kv_cache_manager(num_pages: int, page_size: int, enable_prefix_caching: bool,
                          sliding_windows, speculative: bool = False) -> KVCacheManager:
    """The engine's page manager: :class:`SlidingWindowKVCacheManager` when every layer
    slides (:func:`uniform_window`) and no speculative decoding runs, else the plain
    :class:`KVCacheManager`."""
    window = None if speculative else uniform_window(sliding_windows)
    if window is None:
        return KVCacheManager(num_pages, page_size, enable_prefix_caching)
    return SlidingWindowKVCacheManager(num_pages, page_size, enable_prefix_caching,
                                       window=window)
