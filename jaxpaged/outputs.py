"""Request outputs, with vLLM's class and field names (``vllm/outputs.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One generated sequence of a request.

    Attributes:
        index: the sequence's index within the request (0 while ``n`` is 1).
        text: the generated text so far (the prompt is not included).
        token_ids: the generated token ids so far.
        finish_reason: None while running, then ``"stop"`` (EOS, stop token or stop string),
            ``"length"`` (``max_tokens`` or ``max_model_len``) or ``"abort"``.
        stop_reason: the stop string or stop token id that ended it; None for EOS or length.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        """True once the sequence has a finish reason."""
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request after an engine step.

    Attributes:
        request_id: the id given to ``Engine.add_request``.
        prompt: the prompt text (None if the request was given as token ids only).
        prompt_token_ids: the prompt's token ids, BOS included when the tokenizer adds it.
        outputs: the request's sequences.
        finished: True when every sequence has finished.
        num_preemptions: how often the request was preempted (its KV recomputed).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_preemptions: int = 0
