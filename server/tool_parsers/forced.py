"""The output parsers of ``tool_choice: "required"`` and of a named function, whose output
format is the JSON that structured outputs enforce for them
(:func:`jaxpaged.server.tool_calls.forced_call_schema`): for ``required`` a JSON array of
``{"name", "parameters"}`` objects, for a named function the arguments object itself. Call
ids take the ``--tool-call-parser``'s format where one is configured (Mistral's templates
require their 9 alphanumerics on the next turn), else vLLM's ``chatcmpl-tool-<hex>``.

Contract: vLLM's ``vllm/entrypoints/openai/serving_chat.py`` (``required``: the content is
validated as ``list[FunctionDefinition]``; a named choice: the content is the arguments).
"""

from __future__ import annotations

import json
from collections.abc import Callable

from jaxpaged.server.tool_parsers.base import (LeadingCallsParser, ToolCallDelta, ToolParser,
                                               call_from_json)
from jaxpaged.server.tool_parsers.llama3_json import skip_blank


class RequiredToolParser(LeadingCallsParser):
    """``[{"name": ..., "parameters": {...}}, ...]``, each element emitted when complete; an
    output that is not such an array is content."""

    openers = ("[",)
    keeps_special_tokens = False

    def __init__(self, max_calls: int | None = None, make_id: Callable[[], str] | None = None):
        super().__init__(max_calls)
        if make_id is not None:     # the --tool-call-parser's id format
            self.make_id = make_id
        self._parsed = 0
        self._closed = False

    def take_calls(self, text: str, final: bool):
        # Text is consumed only up to the end of a complete element (or the closing "]"):
        # what is left unconsumed becomes content if the array turns out malformed.
        calls, used, decoder = [], 0, json.JSONDecoder()
        while True:
            pos = skip_blank(text, used)
            if self._closed:
                return (calls, used) if pos == len(text) else None
            if pos == len(text):
                return None if final else (calls, used)
            if not self._parsed:
                if text[pos] != "[":
                    return None
            elif text[pos] == "]":
                self._closed = True
                return calls, pos + 1
            elif text[pos] != ",":
                return None
            pos = skip_blank(text, pos + 1)
            if pos == len(text):
                return None if final else (calls, used)
            try:
                obj, end = decoder.raw_decode(text, pos)
            except ValueError:
                return None if final else (calls, used)
            call = call_from_json(obj, ("parameters",))
            if call is None:
                return None
            calls.append(call)
            self._parsed += 1
            used = end

    def not_calls(self, text: str) -> str:
        # The grammar admits nothing but the array, so a remainder holding no complete JSON
        # value where the next element starts is an element cut by max_tokens: dropped, never
        # shown as content (a complete but malformed element still is content).
        return "" if _cut_short(text) else text


def _cut_short(text: str) -> bool:
    """Whether ``text``, what follows a call array's last complete element (or its
    opening), holds no complete JSON value where the next element starts."""
    pos = skip_blank(text, 0)
    if text[pos:pos + 1] in ("[", ","):
        pos = skip_blank(text, pos + 1)
    try:
        json.JSONDecoder().raw_decode(text, pos)
    except ValueError:
        return True
    return False


class NamedToolParser(ToolParser):
    """The whole output is the arguments of the named function: the call's header (id,
    name) when its arguments begin (the first text that is not blank), then every text
    delta as an arguments fragment (the non-streaming ``arguments`` is the whole output
    from there, as vLLM's). An output with no such text (cut inside the reasoning) makes no
    call at all, never one with empty ``arguments``."""

    keeps_special_tokens = False

    def __init__(self, function_name: str, make_id: Callable[[], str] | None = None):
        super().__init__(max_calls=1)
        if make_id is not None:     # the --tool-call-parser's id format
            self.make_id = make_id
        self.function_name = function_name

    def _feed(self) -> None:
        if not self.num_calls:
            self._buffer = self._buffer.lstrip()    # blank text before the arguments
            if not self._buffer:
                return
            self.num_calls = 1
            self._out.calls.append(ToolCallDelta(0, self.make_id(), self.function_name, ""))
        if self._buffer:
            self._out.calls.append(ToolCallDelta(0, arguments=self._buffer))
            self._buffer = ""

    def _finish(self) -> None:
        self._buffer = ""
