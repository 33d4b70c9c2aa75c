"""The soak's client (``benchmarks/soak.py``): one request sent over HTTP, streamed or not,
hanging up as the workload says, and what it saw."""

from __future__ import annotations

import asyncio
import time

import httpx
import numpy as np

from jaxpaged.benchmarks import soak_messages, soak_responses
from jaxpaged.benchmarks.serve import DONE, sse_payloads
from jaxpaged.benchmarks.soak_workload import SoakRequest, SoakResult


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
    messages = req.path == soak_messages.MESSAGES_PATH

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
            if messages:
                soak_messages.read_answer(res, answer)
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
                elif messages:
                    soak_messages.read_event(res, payload, state)
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
