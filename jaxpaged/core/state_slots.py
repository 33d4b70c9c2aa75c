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

Prefix caching (vLLM's mamba "align" mode, ``MambaManager`` in
``vllm/v1/core/single_type_kv_cache_manager.py``): a prefill chunk of a cacheable sequence is
cut to end on a page boundary (:meth:`StateSlotKVCacheManager.align_prefill`: every
unfinished chunk, and the chunk that would cross the prompt's last full page); a decode
step ends on one every ``page_size`` tokens. After a step that ends on a page boundary (an
aligned chunk or a decode: :meth:`StateSlotKVCacheManager.allocate_slots` decides) the live
slot's states are copied into a cached-state slot (``jaxpaged.core.state_cache``) keyed by
the prefix hash of the page they end, as vLLM's align mode caches a state at every full
block, decode included (here a sequence keeps only its latest decode-time state:
``jaxpaged.core.state_saves``, which also holds the saves whose key async scheduling knows
only a step later). A prefix hit
of ``n`` pages needs pages ``0 .. n-1`` cached *and* a cached state at page ``n - 1``'s end;
the hit is the longest such ``n``. Its state is copied into the sequence's live slot before
its first step, which starts at position ``n * page_size`` (not 0: no reset). The step's
copies travel in ``SchedulerOutput.state_copies`` as ``(restores, saves)`` pairs of slot
indices (:meth:`StateSlotKVCacheManager.take_state_copies`): the runner copies restores
before the forward and saves after it. A save is hittable only from the next step on.
Pure Python, no JAX (host side).
"""

from __future__ import annotations

import logging

from jaxpaged.core.kv_cache_manager import KVCacheManager
from jaxpaged.core.state_cache import CachedStates
from jaxpaged.core.state_saves import StateSaves

logger = logging.getLogger(__name__)

#: Cached-state slots per live slot (``max_num_seqs``) when prefix caching is on.
CACHED_STATES_PER_SEQ = 2


def num_cached_states(max_num_seqs: int, enable_prefix_caching: bool) -> int:
    """Cached-state slots beside ``max_num_seqs`` live ones (0: prefix caching off)."""
    return CACHED_STATES_PER_SEQ * max_num_seqs if enable_prefix_caching else 0


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
    and, with prefix caching, cached states (module docstring); every other attribute is
    the wrapped manager's.

    Args:
        pages: the page manager (prefix caching on only if ``num_cached`` > 0).
        num_slots: live state slots (the engine's ``max_num_seqs``): indices
            ``0 .. num_slots - 1``.
        num_cached: cached-state slots (0: prefix caching off), indices after the live ones.
            Needs a plain ``KVCacheManager``.
    """

    #: A step carries a state slot too (:meth:`step_tables`), whatever ``pages`` is.
    page_table_only = False

    def __init__(self, pages, num_slots: int, num_cached: int = 0):
        self.pages = pages
        self.state_slots = StateSlots(num_slots)
        self.cached_states = CachedStates(num_slots, num_cached) if num_cached else None
        self._hits: dict[str, int] = {}          # request -> cached slot to restore
        self._aligned: dict[str, int] = {}       # request -> its chunk's boundary
        self._restores: dict[str, tuple[int, int]] = {}
        self._saves = StateSaves(self.cached_states) if num_cached else None

    def __getattr__(self, name):
        return getattr(self.pages, name)

    def allocate_slots(self, request_id: str, num_tokens: int, token_ids: list[int] | None = None,
                       num_computed_tokens: int = 0, extra_keys: tuple = ()) -> bool:
        """The page manager's ``allocate_slots``, taking a state slot too at a request's
        first allocation (with a restore copy on a prefix hit), and a cached-state slot for
        a step that ends on a page boundary: a chunk :meth:`align_prefill` cut there, or a
        one-token step (a decode) reaching one. The one place deciding a save (module
        docstring); a step with draft tokens saves nothing (its state ends where the
        verification stops). Returns False, changing nothing, if pages or a slot are
        lacking."""
        new = self.state_slots.slot(request_id) < 0
        if new and not self.state_slots.num_free:
            return False
        if not self.pages.allocate_slots(request_id, num_tokens, token_ids,
                                         num_computed_tokens, extra_keys):
            return False
        live = self.state_slots.acquire(request_id)
        if new and request_id in self._hits:
            self._restores[request_id] = (self._hits.pop(request_id), live)
        aligned = self._aligned.pop(request_id, None) == num_tokens
        saves = self._saves
        if saves is not None and token_ids is not None:
            if saves.has_unkeyed(request_id):
                saves.publish_known(request_id, lambda boundary: self._key(
                    request_id, boundary, token_ids, extra_keys))
            if aligned or (num_tokens == num_computed_tokens + 1
                           and not num_tokens % self.page_size):
                saves.plan(request_id, live, num_tokens,
                           self._key(request_id, num_tokens, token_ids, extra_keys),
                           decode=not aligned)
        return True

    def _key(self, request_id: str, boundary: int, token_ids: list[int],
             extra_keys: tuple) -> bytes | None:
        """The prefix hash of the page ending at ``boundary`` (None: under async scheduling
        its last token ids are not on the host yet)."""
        if boundary > len(token_ids):
            return None
        return self.pages.page_hashes(request_id, token_ids[:boundary],
                                      extra_keys)[boundary // self.page_size - 1]

    def align_prefill(self, req, num_new: int) -> int:
        """``num_new`` tokens of ``req``'s prefill chunk, cut so that a cacheable sequence's
        chunk ends on a page boundary (module docstring): an unfinished chunk at its last
        boundary, the prompt's last chunk at the prompt's last full page (if it crosses it).
        The scheduler calls it for chunks that start inside the prompt."""
        if self.cached_states is None or req.params.prompt_logprobs is not None \
                or req.pooling is not None:
            return num_new
        s, start = self.page_size, req.num_computed_tokens
        end, prompt = start + num_new, req.num_prompt_tokens
        last = prompt // s * s
        if start < last < end:
            end = last
        elif end < prompt and end // s * s > start:
            end = end // s * s
        if end % s == 0:
            self._aligned[req.request_id] = end
        return end - start

    def state_slot(self, request_id: str) -> int:
        """The request's state slot (-1: it holds none)."""
        return self.state_slots.slot(request_id)

    def step_tables(self, request_id: str) -> tuple[list[int], list[list[int]] | None, int]:
        """The page manager's ``step_tables`` with this request's state slot."""
        pages, group_pages, _ = self.pages.step_tables(request_id)
        return pages, group_pages, self.state_slot(request_id)

    def find_cached_prefix(self, request_id: str, token_ids: list[int],
                           extra_keys: tuple = ()) -> int:
        """Take the longest cached prefix that has both its pages and a cached state at its
        end (module docstring); must be called while the request holds no pages. Returns
        the cached tokens (a multiple of the page size, at most ``len(token_ids) - 1``)."""
        cache = self.cached_states
        if cache is None:
            return 0
        found = self.pages.lookup_cached(request_id, token_ids, extra_keys,
                                         (len(token_ids) - 1) // self.page_size)
        hashes, n = self.pages.page_hashes(request_id), 0
        for i, page in enumerate(found):
            if page is None:
                break
            if cache.get(hashes[i]) is not None:
                n = i + 1
        if n:
            self.pages.adopt_cached(request_id, found[:n])
            cache.touch(hashes[n - 1])
            self._hits[request_id] = cache.get(hashes[n - 1])
        return n * self.page_size

    def take_state_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """This step's ``(restores, saves)``: ``(source slot, destination slot)`` pairs the
        runner copies in every recurrent layer, restores before the forward and saves after
        it. The saved states whose key is known become hittable, the others once a later
        allocation knows it (the scheduler calls it once a step)."""
        restores = list(self._restores.values())
        self._restores = {}
        return restores, [] if self._saves is None else self._saves.take()

    def fork(self, parent_id: str, child_id: str) -> None:
        """Parallel sampling would need the parent's state copied into the child's slot,
        which the runner does not do.

        Raises:
            NotImplementedError: always (``n > 1`` is refused before it gets here).
        """
        raise NotImplementedError("parallel sampling (n > 1) is not supported for models "
                                  "with recurrent layers")

    def uncache_from(self, request_id: str, num_tokens: int) -> None:
        """The page manager's ``uncache_from``, also dropping the request's cached states at
        page boundaries after ``num_tokens`` (the failed step did not compute them), keyed or
        not yet."""
        if self.cached_states is not None:
            for key in self.pages.page_hashes(request_id)[num_tokens // self.page_size:]:
                self.cached_states.drop(key)
            self._saves.release(request_id, num_tokens)
        self.pages.uncache_from(request_id, num_tokens)

    def reset_prefix_cache(self) -> None:
        """Forget every cached page and state (as the page manager's; raises the same)."""
        self.pages.reset_prefix_cache()
        if self.cached_states is not None:
            self.cached_states.clear()

    def free(self, request_id: str) -> None:
        """Release the request's pages, its state slot, any copy planned for it in the
        step being scheduled (it was preempted or not admitted after all) and the cached
        slots of its saves whose key is not known yet (it finished, was aborted or
        preempted before its next allocation)."""
        self.pages.free(request_id)
        self.state_slots.release(request_id)
        self._hits.pop(request_id, None)
        self._aligned.pop(request_id, None)
        self._restores.pop(request_id, None)
        if self._saves is not None:
            self._saves.release(request_id)


def with_state_slots(pages, num_slots: int, enable_prefix_caching: bool,
                     architecture: str) -> StateSlotKVCacheManager:
    """``pages`` (built with prefix caching as ``enable_prefix_caching``) wrapped with
    ``num_slots`` live state slots and, with prefix caching, :func:`num_cached_states`
    cached ones. Prefix caching needs a plain ``KVCacheManager`` (no KV cache groups);
    otherwise it is off with a logged reason."""
    num_cached = num_cached_states(num_slots, enable_prefix_caching)
    if num_cached and type(pages) is not KVCacheManager:
        logger.info("prefix caching is off for %s: its recurrent states are cached only "
                    "beside a single KV cache group (docs/models.md)", architecture)
        num_cached = 0
    return StateSlotKVCacheManager(pages, num_slots, num_cached)
