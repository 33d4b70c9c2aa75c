"""Incremental detokenization and stop-string matching for one request.

The decoded text of a growing token list is produced piece by piece without re-decoding the
whole sequence: only a short window (``prefix_offset`` .. end) is decoded and the text beyond
the already-emitted part (``prefix_offset`` .. ``read_offset``) is the new piece. A piece that
ends in U+FFFD (a UTF-8 character whose bytes are split across byte-fallback tokens) is held
back until the character completes, so a broken character is never emitted. Decoding a window
that starts a few tokens before the new ones keeps sentencepiece's leading-space handling
right (the decoder strips a space only at the start of the text it is given).

Reference: vLLM's ``detokenize_incrementally`` (``vllm/transformers_utils/detokenizer_utils.py``),
with the same five-token initial window.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

#: Prompt tokens kept before the first generated token as decoding context.
INITIAL_OFFSET = 5


class IncrementalDetokenizer:
    """Turns one request's generated ids into text, piece by piece.

    Args:
        tokenizer: the model's tokenizer.
        prompt_token_ids: the prompt ids (only the last few are used as context).
        skip_special_tokens: drop special tokens from the text.
        stop: stop strings; the text is cut at the first one found.
        include_stop_str_in_output: keep the matched stop string in the text.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int],
                 skip_special_tokens: bool, stop: tuple[str, ...] = (),
                 include_stop_str_in_output: bool = False):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids = list(prompt_token_ids[-(INITIAL_OFFSET + 1):])
        self._read_offset = len(self._ids)
        self._prefix_offset = max(self._read_offset - INITIAL_OFFSET, 0)
        self._stop = stop
        self._include_stop = include_stop_str_in_output
        self.text = ""

    def add_token(self, token_id: int) -> str | None:
        """Append one generated id and extend :attr:`text`.

        Returns:
            The stop string that matched (``text`` is then cut), else None.
        """
        self._ids.append(token_id)
        prefix = self._decode(self._prefix_offset, self._read_offset)
        full = self._decode(self._prefix_offset, len(self._ids))
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None
        piece = full[len(prefix):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        start = max(len(self.text) - max((len(s) for s in self._stop), default=0) + 1, 0)
        self.text += piece
        return self._match_stop(start)

    def visible_text(self, finished: bool) -> str:
        """The text to report: while generation goes on, the last ``len(longest stop) - 1``
        characters are held back (they might still become a stop string, which would cut
        them), so reported text only ever grows; all of it once finished."""
        if finished or not self._stop:
            return self.text
        hold = max(len(s) for s in self._stop) - 1
        return self.text[:max(len(self.text) - hold, 0)]

    def _decode(self, start: int, end: int) -> str:
        return self._tok.decode(self._ids[start:end], skip_special_tokens=self._skip)

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
