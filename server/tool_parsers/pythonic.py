"""``--tool-call-parser pythonic``: an output that is a Python list of calls with keyword
arguments, ``[get_weather(city="Paris"), get_time(zone="CET")]`` (Llama 3.2 / Llama 4 /
ToolACE style). Argument values are Python literals (strings, numbers, booleans, None,
lists, dicts); an output that is not such a list is content.

Format: vLLM's ``vllm/entrypoints/openai/tool_parsers/pythonic_tool_parser.py``; parsed with
:func:`ast.parse` and :func:`ast.literal_eval` (never evaluated).
"""

from __future__ import annotations

import ast

from jaxpaged.server.tool_parsers.base import LeadingCallsParser

_CLOSE = {"[": "]", "(": ")", "{": "}"}


def list_end(text: str, start: int) -> int | None:
    """The index after the bracket closing the ``[`` at ``start`` (quotes and nesting
    followed), or None when it is not closed yet."""
    stack, quote, i = [], None, start
    while i < len(text):
        ch = text[i]
        if quote:
            if ch == "\\":
                i += 1
            elif ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch in _CLOSE:
            stack.append(_CLOSE[ch])
        elif stack and ch == stack[-1]:
            stack.pop()
            if not stack:
                return i + 1
        i += 1
    return None


def parse_call_list(source: str) -> list[tuple[str, dict]] | None:
    """The ``(name, keyword arguments)`` of a Python list of calls, or None."""
    try:
        tree = ast.parse(source.strip(), mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(tree, ast.List):
        return None
    calls = []
    for node in tree.elts:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)) or node.args \
                or any(k.arg is None for k in node.keywords):
            return None
        try:
            calls.append((node.func.id, {k.arg: ast.literal_eval(k.value)
                                         for k in node.keywords}))
        except (ValueError, TypeError, SyntaxError, RecursionError):
            return None
    return calls


class PythonicToolParser(LeadingCallsParser):
    """One Python list of calls, emitted when its closing bracket arrives."""

    name = "pythonic"
    openers = ("[",)
    keeps_special_tokens = False

    def take_calls(self, text: str, final: bool):
        if "[" not in text:              # after the list: only blank text is no content
            return ([], 0) if not text.strip() else None
        start = text.index("[")
        end = list_end(text, start)
        if end is None:
            return None if final else ([], 0)
        calls = parse_call_list(text[:end])
        return None if calls is None else (calls, end)
