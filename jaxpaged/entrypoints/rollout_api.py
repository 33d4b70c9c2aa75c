"""The RL controls on :class:`jaxpaged.LLM` (vLLM's names), each the engine's own
(``jaxpaged.engine.rollout``, ``jaxpaged.engine.sleep``), which documents the behaviour."""

from __future__ import annotations


class RolloutAPI:
    """Mixed into ``LLM``: weight updates, pause/resume, sleep/wake on ``self.engine``.

    Raises:
        NotImplementedError: a data-parallel ``LLM`` (several engines), for every method.
    """

    def _rollout_engine(self):
        engine = self.engine
        if not hasattr(engine, "weight_version"):
            raise NotImplementedError("RL controls (weight updates, pause, sleep) need one "
                                      "engine; data parallelism is not supported yet")
        return engine

    @property
    def weight_version(self) -> int:
        """The version of the weights serving: 0 at start-up, +1 per update."""
        return self._rollout_engine().weight_version

    def update_weights(self, weights) -> int:
        """Replace the weights in place (``Engine.update_weights``); returns the version."""
        return self._rollout_engine().update_weights(weights)

    def start_weight_update(self) -> None:
        """Open a phased update (``Engine.start_weight_update``)."""
        self._rollout_engine().start_weight_update()

    def finish_weight_update(self) -> int:
        """Close a phased update; returns the new version (``Engine.finish_weight_update``)."""
        return self._rollout_engine().finish_weight_update()

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache; False while requests hold pages."""
        return self._rollout_engine().reset_prefix_cache()

    def pause_generation(self, mode: str = "abort") -> None:
        """Pause (``"abort"``, ``"wait"`` or ``"keep"``; ``Engine.pause_generation``)."""
        self._rollout_engine().pause_generation(mode)

    def resume_generation(self) -> None:
        """End a pause (``Engine.resume_generation``)."""
        self._rollout_engine().resume_generation()

    def is_paused(self) -> bool:
        """Whether generation is paused."""
        return self._rollout_engine().is_paused

    def sleep(self, level: int = 1) -> None:
        """Free the KV pool and the weights' device memory (``Engine.sleep``)."""
        self._rollout_engine().sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore ``"weights"`` and/or ``"kv_cache"`` (``Engine.wake_up``)."""
        self._rollout_engine().wake_up(tags)

    def is_sleeping(self) -> bool:
        """Whether the engine sleeps (a tag not woken yet)."""
        return self._rollout_engine().is_sleeping
