"""Overload: --max-pending-requests (429 with Retry-After; n counts n), --request-timeout
(504, or an error event in a stream; the request's pages are freed), and bounded per-request
output buffers for consumers that fall behind."""

import asyncio
import time

import httpx
import openai
import pytest

from jaxpaged.cli import build_parser
from jaxpaged.arg_utils import EngineArgs
from jaxpaged.engine.async_engine import AsyncEngine
from jaxpaged.engine.exceptions import RequestFailedError, RequestTimeoutError
from jaxpaged.engine.request_stream import RequestStream
from jaxpaged.outputs import CompletionOutput, RequestOutput
from jaxpaged.server.server_args import server_config
from jaxpaged.server.serving import ServerConfig, merge_streams
from tests.server.conftest import (MAX_MODEL_LEN, MODEL, PLAIN_TEMPLATE, LiveServer, engine_args,
                                   open_request, sse_events, wait_engine_empty, wait_until)

LIMIT = 3
LONG = dict(model=MODEL, prompt="Once upon a time", max_tokens=MAX_MODEL_LEN - 8,
            ignore_eos=True, temperature=0)


@pytest.fixture(scope="module")
def server():
    # Two seats, at most LIMIT sequences waiting behind them.
    config = ServerConfig([MODEL], PLAIN_TEMPLATE, max_pending_requests=LIMIT)
    server = LiveServer(engine_args(max_num_seqs=2), config).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def waiting(server) -> int:
    return server.engine.engine.get_num_waiting_seqs()


def assert_429(response):
    assert response.status_code == 429, response.text
    assert response.headers["retry-after"] == "1"
    error = response.json()["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == 429
    assert f"--max-pending-requests={LIMIT}" in error["message"]


# ---- 429 -------------------------------------------------------------------------------


def test_requests_beyond_max_pending_get_429(server, http):
    with server.slow_steps(0.02):          # the held requests outlast the test
        socks = [open_request(server, {**LONG, "stream": True}) for _ in range(2)]
        wait_until(lambda: len(server.engine.engine.scheduler.running) == 2, "two running")
        socks += [open_request(server, {**LONG, "stream": True}) for _ in range(2)]
        wait_until(lambda: waiting(server) == 2, "two waiting")
        body = dict(model=MODEL, prompt="Once", max_tokens=2)
        assert_429(http.post("/v1/completions", json={**body, "n": 2}))     # 2 + 2 > 3
        # All or none: "a" fits, "b" does not, so "a" is aborted again.
        assert_429(http.post("/v1/completions", json={**body, "prompt": ["a", "b"]}))
        wait_until(lambda: waiting(server) == 2, "the abort of 'a'")
        socks.append(open_request(server, {**LONG, "stream": True}))       # 2 + 1 = 3
        wait_until(lambda: waiting(server) == LIMIT, "three waiting")
        assert_429(http.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}]}))
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.RateLimitError) as e:
            client.completions.create(model=MODEL, prompt="Once", max_tokens=2, stream=True)
        assert e.value.response.headers["retry-after"] == "1"
        for sock in socks:
            sock.close()
        wait_engine_empty(server, timeout=20)
    assert http.post("/v1/completions", json={**body, "n": 2}).status_code == 200


def test_more_sequences_than_ever_admitted_is_a_400(http):
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Once", "n": LIMIT + 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    assert f"--max-pending-requests={LIMIT}" in r.json()["error"]["message"]


# ---- --request-timeout -------------------------------------------------------------------


def test_request_past_its_timeout_gets_504_and_is_aborted(server, http):
    assert http.post("/v1/completions", json=LONG).status_code == 200   # compile the shapes
    with server.configured(request_timeout=0.5), server.slow_steps(0.02):
        t0 = time.monotonic()
        r = http.post("/v1/completions", json=LONG)
        assert 0.5 <= time.monotonic() - t0 < 2.0
        assert r.status_code == 504
        error = r.json()["error"]
        assert error["code"] == 504 and error["type"] == "timeout_error"
        assert "--request-timeout=0.5 s" in error["message"]
        wait_engine_empty(server)
        events = sse_events(http.post("/v1/completions", json={**LONG, "stream": True}))
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == 504
        assert any(e["choices"][0]["text"] for e in events[:-2])     # it had started
        wait_engine_empty(server)
        short = http.post("/v1/completions", json={**LONG, "max_tokens": 3})
        assert short.status_code == 200          # a request that finishes in time


# ---- bounded buffers (unit level) --------------------------------------------------------


def delta(i: int, index: int = 0, finished: bool = False) -> RequestOutput:
    return RequestOutput("r", None, [1], outputs=[CompletionOutput(
        index, f"<{i}>", [i], finish_reason="length" if finished else None)], finished=finished)


async def take_all(stream) -> list[RequestOutput]:
    return [out async for out in stream]


def test_stream_folds_deltas_a_slow_consumer_has_not_taken():
    async def main():
        stream = RequestStream("r", aggregate=True)
        for i in range(100):
            stream.put(delta(i))
        stream.put(delta(100, finished=True))
        return await take_all(stream)

    [out] = asyncio.run(main())
    assert out.finished and out.outputs[0].finish_reason == "length"
    assert out.outputs[0].text == "".join(f"<{i}>" for i in range(101))
    assert out.outputs[0].token_ids == list(range(101))


def test_stream_folds_parallel_sequences_and_keeps_only_the_latest_cumulative_output():
    async def main(aggregate, outputs):
        stream = RequestStream("r", aggregate=aggregate)
        for out in outputs:
            stream.put(out)
        stream.put(None)
        return await take_all(stream)

    deltas = [delta(0, index=1), delta(1, index=0), delta(2, index=1)]
    [out] = asyncio.run(main(True, deltas))
    assert [(o.index, o.text, o.token_ids) for o in out.outputs] == \
        [(0, "<1>", [1]), (1, "<0><2>", [0, 2])]
    cumulative = [RequestOutput("r", None, [1], outputs=[CompletionOutput(0, "ab"[:i], [])])
                  for i in (1, 2)]
    [out] = asyncio.run(main(False, cumulative))
    assert out.outputs[0].text == "ab"


def test_stream_raises_the_engine_error_and_its_deadline():
    async def failed():
        stream = RequestStream("r")
        stream.put(RequestOutput("r", None, [1], finished=True, error="step failed: boom"))
        return await take_all(stream)

    with pytest.raises(RequestFailedError, match="step failed: boom"):
        asyncio.run(failed())

    async def late():
        stream = RequestStream("r", deadline=time.monotonic() + 0.05)
        stream.put(delta(0))
        got = []
        with pytest.raises(RequestTimeoutError):
            async for out in stream:
                got.append(out)
        return got

    t0 = time.monotonic()
    assert len(asyncio.run(late())) == 1
    assert 0.05 <= time.monotonic() - t0 < 1

    async def overdue_with_an_output_waiting():   # a consumer kept busy still times out
        stream = RequestStream("r", deadline=time.monotonic() + 0.05)
        await asyncio.sleep(0.06)
        stream.put(delta(0))
        await anext(aiter(stream))

    with pytest.raises(RequestTimeoutError):
        asyncio.run(overdue_with_an_output_waiting())


def test_merged_streams_of_a_stalled_consumer_stay_folded():
    async def main():
        streams = [RequestStream(f"r{i}", aggregate=True) for i in range(3)]
        merged = merge_streams(streams)
        for s in streams:
            s.put(delta(0))
        first = await anext(merged)
        for i in range(1, 50):               # the consumer stalls meanwhile
            for s in streams:
                s.put(delta(i, finished=i == 49))
            await asyncio.sleep(0)
        rest = [item async for item in merged]
        return [first] + rest

    items = asyncio.run(main())
    # Per stream at most: one handed over, one in its pump's hands, the rest folded into one
    # (not 50 queued outputs).
    assert len(items) <= 3 * 3
    texts = {}
    for i, out in items:
        texts[i] = texts.get(i, "") + out.outputs[0].text
    assert texts == {i: "".join(f"<{k}>" for k in range(50)) for i in range(3)}


# ---- flags -------------------------------------------------------------------------------


def test_overload_flags_reach_the_server_config():
    args = build_parser().parse_args(["serve", "--max-pending-requests", "64",
                                      "--request-timeout", "2.5"])
    config = server_config(args)
    assert (config.max_pending_requests, config.request_timeout) == (64, 2.5)
    defaults = server_config(build_parser().parse_args(["serve"]))
    assert (defaults.max_pending_requests, defaults.request_timeout) == (None, None)


@pytest.mark.parametrize("flags, needle", [
    (["--max-pending-requests", "0"], "must be a positive integer, got 0"),
    (["--max-pending-requests", "1.5"], "invalid _positive value"),
    (["--request-timeout", "0"], "must be a positive number of seconds, got 0"),
    (["--request-timeout", "inf"], "must be a positive number of seconds, got inf"),
    (["--request-timeout", "nan"], "must be a positive number of seconds, got nan")])
def test_bad_overload_flags_are_refused(capsys, flags, needle):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", *flags])
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize("limit", [0, -1, 2.0, True])
def test_async_engine_refuses_a_bad_limit(limit):
    with pytest.raises(ValueError, match="max_pending_requests must be a positive integer"):
        AsyncEngine(EngineArgs(), max_pending_requests=limit)
