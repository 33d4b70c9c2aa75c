"""Turns sampled tokens into request state and `RequestOutput`s.

For every sampled token of a sequence: append it, apply vLLM's stop rules in vLLM's order
(EOS unless ``ignore_eos``, ``stop_token_ids``, stop strings found by the incremental
detokenizer, then length: ``max_tokens`` or ``max_model_len``), record its logprobs, and
report the request's sequences together (a request with ``n > 1`` has several).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jaxpaged.engine.detokenizer import IncrementalDetokenizer
from jaxpaged.engine.request import Request
from jaxpaged.outputs import CompletionOutput, Logprob, RequestOutput
from jaxpaged.sampling_params import RequestOutputKind


@dataclass
class SequenceState:
    """Output-side state of one sequence: its text, logprobs, and how much of them earlier
    delta outputs carried."""

    request: Request
    detokenizer: IncrementalDetokenizer
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    sent_chars: int = 0
    sent_tokens: int = 0
    sent_final: bool = False


@dataclass
class RequestGroup:
    """The sequences of one user request (one unless ``n > 1``), its prompt logprobs, its
    timestamps (``time.monotonic()`` seconds; None until the event happens), and why it
    failed (``error``; None unless a step that ran it raised)."""

    request_id: str
    seqs: list[SequenceState] = field(default_factory=list)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.error is not None or (len(self.seqs) == self.seqs[0].request.params.n and all(
            s.request.is_finished for s in self.seqs))


class OutputProcessor:
    """Stop rules, detokenization and output assembly.

    Args:
        tokenizer: the model's tokenizer.
        eos_token_ids: every EOS id of the model, its generation config and its tokenizer.
        max_model_len: the engine's length limit.
    """

    def __init__(self, tokenizer, eos_token_ids: frozenset[int], max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        anchor = tokenizer.encode("a", add_special_tokens=False)
        self._anchor = anchor[-1:] if anchor else []
        self._anchor_text = tokenizer.decode(self._anchor)
        self._token_texts: dict[int, str] = {}

    def token_text(self, token: int) -> str:
        """A token's text as it reads inside a text (``" there"`` for SentencePiece's
        ``"▁there"``, whose lone decode drops the space): the decode of an ordinary token
        followed by this one, less that token's own text. Cached per id."""
        text = self._token_texts.get(token)
        if text is None:
            both = self.tokenizer.decode(self._anchor + [token])
            text = both[len(self._anchor_text):] if both.startswith(self._anchor_text) \
                else self.tokenizer.decode([token])
            self._token_texts[token] = text
        return text

    def new_sequence(self, req: Request) -> SequenceState:
        """Output state for a sequence starting at its current tokens."""
        p = req.params
        detok = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, p.skip_special_tokens,
                                       p.stop_strings, p.include_stop_str_in_output,
                                       p.spaces_between_special_tokens)
        state = SequenceState(req, detok)
        if p.logprobs is not None:
            state.logprobs, state.cumulative_logprob = [], 0.0
        return state

    def append_token(self, state: SequenceState, token: int, logprob: float | None = None,
                     rank: int | None = None, top_ids: list[int] | None = None,
                     top_logprobs: list[float] | None = None) -> None:
        """Record one sampled token and set ``finish_reason`` if a stop rule fires."""
        req = state.request
        req.all_token_ids.append(token)
        if state.logprobs is not None:
            k = req.params.logprobs
            entry = {t: Logprob(lp, r + 1, self.token_text(t))
                     for r, (t, lp) in enumerate(zip(top_ids[:k], top_logprobs[:k]))}
            entry.setdefault(token, Logprob(logprob, rank, self.token_text(token)))
            state.logprobs.append(entry)
            state.cumulative_logprob += logprob
        p = req.params
        may_stop = req.num_output_tokens >= p.min_tokens
        if not may_stop:
            state.detokenizer.add_token(token, check_stop=False)
        elif not p.ignore_eos and token in self.eos_token_ids:
            req.finish_reason = "stop"
        elif token in p.stop_token_id_set:
            req.finish_reason, req.stop_reason = "stop", token
            if p.include_stop_str_in_output:
                state.detokenizer.add_token(token, check_stop=False)
        else:
            stop = state.detokenizer.add_token(token)
            if stop is not None:
                req.finish_reason, req.stop_reason = "stop", stop
        if req.finish_reason is None and (req.num_output_tokens >= req.max_tokens
                                          or req.num_tokens >= self.max_model_len):
            req.finish_reason = "length"
        if req.finish_reason is not None and not isinstance(req.stop_reason, str):
            state.detokenizer.flush()   # a stop string cut the text: nothing to release

    def add_prompt_logprobs(self, group: RequestGroup, start: int, entries) -> None:
        """Record the prompt logprobs a chunk starting at position ``start`` computed (entry
        j predicts prompt token ``start + j + 1``); a recomputation after preemption adds
        nothing new."""
        req = group.seqs[0].request
        if group.prompt_logprobs is None:
            group.prompt_logprobs = [None]
        k = req.params.prompt_logprobs
        for j, (lp, rank, top_ids, top_lps) in enumerate(entries):
            position = start + j + 1
            if position < len(group.prompt_logprobs):
                continue
            token = req.prompt_token_ids[position]
            entry = {t: Logprob(v, r + 1, self.token_text(t))
                     for r, (t, v) in enumerate(zip(top_ids[:k], top_lps[:k]))}
            entry.setdefault(token, Logprob(lp, rank, self.token_text(token)))
            group.prompt_logprobs.append(entry)

    @staticmethod
    def make_output(group: RequestGroup) -> RequestOutput | None:
        """The request's output now, shaped by its ``output_kind``: cumulative text, ids and
        logprobs; or only what is new since the previous output (delta; sequences with
        nothing new are left out); or nothing until it finishes (final only, then cumulative).
        """
        first = group.seqs[0].request
        kind = first.params.output_kind
        if kind is RequestOutputKind.FINAL_ONLY and not group.finished:
            return None
        outs = []
        for s in sorted(group.seqs, key=lambda s: s.request.index):
            req = s.request
            done = req.finish_reason is not None
            text, ids = s.detokenizer.visible_text(done), req.output_token_ids
            logprobs = list(s.logprobs) if s.logprobs is not None else None
            if kind is RequestOutputKind.DELTA:
                if s.sent_final or (len(text) == s.sent_chars and len(ids) == s.sent_tokens
                                    and not done):
                    continue
                text, ids = text[s.sent_chars:], ids[s.sent_tokens:]
                logprobs = logprobs[s.sent_tokens:] if logprobs is not None else None
                s.sent_chars += len(text)
                s.sent_tokens += len(ids)
                s.sent_final = done
            outs.append(CompletionOutput(req.index, text, ids, s.cumulative_logprob, logprobs,
                                         req.finish_reason, req.stop_reason))
        if not outs:
            return None
        return RequestOutput(
            request_id=group.request_id, prompt=first.prompt,
            prompt_token_ids=first.prompt_token_ids, prompt_logprobs=group.prompt_logprobs,
            outputs=outs, finished=group.finished,
            num_cached_tokens=first.num_cached_tokens or 0,
            num_preemptions=sum(s.request.num_preemptions for s in group.seqs),
            error=group.error)

