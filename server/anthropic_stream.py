"""The ``content`` blocks of a ``/v1/messages`` answer, built from the chat output parser's
deltas, and the stream events each delta makes.

One :class:`ContentBuilder` serves both shapes: a stream sends its events as they come, a
non-streaming answer drops them, so the message a client assembles from a stream equals the
non-streaming one. Blocks open in the order the text has them (``thinking`` from the
``--reasoning-parser``, ``text``, each ``tool_use``); each block is closed
(``content_block_stop``) before the next opens. A ``thinking`` block's ``signature`` (sent
as a ``signature_delta`` just before it closes) is the SHA-256 of its text: nothing here is
signed, and the client only has to send it back. A ``tool_use`` block's ``input`` is its
arguments' JSON object (streamed as ``input_json_delta`` fragments); arguments that are no
JSON object (a call cut by ``max_tokens``) give ``{}`` in the non-streaming answer.

Event names, fields and order: Anthropic's streaming reference and the ``anthropic`` client's
``RawMessageStreamEvent`` types: ``message_start``, then per block ``content_block_start`` /
``content_block_delta`` (``text_delta``, ``thinking_delta``, ``signature_delta``,
``input_json_delta``) / ``content_block_stop``, then ``message_delta`` (``stop_reason``,
``stop_sequence``, the cumulative ``usage``) and ``message_stop``.
"""

from __future__ import annotations

import hashlib
import json

from pydantic import BaseModel

from jaxpaged.server.chat_output import ChoiceDelta
from jaxpaged.server.protocol_anthropic import ContentOut, TextOut, ThinkingOut, ToolUseOut


def signature(thinking: str) -> str:
    """The ``signature`` of a thinking block: the hex SHA-256 of its text."""
    return hashlib.sha256(thinking.encode("utf-8")).hexdigest()


def tool_input(arguments: str) -> dict:
    """A call's ``input``: its arguments' JSON object, ``{}`` if they are none."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class ContentBuilder:
    """The content blocks of one message, fed the parser's deltas in order.

    ``add`` and ``finish`` return the stream events (dicts) the change makes.

    Args:
        omit_thinking: ``thinking.display`` ``omitted``: thinking blocks carry no text (their
            signature still comes).
    """

    def __init__(self, omit_thinking: bool = False):
        self.blocks: list[ContentOut] = []
        self.omit_thinking = omit_thinking
        self._open: ContentOut | None = None
        self._calls: dict[int, ToolUseOut] = {}       # by the tool parser's index
        self._arguments: dict[int, str] = {}          # each block's arguments text
        self._thought = ""                             # the open thinking block's text

    @property
    def has_tool_use(self) -> bool:
        """Whether the message holds a ``tool_use`` block."""
        return bool(self._calls)

    def add(self, delta: ChoiceDelta) -> list[dict]:
        """Append one delta: its reasoning, then its content, then its call pieces."""
        events = []
        if delta.reasoning:
            events += self._text(ThinkingOut, delta.reasoning)
        if delta.content:
            events += self._text(TextOut, delta.content)
        for piece in delta.calls:
            if piece.id is not None:          # a call's header opens its block
                events += self._close()
                call = ToolUseOut(id=piece.id, name=piece.name, input={})
                self._calls[piece.index] = call
                events += self._start(call)
            call = self._calls[piece.index]
            if piece.arguments:
                self._arguments[id(call)] = self._arguments.get(id(call), "") + piece.arguments
                events.append(self._delta(call, {"type": "input_json_delta",
                                                 "partial_json": piece.arguments}))
        return events

    def finish(self) -> list[dict]:
        """Close the last block."""
        return self._close()

    # ---- blocks -----------------------------------------------------------------------------

    def _index(self, block: ContentOut) -> int:
        return next(i for i, b in enumerate(self.blocks) if b is block)

    def _delta(self, block: ContentOut, delta: dict) -> dict:
        return {"type": "content_block_delta", "index": self._index(block), "delta": delta}

    def _start(self, block: ContentOut) -> list[dict]:
        self.blocks.append(block)
        self._open = block
        start = block.model_dump()
        if isinstance(block, ThinkingOut):
            start["signature"] = ""
        return [{"type": "content_block_start", "index": len(self.blocks) - 1,
                 "content_block": start}]

    def _text(self, kind: type[TextOut] | type[ThinkingOut], text: str) -> list[dict]:
        events = []
        if not isinstance(self._open, kind):
            events += self._close()
            events += self._start(TextOut(text="") if kind is TextOut else
                                  ThinkingOut(thinking="", signature=""))
        block = self._open
        if isinstance(block, TextOut):
            block.text += text
            return events + [self._delta(block, {"type": "text_delta", "text": text})]
        self._thought += text
        if self.omit_thinking:
            return events
        block.thinking += text
        return events + [self._delta(block, {"type": "thinking_delta", "thinking": text})]

    def _close(self) -> list[dict]:
        block, self._open = self._open, None
        if block is None:
            return []
        events = []
        if isinstance(block, ThinkingOut):
            block.signature = signature(self._thought)
            self._thought = ""
            events.append(self._delta(block, {"type": "signature_delta",
                                              "signature": block.signature}))
        elif isinstance(block, ToolUseOut):
            block.input = tool_input(self._arguments.pop(id(block), ""))
        return events + [{"type": "content_block_stop", "index": self._index(block)}]


def sse_event(event: dict | BaseModel) -> str:
    """One event framed as Anthropic sends it: ``event: <type>`` then ``data: <json>``."""
    data = event if isinstance(event, dict) else event.model_dump()
    return f"event: {data['type']}\ndata: {json.dumps(data)}\n\n"
