"""`KVCacheManager`: host-side ownership of the preallocated KV page pool.

Pure Python, no JAX. It hands out page ids from a free list, keeps each request's page table,
grows it one page at a time as tokens are appended, and returns pages on finish, abort or
preemption. The device pool itself (layout in ``jaxpaged.layers.attention.base``) is only ever
indexed through these page ids. Page 0 (``NULL_PAGE``) is reserved and never allocated.

Reference: Kwon et al., "Efficient Memory Management for Large Language Model Serving with
PagedAttention" (SOSP 2023), section 4.2 (block tables and on-demand allocation).
"""

from __future__ import annotations

from collections import deque

from jaxpaged.layers.attention.base import NULL_PAGE


class KVCacheManager:
    """Free list and page tables over ``num_pages`` pages of ``page_size`` tokens.

    Args:
        num_pages: pages in the pool, the null page included (so ``num_pages - 1`` usable).
        page_size: tokens per page (``--block-size``).

    Raises:
        ValueError: fewer than 2 pages or a non-positive page size.
    """

    def __init__(self, num_pages: int, page_size: int):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if num_pages < 2:
            raise ValueError(f"the KV pool needs at least 2 pages (1 is reserved), got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free: deque[int] = deque(p for p in range(num_pages) if p != NULL_PAGE)
        self._page_tables: dict[str, list[int]] = {}

    @property
    def num_free_pages(self) -> int:
        """Pages not held by any request."""
        return len(self._free)

    @property
    def num_usable_pages(self) -> int:
        """Pages that can ever be allocated (all but the null page)."""
        return self.num_pages - 1

    def pages_needed(self, num_tokens: int) -> int:
        """Pages that hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.page_size)

    def allocate_slots(self, request_id: str, num_tokens: int) -> bool:
        """Grow ``request_id``'s page table to hold ``num_tokens`` tokens in total.

        Returns:
            False, changing nothing, if the free list is too short.
        """
        table = self._page_tables.setdefault(request_id, [])
        need = self.pages_needed(num_tokens) - len(table)
        if need > len(self._free):
            if not table:
                del self._page_tables[request_id]
            return False
        for _ in range(need):
            table.append(self._free.popleft())
        return True

    def free(self, request_id: str) -> None:
        """Return every page of ``request_id`` to the free list (no-op if it holds none)."""
        for page in self._page_tables.pop(request_id, []):
            self._free.append(page)

    def page_table(self, request_id: str) -> list[int]:
        """The request's page ids in token order (empty if it holds none)."""
        return self._page_tables.get(request_id, [])

    def slots(self, request_id: str, start: int, end: int) -> list[int]:
        """Flat pool slots (``page * page_size + row``) of positions ``[start, end)``."""
        table = self._page_tables[request_id]
        s = self.page_size
        return [table[p // s] * s + p % s for p in range(start, end)]
