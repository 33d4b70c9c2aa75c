"""``jaxpaged bench serve``: online serving benchmark against a running ``jaxpaged serve``
(``vllm bench serve``).

Requests go to ``POST /v1/completions`` with streaming (``--dataset-name chat``: chat
messages to ``POST /v1/chat/completions``, rendered by the server's own chat template), at
Poisson arrivals of ``--request-rate`` per second (``inf``: all at once), at most
``--max-concurrency`` in flight. Each generates exactly its ``output_len`` tokens (greedy, EOS
ignored), counted by the stream's ``usage``. Per request: TTFT (send to first streamed text),
ITL (gaps between streamed chunks), TPOT ((E2E - TTFT) / (output tokens - 1)) and E2E
latency. Any OpenAI-compatible server that honours ``ignore_eos`` and
``stream_options.include_usage`` will do (llama.cpp's ``llama-server`` does:
``benchmarks/compare_chat.py``). Prints vLLM's "Serving Benchmark Result" table and
writes its field names to ``--output-json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import httpx
import numpy as np

from jaxpaged.benchmarks.datasets import (CHAT_DATASETS, SampleRequest, add_dataset_args,
                                          requests_from_args)
from jaxpaged.benchmarks.plots import plot_serve_latencies
from jaxpaged.benchmarks.results import (add_cost, add_cost_arg, distribution, plot_next_to,
                                         write_outputs)
from jaxpaged.arg_utils import DEFAULT_MODEL
from jaxpaged.tokenizer import load_tokenizer


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None,
                        help="served model name (default: the first in /v1/models)")
    parser.add_argument("--tokenizer", default=DEFAULT_MODEL,
                        help="tokenizer directory (the served model's)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="requests per second, Poisson arrivals (inf: all at once)")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0, help="seed of the arrival times")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="the server's limit (default: read from /v1/models)")
    add_dataset_args(parser, chat=True)
    parser.add_argument("--output-json", default=None)
    add_sampling_args(parser)
    add_cost_arg(parser)


@dataclass
class RequestResult:
    """One request's measurements (seconds)."""

    ok: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)


def _streamed_text(choice: dict) -> str:
    """The text of one streamed choice: a completion's ``text``, a chat ``delta.content``."""
    if "delta" in choice:
        return choice["delta"].get("content") or ""
    return choice.get("text") or ""


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    """vLLM's ``bench serve`` sampling flags: every request greedy unless they say more."""
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="every request's temperature (default 0: greedy)")
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--min-p", type=float, default=None)


def sampling_fields(args: argparse.Namespace) -> dict:
    """The request body's sampling fields from :func:`add_sampling_args`' flags (those not
    given are left to the server's defaults)."""
    fields = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
              "min_p": args.min_p}
    return {k: v for k, v in fields.items() if v is not None}


async def send(client: httpx.AsyncClient, model: str, q: SampleRequest,
               sampling: dict | None = None) -> RequestResult:
    """Stream one request of exactly ``q.output_len`` tokens (EOS ignored) and time it:
    to ``/v1/chat/completions`` when ``q`` holds chat messages (its prompt length is then the
    server's ``usage.prompt_tokens``), else to ``/v1/completions``. Greedy unless
    ``sampling`` (body fields, :func:`sampling_fields`) says otherwise."""
    body = {"model": model, "max_tokens": q.output_len, "temperature": 0,
            **(sampling or {}), "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    if q.is_chat:
        path, body["messages"] = "/v1/chat/completions", q.prompt
    else:
        path, body["prompt"] = "/v1/completions", q.prompt
    res = RequestResult(prompt_len=q.prompt_len)
    t0 = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"
                return res
            async for chunk in sse_payloads(r):
                if chunk == DONE:
                    continue
                if "error" in chunk:
                    res.error = chunk["error"]["message"]
                    return res
                now = time.perf_counter()
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                    if q.is_chat:
                        res.prompt_len = chunk["usage"].get("prompt_tokens", 0)
                if any(_streamed_text(c) for c in chunk.get("choices") or ()):
                    if last is None:
                        res.ttft = now - t0
                    else:
                        res.itls.append(now - last)
                    last = now
    except httpx.HTTPError as e:
        res.error = repr(e)
        return res
    res.e2e = time.perf_counter() - t0
    res.ok = last is not None and res.output_tokens == q.output_len
    if not res.ok and not res.error:
        res.error = f"{res.output_tokens} tokens streamed, {q.output_len} expected"
    return res


def run(base_url: str, model: str, requests: list[SampleRequest],
        max_concurrency: int | None = None, request_rate: float = float("inf"), seed: int = 0,
        api_key: str | None = None,
        sampling: dict | None = None) -> tuple[list[RequestResult], float]:
    """Send ``requests`` to the server at ``base_url`` (:func:`send` with ``sampling``,
    :func:`run_limited`'s arrivals and limit); returns the results in request order and the
    seconds the whole set took (first send to last answer)."""
    async def go():
        async with http_client(base_url, api_key) as client:
            return await run_limited(requests, lambda q: send(client, model, q, sampling),
                                     max_concurrency, request_rate, seed)

    return asyncio.run(go())


# ---- client pieces (shared with benchmarks/soak.py) -------------------------------------------

#: What :func:`sse_payloads` yields for the stream's closing ``data: [DONE]``.
DONE = "[DONE]"


def auth_headers(api_key: str | None) -> dict[str, str]:
    """``Authorization: Bearer KEY`` when a key is given."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def http_client(base_url: str, api_key: str | None = None) -> httpx.AsyncClient:
    """An async client for ``base_url``: no timeout, no connection limit (the caller bounds
    the concurrency)."""
    # No kept-alive connections: llama-server closes idle ones after a few seconds, and a
    # request sent on one it just closed failed ("Server disconnected without sending a
    # response") in the one-user run after the warm-up; a new loopback connection per
    # request costs well under a millisecond, for either server.
    return httpx.AsyncClient(base_url=base_url, headers=auth_headers(api_key), timeout=None,
                             limits=httpx.Limits(max_connections=None,
                                                 max_keepalive_connections=0))


async def sse_payloads(response: httpx.Response) -> AsyncIterator[dict | str]:
    """The JSON payload of each server-sent event of ``response``; :data:`DONE` for
    ``data: [DONE]``."""
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            yield DONE if data == DONE else json.loads(data)


async def run_limited(items: list, worker: Callable[[object], Awaitable], max_concurrency:
                      int | None, request_rate: float = float("inf"), seed: int = 0
                      ) -> tuple[list, float]:
    """``worker(item)`` for every item, at most ``max_concurrency`` at once, started at
    Poisson arrivals of ``request_rate`` per second (inf: all at once); returns the results
    in order and the seconds it all took."""
    rng = np.random.default_rng(seed)
    limit = asyncio.Semaphore(max_concurrency or max(len(items), 1))

    async def limited(item):
        async with limit:
            return await worker(item)

    tasks = []
    t0 = time.perf_counter()
    for item in items:
        tasks.append(asyncio.create_task(limited(item)))
        if np.isfinite(request_rate):
            await asyncio.sleep(rng.exponential(1.0 / request_rate))
    results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - t0


def served_model(base_url: str, api_key: str | None, model: str | None) -> tuple[str, dict]:
    """The server's base URL (without a trailing ``/v1``) and the ``/v1/models`` card of
    ``model`` (default: the first listed).

    Raises:
        ValueError: no OpenAI-compatible server at ``base_url``, or it does not serve
            ``model``.
    """
    url = base_url.rstrip("/").removesuffix("/v1")
    try:
        r = httpx.get(url + "/v1/models", headers=auth_headers(api_key), timeout=30)
        cards = r.json()["data"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"no OpenAI-compatible server at {url} (GET /v1/models: {e!r})") from None
    names = [c["id"] for c in cards]
    if model is not None and model not in names:
        raise ValueError(f"the server at {url} serves {names}, not {model!r}")
    return url, cards[names.index(model)] if model else cards[0]


def summarize(results: list[RequestResult], duration: float) -> dict:
    """vLLM's serving-benchmark fields."""
    ok = [r for r in results if r.ok]
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    tpots = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "duration": duration, "completed": len(ok), "failed": len(results) - len(ok),
        "total_input_tokens": input_tokens, "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration, "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        **distribution([r.ttft for r in ok], "ttft"), **distribution(tpots, "tpot"),
        **distribution([x for r in ok for x in r.itls], "itl"),
        **distribution([r.e2e for r in ok], "e2el"),
        "errors": [r.error for r in results if not r.ok][:20],
    }


def per_request(results: list[RequestResult]) -> dict:
    """Each request's ``input_lens`` and ``output_lens`` (tokens), ``ttfts`` and ``tpots``
    (seconds; 0.0 for a failed request), in request order."""
    return {"input_lens": [r.prompt_len for r in results],
            "output_lens": [r.output_tokens for r in results],
            "ttfts": [r.ttft for r in results],
            "tpots": [(r.e2e - r.ttft) / (r.output_tokens - 1) if r.ok and r.output_tokens > 1
                      else 0.0 for r in results]}


def print_table(s: dict) -> None:
    rows = [("Successful requests:", s["completed"]), ("Failed requests:", s["failed"]),
            ("Benchmark duration (s):", f"{s['duration']:.2f}"),
            ("Total input tokens:", s["total_input_tokens"]),
            ("Total generated tokens:", s["total_output_tokens"]),
            ("Request throughput (req/s):", f"{s['request_throughput']:.2f}"),
            ("Output token throughput (tok/s):", f"{s['output_throughput']:.2f}"),
            ("Total Token throughput (tok/s):", f"{s['total_token_throughput']:.2f}")]
    print("{s:{c}^50}".format(s=" Serving Benchmark Result ", c="="))
    for name, value in rows:
        print(f"{name:<40}{value:<10}")
    for key, title in (("ttft", "Time to First Token"),
                       ("tpot", "Time per Output Token (excl. 1st token)"),
                       ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        print("{s:{c}^50}".format(s=title, c="-"))
        for stat in ("mean", "median", "p99"):
            label = f"{stat.capitalize() if stat != 'p99' else 'P99'} {key.upper()} (ms):"
            print(f"{label:<40}{s[f'{stat}_{key}_ms']:<10.2f}")
    print("=" * 50)


def main(args: argparse.Namespace) -> dict:
    """Run the benchmark the flags describe; returns (and prints) the result.

    Raises:
        ValueError: no server at ``--base-url``, an unknown ``--model``, bad flags.
        RuntimeError: every request failed.
    """
    if not args.request_rate > 0:
        raise ValueError(f"--request-rate must be > 0 (or inf), got {args.request_rate}")
    args.base_url, card = served_model(args.base_url, args.api_key, args.model)
    model = card["id"]
    max_len = args.max_model_len or card.get("max_model_len") or 2**31
    tokenizer = None if args.dataset_name in CHAT_DATASETS else load_tokenizer(args.tokenizer)
    requests = requests_from_args(args, tokenizer, len(tokenizer or ()), max_len)
    results, duration = run(args.base_url, model, requests, args.max_concurrency,
                            args.request_rate, args.seed, args.api_key, sampling_fields(args))
    summary = summarize(results, duration)
    if not summary["completed"]:
        raise RuntimeError(f"every request failed, e.g.: {summary['errors'][0]}")
    print_table(summary)
    result = {"backend": "jaxpaged", "model": model, "dataset": args.dataset_name,
              "request_rate": args.request_rate if np.isfinite(args.request_rate) else "inf",
              "max_concurrency": args.max_concurrency, "sampling": sampling_fields(args),
              **summary, **per_request(results)}
    add_cost(result, args.cost_per_hour, duration, summary["total_output_tokens"],
             summary["total_input_tokens"] + summary["total_output_tokens"])
    write_outputs(result, args.output_json)
    if args.output_json:
        plot_next_to(args.output_json, lambda path: plot_serve_latencies(result, path))
    return result
