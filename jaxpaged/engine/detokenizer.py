"""Incremental detokenization and stop-string matching for one request.

After each generated token the text is the decode of (the prompt's last few tokens + every
generated token) minus the decode of those prompt tokens alone. Decoding with the prompt's
tail as context keeps sentencepiece's leading-space handling right (its decoder strips a space
only at the start of the text it is given); decoding the whole output each time, rather than a
sliding window, keeps the text exact when byte-fallback or byte-level tokens form invalid UTF-8
(a window can render replacement characters differently from the full decode). Trailing
U+FFFD characters — a character whose bytes have not all arrived — are held back until it
completes, and released as the full decode renders them when generation ends (:meth:`flush`).
Sentencepiece byte-fallback tokens (``<0xNN>``) are decoded a run at a time and a run that is
not valid UTF-8 turns into one U+FFFD per byte, so a trailing run of them is held back whole
until a non-byte token closes it.
The cost is one decode of the output per token (a few microseconds per hundred tokens with
Rust-backed tokenizers).

Reference: vLLM's incremental detokenizer (``vllm/v1/engine/detokenizer.py``) for the
context-window and hold-back rules.
"""

from __future__ import annotations

import re

from transformers import PreTrainedTokenizerBase

#: Prompt tokens decoded before the generated ones as context (vLLM's initial offset).
INITIAL_OFFSET = 5


_BYTE_TOKEN = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")
_byte_token_cache: dict[int, frozenset[int]] = {}


def byte_fallback_ids(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """Ids of the tokenizer's ``<0xNN>`` byte-fallback pieces (empty for byte-level BPE);
    computed once per tokenizer object."""
    key = id(tokenizer)
    if key not in _byte_token_cache:
        _byte_token_cache[key] = frozenset(
            i for piece, i in tokenizer.get_vocab().items() if _BYTE_TOKEN.match(piece))
    return _byte_token_cache[key]


class IncrementalDetokenizer:
    """Turns one request's generated ids into text, token by token.

    Args:
        tokenizer: the model's tokenizer.
        prompt_token_ids: the prompt ids (only the last few are used as context).
        skip_special_tokens: drop special tokens from the text.
        stop: stop strings; the text is cut at the first one found.
        include_stop_str_in_output: keep the matched stop string in the text.
        spaces_between_special_tokens: passed to the tokenizer's ``decode`` (fast tokenizers
            ignore it, as they do in vLLM).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int],
                 skip_special_tokens: bool, stop: tuple[str, ...] = (),
                 include_stop_str_in_output: bool = False,
                 spaces_between_special_tokens: bool = True):
        self._tok = tokenizer
        self._decode_kwargs = {"skip_special_tokens": skip_special_tokens,
                               "spaces_between_special_tokens": spaces_between_special_tokens}
        self._context = list(prompt_token_ids[-INITIAL_OFFSET:])
        self._context_text = self._tok.decode(self._context, **self._decode_kwargs)
        self._out: list[int] = []
        self._byte_ids = byte_fallback_ids(tokenizer)
        self._stop = stop
        self._include_stop = include_stop_str_in_output
        self.text = ""

    def add_token(self, token_id: int, check_stop: bool = True) -> str | None:
        """Append one generated id and extend :attr:`text`.

        Args:
            token_id: the new token.
            check_stop: look for stop strings in the new text (off before ``min_tokens``).

        Returns:
            The stop string that matched (``text`` is then cut), else None.
        """
        self._out.append(token_id)
        closed = len(self._out)
        while closed and self._out[closed - 1] in self._byte_ids:
            closed -= 1      # an open run of byte tokens may still be re-rendered
        stable = self._decoded(closed).rstrip("\ufffd")
        if len(stable) <= len(self.text):
            return None
        start = max(len(self.text) - max((len(s) for s in self._stop), default=0) + 1, 0)
        self.text += stable[len(self.text):]
        return self._match_stop(start) if check_stop else None

    def flush(self) -> None:
        """At the end of generation, release text held back for an incomplete UTF-8
        character, rendered as the full decode renders it (with U+FFFD)."""
        full = self._decoded()
        if len(full) > len(self.text):
            self.text += full[len(self.text):]

    def visible_text(self, finished: bool) -> str:
        """The text to report: while generation goes on, the last ``len(longest stop) - 1``
        characters are held back (they might still become a stop string, which would cut
        them), so reported text only ever grows; all of it once finished."""
        if finished or not self._stop:
            return self.text
        hold = max(len(s) for s in self._stop) - 1
        return self.text[:max(len(self.text) - hold, 0)]

    def _decoded(self, end: int | None = None) -> str:
        """The text of the first ``end`` generated tokens (all by default) as it reads
        after the prompt."""
        out = self._out[:end]
        full = self._tok.decode(self._context + out, **self._decode_kwargs)
        if full.startswith(self._context_text):
            return full[len(self._context_text):]
        return self._tok.decode(out, **self._decode_kwargs)

    def _match_stop(self, search_from: int) -> str | None:
        best = None
        for s in self._stop:
            i = self.text.find(s, search_from)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        self.text = self.text[: i + len(s)] if self._include_stop else self.text[:i]
        return s
