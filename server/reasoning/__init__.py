"""The ``--reasoning-parser`` parsers by name (vLLM's names)."""

from __future__ import annotations

from jaxpaged.server.reasoning.think import (DeepSeekR1ReasoningParser, Qwen3ReasoningParser,
                                             ThinkReasoningParser)

#: ``--reasoning-parser`` choices.
REASONING_PARSERS: dict[str, type[ThinkReasoningParser]] = {
    p.name: p for p in (Qwen3ReasoningParser, DeepSeekR1ReasoningParser)}

__all__ = ["REASONING_PARSERS", "ThinkReasoningParser"]
