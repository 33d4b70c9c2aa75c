"""Incremental tool-call parsing: the text a model writes, fed in deltas, split into content
and complete tool calls.

Every parser is fed the decoded output text in the pieces the engine streams
(:meth:`ToolParser.feed`) and closed with :meth:`ToolParser.finish`; the non-streaming
response feeds the whole text once, so the two always agree. Text that might begin a call
marker is held back until it is decided (as stop strings are), and a call is emitted once its
text is complete and parses: a header delta (index, id, name, ``arguments=""``) then the
arguments, re-serialized with ``json.dumps`` (so streamed fragments join to exactly the
non-streaming ``arguments``). A call whose text does not parse is passed on as content,
markers included. After the first call, whitespace-only text between and after calls is
dropped.

Contract: vLLM's ``vllm/entrypoints/openai/tool_parsers/abstract_tool_parser.py`` (one parser
per ``--tool-call-parser`` name; ``chatcmpl-tool-<32 hex>`` ids from
``vllm/entrypoints/chat_utils.py:make_tool_call_id``).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import ClassVar


@dataclass
class ToolCallDelta:
    """One piece of a streamed tool call (OpenAI's ``delta.tool_calls[]`` entry).

    Attributes:
        index: the call's position among this choice's calls (0-based).
        id: set on the call's first delta only.
        name: the function's name, set on the first delta only.
        arguments: a fragment of the arguments' JSON text.
    """

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class ParsedDelta:
    """What one fed text delta turned into: content text and tool-call pieces."""

    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)

    def extend(self, other: ParsedDelta) -> ParsedDelta:
        """Append ``other`` (the pieces that followed) to this delta; returns ``self``."""
        self.content += other.content
        self.calls += other.calls
        return self


def make_tool_call_id() -> str:
    """``chatcmpl-tool-<32 hex>``, vLLM's tool-call id."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def held_prefix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of ``text`` that is a proper prefix of one of ``markers``
    (characters that might begin a marker: held back until the next delta decides)."""
    best = 0
    for marker in markers:
        for n in range(min(len(text), len(marker) - 1), best, -1):
            if marker.startswith(text[-n:]):
                best = n
                break
    return best


def call_from_json(obj, arguments_keys: tuple[str, ...] = ("arguments", "parameters")
                   ) -> tuple[str, dict] | None:
    """``(name, arguments)`` of a decoded ``{"name": str, "arguments"|"parameters": obj}``,
    or None when it is not one (no arguments key counts as none; a JSON string of an object
    is accepted as arguments)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    for key in arguments_keys:
        if key in obj:
            args = obj[key]
            if isinstance(args, str):
                try:
                    args = json.loads(args)
                except ValueError:
                    return None
            return (obj["name"], args) if isinstance(args, dict) else None
    return None


class ToolParser:
    """Base of the incremental parsers: content handling, ids, call emission.

    Args:
        max_calls: calls after this many are dropped (1 for ``parallel_tool_calls: false``;
            None: no limit).

    Subclasses implement :meth:`_feed` (parse ``self._buffer``, emitting with
    :meth:`_content` / :meth:`_call`) and :meth:`_finish` (the end of the output).
    """

    #: The ``--tool-call-parser`` name (None for the internal ``tool_choice`` parsers).
    name: ClassVar[str | None] = None
    #: Decode special tokens (the call markers of some models are special tokens; vLLM's
    #: parsers set ``skip_special_tokens=False`` in ``adjust_request``).
    keeps_special_tokens: ClassVar[bool] = True

    def __init__(self, max_calls: int | None = None):
        self.max_calls = max_calls
        self.num_calls = 0
        self._buffer = ""
        self._whitespace = ""
        self._out = ParsedDelta()

    @staticmethod
    def make_id() -> str:
        """A new call's id (:func:`make_tool_call_id`; Mistral's parser overrides it, and the
        ``tool_choice`` parsers take the ``--tool-call-parser``'s)."""
        return make_tool_call_id()

    def feed(self, text: str) -> ParsedDelta:
        """Parse the next piece of output text."""
        self._buffer += text
        self._feed()
        return self._take()

    def finish(self) -> ParsedDelta:
        """End of output: whatever is held back is decided (an unfinished marker is
        content)."""
        self._finish()
        return self._take()

    def parse(self, text: str) -> ParsedDelta:
        """The whole output at once (the non-streaming response)."""
        return self.feed(text).extend(self.finish())

    def _take(self) -> ParsedDelta:
        out, self._out = self._out, ParsedDelta()
        return out

    def _content(self, text: str) -> None:
        if not self.num_calls:
            self._out.content += text
            return
        self._whitespace += text
        if self._whitespace.strip():
            self._out.content += self._whitespace
            self._whitespace = ""

    def _call(self, name: str, arguments: dict) -> None:
        if self.max_calls is not None and self.num_calls >= self.max_calls:
            return
        index, self.num_calls = self.num_calls, self.num_calls + 1
        self._whitespace = ""                   # blank text between calls is dropped
        self._out.calls += [ToolCallDelta(index, self.make_id(), name, ""),
                            ToolCallDelta(index, arguments=json.dumps(arguments,
                                                                      ensure_ascii=False))]

    def _feed(self) -> None:
        raise NotImplementedError

    def _finish(self) -> None:
        raise NotImplementedError


class MarkedCallParser(ToolParser):
    """Calls introduced by a marker (``<tool_call>``, ``[TOOL_CALLS]``); content around them
    kept. A call body ends at ``end`` (when set) or where :meth:`body_end` says it does.

    Subclasses set ``start`` / ``end`` and implement :meth:`parse_body`.
    """

    start: ClassVar[str]
    end: ClassVar[str | None] = None

    def __init__(self, max_calls: int | None = None):
        super().__init__(max_calls)
        self._inside = False

    def parse_body(self, body: str) -> list[tuple[str, dict]] | None:
        """The calls a complete body holds, or None when it does not parse."""
        raise NotImplementedError

    def body_end(self, body: str) -> int | None:
        """Where a body without an end marker ends (None: not yet complete)."""
        raise NotImplementedError

    def _feed(self) -> None:
        while True:
            if not self._inside:
                i = self._buffer.find(self.start)
                if i < 0:
                    keep = held_prefix(self._buffer, (self.start,))
                    self._content(self._buffer[:len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep:]
                    return
                self._content(self._buffer[:i])
                self._buffer, self._inside = self._buffer[i + len(self.start):], True
            if self.end is not None:
                j = self._buffer.find(self.end)
                if j < 0:
                    return
                body, rest = self._buffer[:j], self._buffer[j + len(self.end):]
            else:
                j = self.body_end(self._buffer)
                if j is None:
                    return
                body, rest = self._buffer[:j], self._buffer[j:]
            self._emit(body, self.end or "")
            self._buffer, self._inside = rest, False

    def _emit(self, body: str, closing: str) -> None:
        calls = self.parse_body(body)
        if calls is None:
            self._content(self.start + body + closing)
        for name, arguments in calls or ():
            self._call(name, arguments)

    def _finish(self) -> None:
        if self._inside:
            self._emit(self._buffer, "")       # an unclosed call: parsed if complete JSON
        else:
            self._content(self._buffer)
        self._buffer, self._inside = "", False


class LeadingCallsParser(ToolParser):
    """Output that is either calls from its first non-blank character (``{...}``,
    ``[f(x=1)]``) or content throughout.

    Subclasses set ``openers`` and implement :meth:`take_calls`.
    """

    #: What a call output starts with (after leading whitespace).
    openers: ClassVar[tuple[str, ...]]

    def __init__(self, max_calls: int | None = None):
        super().__init__(max_calls)
        self._mode = None          # None: undecided, "calls", "content"

    def take_calls(self, text: str, final: bool) -> tuple[list[tuple[str, dict]], int] | None:
        """The complete calls at the start of ``text`` and the characters they span
        (``([], 0)``: nothing complete yet), or None when ``text`` cannot be calls."""
        raise NotImplementedError

    def _feed(self) -> None:
        if self._mode is None:
            head = self._buffer.lstrip()
            if any(head.startswith(o) for o in self.openers):
                self._mode = "calls"
            elif not head or any(o.startswith(head) for o in self.openers):
                return
            else:
                self._mode = "content"
        if self._mode == "content":
            self._content(self._buffer)
            self._buffer = ""
            return
        self._take_calls(final=False)

    def not_calls(self, text: str) -> str:
        """What of ``text``, found not to be calls, is content (all of it here)."""
        return text

    def _take_calls(self, final: bool) -> None:
        taken = self.take_calls(self._buffer, final)
        if taken is None:           # not calls after all: the rest is content
            self._mode = "content"
            self._content(self.not_calls(self._buffer))
            self._buffer = ""
            return
        calls, used = taken
        for name, arguments in calls:
            self._call(name, arguments)
        self._buffer = self._buffer[used:]

    def _finish(self) -> None:
        if self._mode == "calls":
            self._take_calls(final=True)
        self._content(self._buffer)
        self._buffer = ""
