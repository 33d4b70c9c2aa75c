"""``--tool-call-parser llama3_json``: Llama 3.1/3.2 JSON calls, an output that is (after an
optional ``<|python_tag|>``) one or more ``{"name": ..., "parameters": {...}}`` objects
separated by ``;``. An output that does not start so is content.

Format: vLLM's ``vllm/entrypoints/openai/tool_parsers/llama_tool_parser.py`` and Meta's
Llama 3.1 JSON tool-calling prompt format (``parameters``; ``arguments`` accepted too).
"""

from __future__ import annotations

import json

from jaxpaged.server.tool_parsers.base import LeadingCallsParser, call_from_json

PYTHON_TAG = "<|python_tag|>"


def skip_blank(text: str, pos: int) -> int:
    """The first position at or after ``pos`` that is not whitespace."""
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


class Llama3JsonToolParser(LeadingCallsParser):
    """Objects ``{"name", "parameters"}`` joined by ``;``, each emitted when complete."""

    name = "llama3_json"
    openers = ("{", PYTHON_TAG)

    def __init__(self, max_calls: int | None = None):
        super().__init__(max_calls)
        self._parsed = 0

    def take_calls(self, text: str, final: bool):
        calls, used, decoder = [], 0, json.JSONDecoder()
        while True:
            pos = skip_blank(text, used)
            if self._parsed:                         # after a call: "; {...}" or the end
                if pos == len(text):
                    return calls, used
                if text[pos] != ";":
                    return None
                pos = skip_blank(text, pos + 1)
            elif text.startswith(PYTHON_TAG, pos):
                pos = skip_blank(text, pos + len(PYTHON_TAG))
            if pos == len(text):
                return calls, used
            try:
                obj, end = decoder.raw_decode(text, pos)
            except ValueError:
                return None if final else (calls, used)
            call = call_from_json(obj, ("parameters", "arguments"))
            if call is None:
                return None
            calls.append(call)
            self._parsed += 1
            used = end
