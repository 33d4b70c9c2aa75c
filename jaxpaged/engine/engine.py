"""`Engine`: requests in, `RequestOutput`s out, one scheduled model step at a time.

``step()`` = schedule (scheduler + KV cache manager) -> execute (model runner) -> for each
sampled token: fork parallel-sampling requests after their prompt, append, detokenize, check
stop rules, free the pages of finished sequences (output processor). Callers drive it
themselves (``add_request`` / ``step`` / ``abort_request``) or through :class:`jaxpaged.LLM`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.config import ModelConfig
from jaxpaged.distributed.multihost import check_same_everywhere
from jaxpaged.distributed.multihost import initialize as initialize_multihost
from jaxpaged.distributed.step_sync import install_signal_handlers, stop_requested_anywhere
from jaxpaged.distributed.tensor_parallel import TensorParallel, request_host_devices
from jaxpaged.engine.arg_utils import EngineArgs
from jaxpaged.engine.input_processor import InputProcessor, Prompt
from jaxpaged.engine.kv_cache_manager import KVCacheManager
from jaxpaged.engine.kv_scales import calibrate_kv_scales, calibration_token_ids, set_kv_scales
from jaxpaged.engine.kv_sizing import check_pool_fits, num_kv_pages
from jaxpaged.engine.output_processor import OutputProcessor, RequestGroup, SequenceState
from jaxpaged.engine.request import Request
from jaxpaged.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from jaxpaged.layers.attention import (allocate_kv_pool, get_attention_backend,
                                       kv_bytes_per_page, resolve_kv_cache_dtype)
from jaxpaged.layers.attention.tensor_parallel import TensorParallelAttention
from jaxpaged.metrics.stats import (FinishedRequestStats, IterationStats, SchedulerStats,
                                    StatLogger)
from jaxpaged.models.loader import load_model
from jaxpaged.outputs import RequestOutput
from jaxpaged.runner.model_runner import ModelRunner, RunnerLimits
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

#: Separates a request id from a parallel-sampling sequence index in internal sequence ids.
_SEQ_SEP = "\x1f"


@dataclass
class EngineStats:
    """Counters since start-up (vLLM's metric names where they exist).

    Attributes:
        num_preemptions: sequences preempted (``vllm:num_preemptions``).
        num_compilations: model-step shapes compiled (a rise while serving = a recompile).
        prefix_cache_queries, prefix_cache_hits: prompt tokens looked up / found in the prefix
            cache (``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits``).
        num_running, num_waiting: sequences now running / waiting.
        num_free_pages, num_pages: free and total KV pages (null page excluded).
    """

    num_preemptions: int
    num_compilations: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_running: int
    num_waiting: int
    num_free_pages: int
    num_pages: int


class Engine:
    """The inference engine for one model.

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
        kv_bytes_per_page: bytes one KV page takes on one device, all layers, K and V, in
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

    def __init__(self, args: EngineArgs, devices: list | None = None,
                 seed_rng: np.random.Generator | None = None):
        self.args = args
        # Both before anything starts JAX's backends:
        request_host_devices(
            args.tensor_parallel_size * args.data_parallel_size // args.num_processes)
        initialize_multihost(args.coordinator_address, args.num_processes, args.process_id)
        if args.num_processes > 1:
            install_signal_handlers()   # SIGINT / SIGTERM to any process stop the whole job
        check_same_everywhere("engine settings", {
            k: v for k, v in dataclasses.asdict(args).items() if k != "process_id"})
        if args.compilation_cache_dir:
            _enable_compilation_cache(args.compilation_cache_dir)
        self.model_config = cfg = ModelConfig.from_pretrained(args.model).with_quantization(
            args.quantization)
        self.tokenizer = load_tokenizer(args.tokenizer or args.model, args.trust_remote_code)
        self.dtype = _resolve_dtype(args.dtype, cfg.checkpoint_dtype)
        self.max_model_len = args.max_model_len or cfg.max_position_embeddings
        if self.max_model_len > cfg.max_position_embeddings:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's "
                             f"max_position_embeddings={cfg.max_position_embeddings}")
        generation_config = _generation_config(args.model)
        #: generation_config.json's default sampling fields, by SamplingParams name.
        self.generation_defaults = _generation_defaults(generation_config)
        self.input_processor = InputProcessor(self.tokenizer, cfg.vocab_size,
                                              self.max_model_len, args.max_num_seqs)
        self.output_processor = OutputProcessor(
            self.tokenizer, _eos_token_ids(cfg, generation_config, self.tokenizer),
            self.max_model_len)

        tp = TensorParallel.create(args.tensor_parallel_size, cfg, devices)
        kv_heads = tp.physical_config(cfg).num_kv_heads
        #: The KV pool's element type (the model's dtype, or float8_e4m3fn for fp8).
        self.kv_cache_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, self.dtype)
        backend = get_attention_backend(
            args.attention_backend, num_kv_heads=cfg.num_kv_heads, num_heads=cfg.num_heads,
            head_dim=cfg.head_dim, page_size=args.block_size, dtype=self.dtype,
            kv_cache_dtype=self.kv_cache_dtype)
        if tp.size > 1:
            backend = TensorParallelAttention(backend, tp.mesh)
        model = load_model(args.model, cfg, dtype=self.dtype, backend=backend,
                           load_format=args.load_format, seed=args.seed, tp=tp)
        page_size = args.block_size
        pages_per_seq = -(-self.max_model_len // page_size)
        limits = RunnerLimits(args.max_num_batched_tokens, args.max_num_seqs, pages_per_seq)
        pool = lambda n, dtype=self.kv_cache_dtype: allocate_kv_pool(
            cfg.num_layers, n, page_size, kv_heads, cfg.head_dim, dtype, tp.kv_pool_sharding)
        #: Each layer's ``(k_scale, v_scale)`` (``jaxpaged.engine.kv_scales``).
        self.kv_scales = [(1.0, 1.0)] * cfg.num_layers
        if args.calculate_kv_scales:     # on an unquantized pool; before the runners split it
            calibration = ModelRunner(model, pool(2, self.dtype), backend, page_size, limits,
                                      frozenset(), tp.replicated)
            self.kv_scales = calibrate_kv_scales(calibration, calibration_token_ids(
                self.tokenizer, cfg.max_position_embeddings, cfg.vocab_size))
            set_kv_scales(model, self.kv_scales)
            logger.info("calibrated fp8 KV scales: k_scale %s; v_scale %s",
                        " ".join(f"{k:.3g}" for k, _ in self.kv_scales),
                        " ".join(f"{v:.3g}" for _, v in self.kv_scales))
        # Budgets are per device: each holds kv_heads / tp heads of every page.
        bytes_per_page = kv_bytes_per_page(cfg.num_layers, page_size, kv_heads // tp.size,
                                           cfg.head_dim, self.kv_cache_dtype)
        num_pages = num_kv_pages(
            bytes_per_page=bytes_per_page, pages_per_seq=pages_per_seq,
            max_num_seqs=args.max_num_seqs, num_gpu_blocks_override=args.num_gpu_blocks_override,
            kv_cache_memory_bytes=args.kv_cache_memory_bytes,
            gpu_memory_utilization=args.gpu_memory_utilization,
            profile_peak_bytes=lambda: ModelRunner(model, pool(2), backend, page_size, limits,
                                                   frozenset(), tp.replicated).profile_peak_bytes(),
            num_devices=tp.size * args.data_parallel_size, device=tp.mesh.devices.flat[0])
        check_pool_fits(num_pages, bytes_per_page, tp.size * args.data_parallel_size)
        self.kv_bytes_per_page = bytes_per_page
        self.kv_cache_manager = KVCacheManager(num_pages, page_size, args.enable_prefix_caching)
        if self.kv_cache_manager.num_usable_pages < pages_per_seq:
            raise ValueError(
                f"the KV pool ({self.kv_cache_manager.num_usable_pages} usable pages of "
                f"{page_size} tokens) cannot hold one request of max_model_len="
                f"{self.max_model_len} tokens; give more KV memory or lower max_model_len")
        logger.info("KV cache: %d pages of %d tokens in %s, %d bytes per page (%.1f MiB in "
                    "all); maximum concurrency for %d-token requests: %.2fx", num_pages,
                    page_size, self.kv_cache_dtype.name, bytes_per_page,
                    num_pages * bytes_per_page / 2**20, self.max_model_len,
                    (num_pages - 1) / pages_per_seq)
        self.scheduler = Scheduler(SchedulerConfig(
            args.max_num_seqs, args.max_num_batched_tokens, self.max_model_len,
            args.max_num_partial_prefills, args.long_prefill_token_threshold,
            args.scheduling_policy), self.kv_cache_manager)
        self.runner = ModelRunner(model, pool(num_pages), backend, page_size, limits,
                                  self.output_processor.eos_token_ids, tp.replicated)
        if not args.enforce_eager:
            seconds = self.runner.precompile(should_stop=stop_requested_anywhere)
            logger.info("precompiled %d step shapes in %.1f s", self.runner.num_compilations,
                        seconds)
        self._groups: dict[str, RequestGroup] = {}
        self._seqs: dict[str, SequenceState] = {}
        self.stat_loggers: list[StatLogger] = []
        self._iteration = IterationStats()
        self._reported = (0, 0, 0)   # prefix-cache queries, hits, preemptions already reported
        self._arrivals = 0
        self._num_steps = 0
        self.fault_injector: Callable[[int, list[str]], None] | None = None
        self._seed_rng = seed_rng or np.random.default_rng(args.seed)
        logger.info("model %s (%s, %d layers), dtype %s, quantization %s (weights %.1f MiB), "
                    "max_model_len %d, attention %s, tensor parallel %d", args.model,
                    cfg.architecture, cfg.num_layers, jnp.dtype(self.dtype).name,
                    cfg.quantization, self.runner.weight_bytes / 2**20, self.max_model_len,
                    backend.name, tp.size)

    # ---- requests -------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None,
                    priority: int = 0) -> None:
        """Queue a request; it runs from the next :meth:`step`.

        Args:
            request_id: unique among unfinished requests.
            prompt: text, a list of token ids, or ``{"prompt_token_ids": [...]}`` /
                ``{"prompt": "..."}`` (vLLM's TokensPrompt / TextPrompt), optionally with a
                ``"cache_salt"`` that isolates its prefix-cache entries.
            params: sampling parameters (default ``SamplingParams()``).
            priority: lower runs first under ``--scheduling-policy priority``.

        Raises:
            ValueError: duplicate id, empty or untokenizable prompt, token ids outside the
                vocabulary, a prompt longer than ``max_model_len``, or bad ``params`` fields.
                Nothing is queued then.
            TypeError: a prompt, id, params or priority of the wrong type.
        """
        params = self.input_processor.check_params(params)
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a string, got {type(request_id).__name__}")
        if request_id in self._groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise TypeError(f"priority must be an integer, got {priority!r}")
        cache_salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        text, ids = self.input_processor.tokenize(prompt)
        seed = params.seed if params.seed is not None else int(self._seed_rng.integers(2**62))
        max_tokens = self.max_model_len - len(ids)
        if params.max_tokens is not None:
            max_tokens = min(max_tokens, params.max_tokens)
        req = Request(request_id, text, ids, params, seed=seed, max_tokens=max(max_tokens, 1),
                      arrival=self._arrivals, priority=priority, cache_salt=cache_salt,
                      n_samples=params.n, bad_words_ids=self.input_processor.bad_words_ids(params))
        self._arrivals += 1
        group = RequestGroup(request_id, [self.output_processor.new_sequence(req)],
                             arrival_time=time.monotonic())
        self._groups[request_id] = group
        self._seqs[request_id] = group.seqs[0]
        self.scheduler.add_request(req)

    def abort_request(self, request_id: str | list[str]) -> None:
        """Stop requests now and free their pages; unknown ids are ignored."""
        aborted = False
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            group = self._groups.pop(rid, None)
            if group is None:
                continue
            for seq in group.seqs:
                self._seqs.pop(seq.request.request_id, None)
                if not seq.request.is_finished:
                    seq.request.finish_reason = "abort"
                    self.scheduler.finish_request(seq.request)
            self._iteration.finished_requests.append(
                _finished_stats(group, time.monotonic(), "abort"))
            aborted = True
        if aborted:
            self.record_stats()

    def has_unfinished_requests(self) -> bool:
        """True while any request is waiting or running."""
        return bool(self._groups)

    def get_num_waiting_seqs(self) -> int:
        """Sequences waiting to be scheduled (a request not yet forked counts its ``n``)."""
        return self.scheduler.num_waiting_seqs

    def get_num_unfinished_requests(self) -> int:
        return len(self._groups)

    # ---- the step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduling iteration and model step.

        If the model step raises an ``Exception`` (the runner: batch preparation,
        compilation, the device step, sampling), only the requests it ran fail: each gets a
        final output with finish reason ``"error"`` and :attr:`RequestOutput.error`, its
        pages are freed, and the pages the step was to fill leave the prefix cache. If the
        failure consumed the donated KV pool, the pool is reallocated, every running
        sequence is preempted (it recomputes) and the prefix cache is emptied. Other requests
        carry on. In a multi-host job the error is raised instead (the processes' engines
        must take the same steps).

        Returns:
            An output for every request that produced a token this step (cumulative text and
            ids; ``finished`` set on the last one), and the failed requests' final outputs.
        """
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            if self.scheduler.waiting and not self.scheduler.running:
                # Unreachable while add_request's checks hold; never spin silently.
                raise RuntimeError(f"no waiting request can be scheduled "
                                   f"({len(self.scheduler.waiting)} waiting, {self.stats()})")
            return []
        scheduled_at = time.monotonic()
        step_index, self._num_steps = self._num_steps, self._num_steps + 1
        try:
            if self.fault_injector is not None:
                self.fault_injector(step_index, list(dict.fromkeys(
                    s.request.group_id for s in sched.scheduled)))
            results = self.runner.execute(sched, self.kv_cache_manager)
        except Exception as e:
            if self.args.num_processes > 1:
                raise
            return self._fail_step(sched, e)
        touched: dict[str, RequestGroup] = {}
        for s, result in zip(sched.scheduled, results):
            req = s.request
            req.num_computed_tokens += s.num_new_tokens
            group = self._groups[req.group_id]
            if group.first_scheduled_time is None:
                group.first_scheduled_time = scheduled_at
            self._iteration.num_generation_tokens += len(result.token_ids)
            if result.prompt_logprobs is not None:
                self.output_processor.add_prompt_logprobs(group, s.start, result.prompt_logprobs)
            if not result.token_ids:
                continue
            seqs = [self._seqs[req.request_id]] + self._fork(req, len(result.token_ids) - 1)
            for j, seq in enumerate(seqs):
                lp = result.logprobs
                self.output_processor.append_token(
                    seq, result.token_ids[j], lp and lp[j], lp and result.ranks[j],
                    lp and result.top_ids[j], lp and result.top_logprobs[j])
                if seq.request.finish_reason is not None:
                    self.scheduler.finish_request(seq.request)
            touched[group.request_id] = group
        outputs, now = [], time.monotonic()
        for group in touched.values():
            self._note_tokens(group, now)
            out = self.output_processor.make_output(group)
            if out is not None:
                outputs.append(out)
            if group.finished:
                self._retire(group, now, group.seqs[0].request.finish_reason)
        self.record_stats()
        return outputs

    def _fail_step(self, sched: SchedulerOutput, error: Exception) -> list[RequestOutput]:
        """Fail every request that the step ``sched`` ran, after the step raised ``error``
        (see :meth:`step`); returns their final outputs."""
        kv = self.kv_cache_manager
        kv.take_pending_copies()        # copy-on-write copies into the failed requests' pages
        groups = {s.request.group_id: self._groups[s.request.group_id] for s in sched.scheduled}
        logger.error("a model step failed; failing the requests it ran: %s", list(groups),
                     exc_info=error)
        for s in sched.scheduled:       # the step did not (fully) write these pages
            kv.uncache_from(s.request.request_id, s.start)
        message = f"the model step running this request failed: {type(error).__name__}: {error}"
        outputs, now = [], time.monotonic()
        for group in groups.values():
            group.error = message
            for seq in group.seqs:
                if not seq.request.is_finished:
                    seq.request.finish_reason = "error"
                    self.scheduler.finish_request(seq.request)
            outputs.append(self.output_processor.make_output(group))
            self._retire(group, now, "error")
        if self.runner.kv_pool_lost:
            logger.error("the failed step consumed the KV pool: reallocating it; %d running "
                         "sequences recompute, the prefix cache is emptied",
                         len(self.scheduler.running))
            self.scheduler.preempt_all()
            kv.reset_prefix_cache()
            self.runner.reallocate_kv_pool()
        self.record_stats()
        return outputs

    def _retire(self, group: RequestGroup, now: float, reason: str) -> None:
        """Forget a finished request and record its statistics."""
        del self._groups[group.request_id]
        for seq in group.seqs:
            self._seqs.pop(seq.request.request_id, None)
        self._iteration.finished_requests.append(_finished_stats(group, now, reason))

    def _note_tokens(self, group: RequestGroup, now: float) -> None:
        """Time-to-first-token or inter-token latency of a request that got tokens now."""
        it = self._iteration
        if group.first_token_time is None:
            group.first_token_time = now
            it.time_to_first_tokens.append(now - group.arrival_time)
            it.num_prompt_tokens += group.seqs[0].request.num_prompt_tokens
        else:
            it.inter_token_latencies.append(now - group.last_token_time)
        group.last_token_time = now

    def record_stats(self) -> None:
        """Hand the scheduler snapshot and the events since the last call to the loggers
        (the engine calls it after every step and abort)."""
        kv, sched = self.kv_cache_manager, self.scheduler
        totals = (kv.stats.queries, kv.stats.hits, sched.num_preemptions)
        queries, hits, preemptions = (a - b for a, b in zip(totals, self._reported))
        self._reported = totals
        iteration, self._iteration = self._iteration, IterationStats()
        if not self.stat_loggers:
            return
        snapshot = SchedulerStats(
            num_running_reqs=len({r.group_id for r in sched.running}),
            num_waiting_reqs=len({r.group_id for r in sched.waiting}),
            kv_cache_usage=1.0 - kv.num_free_pages / kv.num_usable_pages,
            prefix_cache_queries=queries, prefix_cache_hits=hits, num_preemptions=preemptions)
        for stat_logger in self.stat_loggers:
            stat_logger.record(snapshot, iteration)

    def _fork(self, leader: Request, count: int) -> list[SequenceState]:
        """Split a parallel-sampling request after its prompt into ``count`` more sequences
        that share the leader's pages (copy-on-write for the partly filled last page)."""
        group = self._groups[leader.group_id]
        children, after = [], leader
        for j in range(1, count + 1):
            child = Request(f"{leader.group_id}{_SEQ_SEP}{j}", leader.prompt,
                            leader.prompt_token_ids, leader.params, seed=leader.seed + j,
                            max_tokens=leader.max_tokens, arrival=leader.arrival,
                            group_id=leader.group_id, index=j, priority=leader.priority,
                            cache_salt=leader.cache_salt, all_token_ids=list(leader.all_token_ids),
                            num_computed_tokens=leader.num_computed_tokens,
                            num_cached_tokens=leader.num_cached_tokens)
            self.kv_cache_manager.fork(leader.request_id, child.request_id)
            self.scheduler.add_running(child, after=after)
            seq = self.output_processor.new_sequence(child)
            group.seqs.append(seq)
            self._seqs[child.request_id] = seq
            children.append(seq)
            after = child
        leader.n_samples = 1
        return children

    # ---- stats ----------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        """The engine's counters and gauges now."""
        kv = self.kv_cache_manager
        return EngineStats(
            num_preemptions=self.scheduler.num_preemptions,
            num_compilations=self.runner.num_compilations,
            prefix_cache_queries=kv.stats.queries, prefix_cache_hits=kv.stats.hits,
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_free_pages=kv.num_free_pages, num_pages=kv.num_usable_pages)

    @property
    def num_preemptions(self) -> int:
        """Preemptions since start-up."""
        return self.scheduler.num_preemptions


def _finished_stats(group: RequestGroup, now: float, reason: str) -> FinishedRequestStats:
    scheduled = group.first_scheduled_time
    return FinishedRequestStats(
        finish_reason=reason, e2e_latency=now - group.arrival_time,
        queue_time=None if scheduled is None else scheduled - group.arrival_time,
        num_prompt_tokens=group.seqs[0].request.num_prompt_tokens,
        num_generation_tokens=sum(s.request.num_output_tokens for s in group.seqs))


def _enable_compilation_cache(path: str) -> None:
    """Persist compiled steps under ``path`` so later start-ups load instead of compiling."""
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def _resolve_dtype(name: str, checkpoint_dtype: str):
    if name == "auto":
        name = "float32" if checkpoint_dtype in ("float32", "float64") else "bfloat16"
    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[name]


def _generation_config(model_dir: str) -> dict:
    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from e


#: generation_config.json keys vLLM applies as default sampling parameters.
_GENERATION_DEFAULT_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                            "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                            "max_new_tokens": "max_tokens"}


def _generation_defaults(generation_config: dict) -> dict:
    return {ours: generation_config[theirs] for theirs, ours in _GENERATION_DEFAULT_KEYS.items()
            if generation_config.get(theirs) is not None}


def _eos_token_ids(cfg: ModelConfig, generation_config: dict, tokenizer) -> frozenset[int]:
    """EOS ids of the config, ``generation_config.json`` and the tokenizer, together."""
    ids = set(cfg.eos_token_ids)
    eos = generation_config.get("eos_token_id")
    ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(int(i) for i in ids)
