"""`AsyncEngine`: the engine on a background thread, requests streamed into asyncio.

One thread owns the :class:`Engine` (it builds it, then loops: take queued commands — add,
abort — then run one step, then hand the step's outputs to the event loop). Coroutines never
touch the engine directly, so a long step never blocks the event loop (health checks, new
connections) and the engine needs no locks. Each request's outputs arrive on its own
:class:`~jaxpaged.engine.request_stream.RequestStream` (memory bounded whatever the
consumer's lag).

Admission: with ``max_pending_requests``, an add that would take the sequences waiting to be
scheduled past the limit is refused on the engine thread (:class:`TooManyPendingRequestsError`),
where the count is exact.

Failures: a model step that raises fails only the requests it ran (their streams raise
:class:`RequestFailedError`; ``Engine.step``); an exception that escapes the engine loop kills
the engine: :meth:`AsyncEngine.check_ready` raises :class:`EngineDeadError` from then on,
running requests end with :class:`RequestFailedError` and queued ones with
:class:`EngineDeadError`.

The split mirrors vLLM's ``AsyncLLM`` (``vllm/v1/engine/async_llm.py``) with a thread in place of
its engine-core process.

In a multi-host job (``--num-processes`` > 1) this runs in process 0, which sends each step's
commands to the other processes before applying them (``jaxpaged.distributed.step_sync``);
those run :func:`jaxpaged.engine.follower.run_follower`, the same loop without HTTP, so every
engine takes the same steps. A stop signal to any process ends the loop on all of them at the
same step.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time

from jaxpaged.distributed.multihost import first_line
from jaxpaged.distributed.step_sync import JobStopped, sync_step
from jaxpaged.arg_utils import EngineArgs
from jaxpaged.runner.background_compile import SERVE
from jaxpaged.engine.data_parallel import DataParallelEngine, make_engine
from jaxpaged.engine.async_lifecycle import AsyncEngineLifecycle
from jaxpaged.engine.engine import Engine
from jaxpaged.engine.commands import (AbortRequest, AddRequest, EngineCall, EngineCommand,
                                      StopEngine)
from jaxpaged.engine.follower import warm_up
from jaxpaged.engine.gc_heap import end_start_up_pause
from jaxpaged.core.input_processor import Prompt
from jaxpaged.engine.exceptions import (EngineStoppedError, RequestFailedError,
                                        RequestIdInUseError, RequestTimeoutError,
                                        TooManyPendingRequestsError)
from jaxpaged.engine.request_stream import RequestStream
from jaxpaged.metrics.stats import StatLogger
from jaxpaged.outputs import RequestOutput
from jaxpaged.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

#: Seconds an idle multi-host leader waits for a command before it sends an empty list, so
#: the other processes never sit in one collective for long.
HEARTBEAT_S = 0.5


class AsyncEngine(AsyncEngineLifecycle):
    """An :class:`Engine` running on its own thread, used from one asyncio event loop.

    Args:
        args: the engine configuration.
        stat_loggers: called with each step's statistics once the engine is warmed up.
        max_pending_requests: most sequences waiting to be scheduled (a request with ``n``
            sequences counts ``n``); adds beyond it are refused. None: no limit.

    Raises:
        ValueError: ``max_pending_requests`` is not a positive integer.

    Call :meth:`start` from the event loop, then :meth:`add_request` / :meth:`abort`. Its
    state and lifecycle (ready, draining, start, stop) are
    :class:`~jaxpaged.engine.async_lifecycle.AsyncEngineLifecycle`'s.
    """

    def __init__(self, args: EngineArgs, stat_loggers: list[StatLogger] | None = None,
                 max_pending_requests: int | None = None):
        if max_pending_requests is not None and (
                not isinstance(max_pending_requests, int) or isinstance(max_pending_requests, bool)
                or max_pending_requests < 1):
            raise ValueError("max_pending_requests must be a positive integer or None, got "
                             f"{max_pending_requests!r}")
        self.args = args
        self.max_pending_requests = max_pending_requests
        self.engine: Engine | DataParallelEngine | None = None
        self.error: BaseException | None = None
        self._stat_loggers = list(stat_loggers or ())
        self._ready = threading.Event()
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._draining = False
        self._multihost = args.num_processes > 1

    # ---- requests (event-loop side) ---------------------------------------------------------

    async def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams,
                          priority: int = 0, deadline: float | None = None,
                          lora_request=None) -> RequestStream:
        """Queue a request and wait until the engine accepted it.

        Args:
            lora_request: the LoRA adapter it runs with (None: the base model).
            deadline: ``time.monotonic()`` by which the request must have finished (None: no
                limit); past it, waiting here or on the stream raises
                :class:`RequestTimeoutError` (the caller aborts the request).

        Returns:
            The stream of its outputs (use ``params.output_kind`` to choose deltas or a single
            final output).

        Raises:
            ValueError / TypeError: the engine refused the request (bad prompt or params).
            RequestIdInUseError: (a ValueError) ``request_id`` is still in flight.
            TooManyPendingRequestsError: beyond ``max_pending_requests``.
            RequestTimeoutError: the deadline passed first.
            EngineNotReadyError / EngineDeadError: as :meth:`check_ready`.
        """
        self.check_ready()
        if request_id in self._streams:
            raise RequestIdInUseError(f"request id {request_id!r} is already in use")
        aggregate = getattr(params, "output_kind", None) is RequestOutputKind.DELTA
        stream = RequestStream(request_id, aggregate, deadline)
        self._streams[request_id] = stream
        accepted = self._loop.create_future()
        self._commands.put(AddRequest(request_id=request_id, prompt=prompt, params=params,
                                      priority=priority, lora_request=lora_request,
                                      accepted=accepted))
        if self.error is not None:   # died after check_ready and after it drained the queue
            _settle(accepted, self._dead_error())
        try:
            if deadline is None:
                await accepted
            else:
                await asyncio.wait_for(accepted, deadline - time.monotonic())
        except TimeoutError:
            self._streams.pop(request_id, None)
            self._commands.put(AbortRequest(request_id))
            raise RequestTimeoutError("the request did not finish before its deadline") from None
        except BaseException:
            self._streams.pop(request_id, None)
            if not accepted.done() or accepted.cancelled():   # cancelled while queued
                self._commands.put(AbortRequest(request_id))
            raise
        return stream

    def abort(self, request_id: str) -> None:
        """Abort a request (its stream ends now; its pages are freed before the next step).
        Unknown or finished ids are ignored."""
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.put(None)
            self._commands.put(AbortRequest(request_id))

    async def call(self, fn):
        """``fn(engine)`` run on the engine thread between two steps; its result (its
        exception is raised here). The RL controls (``server/serving_rl.py``) go through it.

        Raises:
            NotImplementedError: a multi-host job (the other processes would not follow).
        """
        if self._multihost:
            raise NotImplementedError("engine calls (RL controls) need a single-process job")
        self.check_ready()
        done = asyncio.get_running_loop().create_future()
        self._commands.put(EngineCall(fn=fn, done=done))
        return await done

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            stream.put(out)
            if out.finished:
                del self._streams[out.request_id]

    def _end_streams(self, error: BaseException) -> None:
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.put(error)

    # ---- the engine thread ------------------------------------------------------------------

    def _run(self) -> None:
        try:
            # A generating server answers /health once a short request's steps are
            # compiled; the other shapes compile in the background (one process only: every
            # process of a multi-host job runs the same steps in lockstep; not for pooling,
            # whose requests are prompt steps of every token bucket from the start).
            serve = not self._multihost and self.args.pooler is None
            self.engine = make_engine(self.args, background_compile=SERVE if serve else None)
            warm_up(self.engine)
            end_start_up_pause()        # (a server's start-up ran without the collector)
            self.engine.start_background_compile()
            self.engine.stat_loggers.extend(self._stat_loggers)
            self.engine.record_stats()          # every gauge has a value from the start
            self._ready.set()
            self._loop_forever()
        except JobStopped as e:   # another process of the job was told to stop
            logger.info("%s", e)
            self._stopping = True
            stopped = EngineStoppedError(f"the server is shutting down: {e}")
            self._end_everything(stopped, stopped)
        except BaseException as e:   # noqa: BLE001 - the thread must report every failure
            if self._multihost and self.engine is not None:
                logger.error("the multi-host job failed: %s", first_line(e))
            elif self._ready.is_set():
                logger.exception("the engine thread failed")
            self.error = e
            self._ready.set()
            self._end_everything(
                RequestFailedError(f"the engine failed while running this request: {e!r}"),
                self._dead_error())

    def _end_everything(self, running: BaseException, queued: BaseException) -> None:
        """End every running request's stream with ``running`` and refuse every queued add
        with ``queued``."""
        self._call_soon(self._end_streams, running)
        self._reject_queued(queued)

    def _loop_forever(self) -> None:
        engine = self.engine
        while True:
            frozen = getattr(engine, "is_frozen", False)    # paused or asleep: wait for calls
            commands = self._take_commands(block=frozen or not engine.has_unfinished_requests())
            if self.max_pending_requests is not None:
                commands = self._admit(commands)
            if self._multihost:
                try:
                    sync_step([cmd.for_followers() if isinstance(cmd, AddRequest) else cmd
                               for cmd in commands])
                except BaseException:
                    for cmd in commands:       # put back, to be refused with the others
                        self._commands.put(cmd)
                    raise
            for cmd in commands:
                if isinstance(cmd, StopEngine):
                    return
                if isinstance(cmd, AddRequest):
                    self._handle_add(cmd)
                elif isinstance(cmd, EngineCall):
                    self._handle_call(cmd)
                else:
                    engine.abort_request(cmd.request_id)
            if engine.has_unfinished_requests() and not getattr(engine, "is_frozen", False):
                outputs = engine.step()
                if outputs:
                    self._call_soon(self._deliver, outputs)

    def _take_commands(self, block: bool) -> list[EngineCommand]:
        """Every queued command; when ``block``, wait for one first (a multi-host leader
        waits at most :data:`HEARTBEAT_S` and may return none)."""
        commands = []
        if block:
            try:
                commands.append(self._commands.get(timeout=HEARTBEAT_S if self._multihost
                                                   else None))
            except queue.Empty:
                return commands
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _admit(self, commands: list[EngineCommand]) -> list[EngineCommand]:
        """``commands`` less the adds that would take the waiting sequences past
        ``max_pending_requests`` (refused with :class:`TooManyPendingRequestsError`; they
        never reach the engine, nor the other processes of a multi-host job). Counted before
        the batch is applied: an abort in the same batch makes room from the next one."""
        if not any(isinstance(cmd, AddRequest) for cmd in commands):
            return commands
        waiting = self.engine.get_num_waiting_seqs()
        admitted = []
        for cmd in commands:
            if isinstance(cmd, AddRequest):
                n = cmd.params.n if isinstance(cmd.params, SamplingParams) else 1
                if waiting + n > self.max_pending_requests:
                    self._call_soon(_settle, cmd.accepted, TooManyPendingRequestsError(
                        waiting, n, self.max_pending_requests))
                    continue
                waiting += n
            admitted.append(cmd)
        return admitted

    def _handle_add(self, cmd: AddRequest) -> None:
        try:
            self.engine.add_request(cmd.request_id, cmd.prompt, cmd.params, cmd.priority,
                                    cmd.lora_request)
            error = None
        except Exception as e:   # noqa: BLE001 - a refused request is that request's error
            error = e
        self._call_soon(_settle, cmd.accepted, error)

    def _handle_call(self, cmd: EngineCall) -> None:
        try:
            result, error = cmd.fn(self.engine), None
        except Exception as e:   # noqa: BLE001 - the caller's error, raised in its coroutine
            result, error = None, e
        self._call_soon(_settle, cmd.done, error, result)

    def _reject_queued(self, error: BaseException) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, AddRequest):
                self._call_soon(_settle, cmd.accepted, error)
            elif isinstance(cmd, EngineCall):
                self._call_soon(_settle, cmd.done, error)

    def _call_soon(self, fn, *args) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(fn, *args)


def _settle(future: asyncio.Future, error: BaseException | None, result=None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)

