"""The errors the engine ends a request or refuses one with (the server maps each to an HTTP
status in ``server/serving.py``)."""


class EngineNotReadyError(RuntimeError):
    """The engine is still loading (or warming up)."""


class EngineDeadError(RuntimeError):
    """The engine thread failed; no request can run until the process restarts."""


class EngineStoppedError(EngineNotReadyError):
    """The engine is shutting down: running requests were ended, new ones are refused."""


class RequestFailedError(RuntimeError):
    """The engine failed this request: a model step that ran it raised, or the engine died
    while it was running. The message says why."""


class RequestTimeoutError(RuntimeError):
    """The request passed its deadline before it finished (it is aborted)."""


class RequestIdInUseError(ValueError):
    """Refused: a request with this id is still running (ids are unique while in flight)."""


class TooManyPendingRequestsError(RuntimeError):
    """Refused: admitting the request would take the sequences waiting to be scheduled past
    ``max_pending_requests``.

    Attributes:
        num_waiting: sequences waiting when the request was refused.
        limit: the limit.
    """

    def __init__(self, num_waiting: int, requested: int, limit: int):
        super().__init__(f"the server is overloaded: {num_waiting} sequences are waiting to be "
                         f"scheduled and this request adds {requested}, beyond "
                         f"--max-pending-requests={limit}; retry later")
        self.num_waiting, self.limit = num_waiting, limit
