"""``--tool-call-parser hermes``: Hermes 2 Pro / Qwen2.5 / Qwen3 calls,
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one object per tag, any
number of tags, prose before and between them kept as content.

Format: vLLM's ``vllm/entrypoints/openai/tool_parsers/hermes_tool_parser.py`` and the
Qwen2.5 chat template's tool instructions (an unclosed last tag is parsed too, as vLLM's
``<tool_call>(.*)`` alternative does).
"""

from __future__ import annotations

import json

from jaxpaged.server.tool_parsers.base import MarkedCallParser, call_from_json


class HermesToolParser(MarkedCallParser):
    """One JSON object ``{"name", "arguments"}`` between ``<tool_call>`` and
    ``</tool_call>``."""

    name = "hermes"
    start = "<tool_call>"
    end = "</tool_call>"

    def parse_body(self, body: str) -> list[tuple[str, dict]] | None:
        try:
            call = call_from_json(json.loads(body), ("arguments",))
        except ValueError:
            return None
        return None if call is None else [call]
