"""Readiness (503 while loading), shutdown, body limit (413), API key (401), and the
`jaxpaged serve` command itself (engine failures: test_faults.py)."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from starlette.testclient import TestClient

from jaxpaged.server.launcher import make_server
from jaxpaged.server.serving import ServerConfig
from tests.conftest import STORIES
from tests.helpers.processes import free_port, wait_for_health
from tests.server.conftest import MAX_BODY_BYTES, MODEL, LiveServer, engine_args


def test_not_ready_answers_503():
    _, app = make_server(engine_args(), ServerConfig([MODEL]))
    client = TestClient(app)            # no lifespan: the engine is never started
    r = client.get("/health")
    assert r.status_code == 503 and "loading" in r.json()["error"]["message"]
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
    assert client.get("/v1/models").json()["data"][0]["id"] == MODEL


def test_an_engine_that_starts_loading_early_serves_once_the_app_runs():
    """``make_server(start_loading=True)`` (``jaxpaged serve``) loads the engine before the
    app's event loop runs; the app's lifespan then attaches the loop (no second engine
    thread) and requests are answered."""
    engine, app = make_server(engine_args(), ServerConfig([MODEL]), start_loading=True)
    assert engine.wait_ready(300) and engine.error is None
    thread = engine._thread
    with TestClient(app) as client:
        assert client.get("/health").status_code == 200 and engine._thread is thread
        r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Once",
                                                 "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def test_oversized_body_gets_413(http):
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x" * MAX_BODY_BYTES})
    assert r.status_code == 413 and r.json()["error"]["code"] == 413
    assert http.post("/v1/completions", json={"model": MODEL, "prompt": "x",
                                              "max_tokens": 1}).status_code == 200


def wait_until(predicate, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def stop_while_running(server, max_tokens, streams, during_stop=None) -> dict:
    """Start one completion per entry of ``streams`` (name -> stream?), stop the server once
    all run (steps slowed to 50 ms), call ``during_stop()`` while it stops; returns
    name -> (status, body text)."""
    body = {"model": MODEL, "prompt": "Once", "max_tokens": max_tokens, "ignore_eos": True}
    results = {}

    def call(name, stream):
        with httpx.Client(base_url=server.url, timeout=60) as c:
            r = c.post("/v1/completions", json={**body, "stream": stream})
            results[name] = (r.status_code, r.text)

    with server.slow_steps(0.05):
        threads = [threading.Thread(target=call, args=item) for item in streams.items()]
        for t in threads:
            t.start()
        wait_until(lambda: len(server.engine.engine.scheduler.running) == len(streams))
        stopper = threading.Thread(target=server.stop)
        stopper.start()
        if during_stop is not None:
            during_stop()
        for t in threads + [stopper]:
            t.join()
    return results


def test_shutdown_ends_running_requests_cleanly():
    server = LiveServer(engine_args(max_num_seqs=4), ServerConfig([MODEL])).start()
    results = stop_while_running(server, 100, {"s1": True, "s2": True, "n1": False})
    for name in ("s1", "s2"):
        status, text = results[name]
        assert status == 200 and text.rstrip().endswith("data: [DONE]")
        assert "shutting down" in text
    status, text = results["n1"]
    assert status == 503 and "shutting down" in json.loads(text)["error"]["message"]


@pytest.mark.parametrize("shutdown_timeout, drained", [(30.0, True), (0.3, False)])
def test_shutdown_timeout_drains_running_requests(shutdown_timeout, drained):
    """--shutdown-timeout: the running requests finish (or, past the timeout, end as without
    it) while a new request gets 503, /ready 503 and /health 200."""
    server = LiveServer(engine_args(max_num_seqs=4), ServerConfig(
        [MODEL], shutdown_timeout=shutdown_timeout)).start()
    assert httpx.get(server.url + "/ready").status_code == 200

    def during_drain():
        wait_until(lambda: server.engine.is_draining)
        if drained:
            late = httpx.post(server.url + "/v1/completions", json={
                "model": MODEL, "prompt": "x", "max_tokens": 2}, timeout=30)
            assert late.status_code == 503, late.text
            assert "takes no new ones" in late.json()["error"]["message"]
            assert httpx.get(server.url + "/ready").status_code == 503
            assert httpx.get(server.url + "/health").status_code == 200

    results = stop_while_running(server, 40, {"stream": True, "plain": False}, during_drain)
    status, text = results["plain"]
    if drained:
        assert status == 200, text
        choice = json.loads(text)["choices"][0]
        assert choice["finish_reason"] == "length"
        assert json.loads(text)["usage"]["completion_tokens"] == 40
        status, text = results["stream"]
        chunks = [json.loads(line[6:]) for line in text.splitlines()
                  if line.startswith("data: {")]
        assert status == 200 and text.rstrip().endswith("data: [DONE]")
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert "shutting down" not in text
    else:   # 0.3 s is less than 40 steps of 50 ms: the drain ends them
        assert status == 503 and "shutting down" in json.loads(text)["error"]["message"]
        assert "shutting down" in results["stream"][1]


def wait_health(url, proc, timeout=120):
    codes = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read()
        try:
            codes.append(httpx.get(url + "/health", timeout=5).status_code)
            if codes[-1] == 200:
                return codes
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"never healthy: {codes}")


def listening_addresses(port: int) -> set[str]:
    """The local IPv4 addresses of the sockets listening on TCP ``port`` (Linux's
    /proc/net/tcp; the IPv6 table is checked to be free of the port)."""
    addresses = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, hex_port = local.split(":")
                if state == "0A" and int(hex_port, 16) == port:     # 0A: LISTEN
                    assert table == "/proc/net/tcp", f"listening on IPv6: {local}"
                    addresses.add(socket.inet_ntoa(bytes.fromhex(address)[::-1]))
    return addresses


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="needs Linux's /proc/net/tcp")
def test_jaxpaged_serve_command_with_api_key(tmp_path):
    port = free_port()
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    env = {**os.environ, "JAXPAGED_API_KEY": "s3cret"}
    cmd = [sys.executable, "-m", "jaxpaged.cli", "serve", "--port", str(port),
           "--enforce-eager", "--max-num-seqs", "4", "--max-num-batched-tokens", "128",
           "--chat-template", str(template), "--served-model-name", "tiny",
           "--disable-log-requests"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        codes = wait_health(url, proc)
        assert set(codes) <= {503, 200}
        assert listening_addresses(port) == {"127.0.0.1"}      # the default --host
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "x"})
        assert r.status_code == 401 and r.json()["error"]["code"] == 401
        r = httpx.get(url + "/v1/models", headers={"Authorization": "bearer s3cret"})
        assert r.status_code == 200          # the scheme is case-insensitive
        wrong = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
        client = openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0)
        out = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=10,
                                        temperature=0)
        assert out.choices[0].text == ", there was a little girl named Lily"
        chat = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Once upon a time"}],
            max_completion_tokens=4, temperature=0)
        assert chat.choices[0].message.content
        assert httpx.get(url + "/metrics").status_code == 200     # open without a key
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(30)
    assert proc.returncode == 0
    log = proc.stderr.read()
    assert "--disable-log-requests is deprecated" in log
    assert "Once upon a time" not in log and "little girl" not in log   # no request logging


@pytest.mark.parametrize("flags, needle", [
    (["{tmp}"], "jaxpaged: error:"), (["--port", "99999"], "1..65535"),
    (["--chat-template", "{% for %}"], "not a valid Jinja template"),
    (["--served-model-name", "a", "a"], "distinct"),
    (["--max-request-body-bytes", "-5"], "positive"),
    (["{tmp}/nonexistent"], "jaxpaged: error: the model path '{tmp}/nonexistent' does not exist")])
def test_jaxpaged_serve_bad_arguments_exit_with_error(tmp_path, flags, needle):
    flags = [f.replace("{tmp}", str(tmp_path)) for f in flags]
    proc = subprocess.run([sys.executable, "-m", "jaxpaged.cli", "serve", *flags],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and needle.replace("{tmp}", str(tmp_path)) in proc.stderr
    assert "Traceback" not in proc.stderr


def test_interrupt_while_loading_exits_promptly(tmp_path):
    port = free_port()
    # The stories110M shape with dummy weights and an empty compile cache loads for several
    # seconds (the bundled model, its steps stored by earlier tests, is ready before /health
    # first answers): interrupt that.
    shape = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "models",
                         "stories110m-shape")
    proc = subprocess.Popen([sys.executable, "-m", "jaxpaged.cli", "serve", shape,
                             "--load-format", "dummy", "--tokenizer", STORIES,
                             "--compilation-cache-dir", str(tmp_path / "cache"),
                             "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_health(f"http://127.0.0.1:{port}", 503, [proc], timeout=60, poll=0.1)
    time.sleep(2)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    proc.wait(20)
    assert proc.returncode == 0, proc.stderr.read()
    assert time.monotonic() - t0 < 10
