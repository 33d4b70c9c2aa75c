"""The soak's checks (``benchmarks/soak.py``): the server's metrics and idleness, the shape of
each answer, and each comparable answer against the offline engine (floating-point near ties
told apart from real divergences)."""

from __future__ import annotations

import time
from collections import defaultdict

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from jaxpaged.benchmarks.serve import auth_headers
from jaxpaged.benchmarks.soak_workload import SoakRequest, SoakResult
from jaxpaged.sampling_params import SamplingParams


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
