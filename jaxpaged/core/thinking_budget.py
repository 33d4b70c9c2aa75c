"""The thinking budget on the host: how many tokens a sequence may spend inside its
``<think>`` block (``SamplingParams.thinking_token_budget``) before the end-of-think marker
is forced and the answer follows.

Each sequence with a budget carries a :class:`ThinkingBudget`. Before every sampling step the
runner asks it for the token that must come next (:meth:`ThinkingBudget.forced`): None while
the sequence may write freely, else the next token of the end marker, which the step's logit
adjustment then allows alone (``jaxpaged.sampling.logits_adjust.row_adjustment``). So the
budget holds in the engine itself, for ``LLM.generate`` as for the server.

Counting (vLLM's ``ThinkingTokenBudgetLogitsProcessor``, ``vllm/v1/sample/logits_processor/
builtin.py``, counts the same way, on token ids):

- a sequence is *inside* the block from the first output token when its prompt leaves a
  ``<think>`` open (the chat template pre-filled it), else from the output token that
  completes the start marker's ids; it leaves the block with the token that completes the
  end marker's ids;
- every output token inside the block counts, the model's own marker tokens included; the
  start marker's do not. The count is the sequence's total over all its blocks;
- once the count reaches the budget, the end marker's tokens are forced one after the other
  (all of them, whatever the model wrote before), so the text before ``</think>`` is exactly
  ``budget`` tokens. A block opened again after that is closed at once. Budget 0: no
  reasoning at all (the end marker follows the start at once, or opens the output when the
  prompt left the block open).

The markers are ``<think>`` / ``</think>`` (those of the server's ``qwen3`` and
``deepseek_r1`` reasoning parsers and of vLLM's default reasoning config), as token ids of
the text written mid-output (:func:`marker_ids`): one id for models that have them as special
tokens, several otherwise. Forced tokens count against ``max_tokens`` like any other: a limit
reached mid-marker cuts the output there.
"""

from __future__ import annotations

from dataclasses import dataclass

#: The text that opens / closes a reasoning block.
THINK_START, THINK_END = "<think>", "</think>"
#: Prompt tokens decoded to find an open block at its end (the server's parsers read as many).
PROMPT_TAIL_TOKENS = 32


@dataclass(frozen=True, slots=True)
class ThinkMarkers:
    """The token ids of the reasoning block's markers.

    Attributes:
        start, end: ids of :data:`THINK_START` / :data:`THINK_END` as the model writes them
            mid-output (non-empty tuples of ints).
        start_text, end_text: the markers' text.
    """

    start: tuple[int, ...]
    end: tuple[int, ...]
    start_text: str = THINK_START
    end_text: str = THINK_END


def marker_ids(tokenizer, text: str) -> tuple[int, ...]:
    """The ids of ``text`` as written in the middle of an output.

    A sentencepiece tokenizer puts a word-start piece before text at the start of its input
    (``"</think>"`` alone encodes as ``"▁", "<", ...``), which an output's ``</think>`` does
    not hold: ``text`` is encoded after a newline and the newline's ids are dropped, when
    those are a prefix of the result and the rest decodes to ``text`` exactly; otherwise
    ``text`` alone is encoded (a tokenizer with ``text`` as one special token gives its id).

    Args:
        tokenizer: a transformers tokenizer (``encode``, ``decode``).
        text: the marker.

    Raises:
        ValueError: ``text`` encodes to no token.
    """
    base = tokenizer.encode("\n", add_special_tokens=False)
    joined = tokenizer.encode("\n" + text, add_special_tokens=False)
    rest = joined[len(base):]
    if base and rest and joined[:len(base)] == base and tokenizer.decode(
            base + rest, skip_special_tokens=False) == tokenizer.decode(
            base, skip_special_tokens=False) + text:
        return tuple(rest)
    ids = tokenizer.encode(text, add_special_tokens=False)
    if not ids:
        raise ValueError(f"the reasoning marker {text!r} encodes to no token")
    return tuple(ids)


def think_markers(tokenizer) -> ThinkMarkers:
    """The :class:`ThinkMarkers` of ``tokenizer`` (:func:`marker_ids` of each marker)."""
    return ThinkMarkers(marker_ids(tokenizer, THINK_START), marker_ids(tokenizer, THINK_END))


def prompt_opens_block(tokenizer, prompt_ids: list[int], start: str = THINK_START,
                       end: str = THINK_END) -> bool:
    """Whether the prompt ends inside a reasoning block: its last :data:`PROMPT_TAIL_TOKENS`
    tokens, decoded with special tokens, hold ``start`` after the last ``end`` (the
    reasoning parsers' rule, ``jaxpaged.server.reasoning.think.initial_state``)."""
    tail = tokenizer.decode(prompt_ids[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
    return tail.rfind(start) > tail.rfind(end)


@dataclass(frozen=True, slots=True)
class _State:
    inside: bool
    used: int          # output tokens spent inside blocks so far
    closing: int       # end-marker tokens forced so far in the current forced close
    recent: tuple[int, ...]   # the last few tokens (a marker may end at the next one)


class ThinkingBudget:
    """One sequence's thinking budget: which token, if any, must come next.

    Args:
        budget: most output tokens inside reasoning blocks (>= 0).
        markers: the block's marker ids.
        prompt_len: the sequence's prompt length (its output starts after it).
        inside: the prompt left a block open (:func:`prompt_opens_block`).

    The state is advanced incrementally over the output ids each call sees (outputs only
    grow), so a step costs O(new tokens), not O(output).
    """

    __slots__ = ("budget", "markers", "prompt_len", "_initial", "_seen", "_state", "_window")

    def __init__(self, budget: int, markers: ThinkMarkers, prompt_len: int, inside: bool):
        if budget < 0:
            raise ValueError(f"budget must be >= 0, got {budget}")
        if not markers.start or not markers.end:
            raise ValueError("the think markers need at least one token id each")
        self.budget, self.markers, self.prompt_len = budget, markers, prompt_len
        self._window = max(len(markers.start), len(markers.end)) - 1
        self._initial = _State(inside, 0, 0, ())
        self._seen, self._state = 0, self._initial

    def fork(self) -> ThinkingBudget:
        """A fresh tracker for another sequence of the same prompt (parallel sampling)."""
        return ThinkingBudget(self.budget, self.markers, self.prompt_len, self._initial.inside)

    @property
    def num_reasoning_tokens(self) -> int:
        """Output tokens spent inside blocks among those seen so far."""
        return self._state.used

    def forced(self, all_token_ids: list[int], drafts: list[int] | tuple = ()) -> int | None:
        """The token the sequence must sample next, or None if it is free.

        Args:
            all_token_ids: the sequence's prompt + output ids so far (the prompt's first
                ``prompt_len``); the state advances over the output ids not seen before.
            drafts: speculative tokens taken as if already output (for the verification
                row after them); they do not advance the kept state.
        """
        if len(all_token_ids) - self.prompt_len > self._seen:
            state = self._state
            for token in all_token_ids[self.prompt_len + self._seen:]:
                state = self._advance(state, token)
            self._state, self._seen = state, len(all_token_ids) - self.prompt_len
        state = self._state
        for token in drafts:
            state = self._advance(state, token)
        if state.inside and (state.closing or state.used >= self.budget):
            return self.markers.end[state.closing]
        return None

    def _advance(self, s: _State, token: int) -> _State:
        window = s.recent + (token,)        # the marker that may end with this token
        recent = window[len(window) - self._window:] if self._window else ()
        m = self.markers
        if s.inside:
            if s.closing or s.used >= self.budget:      # this token was a forced one
                closing = s.closing + 1
                if closing == len(m.end):
                    return _State(False, s.used, 0, recent)
                return _State(True, s.used, closing, recent)
            if window[-len(m.end):] == m.end:           # the model closed the block
                return _State(False, s.used + 1, 0, recent)
            return _State(True, s.used + 1, 0, recent)
        if window[-len(m.start):] == m.start:
            return _State(True, s.used, 0, recent)
        return _State(False, s.used, 0, recent)
