"""The --reasoning-parser parsers on exact texts, whole and a character at a time: the
initial state read from the prompt's end, and qwen3 / deepseek_r1 on untagged output."""

from __future__ import annotations

import pytest

from jaxpaged.server.reasoning import REASONING_PARSERS

PROMPT = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def split(name: str, prompt: str, text: str) -> tuple[str, str]:
    """(reasoning, content) of ``text``; the same when fed a character at a time."""
    whole = REASONING_PARSERS[name](prompt).parse(text)
    parser, pieces = REASONING_PARSERS[name](prompt), []
    pieces = [parser.feed(ch) for ch in text] + [parser.finish()]
    assert ("".join(r for r, _ in pieces), "".join(c for _, c in pieces)) == whole
    return whole


@pytest.mark.parametrize("name, prompt, text, expected", [
    ("qwen3", PROMPT, "<think>\nplan\n</think>\n\nanswer", ("\nplan\n", "\n\nanswer")),
    ("deepseek_r1", PROMPT, "<think>\nplan\n</think>\n\nanswer", ("\nplan\n", "\n\nanswer")),
    # untagged output: qwen3 thinks only inside tags, R1 always thinks
    ("qwen3", PROMPT, "plan</think>answer", ("", "plan</think>answer")),
    ("deepseek_r1", PROMPT, "plan</think>answer", ("plan", "answer")),
    # a pre-filled open block, and an empty closed block (thinking off)
    ("qwen3", PROMPT + "<think>\n", "plan</think>answer", ("plan", "answer")),
    ("deepseek_r1", PROMPT + "<think>\n\n</think>\n\n", "<think>x</think>y",
     ("", "<think>x</think>y")),
    # cut inside the block, and a lone start of a tag at the end
    ("qwen3", PROMPT, "<think>\nstill </thi", ("\nstill </thi", "")),
    ("qwen3", PROMPT, "<thi", ("", "<thi")),
    ("deepseek_r1", PROMPT, "<thi", ("<thi", "")),
])
def test_reasoning_split(name, prompt, text, expected):
    assert split(name, prompt, text) == expected


def test_a_split_tag_is_held_back_until_decided():
    parser = REASONING_PARSERS["qwen3"](PROMPT)
    assert [parser.feed(t) for t in ("<th", "ink>", "a <", "/th", "ink", ">b")] == [
        ("", ""), ("", ""), ("a ", ""), ("", ""), ("", ""), ("", "b")]
    assert parser.finish() == ("", "")
