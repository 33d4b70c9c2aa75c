"""Sleep mode: give the device memory back between rollouts (vLLM's ``sleep`` / ``wake_up``).

``sleep(level=1)`` frees the KV pool and moves the weights to host memory; ``sleep(level=2)``
frees both (the weights are dropped). ``wake_up(tags)`` restores what the tags name:
``"weights"`` (from the host copy; after level 2 only from weights given meanwhile by
``update_weights``, else :class:`WeightsNotLoadedError`: never a rollout from stale or
random weights) and ``"kv_cache"`` (a zero-filled pool of the same layout). Running
sequences are preempted at sleep (their K/V is gone: they re-prefill after the wake), the
prefix cache is emptied, and no step runs until every tag is awake; requests added meanwhile
are held (``jaxpaged.engine.rollout``). Compiled steps are kept: arrays come back with the
same shapes, dtypes and shardings, so waking compiles no step program.

Mixed into :class:`jaxpaged.engine.engine.Engine` beside ``Rollout``.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

SLEEP_TAGS = ("weights", "kv_cache")


class WeightsNotLoadedError(RuntimeError):
    """``wake_up(["weights"])`` after a level-2 sleep before every weight was given again
    (``update_weights``); the message names the missing tensors."""


class Sleep:
    """``sleep`` / ``wake_up`` / ``is_sleeping`` for ``Engine`` (see the module doc)."""

    _asleep: frozenset = frozenset()
    _sleep_level = 0

    @property
    def is_sleeping(self) -> bool:
        """True from :meth:`sleep` until every tag is awake again."""
        return bool(self._asleep)

    def sleep(self, level: int = 1) -> None:
        """Free the KV pool, and the weights' device memory (level 1: copied to the host
        first; level 2: dropped).

        Raises:
            ValueError: ``level`` not 1 or 2.
            RuntimeError: already asleep, or a phased weight update is open.
            NotImplementedError: a draft model (speculative decoding) or pipeline stages.
        """
        if level not in (1, 2) or isinstance(level, bool):
            raise ValueError(f"level must be 1 or 2, got {level!r}")
        if self._asleep:
            raise RuntimeError("the engine is already asleep; call wake_up() first")
        if self._update_open:
            raise RuntimeError("a weight update is open; call finish_weight_update() first")
        if self.drafter is not None:
            raise NotImplementedError("sleep mode with a draft model is not supported yet")
        self._check_updatable()
        self._settle_in_flight()
        preempted = self.scheduler.reset_kv_cache()      # (their K/V goes with the pool)
        self.runner.free_device_memory(keep_weights=level == 1)
        self._sleep_level, self._asleep = level, frozenset(SLEEP_TAGS)
        logger.info("asleep (level %d): KV pool and weights freed; %d running sequences will "
                    "re-prefill", level, preempted)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what ``tags`` name (default: both ``"weights"`` and ``"kv_cache"``);
        steps run again once neither sleeps. Waking an awake engine does nothing.

        Raises:
            ValueError: an unknown tag.
            WeightsNotLoadedError: ``"weights"`` after a level-2 sleep while some weight was
                not given again (nothing is woken then).
        """
        tags = list(SLEEP_TAGS) if tags is None else list(tags)
        unknown = [t for t in tags if t not in SLEEP_TAGS]
        if unknown:
            raise ValueError(f"unknown wake_up tags {unknown}; choose from {list(SLEEP_TAGS)}")
        if "weights" in tags and "weights" in self._asleep:
            self._wake_weights()
        if "kv_cache" in tags and "kv_cache" in self._asleep:
            self.runner.reallocate_kv_pool()
        self._asleep = self._asleep - set(tags)
        if not self._asleep:
            self._sleep_level = 0
            self._release_held()

    def _wake_weights(self) -> None:
        if self._sleep_level == 1:          # the host copy, less what updates gave since
            self.runner.restore_weights()
            return
        missing = self.runner.deleted_weights()   # level 2: only what updates gave back
        if missing:
            raise WeightsNotLoadedError(
                "cannot wake the weights after a level-2 sleep: they were dropped and "
                f"these were not given again with update_weights: {missing[:20]}"
                + (f" and {len(missing) - 20} more" if len(missing) > 20 else ""))
