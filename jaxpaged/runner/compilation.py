"""How :class:`jaxpaged.runner.model_runner.ModelRunner` gets its compiled programs: one per
step shape (``_shape_key``) and per sampler row bucket, compiled on first use or ahead of time
(:meth:`RunnerCompilation.precompile`), loaded from the executable store or JAX's compilation
cache when an earlier run left them, and, while the start-up's background compilation is still
running, a wider compiled shape in place of one not ready yet (:meth:`ready_pad_sizes`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import jax
import numpy as np
from tqdm.auto import tqdm

from jaxpaged.layers.attention import BatchLayout
from jaxpaged.runner.compile_cache import jax_cache_dir
from jaxpaged.runner.dummy_step import dummy_inputs, dummy_layout
from jaxpaged.runner.executable_store import fingerprint, model_digest
from jaxpaged.runner.host_memory import release_freed_memory
from jaxpaged.runner.input_batch import StepInputs
from jaxpaged.runner.step_programs import sample_inputs

logger = logging.getLogger(__name__)


class RunnerCompilation:
    """The compiled-programs half of ``ModelRunner`` (a base class: the model state, KV pool,
    buckets, executable store and locks it reads are built by ``ModelRunner.__init__``)."""

    def _executables_for(self, layout: BatchLayout, inputs: StepInputs, forward: bool = True,
                         sampler: bool = True) -> tuple:
        """The compiled forward program(s) and sampler for ``inputs``' shapes (compiled now,
        or loaded from the executable store, if new; the runner's executor's,
        ``jaxpaged.runner.step_executor``); None for a program not asked for."""
        return self._executor.executables_for(layout, inputs, forward, sampler)

    def defer_shapes(self, shapes: list[tuple]) -> None:
        """Mark ``shapes`` (``(T, B, P, decode_only, ...)``) as compiling on a background
        thread: until one of them is compiled, a step of that shape runs in a wider compiled
        one (:meth:`ready_pad_sizes`); ``[]`` ends this (a background compilation that
        stopped: steps then compile their own shapes)."""
        self._deferred_shapes = frozenset(shapes)

    def ready_pad_sizes(self, num_tokens: int, num_seqs: int, num_rows: int, max_pages: int,
                        decode_only: bool, verify: bool = False) -> tuple[int, int, int]:
        """:meth:`ShapeBuckets.pad_sizes`; for a shape still waiting for the background
        compilation (:meth:`defer_shapes`), the smallest compiled shape of the same kind
        that holds the step (T, B and P each as large or larger), if any, so the step runs
        padded wider instead of waiting (``jaxpaged.runner.background_compile``).
        Verification steps keep their own shape."""
        sizes = self._pad_sizes(num_tokens, num_seqs, num_rows, max_pages, decode_only, verify)
        key = (*sizes, decode_only)
        if verify or key not in self._deferred_shapes:
            return sizes
        ready = tuple(self._ready_shapes)     # (another thread may add to the set)
        if key in ready:
            return sizes
        t, b, p = sizes
        covers = [s[:3] for s in ready if len(s) == 4 and s[3] == decode_only
                  and s[0] >= t and s[1] >= b and s[2] >= p]
        return min(covers) if covers else sizes

    def _sampler_for(self, logits, inputs: StepInputs, verify: bool = False):
        """The compiled sampler, or with ``verify`` the verifier (its third input: each
        row's proposal), for ``logits`` (the forward's logits' shape and dtype, [B, V]) and
        ``inputs``' adjustment capacity (compiled for a plain greedy step too, which does not
        call it: precompiling a shape readies its sampler)."""
        logits = jax.ShapeDtypeStruct(logits.shape, logits.dtype, sharding=self._replicated)
        return self._compiled(
            ("verify" if verify else "sample", logits.shape[0], inputs.adjust.ids.shape[1],
             inputs.adjust.allowed_ids.shape[1]),
            self._verify if verify else self._programs.sample,
            logits, sample_inputs(inputs),
            np.full(logits.shape[0], -1, np.int32) if verify else self._prev_tokens)

    def _compiled(self, key: tuple, program, *args, devices: list | None = None):
        """``program`` compiled for ``args`` (kept under ``key``) on ``devices`` (default:
        those of the per-step inputs). One compilation at a time (a step that needs a shape
        the start-up's background compilation has not reached waits for the lock, then
        compiles it)."""
        fn = self._executables.get(key)
        if fn is not None:
            return fn
        with self._compile_lock:
            return self._compiled_locked(key, program, *args, devices=devices)

    def _compiled_locked(self, key: tuple, program, *args, devices: list | None = None):
        fn = self._executables.get(key)
        if fn is None:
            t0 = time.perf_counter()
            devices = devices or list(self._replicated.mesh.devices.flat)
            name = fingerprint(self._model_digest(), self._kv_caches, args,
                               (key, self._page_size, repr(self._replicated),
                                [d.id for d in devices], self._cpu_matmuls,
                                self._cpu_argmax))
            fn = self._store.load(name, devices)
            if fn is None:
                fn = self._store.compile(name, lambda: program.lower(*args))
            self._executables[key] = fn
            logger.debug("%s ready in %.2fs", key, time.perf_counter() - t0)
        return fn

    def _model_digest(self) -> str:
        """:func:`model_digest` of the current graph and state (kept while they are the
        same objects)."""
        key = (id(self._graphdef), id(self._state))
        if getattr(self, "_digest", (None,))[0] != key:
            self._digest = (key, model_digest(self._graphdef, self._state))
        return self._digest[1]

    # ---- shapes ------------------------------------------------------------------------------

    @property
    def num_kv_groups(self) -> int:
        """KV cache groups the model's layers form (1: one page table for every layer)."""
        layout = getattr(self, "kv_layout", None)
        return 1 if layout is None else len(layout.groups)

    def _dummy_inputs(self, layout: BatchLayout) -> StepInputs:
        return dummy_inputs(layout, self._backend, self._limits.max_adjust_entries,
                            self._limits.vocab_size, self.num_kv_groups)

    def profile_peak_bytes(self) -> int | None:
        """Run the largest prefill step once on dummy data; the device's peak bytes in use
        afterwards (None if the device keeps no memory statistics)."""
        t_pad = self._token_buckets[-1]
        _, b_pad, _ = self._pad_sizes(t_pad, 1, 1, 1, False)
        layout = dummy_layout(t_pad, b_pad, self._page_buckets[-1], False)
        jax.block_until_ready(self._launch(layout, self._dummy_inputs(layout))[0])
        peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in self.devices
                 if d.process_index == jax.process_index()]
        return None if None in peaks or not peaks else max(peaks)

    def precompile(self, should_stop: Callable[[], bool] = lambda: False,
                   progress: bool | None = None, shapes: list[tuple] | None = None,
                   forwards: bool = True, samplers: bool = True) -> float:
        """Compile every step shape a run can meet (:meth:`step_shapes`: each one's forward,
        and the sampler of each row bucket once; logprobs, prompt logprobs and logit
        adjustments of up to ``max_adjust_entries`` entries a row run in the same
        executables), or only ``shapes``, unless ``should_stop`` turns true between two
        shapes (the rest then compile lazily); returns the seconds taken. ``forwards`` /
        ``samplers`` False: leave that half of each shape out (a plain greedy step never
        runs the sampler; a step that samples compiles its row bucket's when it first
        needs it).

        One shape at a time: on the 2-core CPU two compilations on two threads took as long
        as one after the other (``docs/measurements.md``, "Compilation"), so threads would
        only add contention. ``progress``: show a tqdm
        bar (None: only on a terminal). With the
        compilation cache (``jaxpaged.runner.compile_cache``) a shape compiled by an
        earlier run is loaded instead.
        """
        t0 = time.perf_counter()
        cache_dir, before = jax_cache_dir(), self.num_fresh_compilations
        if self._lora is not None:
            self.write_lora_slot(0, None)    # compiles the slot writer (slot 0 stays zeros)
        shapes = self.step_shapes() if shapes is None else shapes
        if progress is not False:   # (no bar object at all: tqdm() starts a monitor thread)
            shapes = tqdm(shapes, desc="Compiling model steps", unit="shape", leave=False,
                          disable=None if progress is None else not progress)
        for shape in shapes:
            if should_stop():
                break
            layout = dummy_layout(*shape)
            with self._compile_lock:    # (the arguments read under it too: a reload waits)
                self._executables_for(layout, self._dummy_inputs(layout), forwards, samplers)
        release_freed_memory()          # what XLA's compiler freed (jaxpaged.runner.host_memory)
        seconds = time.perf_counter() - t0
        fresh = self.num_fresh_compilations - before
        logger.info("precompiled %d executables in %.1f s (%d compiled, %d loaded from the "
                    "compile cache %s)", self.num_compilations, seconds, fresh,
                    self.num_compilations - fresh, cache_dir or "(off)")
        return seconds


def _shape_key(layout: BatchLayout) -> tuple:
    """What selects a step's forward executable: (T, B, P, decode_only), and the block size
    of a verification step."""
    key = (layout.positions.shape[0], layout.seq_lens.shape[0], layout.page_table.shape[1],
           layout.is_decode_only)
    return key + (layout.verify_block_q,) if layout.verify_block_q else key
