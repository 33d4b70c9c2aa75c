"""The state and lifecycle half of :class:`jaxpaged.engine.async_engine.AsyncEngine`: whether
its engine is loading, ready, draining, stopping or dead, and starting and stopping its thread.
Called from the event loop (or, for the blocking calls, from a plain thread)."""

from __future__ import annotations

import asyncio
import threading

from jaxpaged.engine.commands import AbortRequest, StopEngine
from jaxpaged.engine.exceptions import EngineDeadError, EngineNotReadyError, EngineStoppedError
from jaxpaged.engine.protocol import EngineClient, ModelInfo


class AsyncEngineLifecycle:
    """State and lifecycle of an ``AsyncEngine`` (a base class: the fields it reads, ``engine``,
    ``error``, ``_ready``, ``_thread``, ``_stopping``, ``_draining``, ``_streams``,
    ``_commands``, are set by ``AsyncEngine.__init__``, and ``_run`` is its thread)."""

    # ---- state ----------------------------------------------------------------------------

    @property
    def is_ready(self) -> bool:
        """True once the engine is built and warmed up, and while it has not failed."""
        return self._ready.is_set() and self.error is None

    def check_ready(self) -> EngineClient:
        """The engine, if it can take new requests.

        Raises:
            EngineDeadError: the engine failed (or failed to load).
            EngineStoppedError: shutting down, or draining (:meth:`begin_drain`).
            EngineNotReadyError: still loading.
        """
        engine = self.check_alive()
        if self._draining:
            raise EngineStoppedError("the server is shutting down: it finishes the requests "
                                     "it has and takes no new ones")
        return engine

    def check_alive(self) -> EngineClient:
        """The engine, if it is warmed up and running (taking new requests or draining).

        Raises:
            EngineDeadError / EngineNotReadyError: as :meth:`check_ready`.
            EngineStoppedError: shutting down (running requests ended).
        """
        if self.error is not None:
            raise self._dead_error()
        if self._stopping:
            raise EngineStoppedError("the server is shutting down")
        if not self._ready.is_set():
            raise EngineNotReadyError("the model is still loading")
        return self.engine

    @property
    def model_info(self) -> ModelInfo:
        """The served model (:class:`~jaxpaged.engine.protocol.ModelInfo`), once it is loaded.

        Raises:
            EngineNotReadyError: still loading (no engine yet).
        """
        if self.engine is None:
            raise EngineNotReadyError("the model is still loading")
        return self.engine.model_info

    def device_memory_used(self) -> dict[str, int]:
        """Bytes in use on each of the engine's devices; empty unless :attr:`is_ready`."""
        return self.engine.device_memory_used() if self.is_ready else {}

    @property
    def is_draining(self) -> bool:
        """True from :meth:`begin_drain` on."""
        return self._draining

    def _dead_error(self) -> EngineDeadError:
        return EngineDeadError(f"the engine failed: {self.error!r}")

    @property
    def num_open_streams(self) -> int:
        """Requests whose output stream is still open (0 once every request has finished or
        been aborted; a leak shows here)."""
        return len(self._streams)

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block (not in the event loop) until ready or failed; True if ready."""
        self._ready.wait(timeout)
        return self.is_ready

    # ---- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread (it loads the model), unless :meth:`start_loading` did;
        call from the event loop, which then receives the requests' outputs."""
        self._loop = asyncio.get_running_loop()
        if self._thread is None:
            self.start_loading()

    def start_loading(self) -> None:
        """Start the engine thread now, before the event loop runs (``jaxpaged serve``
        loads its own tokenizer and starts uvicorn meanwhile); :meth:`start` attaches the
        loop later. No request can be added before it does."""
        self._thread = threading.Thread(target=self._run, name="jaxpaged-engine", daemon=True)
        self._thread.start()

    def begin_drain(self) -> None:
        """Refuse new requests (:meth:`check_ready` raises :class:`EngineStoppedError`) and
        let the running ones finish; :attr:`num_open_streams` counts them down. Call from the
        event loop when a graceful shutdown begins (``--shutdown-timeout``)."""
        self._draining = True

    def stop_requests(self) -> None:
        """Refuse new requests and end every running one now (its stream raises
        :class:`EngineStoppedError`, so handlers answer 503 or close their SSE cleanly);
        call from the event loop when the server begins to shut down."""
        self._stopping = True
        streams, self._streams = self._streams, {}
        for rid, stream in streams.items():
            stream.put(EngineStoppedError("the server is shutting down"))
            self._commands.put(AbortRequest(rid))

    @property
    def was_built(self) -> bool:
        """True once the engine thread has built the engine (it may have failed since)."""
        return self.engine is not None

    @property
    def is_loading(self) -> bool:
        """True while the engine thread is still building or warming up the engine."""
        return self._thread is not None and self._thread.is_alive() and not self._ready.is_set()

    def join(self) -> None:
        """Block (not in the event loop) until the engine thread has ended: a failure, a
        stop command, or (multi-host) a stop signal to another process."""
        if self._thread is not None:
            self._thread.join()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine thread after its current step (without waiting for a load or
        compilation still in progress: the process exits around it)."""
        self._stopping = True
        self._commands.put(StopEngine())
        if self._thread is not None and self._ready.is_set():
            self._thread.join(timeout)
