"""A real uvicorn server on 127.0.0.1 with the bundled model, shared by the server tests."""

from __future__ import annotations

import contextlib
import time

import httpx
import openai
import pytest

from jaxpaged.engine.arg_utils import EngineArgs
from server.launcher import ServerThread
from server.serving import ServerConfig

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
    def chat_template(self, template: str | None):
        """Serve with another chat template for the duration of the block."""
        old, self.config.chat_template = self.config.chat_template, template
        try:
            yield
        finally:
            self.config.chat_template = old


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
def client(live_server) -> openai.OpenAI:
    """The official client, unmodified except base_url / api_key."""
    return openai.OpenAI(base_url=live_server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="session")
def http(live_server) -> httpx.Client:
    with httpx.Client(base_url=live_server.url, timeout=60) as c:
        yield c


def sse_events(response: httpx.Response) -> list:
    """The JSON payloads of an SSE response, and the literal "[DONE]" last."""
    import json

    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events
