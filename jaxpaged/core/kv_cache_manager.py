"""`KVCacheManager`: host-side ownership of the preallocated KV page pool.

Pure Python, no JAX. It hands out page ids, keeps each request's page table, grows it a page
at a time as tokens are appended, and releases pages on finish, abort or preemption; the device
pool (``jaxpaged.layers.attention.base``) is indexed only through these ids. Page 0 (``NULL_PAGE``)
is never allocated.

Automatic prefix caching: every *full* page of a request gets a hash chained on its parent
page's hash, its token ids and extra keys (e.g. a ``cache_salt``). A new request reuses the
longest chain of cached pages; a hit is confirmed by comparing the page's token ids and parent
page, so a hash collision falls back to recomputation. Released pages keep their contents and
join an LRU free queue (a request's pages are queued tail first, so its tail is evicted
first); a cached page is dropped from the cache only when the queue hands it out again.

Pages are shared by reference count: between requests with a common prefix, and between the
``n`` sequences of a parallel-sampling request (:meth:`fork`). A write into a shared page copies
it first (copy-on-write), a copy the runner performs on the device before the step.

References: Kwon et al., "Efficient Memory Management for Large Language Model Serving with
PagedAttention" (SOSP 2023), sections 4.2-4.4 (block tables, on-demand allocation, sharing and
copy-on-write); vLLM v1's ``KVCacheManager``/``BlockPool`` (hash chains, LRU free queue).
"""

from __future__ import annotations

import hashlib
import pickle
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from jaxpaged.constants import NULL_PAGE


def hash_page(parent_hash: bytes | None, token_ids: tuple[int, ...], extra_keys: tuple) -> bytes:
    """SHA-256 of (parent hash, the page's token ids, extra keys)."""
    return hashlib.sha256(pickle.dumps((parent_hash, token_ids, extra_keys), protocol=5)).digest()


@dataclass(eq=False, slots=True)
class _Page:
    page_id: int
    ref_cnt: int = 0
    page_hash: bytes | None = None      # set once the page is full and cached
    token_ids: tuple[int, ...] = ()     # the cached page's tokens (hit confirmation)
    parent: int | None = None           # the cached page's parent page id


class _Pages(dict):
    """Page id -> :class:`_Page`, each made when first looked up (a pool of 100k+ pages
    built eagerly slowed every start-up: ``docs/measurements.md``, "KV cache manager")."""

    def __missing__(self, page_id: int) -> _Page:
        page = self[page_id] = _Page(page_id)
        return page


@dataclass
class PrefixCacheStats:
    """Prefix-cache counters since start-up: tokens of admitted requests looked up and found
    (vLLM's ``prefix_cache_queries`` / ``prefix_cache_hits``;
    :meth:`KVCacheManager.record_prefix_lookup`), and evictions of cached pages."""

    queries: int = 0
    hits: int = 0
    evictions: int = 0
    #: Lookups of preempted requests resuming, kept apart (their hits are mostly their own
    #: pages; vLLM's ``preempted_queries`` / ``preempted_hits``): they would inflate the rate.
    preempted_queries: int = 0
    preempted_hits: int = 0


@dataclass(slots=True)
class _Table:
    pages: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)   # hashes of the request's full pages
    num_cached_pages: int = 0                            # leading pages registered in the cache


class KVCacheManager:
    """Free queue, page tables and the prefix cache over ``num_pages`` pages.

    Args:
        num_pages: pages in the pool, the null page included (so ``num_pages - 1`` usable).
        page_size: tokens per page (``--block-size``).
        enable_prefix_caching: reuse cached full pages across requests.

    Raises:
        ValueError: fewer than 2 pages or a non-positive page size.
    """

    #: A step carries only the page table: the scheduler copies it, not :meth:`step_tables`.
    page_table_only = True

    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if num_pages < 2:
            raise ValueError(f"the KV pool needs at least 2 pages (1 is reserved), got {num_pages}")
        self.num_pages, self.page_size = num_pages, page_size
        self.enable_prefix_caching = enable_prefix_caching
        self._pages = _Pages()
        self._free: OrderedDict[int, None] = OrderedDict(
            (p, None) for p in range(num_pages) if p != NULL_PAGE)
        self._cached: dict[bytes, int] = {}
        self._tables: dict[str, _Table] = {}
        self._pending_copies: list[tuple[int, int]] = []
        self.stats = PrefixCacheStats()

    # ---- queries ---------------------------------------------------------------------------

    @property
    def num_free_pages(self) -> int:
        """Pages not held by any request (cached-but-unused pages count as free)."""
        return len(self._free)

    @property
    def num_usable_pages(self) -> int:
        """Pages that can ever be allocated (all but the null page)."""
        return self.num_pages - 1

    @property
    def num_used_pages(self) -> int:
        """Pages held by at least one request."""
        return self.num_usable_pages - len(self._free)

    def page_table(self, request_id: str) -> list[int]:
        """The request's page ids in token order (empty if it holds none)."""
        table = self._tables.get(request_id)
        return table.pages if table else []

    def step_tables(self, request_id: str) -> tuple[list[int], list[list[int]] | None, int]:
        """A scheduled step's copy of the page table, other groups' tables, state slot."""
        return self.page_table(request_id).copy(), None, -1

    def group_page_tables(self, request_id: str) -> list[list[int]] | None:
        """None: one page table serves every layer here (``jaxpaged.core.kv_groups``)."""
        return None

    def state_slot(self, request_id: str) -> int:
        """Always -1: no layer is recurrent here (``jaxpaged.core.state_slots``)."""
        return -1

    def share_pool(self, other: "KVCacheManager") -> None:
        """Draw pages from ``other``'s pool: its pages, free queue, prefix-cache index and
        counters become this manager's too (the groups of
        ``jaxpaged.core.hybrid_kv_cache_manager``; their cache keys must differ). Call it
        before any allocation."""
        self._pages, self._free, self._cached = other._pages, other._free, other._cached
        self.stats = other.stats

    def pages_to_allocate(self, request_id: str, num_tokens: int,
                          num_computed_tokens: int) -> int:
        """Free pages :meth:`allocate_slots` with these arguments would take: new pages for
        the growth and copies of the shared pages the write touches."""
        table = self._tables.get(request_id)
        pages = table.pages if table else []
        s = self.page_size
        grow = max(0, -(-num_tokens // s) - len(pages))
        first = num_computed_tokens // s
        if first == len(pages) - 1:     # a decode in its last page (the common case)
            return grow + (self._pages[pages[first]].ref_cnt > 1)
        return grow + sum(1 for i in range(first, len(pages))
                          if self._pages[pages[i]].ref_cnt > 1)

    def lookup_cached(self, request_id: str, token_ids: list[int], extra_keys: tuple,
                      max_pages: int) -> list[int | None]:
        """Per page of the first ``max_pages`` full pages of ``token_ids``: the cached page
        holding it (its tokens confirmed, and its parent when the page before is cached too),
        or None; takes nothing. The request's hashes are kept for later registration."""
        table = self._tables.setdefault(request_id, _Table())
        hashes = self._page_hashes(table, token_ids, extra_keys)
        s, found = self.page_size, []
        for i, h in enumerate(hashes[:max_pages]):
            page_id = self._cached.get(h)
            if page_id is not None:
                page = self._pages[page_id]
                parent = found[i - 1] if i else None
                if page.token_ids != tuple(token_ids[i * s:(i + 1) * s]) or \
                        (parent is not None or not i) and page.parent != parent:
                    page_id = None      # a hash collision
            found.append(page_id)
        return found

    def page_hashes(self, request_id: str, token_ids=(), extra_keys: tuple = ()) -> list[bytes]:
        """The prefix hashes of the request's full pages (of ``token_ids``, when given)."""
        return self._page_hashes(self._tables.setdefault(request_id, _Table()), token_ids, extra_keys)

    def adopt_cached(self, request_id: str, page_ids: list[int], first: int = 0) -> None:
        """Give the request (holding no pages) the cached pages ``page_ids[first:]`` as its
        first ``len(page_ids)`` pages, entries before ``first`` pointing at the null page
        (a sliding group's pages out of the window)."""
        table = self._tables.setdefault(request_id, _Table())
        assert not table.pages, "adopt_cached on a request that holds pages"
        for page_id in page_ids[first:]:
            self._take(page_id)
        table.pages = [NULL_PAGE] * first + list(page_ids[first:])
        table.num_cached_pages = len(page_ids)

    def slots(self, request_id: str, start: int, end: int) -> list[int]:
        """Flat pool slots (``page * page_size + row``) of positions ``[start, end)``."""
        pages = np.asarray(self._tables[request_id].pages, np.int64)
        positions = np.arange(start, end)
        return (pages[positions // self.page_size] * self.page_size
                + positions % self.page_size).tolist()

    # ---- prefix cache ----------------------------------------------------------------------

    def _page_hashes(self, table: _Table, token_ids: list[int], extra_keys: tuple) -> list[bytes]:
        """Extend ``table.hashes`` to every full page of ``token_ids``."""
        s = self.page_size
        for i in range(len(table.hashes), len(token_ids) // s):
            parent = table.hashes[i - 1] if i else None
            table.hashes.append(hash_page(parent, tuple(token_ids[i * s:(i + 1) * s]), extra_keys))
        return table.hashes

    def find_cached_prefix(self, request_id: str, token_ids: list[int],
                           extra_keys: tuple = ()) -> int:
        """Take the longest run of cached pages matching the start of ``token_ids``.

        Must be called while the request holds no pages. At least one token is always left
        to compute (its logits are needed), so at most ``len(token_ids) - 1`` tokens hit.

        Returns:
            The number of cached tokens (a multiple of ``page_size``); those pages now
            belong to the request.
        """
        table = self._tables.setdefault(request_id, _Table())
        assert not table.pages, "find_cached_prefix on a request that holds pages"
        if not self.enable_prefix_caching:
            return 0
        hashes = self._page_hashes(table, token_ids, extra_keys)
        max_pages = (len(token_ids) - 1) // self.page_size
        s = self.page_size
        parent = None
        for i, h in enumerate(hashes[:max_pages]):
            page_id = self._cached.get(h)
            if page_id is None:
                break
            page = self._pages[page_id]
            if page.token_ids != tuple(token_ids[i * s:(i + 1) * s]) or page.parent != parent:
                break   # a hash collision: recompute from here
            self._take(page_id)
            table.pages.append(page_id)
            parent = page_id
        table.num_cached_pages = len(table.pages)
        return len(table.pages) * s

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int,
                             preempted: bool = False) -> None:
        """Count one admitted request's lookup in :attr:`stats`: ``num_tokens`` tokens
        queried, ``num_hit_tokens`` of them served from the cache (the scheduler calls it once
        per admission, so a request that waits and retries is counted once). A ``preempted``
        request resuming is counted in ``preempted_queries`` / ``preempted_hits`` only, as
        vLLM v1's ``KVCacheManager.get_computed_blocks`` does: its own recomputed pages are
        not prefix-cache hits."""
        if preempted:
            self.stats.preempted_queries += num_tokens
            self.stats.preempted_hits += num_hit_tokens
        else:
            self.stats.queries += num_tokens
            self.stats.hits += num_hit_tokens

    def _register_full_pages(self, table: _Table, token_ids: list[int], num_tokens: int,
                             extra_keys: tuple) -> None:
        """Put the request's pages that ``num_tokens`` fill into the cache (only pages whose
        tokens are all known: under async scheduling a step may compute a token whose id is
        not on the host yet; its page is registered by a later allocation)."""
        full = min(min(num_tokens, len(token_ids)) // self.page_size, len(table.pages))
        if full <= table.num_cached_pages:
            return
        hashes = self._page_hashes(table, token_ids[:full * self.page_size], extra_keys)
        s = self.page_size
        for i in range(table.num_cached_pages, full):
            page = self._pages[table.pages[i]]
            if hashes[i] in self._cached or page.page_hash is not None:
                continue   # the same content is cached already (or this page is, shared)
            page.page_hash, page.token_ids = hashes[i], tuple(token_ids[i * s:(i + 1) * s])
            page.parent = table.pages[i - 1] if i else None
            self._cached[hashes[i]] = page.page_id
        table.num_cached_pages = full

    # ---- allocation ------------------------------------------------------------------------

    def _take(self, page_id: int) -> None:
        page = self._pages[page_id]
        if page.ref_cnt == 0:
            del self._free[page_id]
        page.ref_cnt += 1

    def _pop_free(self) -> int:
        page_id, _ = self._free.popitem(last=False)
        page = self._pages[page_id]
        if page.page_hash is not None:     # evict it from the cache
            self._uncache(page)
            self.stats.evictions += 1
        page.ref_cnt = 1
        return page_id

    def allocate_slots(self, request_id: str, num_tokens: int, token_ids: list[int] | None = None,
                       num_computed_tokens: int = 0, extra_keys: tuple = ()) -> bool:
        """Make ``request_id``'s pages hold ``num_tokens`` tokens, the next write starting at
        ``num_computed_tokens``.

        Grows the page table, copies any shared page that the write would touch
        (copy-on-write, see :meth:`take_pending_copies`), and, with prefix caching, registers
        the pages the ``num_tokens`` tokens ``token_ids`` fill.

        Returns:
            False, changing nothing, if there are not enough free pages.
        """
        table = self._tables.get(request_id)
        if table is None:
            table = self._tables[request_id] = _Table()
        pages, s = table.pages, self.page_size
        num_pages = len(pages)
        grow = -(-num_tokens // s) - num_pages
        first = num_computed_tokens // s      # the first page the write touches
        if grow <= 0 and (first >= num_pages or (first == num_pages - 1
                                                 and self._pages[pages[first]].ref_cnt == 1)):
            # A decode inside its last page, held by this request alone (the common case).
            if (self.enable_prefix_caching and token_ids is not None
                    and num_tokens // s > table.num_cached_pages):
                self._register_full_pages(table, token_ids, num_tokens, extra_keys)
            return True
        shared = [i for i in range(first, num_pages) if self._pages[pages[i]].ref_cnt > 1]
        if max(grow, 0) + len(shared) > len(self._free):
            if not table.pages:
                del self._tables[request_id]
            return False
        for i in shared:
            old = table.pages[i]
            new = self._pop_free()
            self._pending_copies.append((old, new))
            self._pages[old].ref_cnt -= 1
            table.pages[i] = new
            table.num_cached_pages = min(table.num_cached_pages, i)
        for _ in range(grow):
            table.pages.append(self._pop_free())
        if self.enable_prefix_caching and token_ids is not None:
            self._register_full_pages(table, token_ids, num_tokens, extra_keys)
        return True

    def fork(self, parent_id: str, child_id: str) -> None:
        """Give ``child_id`` the parent's pages by reference (parallel sampling)."""
        parent = self._tables[parent_id]
        for page_id in parent.pages:
            self._pages[page_id].ref_cnt += 1
        self._tables[child_id] = _Table(list(parent.pages), list(parent.hashes),
                                        parent.num_cached_pages)

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """(source page, destination page) pairs the device must copy before the next step."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    def uncache_from(self, request_id: str, num_tokens: int) -> None:
        """Drop from the prefix cache the request's pages after its first ``num_tokens``
        tokens (their contents were not written: the step meant to compute them failed), so
        that no later request can hit them. Other requests that hold one of these pages keep
        it (they were in the same failed step: a page is cached only by the step that
        computes it). Call it just before freeing the request."""
        table = self._tables.get(request_id)
        if table is None:
            return
        for page_id in table.pages[num_tokens // self.page_size:]:
            self._uncache(self._pages[page_id])

    def reset_prefix_cache(self) -> None:
        """Forget every cached page (the device pool's contents were lost); needs every page
        free.

        Raises:
            RuntimeError: a request still holds pages.
        """
        if self.num_used_pages:
            raise RuntimeError(f"cannot reset the prefix cache: {self.num_used_pages} pages "
                               "are still in use")
        for page in self._pages.values():     # (pages never made hold nothing)
            self._uncache(page)
        self._pending_copies.clear()

    def _uncache(self, page) -> None:
        """Forget ``page``'s prefix-cache entry and contents (no-op for an uncached page)."""
        if page.page_hash is not None:
            del self._cached[page.page_hash]
        page.page_hash, page.token_ids, page.parent = None, (), None

    def free(self, request_id: str) -> None:
        """Release every page of ``request_id`` (no-op if it holds none). Pages whose count
        drops to zero join the free queue, the request's tail first, keeping cached contents."""
        table = self._tables.pop(request_id, None)
        if table is None:
            return
        for page_id in reversed(table.pages):
            page = self._pages[page_id]
            page.ref_cnt -= 1
            if page.ref_cnt == 0:
                self._free[page_id] = None
