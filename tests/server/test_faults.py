"""Faults through HTTP, injected with Engine.fault_injector (tests/helpers/faults.py): a
failed model step answers its requests 500 (a stream: an error event, then [DONE]), frees
their pages and leaves the others running; a dead engine loop turns /health 503 at once,
ends every running request with an error and refuses new ones with 503."""

import threading
import time

import httpx
import pytest

from jaxpaged import SamplingParams
from jaxpaged.server.serving import ServerConfig
from tests.helpers.faults import EngineKilled, FailSteps
from tests.server.conftest import (MAX_MODEL_LEN, MODEL, PLAIN_TEMPLATE, LiveServer, engine_args,
                                   sse_events, wait_engine_empty, wait_until)
from tests.server.test_abort_and_load import metrics

MESSAGE = "the model step running this request failed: InjectedFault: injected fault"
LONG = dict(model=MODEL, prompt="Once upon a time", max_tokens=MAX_MODEL_LEN - 8,
            ignore_eos=True, temperature=0)


@pytest.fixture(scope="module")
def server():
    server = LiveServer(engine_args(max_num_seqs=1), ServerConfig([MODEL], PLAIN_TEMPLATE)).start()
    yield server
    server.stop()


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c
    server.engine.engine.fault_injector = None
    wait_engine_empty(server)


def failed_reason_count(http) -> float:
    return metrics(http)[("jaxpaged:request_success_total", (("finished_reason", "error"),))]


def test_failed_step_answers_500_and_the_server_keeps_serving(server, http, stories_llm):
    before = failed_reason_count(http)
    server.engine.engine.fault_injector = FailSteps()
    r = http.post("/v1/completions", json={**LONG, "max_tokens": 5})
    assert r.status_code == 500
    assert r.json()["error"] == {"message": MESSAGE, "type": "internal_server_error",
                                 "param": None, "code": 500}
    wait_engine_empty(server)                         # its pages are free again
    assert failed_reason_count(http) == before + 1
    server.engine.engine.fault_injector = FailSteps()
    events = sse_events(http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True,
        "max_tokens": 5}))
    assert events[-1] == "[DONE]" and events[-2]["error"]["message"] == MESSAGE
    wait_engine_empty(server)
    r = http.post("/v1/completions", json={**LONG, "max_tokens": 5})
    ref = stories_llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=5,
                                                                  ignore_eos=True),
                               use_tqdm=False)[0].outputs[0].text
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == ref


def test_failed_step_leaves_waiting_requests_untouched(server, http, stories_llm):
    assert http.post("/v1/completions", json=LONG).status_code == 200    # compile the shapes
    results = {}

    def call(name, body):
        with httpx.Client(base_url=server.url, timeout=60) as c:
            results[name] = c.post("/v1/completions", json=body)

    scheduler = server.engine.engine.scheduler
    waiting_body = {**LONG, "prompt": "Lily and Ben", "max_tokens": 12}
    with server.slow_steps(0.02):
        running = threading.Thread(target=call, args=("running", {**LONG, "stream": True}))
        running.start()
        wait_until(lambda: scheduler.running, "the first request to run")
        waiting = threading.Thread(target=call, args=("waiting", waiting_body))
        waiting.start()
        wait_until(lambda: scheduler.waiting, "the second request to wait (one seat)")
        server.engine.engine.fault_injector = injector = FailSteps()
        running.join()
        waiting.join()
    assert len(injector.failed_steps[0][1]) == 1       # only the running request's step
    events = sse_events(results["running"])
    assert events[-1] == "[DONE]" and events[-2]["error"]["message"] == MESSAGE
    ref = stories_llm.generate("Lily and Ben", SamplingParams(temperature=0, max_tokens=12,
                                                              ignore_eos=True), use_tqdm=False)
    assert results["waiting"].status_code == 200
    assert results["waiting"].json()["choices"][0]["text"] == ref[0].outputs[0].text


def test_dead_engine_loop_fails_running_requests_and_turns_health_503():
    server = LiveServer(engine_args(max_num_seqs=4), ServerConfig([MODEL])).start()
    results = {}

    def call(name, body):
        with httpx.Client(base_url=server.url, timeout=30) as c:
            results[name] = c.post("/v1/completions", json=body)

    try:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            assert http.post("/v1/completions", json=LONG).status_code == 200
            engine = server.engine.engine
            with server.slow_steps(0.02):
                threads = [threading.Thread(target=call, args=(name, body)) for name, body in
                           (("stream", {**LONG, "stream": True}), ("plain", LONG))]
                for t in threads:
                    t.start()
                wait_until(lambda: len(engine.scheduler.running) == 2, "two running requests")
                engine.fault_injector = FailSteps(error=EngineKilled("the device is gone"))
                wait_until(lambda: server.engine.error is not None, "the engine loop to die", 5)
                t0 = time.monotonic()
                health = http.get("/health")
                assert time.monotonic() - t0 < 0.1
                for t in threads:
                    t.join(10)
            assert health.status_code == 503
            assert "the device is gone" in health.json()["error"]["message"]
            plain = results["plain"]
            assert plain.status_code == 500
            assert plain.json()["error"]["message"].startswith(
                "the engine failed while running this request: EngineKilled")
            events = sse_events(results["stream"])
            assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == 500
            assert "EngineKilled('the device is gone')" in events[-2]["error"]["message"]
            for stream in (False, True):
                r = http.post("/v1/completions", json={**LONG, "stream": stream})
                assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
    finally:
        server.stop()


def test_x_request_id_names_the_request_a_fault_injector_sees(server, http):
    """vLLM's ``X-Request-Id``: the engine request is ``cmpl-<header>-<prompt index>`` (what
    ``FailSteps(request_id=...)`` and the soak's fault marks match), the response's id is
    ``cmpl-<header>``; a malformed header or an id still running is a 400."""
    injector = FailSteps(request_id="cmpl-client-7-0")
    server.engine.engine.fault_injector = injector
    body = {**LONG, "max_tokens": 3}
    ok = http.post("/v1/completions", json=body, headers={"X-Request-Id": "client-6"})
    assert ok.status_code == 200 and ok.json()["id"] == "cmpl-client-6"
    failed = http.post("/v1/completions", json=body, headers={"X-Request-Id": "client-7"})
    assert failed.status_code == 500 and injector.failed_steps[0][1] == ["cmpl-client-7-0"]
    chat = http.post("/v1/chat/completions", headers={"X-Request-Id": "c1"}, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert chat.status_code == 200 and chat.json()["id"] == "chatcmpl-c1"
    for bad in ("", "has space", "x" * 129, "é"):
        r = http.post("/v1/completions", json=body, headers={"X-Request-Id": bad.encode()})
        assert r.status_code == 400, bad
        assert "X-Request-Id header must be 1 to 128 printable" in r.json()["error"]["message"]
    with server.slow_steps(0.05):
        running = threading.Thread(target=http.post, args=("/v1/completions",),
                                   kwargs={"json": {**body, "max_tokens": 20},
                                           "headers": {"X-Request-Id": "twice"}})
        running.start()
        wait_until(lambda: server.engine.engine.has_unfinished_requests(), "the first request")
        again = http.post("/v1/completions", json=body, headers={"X-Request-Id": "twice"})
        running.join()
    assert again.status_code == 400
    assert again.json()["error"]["message"] == ("request id 'cmpl-twice-0' is already in use "
                                                "(X-Request-Id must be unique among running "
                                                "requests)")
    after = http.post("/v1/completions", json=body, headers={"X-Request-Id": "twice"})
    assert after.status_code == 200 and after.json()["id"] == "cmpl-twice"
