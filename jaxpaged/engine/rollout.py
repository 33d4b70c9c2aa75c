"""The engine's reinforcement-learning controls: weight updates in place, pause and resume.

vLLM's native RL API (RFC vllm#31848) names them: ``update_weights`` (one call, or the
phased ``start_weight_update`` / ``update_weights(chunk)``... / ``finish_weight_update``),
``reset_prefix_cache``, ``pause_generation(mode)`` / ``resume_generation``. :class:`Rollout`
is mixed into :class:`jaxpaged.engine.engine.Engine`; the step programs take the weights as
arguments, so an update of the same shapes, dtypes and shardings compiles nothing
(``jaxpaged.runner.weight_update``).

State:
- ``weight_version`` starts at 0 and rises by one per finished update; every
  ``RequestOutput`` carries the version whose model produced its tokens.
- After a weight change no K/V of the old policy is read again: the prefix cache is emptied
  and running sequences are preempted (they re-prefill their prompt and the tokens they
  generated under the new weights, as a preempted sequence recomputes).
- A paused engine (``keep``/``abort``, or ``wait`` once its started requests finished), an
  engine inside a phased update, and a sleeping one (``jaxpaged.engine.sleep``) take no
  model step; requests added meanwhile are held, in order, and queued at resume.
"""

from __future__ import annotations

import logging
import time

from jaxpaged.outputs import RequestOutput

logger = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "wait", "keep")


def tag_version(out, version: int) -> None:
    """Record on a ``RequestOutput`` the weight version that produced it (pooling outputs
    carry none)."""
    if isinstance(out, RequestOutput):
        out.weight_version = version


class GenerationPausedError(RuntimeError):
    """A blocking call needs model steps while generation is paused, a weight update is
    open, or the engine sleeps."""


class Rollout:
    """Weight updates and pause/resume, mixed into ``Engine`` (which calls
    :meth:`_init_rollout` and routes new requests through :meth:`_queue_request`)."""

    def _init_rollout(self) -> None:
        #: 0 at start-up, +1 for each finished weight update.
        self.weight_version = 0
        self._pause_mode: str | None = None
        self._held: list = []             # requests added while no step may admit them
        self._update_open = False
        self._update_seconds = 0.0

    # ---- pause and resume -----------------------------------------------------------------

    @property
    def is_paused(self) -> bool:
        """True between :meth:`pause_generation` and :meth:`resume_generation`."""
        return self._pause_mode is not None

    @property
    def _steps_held(self) -> bool:
        """No model step may run: paused in ``keep``/``abort`` mode, inside a phased weight
        update, or asleep."""
        return (self._update_open or bool(getattr(self, "_asleep", None))
                or self._pause_mode in ("keep", "abort"))

    @property
    def is_frozen(self) -> bool:
        """True while :meth:`step` has nothing to return or run: steps are held (see
        :meth:`pause_generation`; ``wait``: once no admitted request is left) and the
        outputs made before are taken. A loop driving the engine waits then."""
        if self._early_outputs:
            return False
        if self._pause_mode == "wait" and not self._steps_held:
            return not self.scheduler.has_unfinished_requests() and self._in_flight is None
        return self._steps_held

    def _held_step(self) -> list[RequestOutput] | None:
        """What :meth:`step` returns while steps are held (the outputs made before it, e.g.
        aborted requests' final ones), or None when a step may run."""
        if not self._steps_held:
            return None
        outputs, self._early_outputs = self._early_outputs, []
        return outputs

    def pause_generation(self, mode: str = "abort") -> list[RequestOutput]:
        """Stop admitting requests (new ones are held until :meth:`resume_generation`).

        Args:
            mode: ``"abort"``: every unfinished request ends now with finish reason
                ``"abort"`` (its final output comes from the next :meth:`step`, and is
                returned here too); ``"wait"``: started and queued requests run to their end,
                later ones wait; ``"keep"``: running requests freeze where they are and
                continue after the resume (re-prefilled first if the weights changed
                meanwhile).

        Returns:
            The final outputs of the requests aborted (``abort``), else ``[]``.

        Raises:
            ValueError: an unknown ``mode``.
        """
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {list(PAUSE_MODES)}, got {mode!r}")
        self._settle_in_flight()
        self._pause_mode = mode
        if mode != "abort":
            return []
        self._unhold(list(self.output_processor.groups))
        outputs, now = [], time.monotonic()
        for group in list(self.output_processor.groups.values()):
            if group.seqs[0].request.pooling is not None:
                continue
            for seq in group.seqs:
                if not seq.request.is_finished:
                    self.scheduler.finish_request(seq.request, "abort")
            out = self.output_processor.make_output(group)
            if out is not None:
                tag_version(out, self.weight_version)
                outputs.append(out)
            self._retire(group, now, "abort")
        self._early_outputs += outputs
        self.record_stats()
        return list(outputs)

    def resume_generation(self) -> None:
        """End a pause: held requests queue in arrival order and steps run again (no-op when
        not paused)."""
        self._pause_mode = None
        self._release_held()

    def _queue_request(self, req) -> None:
        """Queue a new request, or hold it while no step may admit it."""
        if self._pause_mode is not None or self._update_open or getattr(self, "_asleep", None):
            self._held.append(req)
        else:
            self.scheduler.add_request(req)

    def _release_held(self) -> None:
        if self._pause_mode is None and not self._update_open and not getattr(
                self, "_asleep", None):
            held, self._held = self._held, []
            for req in held:
                self.scheduler.add_request(req)

    def _unhold(self, group_ids) -> None:
        """Hand held requests of ``group_ids`` to the scheduler (to be aborted as queued)."""
        ids = set(group_ids)
        for req in [r for r in self._held if r.group_id in ids]:
            self._held.remove(req)
            self.scheduler.add_request(req)

    def _settle_in_flight(self) -> None:
        """Apply the step in flight (async scheduling) now: its outputs come with the next
        :meth:`step`; nothing runs on the device afterwards."""
        step, self._in_flight = self._in_flight, None
        if step is not None:
            self._early_outputs += self._finish(step)

    # ---- weights --------------------------------------------------------------------------

    def start_weight_update(self) -> None:
        """Open a phased update: no step runs (new requests are held) until
        :meth:`finish_weight_update`; each :meth:`update_weights` call then replaces the
        tensors it names at once.

        Raises:
            RuntimeError: an update is already open.
            NotImplementedError: pipeline parallelism (not supported yet).
        """
        if self._update_open:
            raise RuntimeError("a weight update is already open; call finish_weight_update()")
        self._check_updatable()
        self._settle_in_flight()
        self._update_open = True
        self._update_seconds = 0.0

    def update_weights(self, weights) -> int:
        """Replace the model's weights in place (vLLM's ``update_weights``).

        Args:
            weights: a mapping of Hugging Face tensor names (``model.layers.0.mlp.up_proj
                .weight``) to numpy or jax arrays in the checkpoint's layout, an NNX state
                with the model's own paths, or a directory of safetensors files; full or
                partial (tensors not named keep their values). Float arrays are cast to the
                parameters' dtype; an 8-bit model's projections are quantized from the float
                weights sent (``jaxpaged.runner.weight_update``).

        Returns:
            The weight version now serving (outside a phased update: the new one; inside
            one: the old one, until :meth:`finish_weight_update`).

        Raises:
            WeightUpdateError: unknown names, wrong shapes or dtypes (all named); nothing
                is replaced.
            TypeError: ``weights`` of an unsupported kind.
            NotImplementedError: pipeline parallelism; a packed GGUF model.
        """
        self._check_updatable()
        phased = self._update_open
        if not phased:
            self._settle_in_flight()
        t0 = time.perf_counter()
        plan = self.runner.update_weights(weights, self.model_config)
        self._update_seconds += time.perf_counter() - t0
        logger.info("weights replaced: %d tensors in %.3f s", len(plan.names),
                    time.perf_counter() - t0)
        if phased:
            return self.weight_version
        return self._weights_changed()

    def finish_weight_update(self) -> int:
        """Close a phased update: bump :attr:`weight_version`, invalidate the old policy's
        K/V (prefix cache, running sequences re-prefill) and let steps run; returns the new
        version.

        Raises:
            RuntimeError: no update is open.
        """
        if not self._update_open:
            raise RuntimeError("no weight update is open; call start_weight_update() first")
        self._update_open = False
        version = self._weights_changed()
        self._release_held()
        return version

    def _weights_changed(self) -> int:
        self.weight_version += 1
        if self.runner.kv_pool and not self.runner.kv_pool_lost:
            self.scheduler.reset_kv_cache()
        logger.info("weight version %d serving (update took %.3f s)", self.weight_version,
                    self._update_seconds)
        self._update_seconds = 0.0
        return self.weight_version

    def _check_updatable(self) -> None:
        self.runner.check_weights_updatable()
        if self.drafter is not None:
            logger.warning("weight update: the draft model keeps its weights")

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix page (vLLM's ``reset_prefix_cache``); False, and
        nothing changes, while a request holds pages (pause or finish it first)."""
        if self.kv_cache_manager.num_used_pages:
            return False
        self.kv_cache_manager.reset_prefix_cache()
        return True
