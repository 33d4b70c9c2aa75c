"""The soak's workload (``benchmarks/soak.py``): seeded completion and chat requests with every
sampling feature, and the fault injector that fails the model steps of marked requests."""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from jaxpaged.sampling_params import SamplingParams

#: Text prompts of the workload (the bundled model writes children's stories); each is also
#: used with suffixes, so that requests share prefixes.
STORY_PROMPTS = (
    "Once upon a time", "Once upon a time, there was a little girl named Lily.",
    "Tom and his dog went to the park. They", "One day, a big red ball", "The sun was hot and",
    "Sue had a toy car. She", "There was a small bird who could not fly.", "Ben said,",
    "Mom and Dad took the kids to the beach. The water", "The cat saw a mouse",
)
SUFFIXES = ("", " They were happy.", " It was a sunny day.", " He", " She wanted to play")
#: Stop strings the bundled model's stories often contain.
STOP_STRINGS = (".", ",", " the", "!", "\n", " and", "Lily", "He ", "ed", " was")
#: Ends the ``X-Request-Id`` of a request whose model steps are to fail.
FAULT_MARK = "-fault"


@dataclass
class SoakConfig:
    """What one soak run sends.

    Attributes:
        num_requests: HTTP requests in all.
        concurrency: most requests in flight at once.
        disconnect_fraction: clients that hang up at a random moment.
        disconnect_window: a timed hang-up comes at a uniformly random moment of the recent
            median latency of completed requests like it; of this many seconds before any
            has completed.
        seed: seed of the workload (prompts, parameters, hang-ups).
        max_tokens: the largest ``max_tokens`` a request asks for.
        stream_fraction: requests that stream.
        chat_fraction: requests sent to chat completions (when the server has a template).
        logprobs_fraction: requests that ask for top logprobs (every request asks for the
            sampled tokens' logprobs, as token ids, which are compared).
        penalty_fraction: requests with repetition / presence / frequency penalties.
        min_tokens_fraction: requests with ``min_tokens``. Logit adjustments (penalties,
            ``min_tokens``) compile step shapes of their own: a short run on a CPU spends
            much of its time compiling them.
        idle_timeout: seconds the server has to go idle after the last answer.
        fault_fraction: requests marked to fail: every model step that runs one raises
            (:class:`MarkedFaults`), failing the step's other requests too. Needs the server
            in this process (its engine's fault hook).
        responses_fraction: text requests sent to ``/v1/responses`` instead (when the
            server has a chat template).
        messages_fraction: the other text requests sent to Anthropic's ``/v1/messages``
            instead (when the server has a chat template).
    """

    num_requests: int = 2000
    concurrency: int = 64
    disconnect_fraction: float = 0.2
    disconnect_window: float = 1.0
    seed: int = 0
    max_tokens: int = 32
    stream_fraction: float = 0.5
    chat_fraction: float = 0.15
    logprobs_fraction: float = 0.1
    penalty_fraction: float = 0.15
    min_tokens_fraction: float = 0.1
    idle_timeout: float = 30.0
    fault_fraction: float = 0.0
    responses_fraction: float = 0.1
    messages_fraction: float = 0.1

    def __post_init__(self):
        if self.num_requests < 1 or self.concurrency < 1:
            raise ValueError("the soak needs num_requests >= 1 and concurrency >= 1")
        for name in ("disconnect_fraction", "stream_fraction", "chat_fraction", "fault_fraction",
                     "logprobs_fraction", "penalty_fraction", "min_tokens_fraction",
                     "responses_fraction", "messages_fraction"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.max_tokens < 1 or self.disconnect_window <= 0:
            raise ValueError("max_tokens must be >= 1 and disconnect_window > 0")


@dataclass
class SoakRequest:
    """One request of the workload.

    Attributes:
        index: its position in the workload.
        path: ``/v1/completions`` or ``/v1/chat/completions``.
        body: the JSON body.
        prompt: what the offline engine gets (text or token ids; for chat the ids the server's
            ``/tokenize`` renders).
        params: the offline ``SamplingParams`` (the body's fields).
        disconnect_at: when the client hangs up, as a fraction of the recent median latency
            of requests like it (None: never).
        disconnect_events: SSE events after which the client hangs up (None: never).
        fault: marked for the fault injector (its model steps fail).
        headers: extra HTTP headers: ``X-Request-Id`` (``<tag>-<index>``, ``-fault`` added
            when marked), the server's request id after its ``cmpl-`` / ``chatcmpl-``.
    """

    index: int
    path: str
    body: dict
    prompt: str | list[int]
    params: SamplingParams
    disconnect_at: float | None = None
    disconnect_events: int | None = None
    fault: bool = False
    headers: dict = field(default_factory=dict)

    @property
    def comparable(self) -> bool:
        """Greedy or seeded: the offline engine must give the same output."""
        return self.params.is_greedy or self.params.seed is not None

    @property
    def chat(self) -> bool:
        return self.path.endswith("/chat/completions")

    def reproduction(self) -> dict:
        return {"path": self.path, "body": self.body, "offline_prompt": self.prompt}


@dataclass
class SoakResult:
    """What a client saw of one request."""

    status: int | None = None
    error: str = ""
    disconnected: bool = False       # the client hung up before the answer was complete
    done: bool = False               # the JSON answer, or the stream up to [DONE]
    texts: dict[int, str] = field(default_factory=lambda: defaultdict(str))
    finishes: dict[int, list[str]] = field(default_factory=lambda: defaultdict(list))
    token_ids: dict[int, list[int]] = field(default_factory=lambda: defaultdict(list))
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    latency: float = 0.0
    retries: int = 0                 # 429s (--max-pending-requests) waited out and retried

    @property
    def completed(self) -> bool:
        return self.done and self.status == 200 and not self.error


def make_workload(config: SoakConfig, model: str, tokenizer, max_model_len: int,
                  chat_prompts: Callable[[str], list[int]] | None, tag: str = "soak"
                  ) -> list[SoakRequest]:
    """The seeded workload; ``chat_prompts(text)`` gives the ids the server renders for a
    one-message chat (None: no chat requests); ``tag`` starts every ``X-Request-Id``."""
    rng = np.random.default_rng(config.seed)
    vocab = len(tokenizer)
    texts = [p + s for p in STORY_PROMPTS for s in SUFFIXES]
    id_prompts = [rng.integers(3, vocab, size=int(rng.integers(1, 40))).tolist()
                  for _ in range(20)]
    chat_ids: dict[str, list[int]] = {}
    requests = []
    for i in range(config.num_requests):
        chat = chat_prompts is not None and rng.random() < config.chat_fraction
        if chat or rng.random() < 0.6:
            text = texts[rng.integers(len(texts))]
            if rng.random() < 0.3:           # a fresh suffix: a partial prefix-cache hit
                text += f" {int(rng.integers(1000))}"
            if chat:
                if text not in chat_ids:
                    chat_ids[text] = chat_prompts(text)
                prompt = chat_ids[text]
            else:
                prompt = text
            num_prompt = len(prompt) if chat else len(tokenizer.encode(text))
        else:
            prompt = id_prompts[rng.integers(len(id_prompts))]
            if rng.random() < 0.3:
                prompt = prompt + rng.integers(3, vocab, size=int(rng.integers(1, 8))).tolist()
            num_prompt = len(prompt)
        room = max_model_len - num_prompt
        if room < 1:
            raise ValueError(f"max_model_len={max_model_len} leaves no room after a "
                             f"{num_prompt}-token prompt")
        max_tokens = int(rng.integers(1, min(config.max_tokens, room) + 1))
        fields = {"max_tokens": max_tokens, "n": int(rng.choice([1, 1, 1, 2, 3, 4]))}
        if rng.random() < 0.3:
            fields["temperature"] = 0.0
        else:
            fields.update(temperature=round(float(rng.uniform(0.3, 1.3)), 3),
                          top_p=float(rng.choice([1.0, 0.95, 0.8])),
                          top_k=int(rng.choice([0, 0, 5, 40])),
                          min_p=float(rng.choice([0.0, 0.0, 0.05])))
            if rng.random() < 0.9:
                fields["seed"] = int(rng.integers(0, 2**32))
        if rng.random() < config.penalty_fraction:
            fields.update(repetition_penalty=float(rng.choice([1.0, 1.2])),
                          presence_penalty=float(rng.choice([0.0, 0.5])),
                          frequency_penalty=float(rng.choice([0.0, 0.3])))
        if rng.random() < 0.3:
            fields["stop"] = [str(s) for s in rng.choice(STOP_STRINGS, int(rng.integers(1, 3)),
                                                         replace=False)]
            fields["include_stop_str_in_output"] = bool(rng.random() < 0.3)
        if rng.random() < 0.2:
            fields["ignore_eos"] = True
        if rng.random() < config.min_tokens_fraction:
            fields["min_tokens"] = int(rng.integers(0, max_tokens + 1))
        stream = bool(rng.random() < config.stream_fraction)
        body = {"model": model, **fields, "stream": stream}
        # Logprobs as token ids on every request: the ids are compared, not only the text.
        top = int(rng.integers(1, 4)) if rng.random() < config.logprobs_fraction else 0
        body["return_tokens_as_token_ids"] = True
        if chat:
            body.update(messages=[{"role": "user", "content": text}], logprobs=True,
                        top_logprobs=top)
        else:
            body.update(prompt=prompt, logprobs=top)
        if stream:
            body["stream_options"] = {"include_usage": True}
        req = SoakRequest(i, "/v1/chat/completions" if chat else "/v1/completions", body,
                          prompt, SamplingParams(**fields))
        if rng.random() < config.disconnect_fraction:
            if stream and rng.random() < 0.5:
                req.disconnect_events = int(rng.integers(0, max_tokens // 2 + 1))
            else:
                req.disconnect_at = float(rng.random())
        req.fault = bool(config.fault_fraction > 0 and rng.random() < config.fault_fraction)
        req.headers["X-Request-Id"] = f"{tag}-{i}" + (FAULT_MARK if req.fault else "")
        requests.append(req)
    return requests


class InjectedFault(RuntimeError):
    """The error :class:`MarkedFaults` raises in a model step."""


@dataclass
class MarkedFaults:
    """An ``Engine.fault_injector`` (docs/reliability.md) that fails every model step running
    a request whose id contains :data:`FAULT_MARK`.

    Attributes:
        failed_request_ids: the engine request ids of every failed step (each fails).
    """

    failed_request_ids: set[str] = field(default_factory=set)

    def __call__(self, step_index: int, request_ids: list[str]) -> None:
        if any(FAULT_MARK in r for r in request_ids):
            self.failed_request_ids.update(request_ids)
            raise InjectedFault(f"fault injected by the soak in step {step_index}")

    def failed_headers(self) -> set[str]:
        """The ``X-Request-Id`` values of the failed requests (engine ids are
        ``<cmpl|chatcmpl>-<X-Request-Id>-<prompt index>``)."""
        return {r.split("-", 1)[1].rsplit("-", 1)[0] for r in self.failed_request_ids}


@contextlib.contextmanager
def injecting_faults(engine):
    """Within the block, ``engine`` (an AsyncEngine in this process) fails the model steps
    that run marked requests; yields the :class:`MarkedFaults`."""
    core = engine.check_alive()     # the EngineClient: a data-parallel one sets every replica's
    injector = MarkedFaults()
    core.fault_injector = injector
    try:
        yield injector
    finally:
        core.fault_injector = None
