"""`Engine`: requests in, `RequestOutput`s out, one scheduled model step at a time.

``step()`` is vLLM V1's three calls (``vllm/v1/engine/core.py``):
``scheduler.schedule()`` (which sequences run, their tokens, pages and page copies) ->
``runner.dispatch(scheduler_output).result()`` (the device step) ->
``scheduler.update_from_output(scheduler_output, runner_output)`` (fork parallel-sampling
requests, append and detokenize tokens, stop rules, free finished sequences), then the
requests' outputs; with async scheduling the third call of step N-1 comes after step N's
dispatch. The device side is assembled once (``jaxpaged.engine.startup``,
``jaxpaged.runner.worker``). Callers drive it
themselves (``add_request`` / ``step`` / ``abort_request``) or through :class:`jaxpaged.LLM`.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable

import numpy as np

from jaxpaged.runner.device_memory import device_memory_used
from jaxpaged.arg_utils import EngineArgs
from jaxpaged.engine.gc_heap import CompileAwareHeapFreezer, collector_paused
from jaxpaged.core.generation_config import (eos_token_ids, generation_defaults,
                                               load_generation_config)
from jaxpaged.core.input_processor import InputProcessor, Prompt
from jaxpaged.core.output_processor import OutputProcessor
from jaxpaged.core.classifier_head import load_classifier_head
from jaxpaged.core.pooling import POOLING_SAMPLING, pooling_state
from jaxpaged.core.scheduler import Scheduler
from jaxpaged.engine.engine_step import EngineSteps, InFlightStep
from jaxpaged.engine.protocol import ModelInfo
from jaxpaged.core.hybrid_kv_cache_manager import kv_cache_manager_for
from jaxpaged.core.state_slots import with_state_slots
from jaxpaged.engine.rollout import Rollout
from jaxpaged.engine.sleep import Sleep
from jaxpaged.engine.startup import join_processes, load_and_compile
from jaxpaged.lora.config import LoRAConfig
from jaxpaged.lora.manager import LoRAManager
from jaxpaged.metrics.recorder import StatsRecorder
from jaxpaged.metrics.stats import EngineStats, StatLogger
from jaxpaged.outputs import RequestOutput
from jaxpaged.pooling_params import PoolingParams
from jaxpaged.sampling.logits_adjust import needs_adjustment
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


class Engine(EngineSteps, Rollout, Sleep):
    """The inference engine for one model (with the RL controls of
    ``jaxpaged.engine.rollout`` and ``jaxpaged.engine.sleep``).

    Args:
        args: the engine configuration.
        devices: the ``tensor_parallel_size`` devices this engine runs on (default: the
            first ones); a data-parallel replica gets its own
            (``jaxpaged.engine.data_parallel``).
        seed_rng: where seeds of requests without one come from (default: a generator
            seeded with ``args.seed``; data-parallel replicas share one).

    Attributes:
        stat_loggers: sinks called with :class:`SchedulerStats` and :class:`IterationStats`
            after every step and abort (``jaxpaged.metrics.loggers``); empty by default.
        fault_injector: a test hook, None in normal use: called before every model step as
            ``fault_injector(step_index, request_ids)`` (``step_index``: model steps run
            before this one, warm-up included; ``request_ids``: the user request ids the
            step runs, in batch order); whatever it raises is raised inside the step. An
            ``Exception`` fails the step's requests (:meth:`step`); a ``BaseException``
            escapes ``step`` (it kills an ``AsyncEngine``'s loop). ``docs/reliability.md``.
        kv_bytes_per_page: bytes one KV page takes on one device, all layers (with KV cache
            groups, ``jaxpaged.core.kv_groups``: a group's ``slots`` layers), K and V, in
            the KV cache dtype.

    Raises:
        FileNotFoundError / UnsupportedModelError / MissingWeightsError: bad model directory
            (or a checkpoint stored quantized by another method than ``args.quantization``).
        TensorParallelError: ``tensor_parallel_size`` does not fit the devices or the heads.
        MultiHostError: inconsistent multi-host flags, or processes of one job started
            with different settings.
        ValueError: inconsistent limits (e.g. a pool too small for one ``max_model_len``
            request, or ``max_model_len`` beyond the model's trained context).
    """

    @collector_paused       # (start-up makes little cyclic garbage: gc_heap)
    def __init__(self, args: EngineArgs, devices: list | None = None,
                 seed_rng: np.random.Generator | None = None,
                 background_compile: str | None = None):
        self.args = args
        join_processes(args)
        #: The pooler of a pooling engine (embed or classify); None: the engine generates.
        self.pooler = args.pooler
        #: The typed configs (``jaxpaged.engine_config``) the worker and scheduler take.
        self.config = config = args.create_engine_config()
        self.model_config = cfg = config.model_config
        self.max_model_len = config.max_model_len
        speculative_config = config.speculative_config
        loaded = load_and_compile(config, devices, background_compile)
        worker, self.tokenizer = loaded.worker, loaded.tokenizer
        #: A classify engine's classifier head (``jaxpaged.core.classifier_head``), else None.
        self.classifier_head = (
            load_classifier_head(args.model, cfg, self.tokenizer, args.load_format, args.seed)
            if self.pooler is not None and self.pooler.task == "classify" else None)
        self._background = loaded.background
        for job in self._background:        # (a collected engine's shapes are not needed)
            weakref.finalize(self, job.stop)
        #: The draft model's proposer (``method="draft_model"``), else None.
        self.drafter = loaded.drafter
        generation_config = load_generation_config(args.model)
        #: generation_config.json's default sampling fields, by SamplingParams name.
        self.generation_defaults = generation_defaults(generation_config)
        self.output_processor = OutputProcessor(
            self.tokenizer, eos_token_ids(cfg, generation_config, self.tokenizer),
            self.max_model_len)
        #: The served model as callers see it (``jaxpaged.engine.protocol``).
        self.model_info = ModelInfo(cfg, self.max_model_len, self.output_processor.eos_token_ids,
                                    self.generation_defaults)
        #: Compiles structured-output grammars off the engine thread (at the first request).
        self.structured_outputs = StructuredOutputManager(
            self.tokenizer, cfg.vocab_size, self.output_processor.eos_token_ids)
        self.input_processor = InputProcessor(self.tokenizer, cfg.vocab_size,
                                              self.max_model_len, args.max_num_seqs,
                                              self.structured_outputs, self.generation_defaults)
        self.runner = worker.runner
        self.runner.eos_token_ids = self.output_processor.eos_token_ids
        self.dtype = worker.dtype
        #: The KV pool's element type (the model's dtype, or float8_e4m3fn for fp8).
        self.kv_cache_dtype = worker.kv_cache_dtype
        #: Each layer's ``(k_scale, v_scale)`` (``jaxpaged.runner.kv_scales``).
        self.kv_scales = worker.kv_scales
        self.kv_bytes_per_page = worker.kv_bytes_per_page
        #: ``max_model_len`` requests the KV pool holds at once, as start-up logs it.
        self.kv_max_concurrency = worker.max_concurrency
        num_pages, page_size = worker.num_pages, worker.page_size
        recurrent = cfg.family.linear_attention is not None
        self.kv_cache_manager = kv_cache_manager_for(
            num_pages, page_size, args.enable_prefix_caching,
            cfg.sliding_windows, worker.kv_layout, speculative=speculative_config is not None)
        if recurrent:       # (jaxpaged.core.state_slots)
            self.input_processor.parallel_sampling = False
            self.kv_cache_manager = with_state_slots(self.kv_cache_manager, args.max_num_seqs,
                                                     args.enable_prefix_caching, cfg.architecture)
        lora_config = config.lora_config
        #: Multi-LoRA state (``jaxpaged.lora.manager``); None without ``enable_lora``.
        self.lora = lora_config and LoRAManager(lora_config, cfg)
        self.scheduler = Scheduler(
            config.scheduler_config, self.kv_cache_manager, self.output_processor, speculative_config,
            self.lora and self.lora.scheduling)
        self._stats = StatsRecorder()
        self.stat_loggers: list[StatLogger] = self._stats.loggers
        self._arrivals = 0
        self._num_steps = 0
        #: Async scheduling: the dispatched step whose results are not applied yet, and
        #: outputs made early (an abort) for the next step to return.
        self._in_flight: InFlightStep | None = None
        # A multi-host job's processes take their steps in lockstep: synchronously; so do
        # pipelines (a step's micro-batches would each need the previous step's tokens). A
        # speculating engine runs its verification steps synchronously (a step's proposals
        # come from the previous step's tokens; ``step``).
        self._async_scheduling = (args.async_scheduling and args.num_processes == 1
                                  and args.pipeline_parallel_size == 1)
        if args.async_scheduling and args.pipeline_parallel_size > 1:
            logger.info("async scheduling is off with pipeline parallelism: a step's "
                        "micro-batches need the previous step's tokens (docs/distributed.md)")
        # (The function, not a bound method: no reference cycle keeps a dropped engine alive.)
        self._step_impl = Engine._step_async if self._async_scheduling else Engine._step_sync
        self._early_outputs: list[RequestOutput] = []
        self.fault_injector: Callable[[int, list[str]], None] | None = None
        self._seed_rng = seed_rng or np.random.default_rng(args.seed)
        self._heap = CompileAwareHeapFreezer()    # start-up's objects out of the GC's reach
        self._heap.update(self.runner.num_compilations)
        self._init_rollout()

    # ---- requests -------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: Prompt,
                    params: SamplingParams | PoolingParams | None = None,
                    priority: int = 0, lora_request=None) -> None:
        """Queue a request; it runs from the next :meth:`step`.

        Args:
            request_id: unique among unfinished requests.
            prompt: text, a list of token ids, or ``{"prompt_token_ids": [...]}`` /
                ``{"prompt": "..."}`` (vLLM's TokensPrompt / TextPrompt), optionally with a
                ``"cache_salt"`` that isolates its prefix-cache entries.
            params: sampling parameters (default ``SamplingParams()``), or, on a pooling
                engine (``EngineArgs.runner``), ``PoolingParams`` (default too): the request
                then yields one ``PoolingRequestOutput`` (``jaxpaged.core.pooling``).
            priority: lower runs first under ``--scheduling-policy priority``.
            lora_request: a ``jaxpaged.lora.request.LoRARequest`` (None: the base model).

        Raises:
            ValueError: duplicate id, empty or untokenizable prompt, token ids outside the
                vocabulary, a prompt longer than ``max_model_len``, or bad ``params`` fields
                (an invalid structured-outputs schema, regex or grammar among them), an
                adapter that does not load or LoRA not enabled (``jaxpaged.lora.manager``).
                Nothing is queued then.
            TypeError: a prompt, id, params or priority of the wrong type.
        """
        pooling = pooling_state(params, self.pooler, self.classifier_head)
        params = self.input_processor.check_params(POOLING_SAMPLING if pooling else params)
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a string, got {type(request_id).__name__}")
        if request_id in self.output_processor.groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        LoRAManager.check_request(self.lora, lora_request)
        req = self.input_processor.make_request(request_id, prompt, params, priority=priority,
                                                arrival=self._arrivals, seed_rng=self._seed_rng)
        req.lora_request = lora_request
        # (A grammar's next mask needs the previous token on the host: no running ahead.)
        req.needs_output_tokens = needs_adjustment(params) or bool(params.structured_outputs)
        if pooling is not None:     # prefilled only; its result waits for the host
            req.pooling, req.needs_output_tokens = pooling, True
        self._arrivals += 1
        self.output_processor.add_request(req, time.monotonic())
        self._queue_request(req)        # (held while paused: jaxpaged.engine.rollout)

    def abort_request(self, request_id: str | list[str]) -> None:
        """Stop requests now and free their pages; unknown ids are ignored. No output of
        them follows (with async scheduling, not even one of a step that ran before the
        abort but whose output the next :meth:`step` would have returned)."""
        ids = [request_id] if isinstance(request_id, str) else request_id
        self._unhold(ids)
        step = self._in_flight
        if step is not None and not set(ids).isdisjoint(
                s.request.group_id for s in step.scheduler_output.scheduled):
            # Async scheduling: the step running it first (a request it finished is retired
            # as such); the other requests' outputs of it come with the next step.
            self._in_flight = None
            self._early_outputs += self._finish(step)
        if self._early_outputs:     # an aborted request gets no further output
            gone = set(ids)
            self._early_outputs = [o for o in self._early_outputs if o.request_id not in gone]
        aborted = False
        for rid in ids:
            group = self.output_processor.remove_request(rid)
            if group is None:
                continue
            for seq in group.seqs:
                if not seq.request.is_finished:
                    self.scheduler.finish_request(seq.request, "abort")
            self._stats.note_finished(group, time.monotonic(), "abort")
            aborted = True
        if aborted:
            self.record_stats()

    def add_lora(self, lora_request) -> bool:
        """Load an adapter before its requests (vLLM's ``LLMEngine.add_lora``)."""
        LoRAManager.check_request(self.lora, lora_request)
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget adapter ``lora_int_id`` (False if not loaded or LoRA is off)."""
        return self.lora is not None and self.lora.remove(lora_int_id, self.scheduler.running)

    def list_loras(self) -> set[int]:
        """Ids of the adapters loaded on the host."""
        return set() if self.lora is None else self.lora.list()

    @property
    def lora_config(self) -> LoRAConfig | None:
        """The LoRA limits (None without ``enable_lora``)."""
        return None if self.lora is None else self.lora.config

    def wait_until_compiled(self, timeout: float | None = None) -> bool:
        """Wait for the step programs compiling in the background
        (``jaxpaged.runner.background_compile``) to be ready, ``timeout`` seconds at most
        (None: no limit); whether they are. Steps never need this (one whose program is
        not ready compiles it or runs in a wider one); a benchmark calls it before timing."""
        deadline = None if timeout is None else time.monotonic() + timeout
        return all(job.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
                   for job in self._background)

    def start_background_compile(self) -> None:
        """Start the step compilations a server's engine holds back until its warm-up
        request is done (``jaxpaged.runner.background_compile``); no-op otherwise."""
        for job in self._background:
            job.start()

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting or running."""
        return bool(self.output_processor.groups or self._early_outputs)

    def get_num_waiting_seqs(self) -> int:
        """Sequences waiting to be scheduled (a request not yet forked counts its ``n``)."""
        return self.scheduler.num_waiting_seqs

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.groups)

    # ---- the step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduling iteration and model step.

        With ``async_scheduling`` (vLLM's ``--async-scheduling``) the step is scheduled and
        dispatched while the previous one still runs on the device (each running sequence
        assumed to get its token; ``Scheduler.schedule``), and the previous step's tokens
        are then applied and its outputs made while this one runs: outputs come one call
        later, and are those of the synchronous mode. A step after a parallel-sampling
        prompt waits for it (the fork needs its tokens); a step that runs a structured-output
        sequence is finished synchronously (its grammar's next mask needs the token), and so
        is a speculative verification step; before a step that is to speculate
        (``SpecDecodeScheduling.wants_speculation``) the step in flight is finished first,
        since proposals are made from the sequences' last tokens.

        If the model step raises an ``Exception`` (the runner: batch preparation,
        compilation, the device step, sampling), only the requests it ran fail (with async
        scheduling, also those of the step dispatched after it, which read its tokens):
        each gets a final output with finish reason ``"error"`` and
        :attr:`RequestOutput.error`, its pages are freed, and the pages the step was to
        fill leave the prefix cache. If the failure consumed the donated KV pool, the pool
        is reallocated, every running sequence is preempted (it recomputes) and the prefix
        cache is emptied. Other requests carry on. In a multi-host job the error is raised
        instead (the processes' engines must take the same steps).

        Returns:
            An output for every request that produced a token in the step whose results
            came in (this one; with async scheduling, the previous one): cumulative text and
            ids, ``finished`` set on the last one; and the failed requests' final outputs.
        """
        if (held := self._held_step()) is not None:    # paused, updating or asleep
            return held                                 # (jaxpaged.engine.rollout)
        return self._step_impl(self)    # _step_sync or _step_async, chosen in __init__

    def record_stats(self) -> None:
        """Hand the scheduler snapshot and the events since the last call to the loggers
        (the engine calls it after every step and abort)."""
        self._stats.record(self.scheduler, self.kv_cache_manager)

    # ---- stats ----------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        """The engine's counters and gauges now."""
        kv = self.kv_cache_manager
        return EngineStats(
            num_preemptions=self.scheduler.num_preemptions,
            num_compilations=self.runner.num_compilations + (
                self.drafter.num_compilations if self.drafter else 0),
            prefix_cache_queries=kv.stats.queries, prefix_cache_hits=kv.stats.hits,
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_free_pages=kv.num_free_pages, num_pages=kv.num_usable_pages)

    @property
    def num_preemptions(self) -> int:
        """Preemptions since start-up."""
        return self.scheduler.num_preemptions

    def device_memory_used(self) -> dict[str, int]:
        """Bytes in use on each of this engine's devices (``jaxpaged.runner.device_memory``)."""
        return device_memory_used(self.runner.devices)
