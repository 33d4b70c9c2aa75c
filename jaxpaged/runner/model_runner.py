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

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import jax
import numpy as np
from flax import nnx

from jaxpaged.runner.kv_scales import KVScales, set_kv_scales
from jaxpaged.core.scheduler_output import SchedulerOutput
from jaxpaged.distributed.pipeline_parallel import PipelineParallel
from jaxpaged.layers import cpu_matmul
from jaxpaged.layers.attention import AttentionBackend, BatchLayout, KVPages, allocate_kv_pool
from jaxpaged.layers.kv_group_layers import model_kv_layout
from jaxpaged.layers.layer_stack import distinct_leaves
from jaxpaged.layers.recurrent_pool import copy_state_rows, state_copy_indices
from jaxpaged.lora.device import LoRASlotWriter, token_slots
from jaxpaged.runner.buckets import ShapeBuckets, padding_budget_tokens
from jaxpaged.runner.compilation import RunnerCompilation
from jaxpaged.runner.scratch_prefill import ScratchPrefill
from jaxpaged.runner.executable_store import ExecutableStore
from jaxpaged.runner.input_batch import PreparedStep, StepInputs, prepare_step
from jaxpaged.core.runner_output import ModelRunnerOutput
from jaxpaged.runner.pending_step import PendingStep
from jaxpaged.runner.pipeline_runner import PipelineExecutor
from jaxpaged.runner.step_executor import SingleStageExecutor, StepExecutor
from jaxpaged.runner.step_programs import build_verify_program, forward_inputs
from jaxpaged.runner.weight_update import RunnerWeights
from jaxpaged.sampling import cpu_argmax
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


class ModelRunner(RunnerCompilation, ScratchPrefill, RunnerWeights):
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
        pipeline: run the model as these pipeline stages
            (``jaxpaged.runner.pipeline_runner.PipelineExecutor``; ``model``'s parameters
            and ``kv_caches`` already on their stages' devices, ``replicated`` replaced by
            the last stage's); None: as one program over ``replicated``'s mesh
            (``jaxpaged.runner.step_executor.SingleStageExecutor``).
    """

    def __init__(self, model: nnx.Module, kv_caches: list[KVPages], backend: AttentionBackend,
                 *, page_size: int, limits: RunnerLimits,
                 eos_token_ids: frozenset[int] = frozenset(),
                 replicated: jax.sharding.Sharding, executable_dir: str | None = None,
                 lora: LoRASlotWriter | None = None, pipeline: PipelineParallel | None = None):
        if pipeline is None:
            self._executor: StepExecutor = SingleStageExecutor(self)
        else:   # (the sampler runs on the last stage)
            self._executor = PipelineExecutor(self, pipeline, model, backend)
            replicated = pipeline.stages[-1].replicated
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
        """Split ``model`` into graph and state and build the programs over them (the
        executor's), with no compiled step and no previous step."""
        #: The pool's KV cache groups (``jaxpaged.core.kv_groups``; None: a pair per layer).
        self.kv_layout = model_kv_layout(model)
        with self._compile_lock:        # (after a background compilation's current shape)
            self._executor.load(model)
            self._executables.clear()
            self._ready_shapes.clear()
            self._prev_tokens = jax.device_put(
                np.zeros(self._buckets.seq_buckets[-1], np.int32), self._replicated)
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
        the rejection sampler (``jaxpaged.sampling.rejection``), a row per token; every
        other step samples as without speculation."""
        self._executor.refuse("enable_spec_decode")
        self._verify = build_verify_program(self._replicated)
        self._verify_block_q = 1 + num_speculative_tokens
        self._set_buckets(self._verify_block_q)

    def set_kv_scales(self, scales: KVScales) -> None:
        """Give layer i's attention ``scales[i]`` (after a calibration,
        ``jaxpaged.runner.kv_scales``); compiled steps are dropped."""
        self._executor.refuse("set_kv_scales")
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
        return self._executor.devices

    @property
    def pipeline(self) -> PipelineParallel | None:
        """The pipeline stages the model runs as (None: one stage)."""
        return self._executor.pipeline

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
        self._kv_caches = [  # (a recurrent layer's state pair: jaxpaged.layers.recurrent_pool)
            allocate_kv_pool(1, *k.shape, k.dtype, k.sharding)[0] if k.shape == v.shape else
            tuple(jax.numpy.zeros(a.shape, a.dtype, device=a.sharding) for a in (k, v))
            for k, v in self._kv_caches]

    # ---- execution ---------------------------------------------------------------------------

    def copy_pages(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole pages (source -> destination) in every layer, in place (copy-on-write)."""
        if copies:
            self._executor.copy_pages(copies)

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
        restores, saves = scheduler_output.state_copies
        self.copy_states(restores)
        pending = self._executor.dispatch(scheduler_output)
        self.copy_states(saves)
        return pending

    def copy_states(self, copies: list[tuple[int, int]]) -> None:
        """Copy recurrent state slots (source -> destination) in every recurrent layer, in
        place (prefix caching's restores and saves: ``jaxpaged.core.state_slots``)."""
        if copies:
            self._kv_caches = copy_state_rows(self._kv_caches, *state_copy_indices(copies))

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
        or None), all device arrays possibly not ready yet (the executor's)."""
        return self._executor.launch(layout, inputs, draft_ids, scheduler_output)

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

    def _free_bitmask(self, rows: int) -> jax.Array:
        """The all-allowed grammar bitmask of ``rows`` rows, on the device (made once per row
        bucket: a step without structured outputs copies no mask to the device)."""
        mask = self._free_bitmasks.get(rows)
        if mask is None:
            mask = self._free_bitmasks[rows] = jax.device_put(
                all_allowed(rows, num_words(self._limits.vocab_size)), self._replicated)
        return mask
