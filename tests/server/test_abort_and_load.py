"""Client disconnects (B20), 64 concurrent streams, /health under saturation (B22), and
/metrics against the traffic sent."""

import asyncio
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaxpaged import SamplingParams
from tests.server.conftest import MAX_MODEL_LEN, MODEL, open_request, wait_engine_empty

LONG = dict(model=MODEL, prompt="Once upon a time", max_tokens=MAX_MODEL_LEN - 8,
            ignore_eos=True, temperature=0)


def metrics(http) -> dict:
    """{(name, sorted labels without model_name): value} of every sample."""
    out = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[(s.name, labels)] = s.value
    return out


def disconnect_after(live_server, seconds, stream, n=1):
    body = {**LONG, "n": n, "stream": stream}
    with httpx.Client(base_url=live_server.url) as c:
        if stream:
            with c.stream("POST", "/v1/completions", json=body) as r:
                deadline = time.monotonic() + seconds
                for _ in r.iter_lines():
                    if time.monotonic() > deadline:
                        break
        else:
            with pytest.raises(httpx.ReadTimeout):
                c.post("/v1/completions", json=body, timeout=seconds)


def run_b20(live_server, http, repeats):
    """BUGCASES B20: disconnect after 0.3 s (non-streaming, streaming, streaming n=3)."""
    # Compile every step shape a long request uses first (the test server compiles lazily;
    # `jaxpaged serve` precompiles), so that a step is milliseconds, not a compilation.
    assert http.post("/v1/completions", json=LONG).status_code == 200
    before = metrics(http)[("jaxpaged:request_success_total", (("finished_reason", "abort"),))]
    with live_server.slow_steps(0.01):      # a request takes > 1 s: it is surely cut short
        for _ in range(repeats):
            for stream, n in ((False, 1), (True, 1), (True, 3)):
                disconnect_after(live_server, 0.3, stream, n)
                assert wait_engine_empty(live_server) < 0.5
    after = metrics(http)
    assert after[("jaxpaged:request_success_total", (("finished_reason", "abort"),))] == \
        before + 3 * repeats
    assert after[("jaxpaged:num_requests_running", ())] == 0
    assert after[("jaxpaged:kv_cache_usage_perc", ())] == 0


@pytest.mark.parametrize("repeats", [3, pytest.param(50, marks=pytest.mark.slow)])
def test_a_disconnect_aborts_and_frees_pages(live_server, http, repeats):
    run_b20(live_server, http, repeats)


def test_waiting_requests_are_removed_on_disconnect(live_server, http):
    engine = live_server.engine.engine
    with live_server.slow_steps(0.01):
        socks = [open_request(live_server, {**LONG, "stream": s}) for s in [True, False] * 16]
        deadline = time.monotonic() + 10
        while len(engine.scheduler.running) < 16 or not engine.scheduler.waiting:
            assert time.monotonic() < deadline, "never saturated"   # 32 requests, 16 seats
            time.sleep(0.01)
        for sock in socks:
            sock.close()
        # Generous: this test server compiles step shapes lazily, and a new batch mix can
        # cost a compilation before the queued aborts are taken (`serve` precompiles).
        wait_engine_empty(live_server, timeout=20)


def test_64_concurrent_streaming_clients(live_server, http, stories_llm):
    prompts = [f"Once upon a time there was a {w} number {i}" for i, w in
               enumerate(["cat", "dog", "girl", "boy"] * 16)]
    refs = stories_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16),
                                use_tqdm=False)

    async def one(client, prompt):
        text = ""
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=16,
                                                 temperature=0, stream=True)
        async for chunk in stream:
            text += chunk.choices[0].text if chunk.choices else ""
        return text

    async def main():
        async with openai.AsyncOpenAI(base_url=live_server.url + "/v1", api_key="x",
                                      max_retries=0) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    texts = asyncio.run(main())
    assert texts == [r.outputs[0].text for r in refs]
    wait_engine_empty(live_server)
    m = metrics(http)
    assert m[("jaxpaged:num_requests_running", ())] == 0
    assert m[("jaxpaged:num_requests_waiting", ())] == 0
    assert m[("jaxpaged:kv_cache_usage_perc", ())] == 0


def run_b22(live_server, http, seconds):
    """BUGCASES B22: 16 running + 100 waiting requests while /health is polled."""
    stop = threading.Event()

    def hold():
        with httpx.Client(base_url=live_server.url, timeout=None) as c:
            with c.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
                for _ in r.iter_lines():
                    if stop.is_set():
                        return

    threads = [threading.Thread(target=hold) for _ in range(16 + 100)]
    latencies = []
    with live_server.slow_steps(0.05):      # 116 requests then take far longer than the test
        for t in threads:
            t.start()
        try:
            scheduler, deadline = live_server.engine.engine.scheduler, time.monotonic() + 60
            while len(scheduler.running) < 16 or len(scheduler.waiting) < 100:
                assert time.monotonic() < deadline, "never saturated"
                time.sleep(0.05)
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                t0 = time.monotonic()
                assert http.get("/health").status_code == 200
                latencies.append(time.monotonic() - t0)
                time.sleep(0.1)
            t0 = time.monotonic()
            assert http.get("/v1/models").status_code == 200
            assert time.monotonic() - t0 < 0.2
        finally:
            stop.set()
            for t in threads:
                t.join()
    latencies.sort()
    p99 = latencies[int(0.99 * (len(latencies) - 1))]
    assert p99 < 0.2, f"p99 /health latency {p99:.3f} s"
    wait_engine_empty(live_server, timeout=10)


@pytest.mark.parametrize("seconds", [5, pytest.param(30, marks=pytest.mark.slow)])
def test_health_stays_responsive_under_saturation(live_server, http, seconds):
    run_b22(live_server, http, seconds)


def test_metrics_counters_match_traffic(live_server, http):
    live_server.wait_idle()
    before = metrics(http)
    prompt = "Lily and Ben played with a big red ball in the park every day after school"
    usages = []
    for body in ({"prompt": prompt, "max_tokens": 7, "ignore_eos": True},
                 {"prompt": prompt, "max_tokens": 5, "ignore_eos": True},
                 {"prompt": [prompt, "Once"], "max_tokens": 3, "ignore_eos": True, "n": 2}):
        r = http.post("/v1/completions", json={"model": MODEL, "temperature": 0, **body})
        usages.append(r.json()["usage"])
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "top_p": 7})
    assert r.status_code == 400                      # rejected: counted nowhere
    after = metrics(http)

    def delta(name, *labels):
        return after[(name, labels)] - before.get((name, labels), 0)

    prompt_len = len(http.post("/tokenize", json={"prompt": prompt}).json()["tokens"])
    once_len = len(http.post("/tokenize", json={"prompt": "Once"}).json()["tokens"])
    assert delta("jaxpaged:prompt_tokens_total") == 3 * prompt_len + once_len == \
        sum(u["prompt_tokens"] for u in usages)
    assert delta("jaxpaged:generation_tokens_total") == 7 + 5 + 2 * 3 + 2 * 3 == \
        sum(u["completion_tokens"] for u in usages)
    assert delta("jaxpaged:request_success_total", ("finished_reason", "length")) == 4
    assert delta("jaxpaged:request_success_total", ("finished_reason", "stop")) == 0
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds", "request_prompt_tokens",
                 "request_generation_tokens"):
        assert delta(f"jaxpaged:{hist}_count") == 4, hist
    assert delta("jaxpaged:request_prompt_tokens_sum") == 3 * prompt_len + once_len
    assert delta("jaxpaged:request_generation_tokens_sum") == 24
    # inter-token gaps: one per token after the first of each request's step
    assert delta("jaxpaged:inter_token_latency_seconds_count") == 6 + 4 + 2 + 2
    # the same prompt again hits the prefix cache on its full pages (16 tokens each)
    assert delta("jaxpaged:prefix_cache_hits_total") == 16 * ((prompt_len - 1) // 16) * 2
    assert delta("jaxpaged:prefix_cache_queries_total") == 3 * prompt_len + once_len
