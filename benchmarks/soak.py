"""``jaxpaged bench soak``: a soak test of the OpenAI-compatible server.

``num_requests`` requests go over loopback at most ``concurrency`` at a time: completions and
(when the server has a chat template) chat, streaming and not, ``n`` of 1 to 4, greedy and
sampled (mostly seeded), stop strings, ``min_tokens``, penalties, token-id and text prompts
(some repeated, for prefix-cache hits), all with logprobs (as token ids, so that token ids are
compared, not only text); a fraction of the text requests go to ``/v1/responses``
(``benchmarks/soak_responses.py``: compared by text, their event streams checked). A ``disconnect_fraction`` of the clients hang up at a random
moment: after a random part of the recent median latency, or (streams) after a random number
of events. Every request body is valid, so any answer but a 200 is a failure, except a 429
(a server with ``--max-pending-requests``): the client waits ``Retry-After`` and retries.

At the end it checks that:

- no request got a 5xx or any other error (in-band SSE errors included), except the
  requests of model steps that failed on purpose: with ``fault_fraction`` (a server in this
  process) a fraction of the requests is marked (``X-Request-Id: <tag>-<i>-fault``) and the
  engine's fault hook (``Engine.fault_injector``) raises in every model step that runs one;
  each such step fails every request in it (500, or an in-band error once streaming);
- every stream ended with ``[DONE]``, each choice index exactly once with a finish reason;
- the server goes idle: ``/metrics`` reads ``num_requests_running`` 0,
  ``num_requests_waiting`` 0 and ``kv_cache_usage_perc`` 0 (and, for a server in this
  process, every KV page is free, the engine holds no request and no output stream is open);
- the finish counters add up: no more aborts than disconnects, and every completed request
  counted as finished;
- every completed greedy or seeded request equals offline ``LLM.generate`` of the same prompt
  and ``SamplingParams`` (token ids, text and finish reason of every choice, and the
  completion-token count): the engine samples with per-request seeds
  whatever else is in the batch, so concurrency, disconnects of other clients, prefix-cache
  hits and preemption must not change an output. Unseeded sampled requests are only checked
  for shape (``n`` choices, at most ``max_tokens`` tokens each). The one difference allowed
  is floating-point: logits computed in another step shape (a prefix-cache hit, a
  recomputation after preemption) differ in their last bits, which can turn a choice that is
  a near tie; a divergence passes only if :func:`near_tie` finds its first differing token
  to be such a call (it is reported under ``near_ties``).

Without ``--base-url`` the engine flags' model is served in this process on a free
``127.0.0.1`` port (so the page pool can be read directly). With ``--base-url`` the server
there is checked through ``/metrics``; the engine flags then describe the offline reference,
which must be the served model. The soak assumes it is the server's only client.

Then (unless ``--embeddings-requests 0``) ``/v1/embeddings`` requests go to a pooling server,
started here with the same engine flags and ``--runner pooling`` or given by
``--embeddings-base-url`` (``benchmarks/soak_embeddings.py``: one task per server, as vLLM);
their summary is under ``embeddings`` and their problems count with the others.

Prints a one-line JSON summary (``--output-json`` writes it too); exits with an error when a
check fails (the first problems, each with the request body to reproduce it, are listed).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from jaxpaged.benchmarks import soak_embeddings, soak_responses
from jaxpaged.benchmarks.results import add_cost, add_cost_arg, distribution, write_outputs
from jaxpaged.benchmarks.serve import (DONE, auth_headers, http_client, run_limited, served_model,
                                       sse_payloads)
from jaxpaged.engine.arg_utils import EngineArgs
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

    def __post_init__(self):
        if self.num_requests < 1 or self.concurrency < 1:
            raise ValueError("the soak needs num_requests >= 1 and concurrency >= 1")
        for name in ("disconnect_fraction", "stream_fraction", "chat_fraction", "fault_fraction",
                     "logprobs_fraction", "penalty_fraction", "min_tokens_fraction",
                     "responses_fraction"):
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


# ---- the workload ---------------------------------------------------------------------------


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
    core = engine.engine
    cores = getattr(core, "replicas", None) or [core]
    injector = MarkedFaults()
    for c in cores:
        c.fault_injector = injector
    try:
        yield injector
    finally:
        for c in cores:
            c.fault_injector = None


# ---- the client -----------------------------------------------------------------------------


def absorb(res: SoakResult, choices: list[dict], chat: bool, stream: bool) -> None:
    """Add the text, finish reasons and token ids of answer choices (or stream deltas)."""
    for c in choices:
        i = c["index"]
        if chat:
            text = (c["delta"] if stream else c["message"]).get("content")
        else:
            text = c["text"]
        res.texts[i] += text or ""
        if c.get("finish_reason") is not None:
            res.finishes[i].append(c["finish_reason"])
        lp = c.get("logprobs") or {}
        tokens = [e["token"] for e in lp.get("content") or []] if chat else lp.get("tokens", [])
        res.token_ids[i] += [int(t.removeprefix("token_id:")) for t in tokens]


class Latencies:
    """Recent latencies of completed requests, streamed and not, for timing hang-ups."""

    def __init__(self, initial: float, keep: int = 64):
        self.initial, self.keep = initial, keep
        self._recent: dict[bool, list[float]] = {False: [], True: []}

    def add(self, stream: bool, seconds: float) -> None:
        recent = self._recent[stream]
        recent.append(seconds)
        del recent[:-self.keep]

    def typical(self, stream: bool) -> float:
        """The median of the recent latencies (``initial`` before any)."""
        recent = self._recent[stream]
        return float(np.median(recent)) if recent else self.initial


async def send(client: httpx.AsyncClient, req: SoakRequest, latencies: Latencies
               ) -> SoakResult:
    """Send one request, hanging up as the request says."""
    res = SoakResult()
    stream, responses = req.body["stream"], req.path == soak_responses.RESPONSES_PATH

    async def go():
        while await attempt():      # refused for --max-pending-requests: wait as told, retry
            res.retries += 1

    async def backoff(r: httpx.Response) -> bool:
        if r.status_code != 429:
            return False
        await asyncio.sleep(float(r.headers.get("retry-after", 1)))
        return True

    async def attempt() -> bool:
        """One try; True when the server said 429 (and the wait it asked for is over)."""
        if not stream:
            r = await client.post(req.path, json=req.body, headers=req.headers)
            if await backoff(r):
                return True
            res.status = r.status_code
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {r.text[:300]}"
                return False
            answer = r.json()
            if responses:
                soak_responses.read_answer(res, answer)
                return False
            absorb(res, answer["choices"], req.chat, stream=False)
            res.completion_tokens = answer["usage"]["completion_tokens"]
            res.prompt_tokens = answer["usage"]["prompt_tokens"]
            res.done = True
            return False
        async with client.stream("POST", req.path, json=req.body, headers=req.headers) as r:
            if r.status_code == 429:
                await r.aread()
            if await backoff(r):
                return True
            res.status = r.status_code
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:300]}"
                return False
            events, state = 0, {}
            async for payload in sse_payloads(r):
                if req.disconnect_events is not None and events >= req.disconnect_events:
                    res.disconnected = True
                    return False     # leaving the block closes the connection
                events += 1
                if responses:
                    soak_responses.read_event(res, payload, state)
                elif payload == DONE:
                    res.done = True
                elif "error" in payload:
                    res.error = f"in-band error: {payload['error']}"
                else:
                    absorb(res, payload["choices"], req.chat, stream=True)
                    if payload.get("usage"):
                        res.completion_tokens = payload["usage"]["completion_tokens"]
                        res.prompt_tokens = payload["usage"]["prompt_tokens"]
        return False

    t0 = time.perf_counter()
    try:
        if req.disconnect_at is None:
            await go()
        else:
            await asyncio.wait_for(go(), req.disconnect_at * latencies.typical(stream))
    except TimeoutError:
        res.disconnected = True
    except httpx.HTTPError as e:
        res.error = f"transport error: {e!r}"
    res.latency = time.perf_counter() - t0
    if res.completed:
        latencies.add(stream, res.latency)
    return res


# ---- checks ---------------------------------------------------------------------------------


def metric_values(base_url: str, api_key: str | None = None) -> dict[str, float]:
    """``/metrics`` as ``{name without its prefix: value}``, summed over labels other than
    ``finished_reason`` (kept as ``request_success_total:REASON``)."""
    text = httpx.get(base_url + "/metrics", headers=auth_headers(api_key), timeout=30).text
    out: dict[str, float] = defaultdict(float)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            name = s.name.split(":", 1)[-1]
            if "finished_reason" in s.labels:
                name += ":" + s.labels["finished_reason"]
            out[name] += s.value
    return dict(out)


def wait_idle(base_url: str, api_key: str | None, timeout: float) -> tuple[float, dict]:
    """Seconds until ``/metrics`` reads idle (no request running or waiting, no KV page in
    use), and the last reading (read ``timeout`` seconds at most)."""
    t0 = time.monotonic()
    while True:
        m = metric_values(base_url, api_key)
        idle = (m.get("num_requests_running") == 0 and m.get("num_requests_waiting") == 0
                and m.get("kv_cache_usage_perc") == 0)
        if idle or time.monotonic() - t0 > timeout:
            return time.monotonic() - t0, m
        time.sleep(0.05)


def check_answer(req: SoakRequest, res: SoakResult) -> list[str]:
    """Problems with the shape of a completed answer."""
    n = req.params.n
    problems = []
    if sorted(res.texts) != list(range(n)):
        problems.append(f"choice indexes {sorted(res.texts)}, expected 0..{n - 1}")
    for i in range(n):
        finishes = res.finishes.get(i, [])
        if len(finishes) != 1 or finishes[0] not in ("stop", "length"):
            problems.append(f"choice {i} finish reasons {finishes}, expected one stop/length")
    for i, ids in sorted(res.token_ids.items()):
        if not 1 <= len(ids) <= req.params.max_tokens:
            problems.append(f"choice {i} has {len(ids)} tokens, max_tokens is "
                            f"{req.params.max_tokens}")
    if res.completion_tokens is None:
        problems.append("no usage in the answer")
    elif res.completion_tokens != sum(len(ids) for ids in res.token_ids.values()):
        problems.append(f"usage says {res.completion_tokens} completion tokens, the choices "
                        f"have {sum(len(ids) for ids in res.token_ids.values())}")
    return problems


def compare(req: SoakRequest, res: SoakResult, offline) -> list[str]:
    """Differences between a completed answer and the offline ``RequestOutput``."""
    problems = []
    outs = sorted(offline.outputs, key=lambda o: o.index)
    for o in outs:
        got = res.texts.get(o.index, "")
        if got != o.text:
            problems.append(f"choice {o.index}: text {got!r} != offline {o.text!r}")
        finish = res.finishes.get(o.index, [None])[-1]
        if finish != o.finish_reason:
            problems.append(f"choice {o.index}: finish {finish} != offline {o.finish_reason}")
        if res.token_ids.get(o.index) != o.token_ids:
            problems.append(f"choice {o.index}: ids {res.token_ids.get(o.index)} != offline "
                            f"{o.token_ids}")
    expected_tokens = sum(len(o.token_ids) for o in outs)
    if res.completion_tokens is not None and res.completion_tokens != expected_tokens:
        problems.append(f"usage {res.completion_tokens} completion tokens != offline "
                        f"{expected_tokens}")
    return problems


def first_divergence(res: SoakResult, offline) -> tuple[int, int, int | None] | None:
    """The first choice whose token ids differ from offline, the position of the first
    differing token, and the server's token there (None where the server's ids are a prefix
    of the offline ones, or the ids are equal)."""
    for o in sorted(offline.outputs, key=lambda o: o.index):
        got = res.token_ids.get(o.index, [])
        for k, (a, b) in enumerate(zip(got, o.token_ids)):
            if a != b:
                return o.index, k, a
        if len(got) != len(o.token_ids):
            return o.index, min(len(got), len(o.token_ids)), None
    return None


def near_tie(llm, prompt: list[int], params: SamplingParams, index: int, common: list[int],
             token: int, delta: float = 1e-4, trials: int = 64) -> bool:
    """Whether the offline engine's choice of sequence ``index``'s token after ``common`` is
    so close a call that ``token`` (the server's choice) wins it once the logits move by at
    most ``delta`` each: the sampler (``jaxpaged.sampling.sampler.sample``, with the
    request's seed, position and logit adjustments) is run on the offline logits there, as
    they are and with random perturbations. Logits computed in another batch shape (a
    prefix-cache hit, a recomputation after preemption, other requests in the step) differ
    in the last float bits (about 1e-5 here), so such a call can go either way; a logic error
    (a wrong seed, position, mask or KV page) gives a token no such perturbation reaches.
    BUGCASES' determinism note asks the same of greedy divergences (a near tie at the first
    differing token)."""
    import jax.numpy as jnp

    from jaxpaged.sampling.logits_adjust import pack, row_adjustment
    from jaxpaged.sampling.sampler import SamplingMetadata, sample

    engine = llm.engine
    logits, _ = engine.runner.run_prefill(prompt + common)
    row = np.asarray(logits[-1], np.float32)
    noise = np.random.default_rng(0).uniform(-delta, delta, (trials, row.shape[0]))
    noise[0] = 0                                   # the logits as they are, first
    adjustment = row_adjustment(params, prompt, common, engine.output_processor.eos_token_ids,
                                [])
    adjust = None if adjustment is None else pack([adjustment] * trials, trials)
    meta = SamplingMetadata.from_host([(params.temperature, params.top_k, params.top_p,
                                        params.min_p, params.is_greedy, (params.seed or 0)
                                        + index, len(prompt) + len(common))] * trials, trials)
    tokens = sample(jnp.asarray(row + noise, jnp.float32), meta, adjust=adjust).token_ids
    return bool(np.any(np.asarray(tokens) == token))


# ---- the run --------------------------------------------------------------------------------


def run_soak(config: SoakConfig, base_url: str, llm, api_key: str | None = None,
             model: str | None = None, engine=None) -> dict:
    """Run the soak against the server at ``base_url``; returns the summary, whose
    ``problems`` lists every failed check (empty when all passed).

    Args:
        llm: the offline reference (a :class:`jaxpaged.LLM` of the served model).
        engine: the server's :class:`~jaxpaged.engine.async_engine.AsyncEngine` when it runs
            in this process (adds the page-pool checks and makes fault injection possible);
            None for a remote server.

    Raises:
        ValueError: ``config.fault_fraction`` > 0 without ``engine``.
    """
    if config.fault_fraction > 0 and engine is None:
        raise ValueError("fault_fraction > 0 needs the server in this process (its engine's "
                         "fault hook)")
    url, card = served_model(base_url, api_key, model)
    model = card["id"]
    max_model_len = card.get("max_model_len") or llm.engine.max_model_len
    headers = auth_headers(api_key)

    def chat_prompt(text: str) -> list[int]:
        r = httpx.post(url + "/tokenize", headers=headers, timeout=30,
                       json={"model": model, "messages": [{"role": "user", "content": text}]})
        r.raise_for_status()
        return r.json()["tokens"]

    probe = httpx.post(url + "/tokenize", headers=headers, timeout=30, json={
        "model": model, "messages": [{"role": "user", "content": "hi"}]})
    requests = make_workload(config, model, llm.get_tokenizer(), max_model_len,
                             chat_prompt if probe.status_code == 200 else None,
                             f"soak{os.urandom(4).hex()}")
    if probe.status_code == 200 and config.responses_fraction:
        requests = soak_responses.as_responses(requests, config.responses_fraction,
                                               config.seed, chat_prompt)
    before = metric_values(url, api_key)

    latencies = Latencies(config.disconnect_window)

    async def go():
        async with http_client(url, api_key) as client:
            return await run_limited(requests, lambda q: send(client, q, latencies),
                                     config.concurrency)

    faults = injecting_faults(engine) if config.fault_fraction else contextlib.nullcontext()
    with faults as injector:
        results, duration = asyncio.run(go())
    failed_by_fault = injector.failed_headers() if injector else set()
    idle_s, after = wait_idle(url, api_key, config.idle_timeout)

    problems: list[str] = []

    def problem(req: SoakRequest | None, what: str) -> None:
        where = "" if req is None else f"request {req.index} {json.dumps(req.reproduction())}: "
        problems.append(where + what)

    def is_responses(req: SoakRequest) -> bool:
        return req.path == soak_responses.RESPONSES_PATH

    statuses = Counter(r.status for r in results)
    server_errors = unexpected = injected = 0
    for req, res in zip(requests, results):
        failed_by_server = (res.status or 0) >= 500 or res.error.startswith("in-band")
        server_errors += failed_by_server
        if failed_by_server and req.headers["X-Request-Id"] in failed_by_fault:
            injected += 1
        elif res.disconnected and not failed_by_server:
            continue                  # a hang-up: what came before it is not checked
        elif res.error or not res.completed:
            unexpected += 1
            problem(req, res.error or "the stream ended without [DONE]")
        else:
            checked = soak_responses.check_answer if is_responses(req) else check_answer
            for p in checked(req, res):
                problem(req, p)

    compared = [(q, r) for q, r in zip(requests, results) if r.completed and q.comparable]
    t0 = time.perf_counter()
    offline = llm.generate([q.prompt for q, _ in compared], [q.params for q, _ in compared],
                           use_tqdm=False) if compared else []
    offline_s = time.perf_counter() - t0
    mismatches, near_ties = 0, []
    for (req, res), out in zip(compared, offline):
        diffs = soak_responses.compare(res, out) if is_responses(req) else compare(req, res, out)
        if not diffs:
            continue
        where = first_divergence(res, out)
        if where is not None and where[2] is not None:
            index, k, token = where
            common = next(o for o in out.outputs if o.index == index).token_ids[:k]
            if near_tie(llm, list(out.prompt_token_ids), req.params, index, common, token):
                near_ties.append({"request": req.index, "choice": index, "position": k,
                                  "server_token": token, **req.reproduction()})
                continue
        mismatches += 1
        for d in diffs:
            problem(req, d)

    # idle and the counters
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        if after.get(name) != 0:
            problem(None, f"/metrics {name} = {after.get(name)} after {idle_s:.1f} s, not 0")

    def delta(name):
        return after.get(name, 0) - before.get(name, 0)

    completed = [r for r in results if r.completed]
    disconnected = sum(r.disconnected for r in results)
    aborts = delta("request_success_total:abort")
    finished = delta("request_success_total:stop") + delta("request_success_total:length")
    if aborts > disconnected + injected:
        problem(None, f"{aborts:.0f} aborts counted, more than the {disconnected} disconnects "
                      f"and {injected} failed requests")
    if finished < len(completed):
        problem(None, f"{finished:.0f} requests counted as finished, fewer than the "
                      f"{len(completed)} completed")
    leaked_pages = open_streams = None
    if engine is not None:
        core = engine.engine
        kv = core.kv_cache_manager
        leaked_pages = kv.num_usable_pages - kv.num_free_pages
        open_streams = engine.num_open_streams
        if leaked_pages or core.has_unfinished_requests() or open_streams:
            problem(None, f"the engine is not idle: {leaked_pages} pages held, "
                          f"{core.get_num_unfinished_requests()} requests, {open_streams} "
                          f"streams open")
    health = httpx.get(url + "/health", timeout=30).status_code
    if health != 200:
        problem(None, f"/health answers {health} after the soak")

    output_tokens = sum(r.completion_tokens or 0 for r in completed)
    queries = delta("prefix_cache_queries_total")
    return {
        "num_requests": len(requests), "concurrency": config.concurrency,
        "disconnect_fraction": config.disconnect_fraction, "seed": config.seed,
        "duration": duration, "completed": len(completed),
        "hangups_planned": sum(q.disconnect_at is not None or q.disconnect_events is not None
                               for q in requests),
        "disconnected": disconnected,
        "streamed": sum(q.body["stream"] for q in requests),
        "chat": sum(q.chat for q in requests),
        "responses": sum(map(is_responses, requests)), "n_gt_1": sum(q.params.n > 1 for q in requests),
        "statuses": {str(k): v for k, v in sorted(statuses.items(), key=str)},
        "retried_429": sum(r.retries for r in results),
        "server_errors": server_errors, "fault_marked": sum(q.fault for q in requests),
        "failed_steps_requests": len(failed_by_fault), "failed_by_faults": injected,
        "unexpected_errors": unexpected, "compared": len(compared),
        "compared_sequences": sum(q.params.n for q, _ in compared), "mismatches": mismatches,
        "near_ties": len(near_ties), "near_tie_requests": near_ties[:20],
        "offline_seconds": offline_s, "request_throughput": len(completed) / duration,
        "output_throughput": output_tokens / duration, "output_tokens": output_tokens,
        "prompt_tokens": sum(r.prompt_tokens or 0 for r in completed),
        **distribution([r.latency for r in completed], "e2el"),
        "server_aborts": aborts, "server_finished": finished,
        "preemptions": delta("num_preemptions_total"),
        "prefix_cache_hit_rate": delta("prefix_cache_hits_total") / queries if queries else 0.0,
        "idle_after_s": idle_s, "final_gauges": {k: after.get(k) for k in (
            "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")},
        "leaked_pages": leaked_pages, "open_streams": open_streams, "health": health,
        "problems": problems[:50], "num_problems": len(problems),
    }


# ---- the command ----------------------------------------------------------------------------


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    d = SoakConfig()
    parser.add_argument("--base-url", default=None,
                        help="a running server (default: serve the engine flags' model here)")
    parser.add_argument("--served-model", default=None,
                        help="the served model name (default: the first in /v1/models)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--chat-template", default=None,
                        help="chat template of the server started here (file or template); "
                             "chat requests are sent when the server has one")
    parser.add_argument("--num-requests", type=int, default=d.num_requests)
    parser.add_argument("--concurrency", type=int, default=d.concurrency)
    parser.add_argument("--disconnect-fraction", type=float, default=d.disconnect_fraction)
    parser.add_argument("--disconnect-window", type=float, default=d.disconnect_window,
                        help="seconds within which a timed hang-up happens before the first "
                             "request completes (then: within the median latency)")
    parser.add_argument("--soak-seed", type=int, default=d.seed, help="seed of the workload")
    parser.add_argument("--soak-max-tokens", type=int, default=d.max_tokens,
                        help="largest max_tokens of a request")
    for name in ("logprobs", "penalty", "min_tokens"):
        parser.add_argument(f"--{name.replace('_', '-')}-fraction", type=float,
                            default=getattr(d, f"{name}_fraction"))
    parser.add_argument("--responses-fraction", type=float, default=d.responses_fraction,
                        help="text requests sent to /v1/responses instead (with a chat "
                             "template)")
    parser.add_argument("--fault-fraction", type=float, default=d.fault_fraction,
                        help="requests whose model steps fail on purpose (each failed step "
                             "fails all its requests); only for the server started here")
    parser.add_argument("--idle-timeout", type=float, default=d.idle_timeout)
    parser.add_argument("--output-json", default=None)
    add_cost_arg(parser)
    soak_embeddings.add_cli_args(parser)
    EngineArgs.add_cli_args(parser)


def main(args: argparse.Namespace) -> dict:
    """Run the soak the flags describe; returns (and prints) the summary.

    Raises:
        ValueError: bad flags, or no server at ``--base-url``.
        RuntimeError: a check failed (the message lists the first problems).
    """
    from jaxpaged import LLM
    from jaxpaged.engine.arg_utils import DEFAULT_MODEL
    from jaxpaged.server.launcher import ServerThread
    from jaxpaged.server.serving import ServerConfig

    config = SoakConfig(num_requests=args.num_requests, concurrency=args.concurrency,
                        disconnect_fraction=args.disconnect_fraction,
                        disconnect_window=args.disconnect_window, seed=args.soak_seed,
                        max_tokens=args.soak_max_tokens, idle_timeout=args.idle_timeout,
                        logprobs_fraction=args.logprobs_fraction,
                        penalty_fraction=args.penalty_fraction,
                        min_tokens_fraction=args.min_tokens_fraction,
                        fault_fraction=args.fault_fraction,
                        responses_fraction=args.responses_fraction)
    engine_args = EngineArgs.from_cli_args(args)
    server = None
    if args.base_url is None:
        template = args.chat_template
        if template is not None and os.path.isfile(template):
            with open(template) as f:
                template = f.read()
        name = "stories260K" if engine_args.model == DEFAULT_MODEL else engine_args.model
        server = ServerThread(engine_args, ServerConfig([name], template)
                              ).start(timeout=1800)
    try:
        llm = LLM(**vars(engine_args))
        summary = run_soak(config, args.base_url or server.url, llm, args.api_key,
                           args.served_model, server.engine if server else None)
    finally:
        if server is not None:
            server.stop()
    # vLLM serves one task per server: embeddings go to a second, pooling server.
    embeddings = soak_embeddings.soak_from_flags(args, engine_args, config.seed)
    if embeddings is not None:
        summary["embeddings"] = embeddings
        summary["problems"] += embeddings["problems"]
        summary["num_problems"] += embeddings["num_problems"]
    add_cost(summary, args.cost_per_hour, summary["duration"], summary["output_tokens"],
             summary["output_tokens"] + summary["prompt_tokens"])
    write_outputs(summary, args.output_json)
    if summary["num_problems"]:
        raise RuntimeError(f"the soak found {summary['num_problems']} problems, e.g.:\n"
                           + "\n".join(summary["problems"][:10]))
    return summary


if __name__ == "__main__":
    import sys

    parser = argparse.ArgumentParser(prog="python -m jaxpaged.benchmarks.soak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_cli_args(parser)
    try:
        main(parser.parse_args())
    except (ValueError, RuntimeError) as e:
        print(f"soak: error: {e}", file=sys.stderr)
        sys.exit(1)
