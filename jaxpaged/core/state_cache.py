"""Cached recurrent states: an LRU pool of state slots keyed by prefix hash.

A model with recurrent layers (Qwen3-Next) can reuse a cached prefix only if it also has the
recurrent state at the prefix's end (``jaxpaged.core.state_slots``). The device state arrays
hold, after the live slots of running sequences, ``num_slots`` *cached-state slots*; each
holds a copy of some sequence's states (every recurrent layer's ``conv_state`` and
``ssm_state``) at a page boundary, keyed by the prefix hash of the page that ends there
(``KVCacheManager.page_hashes``). Entries are evicted least recently used first, as vLLM's
block pool evicts cached pages (``vllm/v1/core/block_pool.py``) and as its mamba "align" cache
mode keeps block-aligned states (``vllm/v1/core/single_type_kv_cache_manager.py``,
``MambaManager``).

Pure Python, no JAX (host side): it hands out slot indices only; the runner copies the rows.
"""

from __future__ import annotations

from collections import OrderedDict


class CachedStates:
    """``num_slots`` cached-state slots, indices ``first_slot .. first_slot + num_slots - 1``.

    A slot is either free, *reserved* (a save is under way: :meth:`reserve`, then
    :meth:`publish` once the copy is on its way to the device and its key is known, or
    :meth:`release`), or holds one entry in the LRU order.

    Args:
        first_slot: the first slot index (the live slots come before).
        num_slots: the pool's size.

    Raises:
        ValueError: ``num_slots`` < 1 or ``first_slot`` < 0.
    """

    def __init__(self, first_slot: int, num_slots: int):
        if num_slots < 1 or first_slot < 0:
            raise ValueError(f"need num_slots >= 1 and first_slot >= 0, got {num_slots} "
                             f"and {first_slot}")
        self.num_slots = num_slots
        self._free = list(range(first_slot + num_slots - 1, first_slot - 1, -1))
        self._lru: OrderedDict[bytes, int] = OrderedDict()
        #: Entries dropped to make room since start-up.
        self.evictions = 0

    @property
    def num_free(self) -> int:
        """Slots neither holding an entry nor reserved."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Slots holding an entry."""
        return len(self._lru)

    def get(self, key: bytes) -> int | None:
        """The slot holding ``key``'s state, or None (the LRU order is unchanged)."""
        return self._lru.get(key)

    def touch(self, key: bytes) -> None:
        """Mark ``key``'s entry most recently used (no-op if absent)."""
        if key in self._lru:
            self._lru.move_to_end(key)

    def reserve(self) -> int | None:
        """A slot for a new entry: a free one, else the least recently used entry's (evicted);
        None when every slot is reserved."""
        if self._free:
            return self._free.pop()
        if not self._lru:
            return None
        self.evictions += 1
        return self._lru.popitem(last=False)[1]

    def publish(self, key: bytes, slot: int) -> None:
        """Make reserved ``slot`` the (most recent) entry of ``key``; if ``key`` has an
        entry already, ``slot`` goes back to the free list instead."""
        if key in self._lru:
            self._free.append(slot)
            self._lru.move_to_end(key)
        else:
            self._lru[key] = slot

    def release(self, slot: int) -> None:
        """Give a reserved slot back unused."""
        self._free.append(slot)

    def drop(self, key: bytes) -> None:
        """Forget ``key``'s entry (no-op if absent); its slot becomes free."""
        slot = self._lru.pop(key, None)
        if slot is not None:
            self._free.append(slot)

    def clear(self) -> None:
        """Forget every entry (the device lost the states)."""
        for key in list(self._lru):
            self.drop(key)
