"""Turns sampled tokens into request state and `RequestOutput`s.

It keeps every unfinished request's output state (:attr:`OutputProcessor.groups`). For every
sampled token of a sequence (appended and checked against the token-id stop rules by
``Scheduler.update_from_output``, ``jaxpaged.core.stop_check``): record its logprobs,
detokenize it incrementally and find stop strings in the text, returning a match for the
scheduler to finish the sequence with; and report the request's sequences together (a
request with ``n > 1`` has several). Pure Python, no JAX.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jaxpaged.core.detokenizer import IncrementalDetokenizer
from jaxpaged.core.pooling import pooling_output
from jaxpaged.core.request import Request, RequestStatus
from jaxpaged.outputs import CompletionOutput, Logprob, RequestOutput
from jaxpaged.core.runner_output import TokenLogprob
from jaxpaged.core.stop_check import Stop
from jaxpaged.sampling_params import RequestOutputKind

# Enum members read once per token below: a module global costs ~10 ns, ``Enum.MEMBER``
# ~130 ns on CPython 3.12 (the enum class's attribute lookup).
_FINISHED = RequestStatus.FINISHED
_FINAL_ONLY, _DELTA = RequestOutputKind.FINAL_ONLY, RequestOutputKind.DELTA


@dataclass(slots=True)
class SequenceState:
    """Output-side state of one sequence: its text, logprobs, and how much of them earlier
    delta outputs carried.

    """

    request: Request
    detokenizer: IncrementalDetokenizer
    #: Ids whose text is not rendered yet, for a sequence whose text nobody reads before it
    #: finishes (final-only output, no stop strings): rendered at once when it finishes
    #: (``IncrementalDetokenizer.add_tokens``); None: rendered token by token.
    pending: list[int] | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    sent_chars: int = 0
    sent_tokens: int = 0
    sent_final: bool = False


@dataclass(slots=True)
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
        """True once it failed, or all ``n`` sequences exist and have finished."""
        if self.error is not None:
            return True
        seqs = self.seqs
        if len(seqs) == 1:    # the common case, without a generator
            req = seqs[0].request
            return req.status is _FINISHED and req.params.n == 1
        return len(seqs) == seqs[0].request.params.n and all(
            s.request.is_finished for s in seqs)


class OutputProcessor:
    """Logprobs, detokenization, stop strings and output assembly.

    Args:
        tokenizer: the model's tokenizer.
        eos_token_ids: every EOS id of the model, its generation config and its tokenizer.
        max_model_len: the engine's length limit.

    Attributes:
        groups: every unfinished request's :class:`RequestGroup`, by request id.
        seqs: every unfinished sequence's :class:`SequenceState`, by sequence id.
    """

    def __init__(self, tokenizer, eos_token_ids: frozenset[int], max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        anchor = tokenizer.encode("a", add_special_tokens=False)
        self._anchor = anchor[-1:] if anchor else []
        self._anchor_text = tokenizer.decode(self._anchor)
        self._token_texts: dict[int, str] = {}
        self.groups: dict[str, RequestGroup] = {}
        self.seqs: dict[str, SequenceState] = {}

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

    def add_request(self, req: Request, arrival_time: float) -> RequestGroup:
        """Start the output state of a new request (its first sequence); ``arrival_time`` in
        ``time.monotonic()`` seconds."""
        group = RequestGroup(req.group_id, arrival_time=arrival_time)
        self.groups[req.group_id] = group
        self.add_sequence(req)
        return group

    def add_sequence(self, req: Request) -> SequenceState:
        """Output state for a sequence of a known request, starting at its current tokens
        (the first one, or a parallel-sampling fork)."""
        p = req.params
        detok = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, p.skip_special_tokens,
                                       p.stop_strings, p.include_stop_str_in_output,
                                       p.spaces_between_special_tokens)
        state = SequenceState(req, detok, [] if p.output_kind is _FINAL_ONLY
                              and not p.stop_strings else None)
        if p.logprobs is not None:
            state.logprobs, state.cumulative_logprob = [], 0.0
        self.groups[req.group_id].seqs.append(state)
        self.seqs[req.request_id] = state
        return state

    def remove_request(self, request_id: str) -> RequestGroup | None:
        """Forget a request's output state (finished or aborted); None if unknown."""
        group = self.groups.pop(request_id, None)
        if group is not None:
            for seq in group.seqs:
                self.seqs.pop(seq.request.request_id, None)
        return group

    def add_token(self, req: Request, token: int, logprob: TokenLogprob | None,
                  stop: Stop | None) -> str | None:
        """Record the output side of sequence ``req``'s newest token (already appended to
        ``req.all_token_ids`` by ``Scheduler.update_from_output``): its logprob entry, when
        the sequence asked for logprobs, and its text.

        Args:
            stop: what :func:`jaxpaged.core.stop_check.check_stop` found for the token. An
                EOS adds no text, a stop id only with ``include_stop_str_in_output``; text is
                searched for stop strings from the ``min_tokens``-th token on, unless an EOS
                or stop id fired (a stop string outranks the length limit).

        Returns:
            The stop string the text now ends with (cut from the text, unless
            ``include_stop_str_in_output``), or None. The scheduler finishes the sequence
            with it, or with ``stop``.
        """
        state = self.seqs[req.request_id]
        p = req.params
        if stop is None and state.logprobs is None and (
                not p.min_tokens or len(req.all_token_ids) - len(req.prompt_token_ids)
                >= p.min_tokens):
            pending = state.pending    # (most tokens: the last two branches below)
            if pending is None:
                return state.detokenizer.add_token(token)
            pending.append(token)
            return None
        if state.logprobs is not None:
            lp, rank, top_ids, top_logprobs = logprob
            k = p.logprobs
            entry = {t: Logprob(v, r + 1, self.token_text(t))
                     for r, (t, v) in enumerate(zip(top_ids[:k], top_logprobs[:k]))}
            entry.setdefault(token, Logprob(lp, rank, self.token_text(token)))
            state.logprobs.append(entry)
            state.cumulative_logprob += lp
        matched = None
        pending = state.pending
        if len(req.all_token_ids) - len(req.prompt_token_ids) < p.min_tokens:
            if pending is None:     # (stop ids and strings wait for min_tokens)
                state.detokenizer.add_token(token, check_stop=False)
            else:
                pending.append(token)
        elif stop is not None and stop[0] == "stop":     # an EOS or a stop id
            if stop[1] is not None and p.include_stop_str_in_output:
                if pending is None:
                    state.detokenizer.add_token(token, check_stop=False)
                else:
                    pending.append(token)
        elif pending is not None:       # (no stop strings: nothing to match)
            pending.append(token)
        else:
            matched = state.detokenizer.add_token(token)
        if stop is not None and matched is None:
            if pending is None:
                state.detokenizer.flush()    # (a stop string cut the text: nothing to release)
            else:
                state.detokenizer.add_tokens(pending, final=True)
                state.pending = None
        return matched

    def add_prompt_logprobs(self, request_id: str, start: int,
                            entries: list[TokenLogprob]) -> None:
        """Record the prompt logprobs a chunk starting at position ``start`` computed (entry
        j predicts prompt token ``start + j + 1``); a recomputation after preemption adds
        nothing new."""
        group = self.groups[request_id]
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
    def make_output(group: RequestGroup,
                    num_preemptions: int | None = None) -> RequestOutput | None:
        """The request's output now, shaped by its ``output_kind``: cumulative text, ids and
        logprobs; or only what is new since the previous output (delta; sequences with
        nothing new are left out); or nothing until it finishes (final only, then cumulative).
        A pooling request's is a ``PoolingRequestOutput``, once, when it finishes.
        ``num_preemptions``: the count to report (default: the sequences' count now).
        """
        seqs = group.seqs
        first = seqs[0].request
        if first.pooling is not None:
            return pooling_output(group.request_id, first.prompt_token_ids, first.pooling,
                                  group.error) if group.finished else None
        kind = first.params.output_kind
        if kind is _FINAL_ONLY and first.status is not _FINISHED and group.error is None:
            return None     # (a sequence still runs: not finished, without the property)
        finished = group.finished
        if kind is _FINAL_ONLY and not finished:
            return None
        if len(seqs) > 1:
            seqs = sorted(seqs, key=lambda s: s.request.index)
        delta = kind is _DELTA
        outs = []
        for s in seqs:
            req = s.request
            reason = req.finish_reason
            if s.pending is not None:    # finished without a stop rule (abort, error)
                s.detokenizer.add_tokens(s.pending, final=False)
                s.pending = None
            text = s.detokenizer.visible_text(reason is not None)
            if delta:   # only what is new; no copy of what was sent before
                if s.sent_final or (len(text) == s.sent_chars and reason is None
                                    and req.num_output_tokens == s.sent_tokens):
                    continue
                text = text[s.sent_chars:]
                ids = req.all_token_ids[req.num_prompt_tokens + s.sent_tokens:]
                logprobs = s.logprobs[s.sent_tokens:] if s.logprobs is not None else None
                s.sent_chars += len(text)
                s.sent_tokens += len(ids)
                s.sent_final = reason is not None
            else:
                ids = req.all_token_ids[len(req.prompt_token_ids):]
                logprobs = list(s.logprobs) if s.logprobs is not None else None
            outs.append(CompletionOutput(req.index, text, ids, s.cumulative_logprob, logprobs,
                                         reason, req.stop_reason))
        if not outs:
            return None
        if num_preemptions is None:
            num_preemptions = (first.num_preemptions if len(seqs) == 1
                               else sum(s.request.num_preemptions for s in seqs))
        # Positional (RequestOutput's field order): one per request per step.
        return RequestOutput(group.request_id, first.prompt, first.prompt_token_ids,
                             group.prompt_logprobs, outs, finished,
                             first.num_cached_tokens or 0, num_preemptions, group.error)
