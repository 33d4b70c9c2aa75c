"""``jaxpaged bench compare-chat``: one GGUF served by ``jaxpaged serve`` and by llama.cpp's
``llama-server``, one after the other, measured with the same chat workload.

The workload is ``--dataset-name chat`` of ``bench serve`` (``configs/workloads/chat.json``):
short user questions sent as chat messages to ``POST /v1/chat/completions`` (each server
renders them with its own chat template), greedy, exactly ``--output-len`` tokens each (EOS
ignored), streamed; the first ``--single-user-prompts`` of them one at a time, then all
``--num-prompts`` with ``--concurrency`` in flight. TTFT, TPOT and ITL are ``bench serve``'s
(``benchmarks/serve.py``: the same client). Before the timed runs each server gets an
untimed warm-up: one request of 8 tokens alone, then ``--concurrency`` of them at once.

Servers, never both at once (on a small CPU two servers would share its cores):

* ``jaxpaged serve MODEL --host 127.0.0.1 --port P [--serve-args]`` (this Python's
  ``-m jaxpaged.cli``), started twice: first on an empty compile cache
  (``--compilation-cache-dir`` a new temporary directory: every step program is compiled),
  stopped once ``/health`` is 200, then on the cache that start left (warm), which serves the
  workload. The CPU kernel library, built once per install under ``$JAXPAGED_CACHE_ROOT``,
  is not rebuilt: it is not the compile cache.
* ``llama-server --model MODEL --host 127.0.0.1 --port P --parallel 16 --cont-batching
  --ctx-size 8192 --threads 2 --threads-batch 2 --no-webui [--llama-server-args]``
  (``benchmarks/baselines/llama_cpp.py``'s command line) when ``--llama-server BIN`` is given.

Start-up is the time from spawn to the first ``GET /health`` 200. Peak RSS is the largest
resident memory of the server's process tree, sampled from ``/proc`` every
``--rss-interval`` seconds while it runs (start-up and workload;
``benchmarks/server_process.py``).

Writes ``--output-json`` (every figure, each run's ``bench serve`` fields and per-request
TTFT/TPOT, the machine, the command lines, the table) and a PNG beside it (matplotlib), and
prints the table as markdown. Each ratio says how many times better jaxpaged does: its
output tokens/s over llama.cpp's, or llama.cpp's seconds or megabytes over jaxpaged's.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time

from jaxpaged.benchmarks.baselines.llama_cpp import free_port, server_command, server_version
from jaxpaged.benchmarks.datasets import SampleRequest, chat_requests, load_chat
from jaxpaged.benchmarks.plots import plot_grouped_bars
from jaxpaged.benchmarks.results import (add_cost, add_cost_arg, machine, plot_next_to,
                                         write_outputs)
from jaxpaged.benchmarks.serve import (add_sampling_args, per_request, run, sampling_fields,
                                      served_model, summarize)
from jaxpaged.benchmarks.server_process import ServerProcess
from jaxpaged.runner.compile_cache import DISABLE_ENV

#: Output tokens of each warm-up request.
WARMUP_OUTPUT = 8


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """The command's flags (see the module docstring)."""
    parser.add_argument("model", help="the GGUF file both servers load (jaxpaged serve also "
                                      "takes a model directory, for a jaxpaged-only run)")
    parser.add_argument("--llama-server", default=None, metavar="BIN",
                        help="llama.cpp's llama-server binary (without it: the jaxpaged "
                             "column only)")
    parser.add_argument("--serve-args", default="",
                        help="more jaxpaged serve flags, one string (engine flags, e.g. "
                             "'--max-num-seqs 16 --dtype bfloat16')")
    parser.add_argument("--llama-server-args", default="",
                        help="more llama-server flags, one string (e.g. '-ctk f32 -ctv f32')")
    parser.add_argument("--llama-parallel", type=int, default=16, help="llama-server slots")
    parser.add_argument("--llama-ctx-size", type=int, default=8192,
                        help="llama-server --ctx-size (split over the slots)")
    parser.add_argument("--llama-threads", type=int, default=2,
                        help="llama-server --threads and --threads-batch")
    parser.add_argument("--num-prompts", type=int, default=None,
                        help="requests of the concurrent run (default: the workload's 64)")
    parser.add_argument("--single-user-prompts", type=int, default=None,
                        help="requests of the one-at-a-time run, the first of the set "
                             "(default: the workload's 8)")
    parser.add_argument("--concurrency", type=int, default=None,
                        help="requests in flight in the concurrent run (default: 16)")
    parser.add_argument("--output-len", type=int, default=None,
                        help="tokens each request generates (default: 128)")
    parser.add_argument("--rss-interval", type=float, default=0.1,
                        help="seconds between two RSS samples of a server")
    parser.add_argument("--health-timeout", type=float, default=1800.0,
                        help="seconds a server may take to answer /health 200")
    parser.add_argument("--work-dir", default=None,
                        help="where the servers' logs go (default: a new temporary directory)")
    parser.add_argument("--output-json", default=None)
    add_sampling_args(parser)
    add_cost_arg(parser)


def workload(args: argparse.Namespace) -> dict:
    """The run's workload: the flags, or the defaults of ``configs/workloads/chat.json``.

    Raises:
        ValueError: a count below 1, or more single-user requests than requests.
    """
    w = load_chat()
    defaults = {"num_prompts": w["num_requests"], "single_user_prompts":
                w["single_user_requests"], "concurrency": w["concurrency"],
                "output_len": w["output_len"]}
    out = {k: v if getattr(args, k) is None else getattr(args, k) for k, v in defaults.items()}
    for name, value in out.items():
        if value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if out["single_user_prompts"] > out["num_prompts"]:
        raise ValueError(f"--single-user-prompts {out['single_user_prompts']} is more than "
                         f"--num-prompts {out['num_prompts']}")
    return out


def measure_server(url: str, requests: list[SampleRequest], single: int,
                   concurrency: int, sampling: dict | None = None) -> dict:
    """The timed runs against the server at ``url``, after an untimed warm-up (one request
    of :data:`WARMUP_OUTPUT` tokens alone, then ``concurrency`` of them at once: the shapes of
    both runs): ``requests[:single]`` one at a time, then all of ``requests`` with
    ``concurrency`` in flight; greedy unless ``sampling`` (request body fields) says more.

    Returns:
        ``{"model": served name, "runs": {"single_user": ..., "concurrent": ...}}``, each run
        ``bench serve``'s summary (:func:`~jaxpaged.benchmarks.serve.summarize`: seconds,
        tokens/s, ``*_ms`` percentiles) with the per-request lists and ``max_concurrency``.
    Raises:
        RuntimeError: a request failed (the first errors are named).
    """
    url, card = served_model(url, None, None)
    model = card["id"]
    warmup = [SampleRequest(q.prompt, 0, WARMUP_OUTPUT) for q in requests[:concurrency]]
    run(url, model, warmup[:1], 1, sampling=sampling)
    run(url, model, warmup, concurrency, sampling=sampling)
    runs = {}
    for name, n, reqs in (("single_user", 1, requests[:single]),
                          ("concurrent", concurrency, requests)):
        results, duration = run(url, model, reqs, n, sampling=sampling)
        summary = summarize(results, duration)
        if summary["failed"]:
            raise RuntimeError(f"{summary['failed']} of {len(reqs)} requests to {url} failed "
                               f"at concurrency {n}, e.g.: {summary['errors'][:3]}")
        runs[name] = {"max_concurrency": n, **summary, **per_request(results)}
    return {"model": model, "runs": runs}


def jaxpaged_command(model: str, port: int, serve_args: str, cache_dir: str) -> list[str]:
    """``python -m jaxpaged.cli serve MODEL`` on 127.0.0.1:``port`` with ``serve_args`` and
    the compile cache in ``cache_dir`` (last, so that it wins over one in ``serve_args``)."""
    return [sys.executable, "-m", "jaxpaged.cli", "serve", model, "--host", "127.0.0.1",
            "--port", str(port), *shlex.split(serve_args), "--compilation-cache-dir", cache_dir]


_PRECOMPILED = re.compile(r"precompiled (\d+) executables in ([\d.]+) s \((\d+) compiled, "
                          r"(\d+) loaded")


def precompile_figures(log_path: str) -> dict | None:
    """What a ``jaxpaged serve`` log says its start-up precompile did: ``executables``,
    ``seconds``, ``compiled`` (afresh) and ``loaded`` (from the compile cache); None when the
    log has no such line (``--enforce-eager``)."""
    with open(log_path, errors="replace") as f:
        m = _PRECOMPILED.search(f.read())
    if m is None:
        return None
    return {"executables": int(m[1]), "seconds": float(m[2]), "compiled": int(m[3]),
            "loaded": int(m[4])}


def prepare_kernels(env: dict[str, str]) -> float:
    """Build (or find built) the CPU kernel library in a subprocess with ``env``, so that
    the empty-cache start-up does not include a kernel build (the library is cached per
    install under ``$JAXPAGED_CACHE_ROOT/kernels``, apart from the compile cache); returns its
    seconds."""
    t0 = time.perf_counter()
    code = "from jaxpaged.layers.cpu_build import load_cpu_kernels; load_cpu_kernels()"
    subprocess.run([sys.executable, "-c", code], env=env, check=True,
                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


_BACKGROUND_STARTED = "more step shapes in the background"
_BACKGROUND_DONE = re.compile(r"background compilation of \d+ step shapes done in ([\d.]+) s")


def wait_for_background_compile(log_path: str, timeout_s: float) -> float | None:
    """Wait until the server log at ``log_path`` says its background compilation is done
    (polling every 0.2 s, at most ``timeout_s``); its seconds, or None when the server
    started none (its log says so at once: ``compiling N more step shapes``)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with open(log_path, errors="replace") as f:
            text = f.read()
        m = _BACKGROUND_DONE.search(text)
        if m:
            return float(m[1])
        if _BACKGROUND_STARTED not in text:
            return None
        time.sleep(0.2)
    return None


def run_jaxpaged(args: argparse.Namespace, requests: list[SampleRequest], w: dict,
                 work: str) -> dict:
    """The jaxpaged column: a start on an empty compile cache (stopped at ``/health`` 200),
    then a warm start on the cache it left, which serves the workload; start-up seconds, peak
    RSS (MB) and precompile figures of each, the runs of :func:`measure_server` and the
    command lines."""
    env = {k: v for k, v in os.environ.items() if k != DISABLE_ENV}
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    out: dict = {"commands": [], "logs": [], "kernels_prepare_s": prepare_kernels(env)}
    with tempfile.TemporaryDirectory(prefix="jaxpaged-compile-cache-") as cache:
        for kind in ("empty_cache", "warm"):
            command = jaxpaged_command(args.model, free_port(), args.serve_args, cache)
            log = os.path.join(work, f"jaxpaged-serve-{kind}.log")
            out["commands"].append(command)
            out["logs"].append(log)
            with ServerProcess(command, log, args.health_timeout, stop_timeout_s=30.0, env=env,
                               rss_interval_s=args.rss_interval, name="jaxpaged serve") as s:
                out[f"startup_{kind}_s"] = s.startup_time
                # The shapes compiled after /health (jaxpaged.runner.background_compile):
                # the cold start finishes them so that the warm start finds them all, and
                # the workload runs on a server that is no longer compiling.
                out[f"background_compile_{kind}_s"] = wait_for_background_compile(
                    log, args.health_timeout)
                if kind == "warm":
                    out.update(measure_server(s.url, requests, w["single_user_prompts"],
                                              w["concurrency"], sampling_fields(args)))
            # the warm server's peak (start-up and workload) is the column's
            key = "peak_rss_mb" if kind == "warm" else "startup_empty_cache_peak_rss_mb"
            out[key] = s.rss.peak_mb
            out[f"precompile_{kind}"] = precompile_figures(log)
    return out


def run_llama_cpp(args: argparse.Namespace, requests: list[SampleRequest], w: dict,
                  work: str) -> dict:
    """The llama.cpp column: one ``llama-server`` start (it has no compile cache), its
    start-up seconds, peak RSS (MB) over start-up and workload, the runs of
    :func:`measure_server`, its version and command line."""
    command = server_command(args.llama_server, args.model, free_port(), args.llama_parallel,
                             args.llama_ctx_size, args.llama_threads)
    command += shlex.split(args.llama_server_args)
    log = os.path.join(work, "llama-server.log")
    with ServerProcess(command, log, args.health_timeout, rss_interval_s=args.rss_interval,
                       name="llama-server") as s:
        out = {"commands": [command], "startup_s": s.startup_time,
               **measure_server(s.url, requests, w["single_user_prompts"], w["concurrency"],
                                sampling_fields(args))}
    out["peak_rss_mb"] = s.rss.peak_mb
    out["version"] = server_version(args.llama_server)
    out["logs"] = [log]
    return out


def _startups(e: dict) -> list[float]:
    """A column's start-up seconds: jaxpaged's empty-cache and warm ones, llama.cpp's one."""
    return ([e["startup_empty_cache_s"], e["startup_warm_s"]] if "startup_warm_s" in e
            else [e["startup_s"]])


def _ttfts(e: dict) -> list[float]:
    """A column's TTFT p50 and p90 (ms) in the concurrent run."""
    return [e["runs"]["concurrent"]["median_ttft_ms"], e["runs"]["concurrent"]["p90_ttft_ms"]]


def _ratio(ours: float | None, theirs: float | None, higher_is_better: bool) -> float | None:
    if not ours or not theirs:
        return None
    return ours / theirs if higher_is_better else theirs / ours


def comparison_table(engines: dict, concurrency: int) -> list[dict]:
    """The table's rows from the columns of :func:`run_jaxpaged` and :func:`run_llama_cpp`
    (``engines["llama.cpp"]`` may be missing).

    Returns:
        one dict per row: ``measure`` (its name), ``unit``, ``jaxpaged`` and ``llama.cpp``
        (the figures, a list each, None without that column) and ``ratio`` (one per figure
        pair, how many times better jaxpaged does, None without llama.cpp).
    """
    def run_figures(e: dict, which: str) -> list[float]:
        r = e["runs"][which]
        return [r["output_throughput"], r["median_tpot_ms"]]

    def figures(e: dict) -> dict:
        return {"single": run_figures(e, "single_user"), "multi": run_figures(e, "concurrent"),
                "ttft": _ttfts(e), "startup": _startups(e), "rss": [e["peak_rss_mb"]]}

    ours = figures(engines["jaxpaged"])
    theirs = figures(engines["llama.cpp"]) if "llama.cpp" in engines else None
    rows = [("single", "1 user: output tok/s (TPOT p50)", "tok/s (ms)", True),
            ("multi", f"{concurrency} users: output tok/s (TPOT p50)", "tok/s (ms)", True),
            ("ttft", f"{concurrency} users: TTFT p50 / p90", "ms", False),
            ("startup", "start-up to /health 200, empty compile cache / warm", "s", False),
            ("rss", "peak RSS (MB, of the server process tree)", "MB", False)]
    table = []
    for key, measure, unit, higher in rows:
        if theirs is None:
            ratio = None
        elif key in ("single", "multi"):
            ratio = [_ratio(ours[key][0], theirs[key][0], True)]
        else:       # llama.cpp's one start-up against each of jaxpaged's two
            ratio = [_ratio(o, theirs[key][min(i, len(theirs[key]) - 1)], higher)
                     for i, o in enumerate(ours[key])]
        table.append({"measure": measure, "unit": unit, "jaxpaged": ours[key],
                      "llama.cpp": theirs[key] if theirs else None, "ratio": ratio})
    return table


def _cell(values: list[float] | None, unit: str) -> str:
    if values is None:
        return "-"
    if unit == "tok/s (ms)":
        return f"{values[0]:.1f} ({values[1]:.2f} ms)"
    if unit == "MB":
        return f"{values[0]:.0f}"
    digits = 1 if unit == "s" or min(values) >= 10 else 2
    return " / ".join(f"{v:.{digits}f}" for v in values) + f" {unit}"


def markdown_table(table: list[dict]) -> str:
    """The rows of :func:`comparison_table` as a markdown table (one line each, a header)."""
    lines = ["| measure | jaxpaged | llama.cpp | ratio |", "|---|---|---|---|"]
    for row in table:
        ratio = ("-" if row["ratio"] is None else " / ".join(
            "-" if r is None else f"{r:.2f}" for r in row["ratio"]))
        lines.append(f"| {row['measure']} | {_cell(row['jaxpaged'], row['unit'])} | "
                     f"{_cell(row['llama.cpp'], row['unit'])} | {ratio} |")
    return "\n".join(lines)


def plot_panels(engines: dict, concurrency: int) -> list[tuple]:
    """The plot's panels for :func:`~jaxpaged.benchmarks.plots.plot_grouped_bars`: output
    tokens/s by concurrency, TTFT p50 and p90, start-up, peak RSS; one bar per engine in each
    group (llama.cpp's single start-up in both start-up groups)."""
    tok, ttft, start, rss = {}, {}, {}, {}
    for name, e in engines.items():
        tok[name] = [e["runs"][r]["output_throughput"] for r in ("single_user", "concurrent")]
        ttft[name] = _ttfts(e)
        start[name] = (_startups(e) * 2)[:2]      # llama.cpp's one start-up in both groups
        rss[name] = [e["peak_rss_mb"]]
    return [("output tokens/s", ["1 user", f"{concurrency} users"], tok),
            (f"TTFT at {concurrency} users (ms)", ["p50", "p90"], ttft),
            ("start-up to /health 200 (s)", ["empty cache", "warm"], start),
            ("peak RSS (MB)", ["server tree"], rss)]


def main(args: argparse.Namespace) -> dict:
    """Run the comparison the flags describe; returns (and writes, prints) the result.

    Raises:
        ValueError: bad flags.
        FileNotFoundError: no such model or ``--llama-server`` binary.
        RuntimeError: a server did not start, or a request failed.
    """
    w = workload(args)
    if not os.path.exists(args.model):
        raise FileNotFoundError(f"no model at {args.model}")
    if args.llama_server and not os.access(args.llama_server, os.X_OK):
        raise FileNotFoundError(f"--llama-server {args.llama_server} is not an executable")
    load_before = os.getloadavg()[0]
    work = args.work_dir or tempfile.mkdtemp(prefix="jaxpaged-compare-chat-")
    os.makedirs(work, exist_ok=True)
    requests = chat_requests(w["num_prompts"], w["output_len"])
    engines = {"jaxpaged": run_jaxpaged(args, requests, w, work)}
    if args.llama_server:
        engines["llama.cpp"] = run_llama_cpp(args, requests, w, work)
    for name, e in engines.items():        # the cost of each column's concurrent run
        r = e["runs"]["concurrent"]
        if args.cost_per_hour is not None:
            print(f"{name}, {w['concurrency']} users:", end=" ")
        add_cost(e, args.cost_per_hour, r["duration"], r["total_output_tokens"],
                 r["total_input_tokens"] + r["total_output_tokens"])
    table = comparison_table(engines, w["concurrency"])
    result = {"benchmark": "compare-chat", "model": os.path.abspath(args.model),
              **machine(load_before),
              "workload": {"dataset": "chat", **w, "sampling": sampling_fields(args)},
              "ratio": "how many times better jaxpaged does: its output tokens/s over "
                       "llama.cpp's; llama.cpp's ms, s or MB over jaxpaged's",
              "table": table, "engines": engines,
              "commands": {name: [shlex.join(c) for c in e["commands"]]
                           for name, e in engines.items()},
              "harness_args": {k: v for k, v in vars(args).items()
                               if isinstance(v, (str, int, float, bool, type(None)))}}
    markdown = markdown_table(table)
    write_outputs(result, args.output_json)
    if args.output_json:
        plot_next_to(args.output_json, lambda path: plot_grouped_bars(
            plot_panels(engines, w["concurrency"]), path,
            f"chat workload, {os.path.basename(args.model)} ({result['cpu']})"))
    print(markdown)
    print(f"ratio: {result['ratio']}")
    return result
