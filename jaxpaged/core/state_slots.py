"""Recurrent state slots beside the page pool (models with linear-attention layers).

A Gated DeltaNet layer (Qwen3-Next, ``jaxpaged.layers.gated_deltanet``) keeps per sequence
a fixed-size state (its convolution's last inputs and its [Hv, Dk, Dv] memory) instead of
one page per token. The device holds ``num_slots`` such states per recurrent layer
(``jaxpaged.layers.recurrent_pool``); a sequence owns one slot index for all of them while it
runs, as vLLM's mamba cache hands out one state index per request
(``vllm/v1/core/single_type_kv_cache_manager.py``, ``MambaManager``).

:class:`StateSlotKVCacheManager` wraps the engine's page manager so the scheduler needs no
new calls: a sequence's first successful page allocation (its first scheduling, or its
rescheduling after a preemption) also takes a slot, and :meth:`free` (finished, aborted or
preempted) gives it back. A preempted sequence recomputes from position 0, and the device
starts a sequence's state from zero at position 0, so a reused slot needs no clearing. With
``num_slots = max_num_seqs`` a slot is always free for a sequence the scheduler admits.

Prefix caching is off for these models (a page boundary would need the recurrent state
saved there; vLLM's first hybrid support was the same), so the manager never reports a
cached prefix. Pure Python, no JAX (host side).
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


class StateSlots:
    """A free list of ``num_slots`` slot indices, each held by at most one request.

    Raises:
        ValueError: ``num_slots`` < 1.
    """

    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))     # pop() gives slot 0 first
        self._held: dict[str, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def slot(self, request_id: str) -> int:
        """The request's slot, or -1 when it holds none."""
        return self._held.get(request_id, -1)

    def acquire(self, request_id: str) -> int | None:
        """The request's slot, taking a free one if it holds none; None when none is free."""
        slot = self._held.get(request_id)
        if slot is None:
            if not self._free:
                return None
            slot = self._held[request_id] = self._free.pop()
        return slot

    def release(self, request_id: str) -> None:
        """Give the request's slot back (no-op if it holds none)."""
        slot = self._held.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)


class StateSlotKVCacheManager:
    """A page manager (``KVCacheManager`` or ``HybridKVCacheManager``) plus state slots
    (module docstring); every other attribute is the wrapped manager's.

    Args:
        pages: the page manager (built with prefix caching off).
        num_slots: state slots (the engine's ``max_num_seqs``).
    """

    def __init__(self, pages, num_slots: int):
        self.pages = pages
        self.state_slots = StateSlots(num_slots)

    def __getattr__(self, name):
        return getattr(self.pages, name)

    def allocate_slots(self, request_id: str, num_tokens: int, token_ids: list[int] | None = None,
                       num_computed_tokens: int = 0, extra_keys: tuple = ()) -> bool:
        """The page manager's ``allocate_slots``, taking a state slot too at a request's
        first allocation. Returns False, changing nothing, if pages or a slot are lacking."""
        new = self.state_slots.slot(request_id) < 0
        if new and not self.state_slots.num_free:
            return False
        if not self.pages.allocate_slots(request_id, num_tokens, token_ids,
                                         num_computed_tokens, extra_keys):
            return False
        if new:
            self.state_slots.acquire(request_id)
        return True

    def state_slot(self, request_id: str) -> int:
        """The request's state slot (-1: it holds none)."""
        return self.state_slots.slot(request_id)

    def find_cached_prefix(self, request_id: str, token_ids: list[int],
                           extra_keys: tuple = ()) -> int:
        """Always 0: recurrent states are not cached at page boundaries (module docstring)."""
        return 0

    def fork(self, parent_id: str, child_id: str) -> None:
        """Parallel sampling would need the parent's state copied into the child's slot,
        which the runner does not do.

        Raises:
            NotImplementedError: always (``n > 1`` is refused before it gets here).
        """
        raise NotImplementedError("parallel sampling (n > 1) is not supported for models "
                                  "with recurrent layers")

    def free(self, request_id: str) -> None:
        """Release the request's pages and its state slot."""
        self.pages.free(request_id)
        self.state_slots.release(request_id)


def with_state_slots(pages, num_slots: int, prefix_caching_requested: bool,
                     architecture: str) -> StateSlotKVCacheManager:
    """``pages`` (built with prefix caching off) wrapped with ``num_slots`` state slots,
    logging why prefix caching is off when it was asked for."""
    if prefix_caching_requested:
        logger.info("prefix caching is off for %s: its recurrent layers' states are not "
                    "saved at page boundaries (docs/models.md)", architecture)
    return StateSlotKVCacheManager(pages, num_slots)
