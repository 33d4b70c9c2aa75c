"""The ``--tool-call-parser`` parsers by name (vLLM's names)."""

from __future__ import annotations

from jaxpaged.server.tool_parsers.base import ParsedDelta, ToolCallDelta, ToolParser
from jaxpaged.server.tool_parsers.hermes import HermesToolParser
from jaxpaged.server.tool_parsers.llama3_json import Llama3JsonToolParser
from jaxpaged.server.tool_parsers.mistral import MistralToolParser
from jaxpaged.server.tool_parsers.pythonic import PythonicToolParser

#: ``--tool-call-parser`` choices.
TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser,
                        PythonicToolParser)}

__all__ = ["TOOL_PARSERS", "ParsedDelta", "ToolCallDelta", "ToolParser"]
