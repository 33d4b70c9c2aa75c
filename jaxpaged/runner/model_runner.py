"""`ModelRunner`: a `SchedulerOutput` -> padded device arrays -> one compiled forward + sample
-> a `ModelRunnerOutput` (vLLM V1's ``execute_model`` contract; the runner never calls the KV
cache manager: the page ids and page copies arrive in the ``SchedulerOutput``).

A step is two jitted programs (``jaxpaged.runner.step_programs``) dispatched back to back:
the forward takes the model's parameters, the donated KV pool, the step's inputs
(``jaxpaged.runner.input_batch``) and the previous step's sampled ids (for the tokens the host
does not know yet under async scheduling) and returns the sampling rows' logits (and prompt
logprobs when asked) and the updated pool; the sampler turns the logits into a
``SamplerOutput`` (the sampled tokens, with their log-probabilities when asked) and this
step's sampled ids. Arrays are padded to buckets (``jaxpaged.runner.buckets``) so the
programs compile a bounded number of times.

Each (T, B, P, decode-only) forward shape and each row bucket B of the sampler is compiled
ahead of time once and kept; logprobs, prompt logprobs and logit adjustments are inputs of
fixed shapes, not part of the shape. :meth:`ModelRunner.precompile` compiles every shape a
run can meet (:meth:`ModelRunner.step_shapes`), loading it instead when an earlier run left
it in the executable store or JAX's compilation cache, and
:attr:`ModelRunner.num_compilations` counts compilations so one during serving is visible.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import jax
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from jaxpaged.distributed.multihost import to_host
from jaxpaged.runner.kv_scales import KVScales, set_kv_scales
from jaxpaged.engine.scheduler_output import SchedulerOutput
from jaxpaged.layers import cpu_matmul
from jaxpaged.layers.attention import AttentionBackend, BatchLayout, KVPages, allocate_kv_pool
from jaxpaged.layers.layer_stack import distinct_leaves
from jaxpaged.lora.device import LoRASlotWriter, token_slots
from jaxpaged.runner.buckets import ShapeBuckets, padding_budget_tokens
from jaxpaged.runner.compile_cache import jax_cache_dir
from jaxpaged.runner.dummy_step import dummy_inputs, dummy_layout
from jaxpaged.runner.executable_store import ExecutableStore, fingerprint, model_digest
from jaxpaged.runner.host_memory import release_freed_memory
from jaxpaged.runner.input_batch import PreparedStep, StepInputs, attention_metadata, prepare_step
from jaxpaged.runner.output import ModelRunnerOutput
from jaxpaged.runner.pending_step import PendingStep, copy_indices
from jaxpaged.runner.step_programs import (build_programs, build_verify_program,
                                           forward_inputs, is_plain_greedy, sample_inputs)
from jaxpaged.runner.weight_update import RunnerWeights
from jaxpaged.sampling import cpu_argmax
from jaxpaged.sampling.sampler import SamplerOutput
from jaxpaged.structured_output.manager import all_allowed, num_words

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class RunnerLimits:
    """Largest shapes the runner pads to.

    Attributes:
        max_num_tokens: tokens per step (``max_num_batched_tokens``).
        max_num_seqs: sequences per step.
        max_pages_per_seq: pages of a ``max_model_len`` sequence.
        max_adjust_entries: logit-adjustment entries (and allowed tokens) per sampling row
            every step is compiled for (:func:`jaxpaged.sampling.logits_adjust.capacity`).
        vocab_size: logits per sampling row (V); the grammar bitmask input has
            ``ceil(V / 32)`` int32 words a row.
    """

    max_num_tokens: int
    max_num_seqs: int
    max_pages_per_seq: int
    vocab_size: int
    max_adjust_entries: int = 16


class ModelRunner(RunnerWeights):
    """Holds the model's parameters and the KV pool; executes scheduled steps (weight
    updates and sleep mode: ``jaxpaged.runner.weight_update``).

    Args:
        model: the loaded NNX model (split once into graph and state here).
        kv_caches: the preallocated pool, one ``(k_pages, v_pages)`` per layer.
        backend: the attention backend the model was built with.
        page_size: tokens per page.
        limits: the largest padded shapes.
        eos_token_ids: the model's EOS ids (masked before a request's ``min_tokens``); the
            engine sets :attr:`eos_token_ids` once its tokenizer is loaded (the runner is
            built and compiles while the tokenizer loads), before the first step.
        replicated: the sharding of every per-step input and output (the whole mesh); the
            parameters and the pool keep the shardings they arrived with. Where
            :func:`jaxpaged.layers.cpu_matmul.wanted` (one AVX-512 CPU device, the ``cpu``
            attention backend) the forward's few-row float32 projections run through its C++
            kernel.
        executable_dir: where compiled steps are kept whole across runs
            (``jaxpaged.runner.executable_store``; None: not kept).
        lora: the writer of the model's LoRA slots (``jaxpaged.lora.device``; None: LoRA
            off, and the step takes no slot index).
    """

    def __init__(self, model: nnx.Module, kv_caches: list[KVPages], backend: AttentionBackend,
                 *, page_size: int, limits: RunnerLimits,
                 eos_token_ids: frozenset[int] = frozenset(),
                 replicated: jax.sharding.Sharding, executable_dir: str | None = None,
                 lora: LoRASlotWriter | None = None):
        self._kv_caches = kv_caches
        self._lora = lora
        self._store = ExecutableStore(executable_dir)
        self._backend = backend
        self._page_size = page_size
        self._limits = limits
        self._replicated = replicated
        self._cpu_matmuls = cpu_matmul.wanted(backend.name, replicated.mesh.size)
        self._cpu_argmax = cpu_argmax.wanted(backend.name, replicated.mesh.size)
        self._num_params = sum(x.size for x in jax.tree.leaves(nnx.state(model)))
        self._set_buckets()
        self._executables: dict[tuple, object] = {}
        #: Step shapes (:func:`_shape_key`) whose forward and sampler are compiled, and
        #: those a background thread will compile (:meth:`defer_shapes`).
        self._ready_shapes: set[tuple] = set()
        self._deferred_shapes: frozenset[tuple] = frozenset()
        self._compile_lock = threading.RLock()
        self.eos_token_ids = eos_token_ids
        self._verify = None     # the speculative sampler (enable_spec_decode)
        self._verify_block_q = 0
        self._load(model)

    def _load(self, model: nnx.Module) -> None:
        """Split ``model`` into graph and state and build the jitted functions over them."""
        for _, node in nnx.iter_graph(model):    # (layer_stack: fewer step arguments)
            if hasattr(node, "stack_packed_weights"):
                node.stack_packed_weights()
        with self._compile_lock:        # (after a background compilation's current shape)
            graphdef, self._state = nnx.split(model)
            self._graphdef = graphdef
            self._executables.clear()
            self._ready_shapes.clear()
            num_rows = self._buckets.seq_buckets[-1]
            self._state_leaves, state_def, self._leaf_index = distinct_leaves(self._state)
            self._programs = build_programs(
                graphdef, [a.sharding for a in self._state_leaves],
                jax.tree.map(lambda a: a.sharding, self._kv_caches), self._replicated,
                self._cpu_matmuls, state_def, self._cpu_argmax, self._leaf_index)
            self._prev_tokens = jax.device_put(np.zeros(num_rows, np.int32), self._replicated)
            self._prev_rows: Callable[[], dict[str, int]] = dict
            self._free_bitmasks: dict[int, jax.Array] = {}

    def _set_buckets(self, verify_block_q: int = 0) -> None:
        limits = self._limits
        self._buckets = ShapeBuckets(
            max_num_tokens=limits.max_num_tokens, max_num_seqs=limits.max_num_seqs,
            max_pages_per_seq=limits.max_pages_per_seq,
            page_buckets_by_width=self._backend.name == "pallas",
            max_padding=padding_budget_tokens(self._num_params), verify_block_q=verify_block_q)
        self._token_buckets = self._buckets.token_buckets
        self._page_buckets = self._buckets.page_buckets
        self._pad_sizes = self._buckets.pad_sizes
        #: Every ``(T, B, P, decode_only)`` a step can be padded to
        #: (:meth:`ShapeBuckets.step_shapes`).
        self.step_shapes = self._buckets.step_shapes

    def enable_spec_decode(self, num_speculative_tokens: int) -> None:
        """From now on run steps whose sequences all decode, with up to
        ``num_speculative_tokens`` proposals each, as verification steps of their own
        shapes (``ShapeBuckets(verify_block_q=1 + k)``; precompile after this), sampled by
        the rejection sampler (``jaxpaged.spec_decode.rejection``), a row per token; every
        other step samples as without speculation."""
        self._verify = build_verify_program(self._replicated)
        self._verify_block_q = 1 + num_speculative_tokens
        self._set_buckets(self._verify_block_q)

    def set_kv_scales(self, scales: KVScales) -> None:
        """Give layer i's attention ``scales[i]`` (after a calibration,
        ``jaxpaged.runner.kv_scales``); compiled steps are dropped."""
        model = nnx.merge(self._graphdef, self._state)
        set_kv_scales(model, scales)
        self._load(model)

    def set_kv_pool(self, kv_caches: list[KVPages]) -> None:
        """Serve from ``kv_caches`` (same layout and shardings, any page count); compiled
        steps, which are specialized to the pool's shape, are dropped."""
        with self._compile_lock:
            self._kv_caches = kv_caches
            self._executables.clear()
            self._ready_shapes.clear()

    @property
    def backend(self) -> AttentionBackend:
        return self._backend

    @property
    def devices(self) -> list:
        """The devices the model and its pool live on, by id."""
        return sorted(self._replicated.device_set, key=lambda d: d.id)

    @property
    def weight_bytes(self) -> int:
        """Bytes of the model's parameters (each array counted once, however it is sharded):
        what ``--quantization`` shrinks."""
        return sum(x.nbytes for x in distinct_leaves(self._state)[0])     # (stacks: once)

    @property
    def num_compilations(self) -> int:
        """Executables compiled (or loaded) so far, forward shapes and sampler row buckets
        together (a rise while serving means a recompilation)."""
        return len(self._executables)

    @property
    def num_fresh_compilations(self) -> int:
        """Of :attr:`num_compilations`, those XLA compiled afresh (the rest were loaded from
        the compile cache or the executable store)."""
        return self._store.num_fresh

    @property
    def kv_pool_lost(self) -> bool:
        """True when the KV pool's arrays are gone: a step that failed after the pool was
        donated to it (its contents cannot be recovered)."""
        return any(a.is_deleted() for pair in self._kv_caches for a in pair)

    def reallocate_kv_pool(self) -> None:
        """Replace the pool with a zero-filled one of the same layout (after
        :attr:`kv_pool_lost`); every page's contents are then gone."""
        self._kv_caches = [allocate_kv_pool(1, *k.shape, k.dtype, k.sharding)[0]
                           for k, _ in self._kv_caches]

    # ---- execution ---------------------------------------------------------------------------

    def copy_pages(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole pages (source -> destination) in every layer, in place (copy-on-write)."""
        if not copies:
            return
        self._kv_caches = self._programs.copy_pages(self._kv_caches, *copy_indices(copies))

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step: the step's page copies, then the forward pass and sampling.

        Args:
            scheduler_output: the step (at least one sequence); its page tables and copies
                are all the runner needs from the KV cache manager's decisions.

        Returns:
            Per scheduled sequence, in batch order, its sampled tokens (and logprobs).

        Raises:
            ValueError: a step beyond the largest bucket; whatever compiling or running it
                raises.
        """
        return self.dispatch(scheduler_output).result()

    def dispatch(self, scheduler_output: SchedulerOutput) -> PendingStep:
        """Start the step of :meth:`execute` on the device and return at once (JAX
        dispatches asynchronously); :meth:`PendingStep.result` waits for it.

        A sequence may decode a token whose id the host does not know yet: the one the step
        dispatched just before samples for it (async scheduling, see
        ``Scheduler.schedule``); the step reads it from that step's device output, so the
        two steps run back to back without the host in between.
        """
        self.copy_pages(scheduler_output.page_copies)
        for slot, adapter in scheduler_output.lora_loads:
            self.write_lora_slot(slot, adapter)
        prepared = self._prepare(scheduler_output)
        out, pooled, accepted = self._launch(prepared.layout, prepared.inputs,
                                             prepared.draft_ids, scheduler_output)
        scheduled, starts = scheduler_output.scheduled, prepared.row_starts
        self._prev_rows = lambda: {s.request.request_id: starts[i]
                                   for i, s in enumerate(scheduled) if s.samples}
        return PendingStep(scheduler_output, prepared, out, pooled, accepted)

    def _prepare(self, scheduler_output: SchedulerOutput) -> PreparedStep:
        """The step's padded host inputs (``jaxpaged.runner.input_batch.prepare_step``)."""
        return prepare_step(scheduler_output, page_size=self._page_size,
                            backend=self._backend, eos_token_ids=self.eos_token_ids,
                            pad_sizes=self.ready_pad_sizes, prev_rows=self._prev_rows,
                            bitmask_words=num_words(self._limits.vocab_size),
                            free_bitmask=self._free_bitmask,
                            adjust_capacity=self._limits.max_adjust_entries,
                            verify_block_q=self._verify_block_q)

    def _launch(self, layout: BatchLayout, inputs: StepInputs, draft_ids=None,
                scheduler_output: SchedulerOutput | None = None) -> tuple:
        """Dispatch the forward and the sampler over ``inputs`` (the pool updated in
        place; with LoRA, each token's adapter slot from ``scheduler_output``); returns
        (SamplerOutput with prompt logprobs, pooled rows, the verifier's accepted [B] bool
        or None), all device arrays possibly not ready yet."""
        forward, _ = self._executables_for(layout, inputs, sampler=False)
        logits, prompt, pooled, greedy, greedy_prev, self._kv_caches = forward(
            self._state_leaves, self._kv_caches, self._forward_inputs(inputs, scheduler_output),
            self._prev_tokens)
        accepted = None
        if layout.verify_block_q:
            out, accepted = self._sampler_for(logits, inputs, verify=True)(
                logits, sample_inputs(inputs), draft_ids)
        elif is_plain_greedy(inputs, self._free_bitmasks.get(logits.shape[0])):
            out, self._prev_tokens = SamplerOutput(greedy), greedy_prev
        else:       # (the sampler compiled by the first step that samples, if not before)
            out, self._prev_tokens = self._sampler_for(logits, inputs)(
                logits, sample_inputs(inputs), self._prev_tokens)
        return dataclasses.replace(out, prompt_logprobs=prompt), pooled, accepted

    def _forward_inputs(self, inputs: StepInputs,
                        scheduler_output: SchedulerOutput | None = None) -> dict:
        """The forward program's inputs; with LoRA, each token's adapter slot too (zeros
        for a dummy step)."""
        fwd = forward_inputs(inputs)
        if self._lora is not None:
            num_padded = inputs.input_ids.shape[0]
            fwd["lora_slots"] = (np.zeros(num_padded, np.int32) if scheduler_output is None
                                 else token_slots(scheduler_output.scheduled,
                                                  scheduler_output.lora_slots, num_padded))
        return fwd

    def write_lora_slot(self, slot: int, adapter) -> None:
        """Write ``adapter`` (a ``jaxpaged.lora.peft.LoRAAdapter``; None: zeros) into LoRA
        slot ``slot`` of every target, in place, with the one precompiled write program."""
        lora = self._lora
        new = lora.host_weights(self._state, adapter)
        arrays = lora.arrays(self._state)
        write = self._compiled(("lora_write",), lora.program(self._state), arrays,
                               np.int32(slot), new)
        lora.set_arrays(self._state, write(arrays, np.int32(slot), new))
        self._state_leaves, _, index = distinct_leaves(self._state)
        if index != self._leaf_index:            # (the compiled programs index the list)
            raise RuntimeError("a LoRA write changed which state arrays are shared")

    def _executables_for(self, layout: BatchLayout, inputs: StepInputs, forward: bool = True,
                         sampler: bool = True) -> tuple:
        """The compiled forward and sample programs for ``inputs``' shapes (compiled now,
        or loaded from the executable store, if new); None for a program not asked for."""
        fn = None
        if forward:
            fn = self._compiled(
                ("forward", *_shape_key(layout)), self._programs.forward, self._state_leaves,
                self._kv_caches, self._forward_inputs(inputs), self._prev_tokens)
            self._ready_shapes.add(_shape_key(layout))
        # (the forward's logits [B, V] float32, known without asking it: out_info costs ~1 ms)
        logits = jax.ShapeDtypeStruct((inputs.logits_indices.shape[0], self._limits.vocab_size),
                                      np.float32)
        return fn, (self._sampler_for(logits, inputs, verify=bool(layout.verify_block_q))
                    if sampler else None)

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

    def _free_bitmask(self, rows: int) -> jax.Array:
        """The all-allowed grammar bitmask of ``rows`` rows, on the device (made once per row
        bucket: a step without structured outputs copies no mask to the device)."""
        mask = self._free_bitmasks.get(rows)
        if mask is None:
            mask = self._free_bitmasks[rows] = jax.device_put(
                all_allowed(rows, num_words(self._limits.vocab_size)), self._replicated)
        return mask

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

    def run_prefill(self, token_ids: list[int]) -> tuple[np.ndarray, list[KVPages]]:
        """One whole-prompt prefill on a scratch pool, outside the serving path.

        The scratch pool is shaped like the serving pool (dtype, page size, heads, sharding)
        but holds only the prompt, in pages 1..n (page 0 stays the null page); the serving
        pool, the compiled steps and the KV cache manager are not touched. It shows what a
        prompt's K/V look like in this runner's cache (KV-scale calibration,
        ``jaxpaged.runner.kv_scales``) and what logits this configuration gives (accuracy
        measurements against reference logits).

        Args:
            token_ids: the prompt (compiled for its exact length, not a bucket; no step
                limit applies).

        Returns:
            ([T, vocab_size] float32 logits at every position, the scratch pool: one
            ``(k_pages, v_pages)`` of [n + 1, page_size, KVH, head_dim] per layer).

        Raises:
            ValueError: an empty prompt.
        """
        t = len(token_ids)
        if not t:
            raise ValueError("run_prefill needs at least one token")
        page_size = self._page_size
        num_pages = -(-t // page_size)
        k_pages = self._kv_caches[0][0]
        pool = allocate_kv_pool(len(self._kv_caches), num_pages + 1, page_size,
                                *k_pages.shape[2:], k_pages.dtype, k_pages.sharding)
        positions = np.arange(t, dtype=np.int32)
        pages = np.arange(1, num_pages + 1, dtype=np.int32)
        layout = BatchLayout(
            query_start_loc=np.array([0, t], np.int32), seq_lens=np.array([t], np.int32),
            positions=positions, slot_mapping=pages[positions // page_size] * page_size
            + positions % page_size, page_table=pages[None], num_seqs=1, num_tokens=t)
        logits, pool = self._programs.prefill(self._state_leaves, pool, np.asarray(token_ids, np.int32),
                                     positions, attention_metadata(self._backend, layout))
        return to_host(logits), pool

    # ---- shapes ------------------------------------------------------------------------------

    def _dummy_inputs(self, layout: BatchLayout) -> StepInputs:
        return dummy_inputs(layout, self._backend, self._limits.max_adjust_entries,
                            self._limits.vocab_size)

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
        as one after the other (measured again with jaxlib 0.12.0.1: 8.5 CPU seconds either
        way, no overlap), so threads would only add contention. ``progress``: show a tqdm
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
