"""Request outputs, with vLLM's class and field names (``vllm/outputs.py``, ``vllm/logprobs.py``).

The classes have ``__slots__``: the engine builds a ``RequestOutput`` and a ``CompletionOutput``
per request per step (and a ``Logprob`` per returned logprob), and a slotted instance is
smaller and faster to build; no attribute outside the fields can be set on them.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    """One token's log-probability.

    Attributes:
        logprob: natural-log probability under the raw model distribution.
        rank: 1 for the most likely token of the vocabulary.
        decoded_token: the token's text.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(slots=True)
class CompletionOutput:
    """One generated sequence of a request.

    Attributes:
        index: the sequence's index within the request (0 .. n-1).
        text: the generated text so far (the prompt is not included).
        token_ids: the generated token ids so far.
        cumulative_logprob: sum of the sampled tokens' logprobs (None unless ``logprobs`` was set).
        logprobs: per generated token, ``{token_id: Logprob}`` for the sampled token and the
            ``logprobs`` most likely ones (None unless ``logprobs`` was set).
        finish_reason: None while running, then ``"stop"`` (EOS, stop token or stop string),
            ``"length"`` (``max_tokens`` or ``max_model_len``), ``"abort"``, or ``"error"``
            (a model step that ran the request failed; ``RequestOutput.error`` says why).
        stop_reason: the stop string or stop token id that ended it; None for EOS or length.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        """True once the sequence has a finish reason."""
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """The state of one request after an engine step.

    Attributes:
        request_id: the id given to ``Engine.add_request``.
        prompt: the prompt text (None if the request was given as token ids only).
        prompt_token_ids: the prompt's token ids, BOS included when the tokenizer adds it.
        prompt_logprobs: with ``prompt_logprobs`` set, one entry per prompt token: None for
            the first, then ``{token_id: Logprob}`` for the token and the most likely ones.
        outputs: the request's sequences, by index.
        finished: True when every sequence has finished.
        num_cached_tokens: prompt tokens served from the prefix cache.
        num_preemptions: how often the request's sequences were preempted, in total.
        error: why the request failed (its sequences' finish reason is then ``"error"``);
            None otherwise.
        weight_version: the engine's weight version (``Engine.weight_version``: 0 at
            start-up, +1 per weight update) whose model produced this output's tokens.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    error: str | None = None
    weight_version: int = 0

    def add(self, next_output: "RequestOutput", aggregate: bool) -> None:
        """Fold a later output of the same request into this one (vLLM's
        ``RequestOutput.add``): a consumer that fell behind then gets one output instead of a
        queue of them.

        Args:
            next_output: the request's next output.
            aggregate: the outputs are deltas (``RequestOutputKind.DELTA``): append each
                sequence's new text, ids and logprobs. Otherwise the later output replaces
                this one's sequences (it is cumulative).
        """
        self.prompt_logprobs = next_output.prompt_logprobs
        self.finished = next_output.finished
        self.num_cached_tokens = next_output.num_cached_tokens
        self.num_preemptions = next_output.num_preemptions
        self.error = next_output.error
        self.weight_version = next_output.weight_version
        if not aggregate:
            self.outputs = next_output.outputs
            return
        mine = {out.index: out for out in self.outputs}
        for out in next_output.outputs:
            prev = mine.get(out.index)
            if prev is None:
                mine[out.index] = out
                continue
            prev.text += out.text
            prev.token_ids.extend(out.token_ids)
            if prev.logprobs is None:
                prev.logprobs = out.logprobs
            elif out.logprobs is not None:
                prev.logprobs.extend(out.logprobs)
            prev.cumulative_logprob = out.cumulative_logprob
            prev.finish_reason, prev.stop_reason = out.finish_reason, out.stop_reason
        self.outputs = sorted(mine.values(), key=lambda out: out.index)


@dataclass(slots=True)
class PoolingOutput:
    """A pooling request's result (vLLM's ``PoolingOutput``).

    Attributes:
        data: [hidden_size] float32 numpy array: the pooled (and, as configured,
            L2-normalised) final hidden states of the prompt.
    """

    data: object


@dataclass(slots=True)
class PoolingRequestOutput:
    """The output of a pooling request, as ``Engine.step`` returns it once, when finished
    (vLLM's ``PoolingRequestOutput``).

    Attributes:
        request_id: the id given to ``Engine.add_request``.
        outputs: the pooled vector (None if the request failed).
        prompt_token_ids: the prompt's token ids (BOS included when the tokenizer adds it).
        finished: always True (a pooling request has one output).
        num_cached_tokens: prompt tokens served from the prefix cache (0: pooling requests
            compute every token).
        error: why the request failed (its step raised); None otherwise.
    """

    request_id: str
    outputs: PoolingOutput | None
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0
    error: str | None = None


@dataclass(slots=True)
class EmbeddingOutput:
    """An embedding (vLLM's ``EmbeddingOutput``).

    Attributes:
        embedding: the vector as Python floats (float32 values).
    """

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass(slots=True)
class EmbeddingRequestOutput:
    """What ``LLM.embed`` returns per prompt (vLLM's ``EmbeddingRequestOutput``).

    Attributes:
        request_id: the engine's request id.
        outputs: the embedding.
        prompt_token_ids: the prompt's token ids.
        finished: always True.
    """

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True

    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> EmbeddingRequestOutput:
        """The embedding view of a finished pooling output.

        Raises:
            RuntimeError: the request failed (its ``error``).
        """
        return cls(out.request_id, EmbeddingOutput(pooled_values(out)), out.prompt_token_ids,
                   out.finished)


def pooled_values(out: PoolingRequestOutput) -> list[float]:
    """A finished pooling output's values as a list of floats.

    Raises:
        RuntimeError: the request failed (its ``error``).
    """
    if out.error is not None or out.outputs is None:
        raise RuntimeError(f"request {out.request_id} failed: {out.error}")
    return out.outputs.data.tolist()


@dataclass(slots=True)
class ClassificationOutput:
    """A classifier's output for one prompt (vLLM's ``ClassificationOutput``).

    Attributes:
        probs: per label, the head's sigmoid (one label) or softmax (several) of its logits
            (the logits themselves with ``PoolingParams(use_activation=False)``).
    """

    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass(slots=True)
class ClassificationRequestOutput:
    """What ``LLM.classify`` returns per prompt (vLLM's ``ClassificationRequestOutput``)."""

    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True

    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> ClassificationRequestOutput:
        """The classification view of a finished pooling output of a classify engine.

        Raises:
            RuntimeError: the request failed (its ``error``).
        """
        return cls(out.request_id, ClassificationOutput(pooled_values(out)),
                   out.prompt_token_ids, out.finished)


@dataclass(slots=True)
class ScoringOutput:
    """One pair's score (vLLM's ``ScoringOutput``): a classifier's one-label output, or the
    cosine similarity of two embeddings."""

    score: float


@dataclass(slots=True)
class ScoringRequestOutput:
    """What ``LLM.score`` returns per pair (vLLM's ``ScoringRequestOutput``).

    Attributes:
        request_id: the engine's request id (an embedding model's: both texts' ids).
        outputs: the score.
        prompt_token_ids: the pair's prompt (an embedding model's: both texts' ids).
        finished: always True.
    """

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True
