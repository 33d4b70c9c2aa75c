"""Baseline: llama.cpp's ``llama-server`` (continuous batching) on the same requests.

``benchmarks/compare.py --llama-server BIN --gguf FILE`` runs it: this module starts
``llama-server`` on loopback (127.0.0.1, a free port) with ``--parallel`` slots and
``--cont-batching``, waits for ``GET /health`` to answer 200, sends one untimed warm-up
request, then sends every request's token ids to ``POST /completion`` with ``concurrency``
of them in flight and times the whole set (first request sent to last answer). The server is
stopped by its PID in a ``finally`` (SIGTERM, then SIGKILL after ``stop_timeout_s``).

The protocol is llama.cpp's own ``/completion`` (``tools/server/README.md`` of the vendored
llama.cpp): ``prompt`` as a list of token ids (no BOS is added to such a prompt),
``n_predict``, ``ignore_eos`` so that exactly ``n_predict`` tokens come out,
``temperature`` 0 (greedy) and ``cache_prompt`` false (no KV reuse between requests, as the
W1 prompts share no prefix anyway); the answer's ``tokens_predicted`` is checked.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from jaxpaged.benchmarks.server_process import ServerProcess

#: Tokens of the untimed warm-up request (the first prompt's head), and its output length.
WARMUP_PROMPT_TOKENS, WARMUP_OUTPUT = 16, 8


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bound with port 0, then closed)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def slot_context(requests, parallel: int, multiple: int = 256) -> int:
    """``--ctx-size`` for ``parallel`` slots: llama-server splits the context evenly over its
    slots (no unified KV when ``--parallel`` is given), so each slot gets the longest
    request's prompt + output tokens, rounded up to ``multiple``."""
    longest = max(q.prompt_len + q.output_len for q in requests)
    return parallel * (-(-longest // multiple) * multiple)


def server_command(binary: str, gguf: str, port: int, parallel: int, ctx_size: int,
                   threads: int) -> list[str]:
    """The ``llama-server`` command line: loopback only, ``parallel`` slots with continuous
    batching, ``threads`` threads for decode and for batch (prompt) processing, no web UI."""
    return [binary, "--model", gguf, "--host", "127.0.0.1", "--port", str(port),
            "--parallel", str(parallel), "--cont-batching", "--ctx-size", str(ctx_size),
            "--threads", str(threads), "--threads-batch", str(threads), "--no-webui"]


class LlamaServer(ServerProcess):
    """A ``llama-server`` subprocess on 127.0.0.1 (a context manager that stops it by PID),
    with llama.cpp's own ``/completion`` client.

    Args:
        command: from :func:`server_command` (its ``--port`` is where requests go).
        log_path: the server's stdout and stderr.
        health_timeout_s: how long the model may take to load.
        stop_timeout_s: how long SIGTERM may take before SIGKILL.
        **kwargs: more of :class:`~jaxpaged.benchmarks.server_process.ServerProcess`'s
            (``rss_interval_s``, ``env``).
    Raises (on entry):
        RuntimeError: the server exited, or ``/health`` was not 200 within the timeout.
    """

    def complete(self, prompt: list[int], n_predict: int) -> dict:
        """``POST /completion`` of token ids, greedy, exactly ``n_predict`` tokens.

        Raises:
            RuntimeError: the answer holds another number of tokens.
        """
        body = json.dumps({"prompt": list(prompt), "n_predict": n_predict, "ignore_eos": True,
                           "temperature": 0.0, "cache_prompt": False}).encode()
        req = urllib.request.Request(self.url + "/completion", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=3600) as r:
            out = json.load(r)
        if out.get("tokens_predicted") != n_predict:
            raise RuntimeError(f"llama-server generated {out.get('tokens_predicted')} tokens, "
                               f"{n_predict} asked")
        return out

    def run(self, requests, concurrency: int) -> tuple[float, list[dict]]:
        """(seconds, answers in request order) for ``requests`` (token-id prompts) with
        ``concurrency`` in flight, from the first request sent to the last answer."""
        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            t0 = time.perf_counter()
            futures = [pool.submit(self.complete, q.prompt, q.output_len) for q in requests]
            answers = [f.result() for f in futures]
            elapsed = time.perf_counter() - t0
        return elapsed, answers


def server_version(binary: str) -> str:
    """``llama-server --version``'s lines joined by "; " ("" when it prints nothing)."""
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60)
    return "; ".join(line.strip() for line in (out.stdout + out.stderr).strip().splitlines())


def llama_cpp_row(binary: str, gguf: str, requests, work: str, parallel: int = 16,
                  threads: int = 2, extra_args: list[str] = (),
                  stop_timeout_s: float = 10.0) -> dict:
    """The ``llama.cpp <gguf file name>`` row: W1's requests through ``llama-server``
    (``extra_args`` appended to :func:`server_command`'s).

    Returns:
        the row dict: ``elapsed_time`` (s, the timed pass only: no start-up, no warm-up),
        ``output_tokens_per_second``, the prompt and output token counts the server reported,
        its start-up seconds, version and command line.
    """
    name = os.path.basename(gguf)
    command = server_command(binary, gguf, free_port(), parallel,
                             slot_context(requests, parallel), threads) + list(extra_args)
    with LlamaServer(command, os.path.join(work, f"llama-server-{name}.log"),
                     stop_timeout_s=stop_timeout_s) as server:
        startup = server.startup_time
        server.complete(requests[0].prompt[:WARMUP_PROMPT_TOKENS], WARMUP_OUTPUT)
        elapsed, answers = server.run(requests, parallel)
    out_tokens = sum(a["tokens_predicted"] for a in answers)
    prompt_tokens = sum(a.get("tokens_evaluated", 0) for a in answers)
    return {"backend": f"llama.cpp {name}", "elapsed_time": elapsed,
            "num_requests": len(requests), "total_prompt_tokens": prompt_tokens,
            "total_output_tokens": out_tokens, "output_tokens_per_second": out_tokens / elapsed,
            "requests_per_second": len(requests) / elapsed,
            "tokens_per_second": (prompt_tokens + out_tokens) / elapsed,
            "startup_time": startup, "llama_server_version": server_version(binary),
            "llama_server_command": command}
