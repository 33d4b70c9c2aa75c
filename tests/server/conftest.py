"""A real uvicorn server on 127.0.0.1 with the bundled model, shared by the server tests."""

from __future__ import annotations

import contextlib
import json
import socket
import time

import httpx
import openai
import pytest

from jaxpaged.arg_utils import EngineArgs
from jaxpaged.server.launcher import ServerThread
from jaxpaged.server.serving import ServerConfig

#: The server tests' context limit (BUGCASES B11 uses L = 128).
MAX_MODEL_LEN = 128
MODEL = "stories260K"
#: The test server's request-body limit (HTTP 413 above it).
MAX_BODY_BYTES = 64 * 1024
#: A plain chat template for the bundled model (its tokenizer has none).
PLAIN_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}" \
                 "{% if add_generation_prompt %}assistant:{% endif %}"


class LiveServer(ServerThread):
    """uvicorn serving one engine on a free local port, in a background thread, with test
    helpers."""

    @property
    def kv(self):
        """The engine's KV cache manager (read between requests, when the engine is idle)."""
        return self.engine.engine.kv_cache_manager

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Wait until the engine holds no request."""
        deadline = time.monotonic() + timeout
        while self.engine.engine.has_unfinished_requests():
            assert time.monotonic() < deadline, "the engine still holds requests"
            time.sleep(0.02)

    @contextlib.contextmanager
    def slow_steps(self, seconds: float):
        """Make every engine step take at least ``seconds`` (as a big model's would), so that
        a test can act while requests are surely still running."""
        engine = self.engine.engine
        step = engine.step

        def slow_step():
            time.sleep(seconds)
            return step()

        engine.step = slow_step
        try:
            yield
        finally:
            del engine.step      # the class's method again

    @contextlib.contextmanager
    def configured(self, **changes):
        """Serve with these :class:`ServerConfig` fields changed for the duration of the
        block (``chat_template=...``, ``request_timeout=...``)."""
        old = {name: getattr(self.config, name) for name in changes}
        for name, value in changes.items():
            setattr(self.config, name, value)
        try:
            yield
        finally:
            for name, value in old.items():
                setattr(self.config, name, value)


def engine_args(**overrides) -> EngineArgs:
    values = dict(enforce_eager=True, max_model_len=MAX_MODEL_LEN, max_num_seqs=16,
                  max_num_batched_tokens=256)
    values.update(overrides)
    return EngineArgs(**values)


@pytest.fixture(scope="session")
def live_server():
    config = ServerConfig([MODEL, "alias"], PLAIN_TEMPLATE, max_request_body_bytes=MAX_BODY_BYTES)
    server = LiveServer(engine_args(), config).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def pooling_server():
    """The bundled model served for embeddings (``--runner pooling``), 16-token steps (a
    long input is prefilled in chunks)."""
    server = LiveServer(engine_args(runner="pooling", max_num_batched_tokens=16),
                        ServerConfig([MODEL])).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def client(live_server) -> openai.OpenAI:
    """The official client, unmodified except base_url / api_key."""
    return openai.OpenAI(base_url=live_server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="session")
def http(live_server) -> httpx.Client:
    with httpx.Client(base_url=live_server.url, timeout=60) as c:
        yield c


def wait_engine_empty(live_server, timeout=3.0) -> float:
    """Seconds until the engine holds no request and every page is free again."""
    start = time.monotonic()
    engine, kv = live_server.engine.engine, live_server.kv
    while engine.has_unfinished_requests() or kv.num_free_pages != kv.num_usable_pages:
        assert time.monotonic() - start < timeout, "the aborted requests still hold pages"
        time.sleep(0.01)
    return time.monotonic() - start


def wait_until(condition, what: str, timeout: float = 30.0) -> None:
    """Poll ``condition()`` until it is true; fail naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def open_request(live_server, body: dict) -> socket.socket:
    """A raw HTTP connection with ``body`` posted to /v1/completions (closing the socket is a
    client disconnect)."""
    payload = json.dumps(body).encode()
    host, port = live_server.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                 b"\r\nContent-Length: %d\r\n\r\n%s" % (len(payload), payload))
    return sock


def sse_events(response: httpx.Response) -> list:
    """The JSON payloads of an SSE response, and the literal "[DONE]" last."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events
