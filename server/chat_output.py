"""One chat choice's output text split into reasoning, content and tool calls, streamed
or whole: the reasoning parser first, the tool parser on the content after the reasoning.

The non-streaming message is built from the same deltas a stream sends, so a stream's
``reasoning``, ``content`` and joined ``arguments`` equal the non-streaming message's.
Finish reason: ``tool_calls`` when ``tool_choice`` is ``auto`` and calls were found, or
``required`` and the output stopped (vLLM's ``serving_chat.py`` rule); otherwise the
engine's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jaxpaged.server.protocol_chat import (AssistantMessage, DeltaFunctionCall, DeltaMessage,
                                           DeltaToolCall, FunctionCall, ToolCall)
from jaxpaged.server.reasoning import ThinkReasoningParser
from jaxpaged.server.tool_parsers import ParsedDelta, ToolCallDelta, ToolParser


@dataclass
class ChoiceDelta:
    """What one text delta of a choice became."""

    reasoning: str = ""
    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)

    def extend(self, other: ChoiceDelta) -> ChoiceDelta:
        """Append ``other`` (the pieces that followed); returns ``self``."""
        self.reasoning += other.reasoning
        self.content += other.content
        self.calls += other.calls
        return self


class ChoiceOutputParser:
    """Reasoning then tool parsing of one choice's text deltas.

    Args:
        reasoning: the choice's reasoning parser (None: no ``--reasoning-parser``).
        tools: the choice's tool parser (None: no tool parsing).
        tool_choice: ``"auto"``, ``"required"``, a named choice or ``"none"`` (for the
            finish reason).
    """

    def __init__(self, reasoning: ThinkReasoningParser | None, tools: ToolParser | None,
                 tool_choice):
        self.reasoning = reasoning
        self.tools = tools
        self.tool_choice = tool_choice

    def feed(self, text: str) -> ChoiceDelta:
        """Split the next text delta."""
        reasoning, content = self.reasoning.feed(text) if self.reasoning else ("", text)
        return self._tools(reasoning, self.tools.feed(content) if self.tools else None, content)

    def finish(self) -> ChoiceDelta:
        """The end of the choice's output: what the parsers held back."""
        reasoning, content = self.reasoning.finish() if self.reasoning else ("", "")
        if not self.tools:
            return ChoiceDelta(reasoning, content)
        return self._tools(reasoning, self.tools.feed(content).extend(self.tools.finish()),
                           content)

    @staticmethod
    def _tools(reasoning: str, parsed: ParsedDelta | None, content: str) -> ChoiceDelta:
        if parsed is None:
            return ChoiceDelta(reasoning, content)
        return ChoiceDelta(reasoning, parsed.content, parsed.calls)

    def parse(self, text: str) -> ChoiceDelta:
        """A whole output."""
        return self.feed(text).extend(self.finish())

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """The choice's ``finish_reason`` (given the engine's, once it finished)."""
        if engine_reason is None:
            return None
        called = self.tools is not None and self.tools.num_calls > 0
        if (self.tool_choice == "auto" and called) or \
                (self.tool_choice == "required" and called and engine_reason == "stop"):
            return "tool_calls"
        return engine_reason


def assistant_message(delta: ChoiceDelta, parsed: bool) -> AssistantMessage:
    """The non-streaming message of a whole choice. With a parser (``parsed``), empty
    content is null, as vLLM's."""
    calls: dict[int, ToolCall] = {}
    for piece in delta.calls:
        if piece.id is not None:
            calls[piece.index] = ToolCall(id=piece.id, function=FunctionCall(
                name=piece.name, arguments=piece.arguments))
        else:
            calls[piece.index].function.arguments += piece.arguments
    reasoning = delta.reasoning or None
    content = delta.content if delta.content or not parsed else None
    return AssistantMessage(content=content, reasoning=reasoning, reasoning_content=reasoning,
                            tool_calls=list(calls.values()))


def delta_messages(delta: ChoiceDelta) -> list[DeltaMessage]:
    """The stream deltas of one choice delta: reasoning, then content, then each call piece
    on its own (a call's header, then its arguments)."""
    out = []
    if delta.reasoning:
        out.append(DeltaMessage(reasoning=delta.reasoning, reasoning_content=delta.reasoning))
    if delta.content:
        out.append(DeltaMessage(content=delta.content))
    for piece in delta.calls:
        first = piece.id is not None
        out.append(DeltaMessage(tool_calls=[DeltaToolCall(
            index=piece.index, id=piece.id, type="function" if first else None,
            function=DeltaFunctionCall(name=piece.name, arguments=piece.arguments))]))
    return out
