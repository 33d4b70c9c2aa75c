"""Data parallelism (``--data-parallel-size N``): N engine replicas in one process, each on its
own ``tensor_parallel_size`` devices with its own weights, KV pool and scheduler, sharing the
requests.

A new request goes to the replica with the fewest unfinished requests (the lowest index on a
tie); a step steps every replica that has work, concurrently, each on its own thread (JAX
releases the GIL while a device computes), and returns their outputs together. Per-request
seeds are drawn from one generator in arrival order, as a single engine draws them, so a
request's tokens do not depend on N or on its replica. Statistics are merged: gauges summed
(KV usage averaged over the equal pools), events passed on as they come.

This is vLLM's ``--data-parallel-size`` (``vllm/v1/engine/core_client.py``: one engine core per
rank behind a load-balancing client) within one process. On a CPU the replicas split the host
into ``N x tensor_parallel_size`` devices, so each core runs its own replica with no
collectives between them.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np

from jaxpaged.distributed.tensor_parallel import TensorParallelError, request_host_devices
from jaxpaged.arg_utils import EngineArgs
from jaxpaged.engine.engine import Engine
from jaxpaged.metrics.stats import EngineStats
from jaxpaged.core.input_processor import Prompt
from jaxpaged.metrics.stats import IterationStats, SchedulerStats, StatLogger
from jaxpaged.outputs import RequestOutput
from jaxpaged.sampling_params import SamplingParams


def make_engine(args: EngineArgs, background_compile: str | None = None
                ) -> Engine | DataParallelEngine:
    """An :class:`Engine`, or a :class:`DataParallelEngine` when
    ``args.data_parallel_size > 1`` (``background_compile``: see
    :func:`jaxpaged.engine.startup.load_and_compile`)."""
    if args.data_parallel_size > 1:
        return DataParallelEngine(args, background_compile)
    return Engine(args, background_compile=background_compile)


class DataParallelEngine:
    """``args.data_parallel_size`` :class:`Engine` replicas behind the engine's interface
    (``add_request``, ``abort_request``, ``step``, ``has_unfinished_requests``,
    ``wait_until_compiled``, ``start_background_compile``,
    ``get_num_waiting_seqs``, ``stats``, ``stat_loggers``, ``record_stats``,
    ``lora_config``; a test's ``fault_injector`` goes on each of ``replicas``).

    Args:
        args: the configuration of every replica.

    Raises:
        TensorParallelError: fewer than ``tensor_parallel_size x data_parallel_size``
            devices. Otherwise as :class:`Engine`.
    """

    def __init__(self, args: EngineArgs, background_compile: str | None = None):
        tp, dp = args.tensor_parallel_size, args.data_parallel_size
        self.args = args
        request_host_devices(tp * dp)       # before _devices starts JAX
        seeds = np.random.default_rng(args.seed)
        self.replicas: list[Engine] = []
        for i in range(dp):
            devices = _devices(i, tp, dp)
            self.replicas.append(Engine(args, devices, seed_rng=seeds,
                                        background_compile=background_compile))
        first = self.replicas[0]
        self.tokenizer = first.tokenizer
        self.model_config = first.model_config
        self.max_model_len = first.max_model_len
        self.generation_defaults = first.generation_defaults
        self.model_info = first.model_info
        self.lora_config = first.lora_config
        #: The loggers every replica's statistics reach, merged.
        self.stat_loggers: list[StatLogger] = []
        merger = _StatsMerger(self.stat_loggers, dp)
        for i, replica in enumerate(self.replicas):
            replica.stat_loggers.append(merger.for_replica(i))
        self._replica_of: dict[str, Engine] = {}
        self._pool = ThreadPoolExecutor(dp, thread_name_prefix="jaxpaged-dp")

    @property
    def fault_injector(self):
        """The replicas' test hook (``Engine.fault_injector``); setting it sets every one's."""
        return self.replicas[0].fault_injector

    @fault_injector.setter
    def fault_injector(self, injector) -> None:
        for replica in self.replicas:
            replica.fault_injector = injector

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None,
                    priority: int = 0, lora_request=None) -> None:
        """Queue a request on the least busy replica; as :meth:`Engine.add_request`."""
        if request_id in self._replica_of:
            raise ValueError(f"request_id {request_id!r} is already in use")
        replica = min(self.replicas, key=Engine.get_num_unfinished_requests)
        replica.add_request(request_id, prompt, params, priority, lora_request)
        self._replica_of[request_id] = replica

    def abort_request(self, request_id: str | list[str]) -> None:
        """Stop requests now and free their pages; unknown ids are ignored."""
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            replica = self._replica_of.pop(rid, None)
            if replica is not None:
                replica.abort_request(rid)

    def wait_until_compiled(self, timeout: float | None = None) -> bool:
        """:meth:`Engine.wait_until_compiled` of every replica (``timeout`` for each)."""
        return all([r.wait_until_compiled(timeout) for r in self.replicas])

    def start_background_compile(self) -> None:
        """:meth:`Engine.start_background_compile` of every replica."""
        for r in self.replicas:
            r.start_background_compile()

    def has_unfinished_requests(self) -> bool:
        """True while any replica has a request waiting or running."""
        return any(r.has_unfinished_requests() for r in self.replicas)

    def get_num_unfinished_requests(self) -> int:
        return sum(r.get_num_unfinished_requests() for r in self.replicas)

    def get_num_waiting_seqs(self) -> int:
        """Sequences waiting to be scheduled, over all replicas."""
        return sum(r.get_num_waiting_seqs() for r in self.replicas)

    def step(self) -> list[RequestOutput]:
        """One step of every replica that has work, concurrently; their outputs, replica by
        replica."""
        busy = [r for r in self.replicas if r.has_unfinished_requests()]
        results = [f.result() for f in [self._pool.submit(r.step) for r in busy]]
        outputs = [out for result in results for out in result]
        for out in outputs:
            if out.finished:
                self._replica_of.pop(out.request_id, None)
        return outputs

    def record_stats(self) -> None:
        """Report every replica's statistics now (merged)."""
        for replica in self.replicas:
            replica.record_stats()

    def stats(self) -> EngineStats:
        """The replicas' counters and gauges, summed."""
        per_replica = [r.stats() for r in self.replicas]
        return EngineStats(*(sum(values) for values in zip(*(
            (s.num_preemptions, s.num_compilations, s.prefix_cache_queries,
             s.prefix_cache_hits, s.num_running, s.num_waiting, s.num_free_pages, s.num_pages)
            for s in per_replica))))

    @property
    def num_preemptions(self) -> int:
        """Preemptions since start-up, over all replicas."""
        return sum(r.num_preemptions for r in self.replicas)

    def device_memory_used(self) -> dict[str, int]:
        """Bytes in use on each device of every replica."""
        return {d: n for r in self.replicas for d, n in r.device_memory_used().items()}


def _devices(replica: int, tp: int, dp: int) -> list:
    devices = jax.devices()
    if len(devices) < tp * dp:
        raise TensorParallelError(
            f"data_parallel_size={dp} x tensor_parallel_size={tp} needs {tp * dp} devices but "
            f"this process has {len(devices)}")
    return devices[replica * tp:(replica + 1) * tp]


class _StatsMerger:
    """Combines the replicas' reports into one stream for the real loggers: the latest
    snapshot of every replica makes the gauges; counters and events pass through."""

    def __init__(self, loggers: list[StatLogger], num_replicas: int):
        self._loggers = loggers
        self._latest: list[SchedulerStats | None] = [None] * num_replicas
        self._lock = threading.Lock()

    def for_replica(self, index: int) -> StatLogger:
        """The logger replica ``index`` reports to."""
        return _ReplicaStats(self, index)

    def record(self, index: int, stats: SchedulerStats, iteration: IterationStats) -> None:
        with self._lock:
            self._latest[index] = stats
            known = [s for s in self._latest if s is not None]
            merged = SchedulerStats(
                num_running_reqs=sum(s.num_running_reqs for s in known),
                num_waiting_reqs=sum(s.num_waiting_reqs for s in known),
                kv_cache_usage=sum(s.kv_cache_usage for s in known) / len(self._latest),
                prefix_cache_queries=stats.prefix_cache_queries,
                prefix_cache_hits=stats.prefix_cache_hits,
                num_preemptions=stats.num_preemptions)
            for stat_logger in self._loggers:
                stat_logger.record(merged, iteration)


class _ReplicaStats:
    """One replica's :class:`StatLogger`: tags its reports with the replica's index."""

    def __init__(self, merger: _StatsMerger, index: int):
        self._merger = merger
        self._index = index

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        self._merger.record(self._index, scheduler_stats, iteration_stats)
