"""The ``output`` items of a ``/v1/responses`` answer, built from the chat output parser's
deltas, and the typed stream events each delta makes.

One :class:`OutputBuilder` serves both shapes: a stream sends its events as they come, a
non-streaming answer drops them, so the final ``output`` of a stream equals the
non-streaming one. Items open in the order the text has them (reasoning, the message, each
function call), and each item is closed before the next opens.

Event names, fields and order: OpenAI's streaming reference and the ``openai`` client's
``openai.types.responses`` events (``ResponseOutputItemAddedEvent``,
``ResponseContentPartAddedEvent``, ``ResponseTextDeltaEvent``, ``ResponseTextDoneEvent``,
``ResponseContentPartDoneEvent``, ``ResponseOutputItemDoneEvent``,
``ResponseReasoningTextDeltaEvent`` / ``DoneEvent``,
``ResponseFunctionCallArgumentsDeltaEvent`` / ``DoneEvent``); the same order vLLM's
``serving_responses.py`` streams. Every event carries ``sequence_number`` (0, 1, 2, ... in
the order sent) via :class:`EventCounter`.
"""

from __future__ import annotations

import json
import uuid

from pydantic import BaseModel

from jaxpaged.server.chat_output import ChoiceDelta
from jaxpaged.server.protocol_responses import (FunctionCallOutput, OutputItem, OutputMessage,
                                                OutputText, ReasoningOutput,
                                                ReasoningTextPart)


def new_id(prefix: str) -> str:
    """``{prefix}_<32 hex>`` (OpenAI's id style: ``msg_``, ``fc_``, ``rs_``, ``resp_``)."""
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputBuilder:
    """The output items of one response, fed the parser's deltas in order.

    ``add`` and ``finish`` return the stream events (dicts without ``sequence_number``) the
    change makes.
    """

    def __init__(self):
        self.items: list[OutputItem] = []
        self._open: OutputItem | None = None
        self._calls: dict[int, FunctionCallOutput] = {}     # by the tool parser's index

    def add(self, delta: ChoiceDelta) -> list[dict]:
        """Append one delta: its reasoning, then its content, then its call pieces."""
        events = []
        if delta.reasoning:
            events += self._text(ReasoningOutput, delta.reasoning)
        if delta.content:
            events += self._text(OutputMessage, delta.content)
        for piece in delta.calls:
            if piece.id is not None:     # a call's header opens its item
                events += self._close("completed")
                call = FunctionCallOutput(id=new_id("fc"), status="in_progress",
                                          call_id=piece.id, name=piece.name, arguments="")
                self._calls[piece.index] = call
                events += self._start(call)
            call = self._calls[piece.index]
            if piece.arguments:
                call.arguments += piece.arguments
                events.append({"type": "response.function_call_arguments.delta",
                               "item_id": call.id, "output_index": self._index(call),
                               "delta": piece.arguments})
        return events

    def finish(self, status: str) -> list[dict]:
        """Close the last item with ``status`` (``completed`` / ``incomplete``); an output
        with no item at all gets an empty message, so ``output_text`` is ``""``."""
        events = [] if self.items else self._start(self._new(OutputMessage))
        return events + self._close(status)

    # ---- items ------------------------------------------------------------------------------

    def _index(self, item: OutputItem) -> int:
        return next(i for i, x in enumerate(self.items) if x is item)

    @staticmethod
    def _new(kind: type[OutputMessage] | type[ReasoningOutput]) -> OutputItem:
        if kind is OutputMessage:
            return OutputMessage(id=new_id("msg"), status="in_progress")
        return ReasoningOutput(id=new_id("rs"), status="in_progress")

    def _start(self, item: OutputItem) -> list[dict]:
        self.items.append(item)
        self._open = item
        index = len(self.items) - 1
        events = [{"type": "response.output_item.added", "output_index": index,
                   "item": item.model_dump()}]
        if isinstance(item, FunctionCallOutput):
            return events
        part = OutputText(text="") if isinstance(item, OutputMessage) else \
            ReasoningTextPart(text="")
        item.content.append(part)
        return events + [{"type": "response.content_part.added", "item_id": item.id,
                          "output_index": index, "content_index": 0,
                          "part": part.model_dump()}]

    def _text(self, kind, text: str) -> list[dict]:
        events = []
        if not isinstance(self._open, kind):
            events += self._close("completed")
            events += self._start(self._new(kind))
        item = self._open
        item.content[0].text += text
        name = "output_text" if kind is OutputMessage else "reasoning_text"
        event = {"type": f"response.{name}.delta", "item_id": item.id,
                 "output_index": self._index(item), "content_index": 0, "delta": text}
        if kind is OutputMessage:
            event["logprobs"] = []
        return events + [event]

    def _close(self, status: str) -> list[dict]:
        item, self._open = self._open, None
        if item is None:
            return []
        item.status = status
        index, events = self._index(item), []
        if isinstance(item, FunctionCallOutput):
            events.append({"type": "response.function_call_arguments.done", "item_id": item.id,
                           "output_index": index, "name": item.name,
                           "arguments": item.arguments})
        else:
            part = item.content[0]
            name = "output_text" if isinstance(item, OutputMessage) else "reasoning_text"
            done = {"type": f"response.{name}.done", "item_id": item.id, "output_index": index,
                    "content_index": 0, "text": part.text}
            if isinstance(item, OutputMessage):
                done["logprobs"] = []
            events += [done, {"type": "response.content_part.done", "item_id": item.id,
                              "output_index": index, "content_index": 0,
                              "part": part.model_dump()}]
        return events + [{"type": "response.output_item.done", "output_index": index,
                          "item": item.model_dump()}]


class EventCounter:
    """Numbers a stream's events and frames them as SSE (``event: <type>`` then
    ``data: <json>``, as OpenAI sends them; no ``[DONE]``)."""

    def __init__(self):
        self.next = 0

    def sse(self, event: dict) -> str:
        """One event, numbered."""
        event = {**event, "sequence_number": self.next}
        self.next += 1
        return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"

    def lifecycle(self, kind: str, response: BaseModel) -> str:
        """``response.<kind>`` carrying the response object as it is now."""
        return self.sse({"type": f"response.{kind}", "response": response.model_dump()})
