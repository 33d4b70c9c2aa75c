"""Reasoning parsers: the text a model writes inside ``<think>...</think>`` split from the
answer, incrementally (a tag split across tokens is held back until it is decided, so it
never leaks into either part).

The state at the first output token is read from the rendered prompt: a prompt whose last
``<think>`` is still open (the template pre-filled it) starts inside the reasoning; one that
ends with ``</think>`` (``enable_thinking: false`` pre-fills an empty block) starts in the
answer; otherwise the output may open with ``<think>``, and what follows without one is the
answer (``qwen3``) or reasoning until ``</think>`` (``deepseek_r1``, whose models always
think). Output cut (``max_tokens``, a stop string) before ``</think>`` is all reasoning.

A request whose output is constrained (a structured output or a forced tool call) gets its
grammar behind the reasoning (:meth:`ThinkReasoningParser.grammar_opening`): ``qwen3`` offers
the model a think block only where the request enables thinking (``chat_template_kwargs``
``enable_thinking`` / ``thinking`` true, or a template that opened the block), else the
grammar holds from the first token and the output is all answer; an opening tag cut by
``max_tokens`` is then a cut thought (no answer), never content.

Contract: vLLM's ``vllm/reasoning/qwen3_reasoning_parser.py`` and
``deepseek_r1_reasoning_parser.py`` (``reasoning`` / ``content`` exactly the text either side
of the tags, nothing stripped).
"""

from __future__ import annotations

from typing import ClassVar

from jaxpaged.server.tool_parsers.base import held_prefix

#: Parser states.
AWAIT, REASONING, CONTENT = "await", "reasoning", "content"


class ThinkReasoningParser:
    """Splits ``<think>`` reasoning from content, one text delta at a time.

    Args:
        prompt_tail: the end of the rendered prompt (its last few tokens decoded), from which
            the initial state is read.
        thinking: whether the request enables thinking (:func:`thinking_enabled` of its
            template variables); read only by ``qwen3``'s :meth:`grammar_opening`.
        constrained: the output follows a grammar placed by :meth:`grammar_opening`: where
            that grammar offers no think block the output is all answer, and a cut
            ``start`` tag is a cut thought.
    """

    name: ClassVar[str]
    start: ClassVar[str] = "<think>"
    end: ClassVar[str] = "</think>"
    #: The state of output that does not open with ``start`` (and had no prompt hint).
    untagged: ClassVar[str]

    def __init__(self, prompt_tail: str = "", thinking: bool = False,
                 constrained: bool = False):
        self.state = initial_state(prompt_tail, self.start, self.end)
        self.thinking = thinking
        self.constrained = constrained
        if constrained and self.grammar_opening() is None:
            self.state = CONTENT
        self._buffer = ""

    def grammar_opening(self) -> str | None:
        """How a structured output's grammar must let the output begin in this state
        (:func:`jaxpaged.structured_output.grammar.after_reasoning`'s ``opening``), or None
        when the grammar applies from the first token: the reasoning already ended, or
        (``qwen3``) the request does not enable thinking, so no think block is offered."""
        if self.state == REASONING:
            return "inside"
        if self.state == AWAIT:
            if self.untagged == REASONING:
                return "untagged_reasoning"
            return "optional" if self.thinking else None
        return None

    def feed(self, text: str) -> tuple[str, str]:
        """``(reasoning, content)`` of the next text delta (either may be empty)."""
        self._buffer += text
        reasoning = content = ""
        if self.state == AWAIT:
            if self._buffer.startswith(self.start):
                self.state, self._buffer = REASONING, self._buffer[len(self.start):]
            elif self.start.startswith(self._buffer):
                return "", ""
            else:
                self.state = self.untagged
        if self.state == REASONING:
            i = self._buffer.find(self.end)
            if i < 0:
                keep = held_prefix(self._buffer, (self.end,))
                reasoning = self._buffer[:len(self._buffer) - keep]
                self._buffer = self._buffer[len(self._buffer) - keep:]
                return reasoning, ""
            reasoning, self._buffer = self._buffer[:i], self._buffer[i + len(self.end):]
            self.state = CONTENT
        content, self._buffer = self._buffer, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """The held-back rest: reasoning inside the block, else content."""
        rest, self._buffer = self._buffer, ""
        if self.state == AWAIT:                  # a lone start of "<think>" and nothing more
            self.state = self.untagged
            if self.constrained and rest:       # under a grammar: the tag, cut (no text)
                self.state, rest = REASONING, ""
        return (rest, "") if self.state == REASONING else ("", rest)

    def parse(self, text: str) -> tuple[str, str]:
        """``(reasoning, content)`` of a whole output."""
        r1, c1 = self.feed(text)
        r2, c2 = self.finish()
        return r1 + r2, c1 + c2


def thinking_enabled(template_kwargs: dict | None) -> bool:
    """Whether a chat request's template variables (``chat_template_kwargs`` over the
    server's defaults) turn thinking on: ``enable_thinking`` (Qwen3's templates) or
    ``thinking`` (DeepSeek-V3.1's) true."""
    kwargs = template_kwargs or {}
    return bool(kwargs.get("enable_thinking", kwargs.get("thinking", False)))


def initial_state(prompt_tail: str, start: str, end: str) -> str:
    """The state at the first output token, read from the end of the prompt."""
    opened, closed = prompt_tail.rfind(start), prompt_tail.rfind(end)
    if opened > closed:
        return REASONING
    if closed >= 0 and prompt_tail.rstrip().endswith(end):
        return CONTENT
    return AWAIT


class Qwen3ReasoningParser(ThinkReasoningParser):
    """``--reasoning-parser qwen3``: output without ``<think>`` is the answer (thinking
    off)."""

    name = "qwen3"
    untagged = CONTENT


class DeepSeekR1ReasoningParser(ThinkReasoningParser):
    """``--reasoning-parser deepseek_r1``: everything before ``</think>`` is reasoning, with
    or without the opening tag (R1's template pre-fills it)."""

    name = "deepseek_r1"
    untagged = REASONING
