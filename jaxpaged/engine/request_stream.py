"""Per-request output streams of the :class:`~jaxpaged.engine.async_engine.AsyncEngine` (the
errors a request can end with are in :mod:`jaxpaged.engine.exceptions`).

A :class:`RequestStream` holds at most one output: outputs that arrive while the consumer is
busy (a slow streaming client) are folded into it, so memory never grows with the consumer's
lag. The folding is vLLM's ``RequestOutputCollector`` (``vllm/v1/engine/output_processor.py``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from jaxpaged.engine.exceptions import RequestFailedError, RequestTimeoutError
from jaxpaged.outputs import PoolingRequestOutput, RequestOutput


_OPEN = object()    # a stream that has not ended


class RequestStream:
    """The outputs of one request, in order, as an async iterator.

    It holds at most one output: one that arrives before the previous one was taken is folded
    into it (:meth:`RequestOutput.add`; deltas are concatenated, cumulative outputs replaced).

    Iteration ends after the request's finished output, or when the request was aborted
    (after any output not yet taken). It raises :class:`RequestFailedError` for a request
    the engine failed, :class:`RequestTimeoutError` once ``deadline`` passes, and the error
    the stream was ended with otherwise (:class:`EngineStoppedError` at shutdown).

    Args:
        request_id: the engine's request id.
        aggregate: the outputs are deltas (``RequestOutputKind.DELTA``).
        deadline: ``time.monotonic()`` by which the request must finish (None: no limit).
    """

    def __init__(self, request_id: str, aggregate: bool = False, deadline: float | None = None):
        self.request_id = request_id
        self.deadline = deadline
        self.finished = False
        self._aggregate = aggregate
        self._output: RequestOutput | None = None
        self._end: object = _OPEN          # then None (the end) or the error to raise
        self._ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException | None) -> None:
        """Deliver an output, an error, or None (the end); event-loop thread only. The first
        end or error wins."""
        if isinstance(item, PoolingRequestOutput):    # a pooling request's one output
            self._output = item
        elif isinstance(item, RequestOutput):
            if self._output is None:
                self._output = item
            else:
                self._output.add(item, self._aggregate)
        elif self._end is _OPEN:
            self._end = item
        self._ready.set()

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while not self.finished:
            await self._wait()
            if self._output is not None:
                out, self._output = self._output, None
                if out.error is not None:
                    self.finished = True
                    raise RequestFailedError(out.error)
                self.finished = out.finished
                yield out
            else:
                self.finished = True
                if self._end is not None:
                    raise self._end
                return

    async def _wait(self) -> None:
        """Until there is an output or the end (at once if there is one already).

        Raises:
            RequestTimeoutError: the deadline has passed (even with an output waiting: a
                consumer that keeps up with a fast producer still times out).
        """
        if self._output is None and self._end is _OPEN:
            self._ready.clear()
        if self.deadline is None:
            await self._ready.wait()
            return
        try:
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            await asyncio.wait_for(self._ready.wait(), remaining)
        except TimeoutError:
            self.finished = True
            raise RequestTimeoutError("the request did not finish before its deadline") from None
