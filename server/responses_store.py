"""The opt-in store of ``/v1/responses`` (``--responses-store-size N``): the last ``N``
responses, least recently used dropped first, in this process's memory only (gone at
restart), for ``GET /v1/responses/{id}``, ``previous_response_id`` and ``background``.

Each entry keeps the response object and its conversation (the earlier turns' items, this
request's input items and its output items), which a follow-up turn naming it as
``previous_response_id`` continues (``instructions`` are not carried over, as OpenAI's
reference says). vLLM keeps the same in-memory dicts, unbounded, behind
``VLLM_ENABLE_RESPONSES_API_STORE``; this one is bounded.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from jaxpaged.server.errors import APIError, bad_request
from jaxpaged.server.protocol_responses import InputItem, ResponseObject

#: Statuses of a response still being generated.
RUNNING = ("queued", "in_progress")
#: What a request that needs the store is told when the server keeps none.
ENABLE_HINT = ("start jaxpaged serve with --responses-store-size N to keep the last N "
               "responses in memory")


@dataclass
class StoredResponse:
    """A stored response: the object as last reported, and its whole conversation."""

    response: ResponseObject
    conversation: list[InputItem]


class ResponsesStore:
    """The last ``capacity`` responses by id (LRU; ``capacity`` 0: the store is off).

    ``capacity`` may change while serving (it is read at each :meth:`put`).
    """

    def __init__(self, capacity: int = 0):
        self.capacity = capacity
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def require(self, field: str) -> None:
        """Raises APIError 400 naming ``field`` when the store is off, saying how to turn it
        on."""
        if self.capacity <= 0:
            raise bad_request(f"{field} needs the responses store, which this server does not "
                              f"keep: {ENABLE_HINT}", field)

    def put(self, entry: StoredResponse) -> None:
        """Keep (or replace) ``entry``, dropping the least recently used beyond capacity.
        A response still running (``queued`` / ``in_progress``: a ``background`` one) is
        never dropped, so the store holds more than ``capacity`` while more than that run."""
        self._entries[entry.response.id] = entry
        self._entries.move_to_end(entry.response.id)
        excess = len(self._entries) - max(self.capacity, 0)
        for response_id in [i for i, e in self._entries.items()
                            if e.response.status not in RUNNING][:max(excess, 0)]:
            del self._entries[response_id]

    def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        """The stored response (now the most recently used).

        Raises:
            APIError 404: no such response (never stored, or dropped as least recently
                used).
        """
        entry = self._entries.get(response_id)
        if entry is None:
            raise APIError(404, f"Response with id '{response_id}' not found (the store keeps "
                                f"the last {self.capacity} responses).", "NotFoundError", param)
        self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> None:
        """Forget a response. Raises APIError 404 as :meth:`get`."""
        self.get(response_id)
        del self._entries[response_id]

    def __len__(self) -> int:
        return len(self._entries)
