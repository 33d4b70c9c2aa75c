"""The saves of recurrent states into cached-state slots that a hybrid model's steps make.

``jaxpaged.core.state_slots`` decides which steps save (a step ending on a page boundary);
this keeps their bookkeeping between the scheduling of a step and the state's entry in the
LRU pool (``jaxpaged.core.state_cache``):

* a save is *planned* while its step is scheduled (a reserved slot); taking the step's copies
  (:meth:`StateSaves.take`) publishes it under its key, the prefix hash of the page it ends;
* under async scheduling a decode's input token is not on the host when its step is
  scheduled, so its key is not known: the copy still runs after the step, and the slot stays
  reserved, *unkeyed*, until an allocation knowing the page's tokens publishes it
  (:meth:`StateSaves.publish_known`); freeing the request first gives the slot back;
* a sequence keeps only its latest decode-time state: publishing one drops the entry of its
  previous one, so a long generation holds one slot instead of flushing the pool (its
  prompt's states, saved by prefill, stay). A later turn of a chat extends the answer to
  its end, where that state is.

Pure Python, no JAX (host side).
"""

from __future__ import annotations

from collections.abc import Callable

from jaxpaged.core.state_cache import CachedStates


class StateSaves:
    """Planned, unkeyed and latest decode-time saves per request over ``cache``."""

    def __init__(self, cache: CachedStates):
        self.cache = cache
        # request -> (live slot, cached slot, boundary, key or None, decode-time)
        self._planned: dict[str, tuple[int, int, int, bytes | None, bool]] = {}
        self._unkeyed: dict[str, list[tuple[int, int, bool]]] = {}   # (slot, boundary, decode)
        self._latest: dict[str, bytes] = {}         # request -> its latest decode-time key

    def plan(self, request_id: str, live: int, boundary: int, key: bytes | None,
             decode: bool) -> None:
        """Plan the copy of live slot ``live`` after this step, which ends at token
        ``boundary``, into a reserved slot for ``key`` (None: not known yet). None is
        planned if ``key`` is cached already (it is touched) or every slot is reserved."""
        cache = self.cache
        if key is not None and cache.get(key) is not None:
            cache.touch(key)
            if decode:
                self._keep_latest(request_id, key)
            return
        slot = cache.reserve()
        if slot is not None:
            self._planned[request_id] = (live, slot, boundary, key, decode)

    def take(self) -> list[tuple[int, int]]:
        """The step's ``(live, cached)`` copies; the keyed saves become entries, the others
        wait for their key."""
        copies = []
        for request_id, (live, slot, boundary, key, decode) in self._planned.items():
            if key is None:
                self._unkeyed.setdefault(request_id, []).append((slot, boundary, decode))
            else:
                self._publish(request_id, key, slot, decode)
            copies.append((live, slot))
        self._planned = {}
        return copies

    def has_unkeyed(self, request_id: str) -> bool:
        """Whether the request has saves waiting for their key."""
        return request_id in self._unkeyed

    def publish_known(self, request_id: str, key_of: Callable[[int], bytes | None]) -> None:
        """Publish the request's unkeyed saves whose key ``key_of(boundary)`` now gives."""
        waiting = []
        for slot, boundary, decode in self._unkeyed.pop(request_id):
            key = key_of(boundary)
            if key is None:
                waiting.append((slot, boundary, decode))
            else:
                self._publish(request_id, key, slot, decode)
        if waiting:
            self._unkeyed[request_id] = waiting

    def _publish(self, request_id: str, key: bytes, slot: int, decode: bool) -> None:
        self.cache.publish(key, slot)
        if decode:
            self._keep_latest(request_id, key)

    def _keep_latest(self, request_id: str, key: bytes) -> None:
        """Make ``key`` the request's latest decode-time state, dropping its previous one."""
        previous = self._latest.get(request_id)
        if previous is not None and previous != key:
            self.cache.drop(previous)
        self._latest[request_id] = key

    def release(self, request_id: str, after: int = 0) -> None:
        """Give back the request's reserved slots of saves ending after token ``after``: the
        planned one and the unkeyed ones (a failed step did not compute them, or the request
        is freed: ``after`` 0, which also forgets its latest decode-time state, leaving its
        entry cached)."""
        planned = self._planned.get(request_id)
        if planned is not None and planned[2] > after:
            del self._planned[request_id]
            self.cache.release(planned[1])
        kept = []
        for slot, boundary, decode in self._unkeyed.pop(request_id, ()):
            if boundary > after:
                self.cache.release(slot)
            else:
                kept.append((slot, boundary, decode))
        if kept:
            self._unkeyed[request_id] = kept
        if not after:
            self._latest.pop(request_id, None)
