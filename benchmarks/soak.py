"""``jaxpaged bench soak``: a soak test of the OpenAI-compatible server.

``num_requests`` requests go over loopback at most ``concurrency`` at a time: completions and
(when the server has a chat template) chat, streaming and not, ``n`` of 1 to 4, greedy and
sampled (mostly seeded), stop strings, ``min_tokens``, penalties, token-id and text prompts
(some repeated, for prefix-cache hits), all with logprobs (as token ids, so that token ids are
compared, not only text); a fraction of the text requests go to ``/v1/responses``
(``benchmarks/soak_responses.py``: compared by text, their event streams checked) and
another to Anthropic's ``/v1/messages`` (``benchmarks/soak_messages.py``: the same). A
``disconnect_fraction`` of the clients hang up at a random
moment: after a random part of the recent median latency, or (streams) after a random number
of events. Every request body is valid, so any answer but a 200 is a failure, except a 429
(a server with ``--max-pending-requests``): the client waits ``Retry-After`` and retries.

At the end it checks that:

- no request got a 5xx or any other error (in-band SSE errors included), except the
  requests of model steps that failed on purpose: with ``fault_fraction`` (a server in this
  process) a fraction of the requests is marked (``X-Request-Id: <tag>-<i>-fault``) and the
  engine's fault hook (``Engine.fault_injector``) raises in every model step that runs one;
  each such step fails every request in it (500, or an in-band error once streaming);
- every stream ended with ``[DONE]``, each choice index exactly once with a finish reason;
- the server goes idle: ``/metrics`` reads ``num_requests_running`` 0,
  ``num_requests_waiting`` 0 and ``kv_cache_usage_perc`` 0 (and, for a server in this
  process, every KV page is free, the engine holds no request and no output stream is open);
- the finish counters add up: no more aborts than disconnects, and every completed request
  counted as finished;
- every completed greedy or seeded request equals offline ``LLM.generate`` of the same prompt
  and ``SamplingParams`` (token ids, text and finish reason of every choice, and the
  completion-token count): the engine samples with per-request seeds
  whatever else is in the batch, so concurrency, disconnects of other clients, prefix-cache
  hits and preemption must not change an output. Unseeded sampled requests are only checked
  for shape (``n`` choices, at most ``max_tokens`` tokens each). The one difference allowed
  is floating-point: logits computed in another step shape (a prefix-cache hit, a
  recomputation after preemption) differ in their last bits, which can turn a choice that is
  a near tie; a divergence passes only if :func:`near_tie` finds its first differing token
  to be such a call (it is reported under ``near_ties``).

Without ``--base-url`` the engine flags' model is served in this process on a free
``127.0.0.1`` port (so the page pool can be read directly). With ``--base-url`` the server
there is checked through ``/metrics``; the engine flags then describe the offline reference,
which must be the served model. The soak assumes it is the server's only client.

Then (unless ``--embeddings-requests 0``) ``/v1/embeddings`` requests go to a pooling server,
started here with the same engine flags and ``--runner pooling`` or given by
``--embeddings-base-url`` (``benchmarks/soak_embeddings.py``: one task per server, as vLLM);
their summary is under ``embeddings`` and their problems count with the others.

The workload and its fault injector are in ``benchmarks/soak_workload.py``, the client in
``soak_client.py``, the checks in ``soak_checks.py``.

Prints a one-line JSON summary (``--output-json`` writes it too); exits with an error when a
check fails (the first problems, each with the request body to reproduce it, are listed).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import time
from collections import Counter

import httpx

from jaxpaged.benchmarks import soak_embeddings, soak_messages, soak_responses
from jaxpaged.benchmarks.results import add_cost, add_cost_arg, distribution, write_outputs
from jaxpaged.benchmarks.serve import auth_headers, http_client, run_limited, served_model
from jaxpaged.benchmarks.soak_checks import (check_answer, compare, first_divergence,
                                             metric_values, near_tie, wait_idle)
from jaxpaged.benchmarks.soak_client import Latencies, send
from jaxpaged.benchmarks.soak_workload import (SoakConfig, SoakRequest, injecting_faults,
                                               make_workload)
from jaxpaged.arg_utils import EngineArgs

__all__ = ["SoakConfig", "main", "near_tie", "run_soak"]


# ---- the run --------------------------------------------------------------------------------


def run_soak(config: SoakConfig, base_url: str, llm, api_key: str | None = None,
             model: str | None = None, engine=None) -> dict:
    """Run the soak against the server at ``base_url``; returns the summary, whose
    ``problems`` lists every failed check (empty when all passed).

    Args:
        llm: the offline reference (a :class:`jaxpaged.LLM` of the served model).
        engine: the server's :class:`~jaxpaged.engine.async_engine.AsyncEngine` when it runs
            in this process (adds the page-pool checks and makes fault injection possible);
            None for a remote server.

    Raises:
        ValueError: ``config.fault_fraction`` > 0 without ``engine``.
    """
    if config.fault_fraction > 0 and engine is None:
        raise ValueError("fault_fraction > 0 needs the server in this process (its engine's "
                         "fault hook)")
    url, card = served_model(base_url, api_key, model)
    model = card["id"]
    max_model_len = card.get("max_model_len") or llm.engine.max_model_len
    headers = auth_headers(api_key)

    def chat_prompt(text: str) -> list[int]:
        r = httpx.post(url + "/tokenize", headers=headers, timeout=30,
                       json={"model": model, "messages": [{"role": "user", "content": text}]})
        r.raise_for_status()
        return r.json()["tokens"]

    probe = httpx.post(url + "/tokenize", headers=headers, timeout=30, json={
        "model": model, "messages": [{"role": "user", "content": "hi"}]})
    requests = make_workload(config, model, llm.get_tokenizer(), max_model_len,
                             chat_prompt if probe.status_code == 200 else None,
                             f"soak{os.urandom(4).hex()}")
    if probe.status_code == 200 and config.responses_fraction:
        requests = soak_responses.as_responses(requests, config.responses_fraction,
                                               config.seed, chat_prompt)
    if probe.status_code == 200 and config.messages_fraction:
        requests = soak_messages.as_messages(requests, config.messages_fraction, config.seed,
                                             chat_prompt)
    before = metric_values(url, api_key)

    latencies = Latencies(config.disconnect_window)

    async def go():
        async with http_client(url, api_key) as client:
            return await run_limited(requests, lambda q: send(client, q, latencies),
                                     config.concurrency)

    faults = injecting_faults(engine) if config.fault_fraction else contextlib.nullcontext()
    with faults as injector:
        results, duration = asyncio.run(go())
    failed_by_fault = injector.failed_headers() if injector else set()
    idle_s, after = wait_idle(url, api_key, config.idle_timeout)

    problems: list[str] = []

    def problem(req: SoakRequest | None, what: str) -> None:
        where = "" if req is None else f"request {req.index} {json.dumps(req.reproduction())}: "
        problems.append(where + what)

    def is_responses(req: SoakRequest) -> bool:
        return req.path == soak_responses.RESPONSES_PATH

    def is_text_only(req: SoakRequest) -> bool:     # compared by text: no token ids
        return req.path in (soak_responses.RESPONSES_PATH, soak_messages.MESSAGES_PATH)

    statuses = Counter(r.status for r in results)
    server_errors = unexpected = injected = 0
    for req, res in zip(requests, results):
        failed_by_server = (res.status or 0) >= 500 or res.error.startswith("in-band")
        server_errors += failed_by_server
        if failed_by_server and req.headers["X-Request-Id"] in failed_by_fault:
            injected += 1
        elif res.disconnected and not failed_by_server:
            continue                  # a hang-up: what came before it is not checked
        elif res.error or not res.completed:
            unexpected += 1
            problem(req, res.error or "the stream ended without [DONE]")
        else:
            checked = soak_responses.check_answer if is_text_only(req) else check_answer
            for p in checked(req, res):
                problem(req, p)

    compared = [(q, r) for q, r in zip(requests, results) if r.completed and q.comparable]
    t0 = time.perf_counter()
    offline = llm.generate([q.prompt for q, _ in compared], [q.params for q, _ in compared],
                           use_tqdm=False) if compared else []
    offline_s = time.perf_counter() - t0
    mismatches, near_ties = 0, []
    for (req, res), out in zip(compared, offline):
        diffs = soak_responses.compare(res, out) if is_text_only(req) else \
            compare(req, res, out)
        if not diffs:
            continue
        where = first_divergence(res, out)
        if where is not None and where[2] is not None:
            index, k, token = where
            common = next(o for o in out.outputs if o.index == index).token_ids[:k]
            if near_tie(llm, list(out.prompt_token_ids), req.params, index, common, token):
                near_ties.append({"request": req.index, "choice": index, "position": k,
                                  "server_token": token, **req.reproduction()})
                continue
        mismatches += 1
        for d in diffs:
            problem(req, d)

    # idle and the counters
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        if after.get(name) != 0:
            problem(None, f"/metrics {name} = {after.get(name)} after {idle_s:.1f} s, not 0")

    def delta(name):
        return after.get(name, 0) - before.get(name, 0)

    completed = [r for r in results if r.completed]
    disconnected = sum(r.disconnected for r in results)
    aborts = delta("request_success_total:abort")
    finished = delta("request_success_total:stop") + delta("request_success_total:length")
    if aborts > disconnected + injected:
        problem(None, f"{aborts:.0f} aborts counted, more than the {disconnected} disconnects "
                      f"and {injected} failed requests")
    if finished < len(completed):
        problem(None, f"{finished:.0f} requests counted as finished, fewer than the "
                      f"{len(completed)} completed")
    leaked_pages = open_streams = None
    if engine is not None and engine.is_ready:     # (a dead one fails /health below)
        core = engine.check_alive()         # the EngineClient (engine/protocol.py)
        kv = core.stats()
        leaked_pages = kv.num_pages - kv.num_free_pages
        open_streams = engine.num_open_streams
        if leaked_pages or core.has_unfinished_requests() or open_streams:
            problem(None, f"the engine is not idle: {leaked_pages} pages held, "
                          f"{core.get_num_unfinished_requests()} requests, {open_streams} "
                          f"streams open")
    health = httpx.get(url + "/health", timeout=30).status_code
    if health != 200:
        problem(None, f"/health answers {health} after the soak")

    output_tokens = sum(r.completion_tokens or 0 for r in completed)
    queries = delta("prefix_cache_queries_total")
    return {
        "num_requests": len(requests), "concurrency": config.concurrency,
        "disconnect_fraction": config.disconnect_fraction, "seed": config.seed,
        "duration": duration, "completed": len(completed),
        "hangups_planned": sum(q.disconnect_at is not None or q.disconnect_events is not None
                               for q in requests),
        "disconnected": disconnected,
        "streamed": sum(q.body["stream"] for q in requests),
        "chat": sum(q.chat for q in requests),
        "responses": sum(map(is_responses, requests)),
        "messages": sum(q.path == soak_messages.MESSAGES_PATH for q in requests),
        "n_gt_1": sum(q.params.n > 1 for q in requests),
        "statuses": {str(k): v for k, v in sorted(statuses.items(), key=str)},
        "retried_429": sum(r.retries for r in results),
        "server_errors": server_errors, "fault_marked": sum(q.fault for q in requests),
        "failed_steps_requests": len(failed_by_fault), "failed_by_faults": injected,
        "unexpected_errors": unexpected, "compared": len(compared),
        "compared_sequences": sum(q.params.n for q, _ in compared), "mismatches": mismatches,
        "near_ties": len(near_ties), "near_tie_requests": near_ties[:20],
        "offline_seconds": offline_s, "request_throughput": len(completed) / duration,
        "output_throughput": output_tokens / duration, "output_tokens": output_tokens,
        "prompt_tokens": sum(r.prompt_tokens or 0 for r in completed),
        **distribution([r.latency for r in completed], "e2el"),
        "server_aborts": aborts, "server_finished": finished,
        "preemptions": delta("num_preemptions_total"),
        "prefix_cache_hit_rate": delta("prefix_cache_hits_total") / queries if queries else 0.0,
        "idle_after_s": idle_s, "final_gauges": {k: after.get(k) for k in (
            "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")},
        "leaked_pages": leaked_pages, "open_streams": open_streams, "health": health,
        "problems": problems[:50], "num_problems": len(problems),
    }


# ---- the command ----------------------------------------------------------------------------


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    d = SoakConfig()
    parser.add_argument("--base-url", default=None,
                        help="a running server (default: serve the engine flags' model here)")
    parser.add_argument("--served-model", default=None,
                        help="the served model name (default: the first in /v1/models)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--chat-template", default=None,
                        help="chat template of the server started here (file or template); "
                             "chat requests are sent when the server has one")
    parser.add_argument("--num-requests", type=int, default=d.num_requests)
    parser.add_argument("--concurrency", type=int, default=d.concurrency)
    parser.add_argument("--disconnect-fraction", type=float, default=d.disconnect_fraction)
    parser.add_argument("--disconnect-window", type=float, default=d.disconnect_window,
                        help="seconds within which a timed hang-up happens before the first "
                             "request completes (then: within the median latency)")
    parser.add_argument("--soak-seed", type=int, default=d.seed, help="seed of the workload")
    parser.add_argument("--soak-max-tokens", type=int, default=d.max_tokens,
                        help="largest max_tokens of a request")
    for name in ("logprobs", "penalty", "min_tokens"):
        parser.add_argument(f"--{name.replace('_', '-')}-fraction", type=float,
                            default=getattr(d, f"{name}_fraction"))
    parser.add_argument("--responses-fraction", type=float, default=d.responses_fraction,
                        help="text requests sent to /v1/responses instead (with a chat "
                             "template)")
    parser.add_argument("--messages-fraction", type=float, default=d.messages_fraction,
                        help="other text requests sent to /v1/messages instead (with a chat "
                             "template)")
    parser.add_argument("--fault-fraction", type=float, default=d.fault_fraction,
                        help="requests whose model steps fail on purpose (each failed step "
                             "fails all its requests); only for the server started here")
    parser.add_argument("--idle-timeout", type=float, default=d.idle_timeout)
    parser.add_argument("--output-json", default=None)
    add_cost_arg(parser)
    soak_embeddings.add_cli_args(parser)
    EngineArgs.add_cli_args(parser)


def main(args: argparse.Namespace) -> dict:
    """Run the soak the flags describe; returns (and prints) the summary.

    Raises:
        ValueError: bad flags, or no server at ``--base-url``.
        RuntimeError: a check failed (the message lists the first problems).
    """
    from jaxpaged import LLM
    from jaxpaged.arg_utils import DEFAULT_MODEL
    from jaxpaged.server.launcher import ServerThread
    from jaxpaged.server.serving import ServerConfig

    config = SoakConfig(num_requests=args.num_requests, concurrency=args.concurrency,
                        disconnect_fraction=args.disconnect_fraction,
                        disconnect_window=args.disconnect_window, seed=args.soak_seed,
                        max_tokens=args.soak_max_tokens, idle_timeout=args.idle_timeout,
                        logprobs_fraction=args.logprobs_fraction,
                        penalty_fraction=args.penalty_fraction,
                        min_tokens_fraction=args.min_tokens_fraction,
                        fault_fraction=args.fault_fraction,
                        responses_fraction=args.responses_fraction,
                        messages_fraction=args.messages_fraction)
    engine_args = EngineArgs.from_cli_args(args)
    server = None
    if args.base_url is None:
        template = args.chat_template
        if template is not None and os.path.isfile(template):
            with open(template) as f:
                template = f.read()
        name = "stories260K" if engine_args.model == DEFAULT_MODEL else engine_args.model
        server = ServerThread(engine_args, ServerConfig([name], template)
                              ).start(timeout=1800)
    try:
        llm = LLM(**vars(engine_args))
        summary = run_soak(config, args.base_url or server.url, llm, args.api_key,
                           args.served_model, server.engine if server else None)
    finally:
        if server is not None:
            server.stop()
    # vLLM serves one task per server: embeddings go to a second, pooling server.
    embeddings = soak_embeddings.soak_from_flags(args, engine_args, config.seed)
    if embeddings is not None:
        summary["embeddings"] = embeddings
        summary["problems"] += embeddings["problems"]
        summary["num_problems"] += embeddings["num_problems"]
    add_cost(summary, args.cost_per_hour, summary["duration"], summary["output_tokens"],
             summary["output_tokens"] + summary["prompt_tokens"])
    write_outputs(summary, args.output_json)
    if summary["num_problems"]:
        raise RuntimeError(f"the soak found {summary['num_problems']} problems, e.g.:\n"
                           + "\n".join(summary["problems"][:10]))
    return summary


if __name__ == "__main__":
    import sys

    parser = argparse.ArgumentParser(prog="python -m jaxpaged.benchmarks.soak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_cli_args(parser)
    try:
        main(parser.parse_args())
    except (ValueError, RuntimeError) as e:
        print(f"soak: error: {e}", file=sys.stderr)
        sys.exit(1)
