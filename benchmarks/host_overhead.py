"""``jaxpaged bench host-overhead``: host time per engine step outside the device call, and
the per-token cost of incremental detokenization (issue 20's acceptance benchmark).

Part 1 drives ``Engine.step()`` by hand on ``--num-requests`` random prompts of
``--min-prompt-len``..``--max-prompt-len`` tokens, each generating exactly ``--output-len``
greedy tokens (EOS ignored), all submitted at once. Every step is timed with
``time.perf_counter``: its wall time, the time inside the model runner's ``execute`` (the
device call: batch assembly, the jitted step and the copy of its results to the host), and
the host time outside it (scheduling, stop checks, detokenization, output assembly). Medians
and means are taken over the decode steps: the steps after every request has its first token
(no prompt token left to run). A warm-up pass with the same lengths and other token ids
compiles every step shape first. It runs in synchronous mode and, where ``EngineArgs`` has
``async_scheduling`` (vLLM's ``--async-scheduling``), in asynchronous mode too.

Part 2 feeds :class:`~jaxpaged.engine.detokenizer.IncrementalDetokenizer` one random token
at a time for outputs of each ``--detok-lengths`` length with a 32000-piece sentencepiece
tokenizer (``configs/tokenizers/llama2``) and prints the time per token and the ratio of the
longest to the shortest (goal: <= 1.5, the cost does not grow with the output).

Writes every step's figures to ``--output-json``; ends with the result as one JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

import numpy as np

from jaxpaged.benchmarks.datasets import ROOT, random_requests
from jaxpaged.benchmarks.results import write_outputs
from jaxpaged.benchmarks.throughput import shifted
from jaxpaged import LLM, SamplingParams
from jaxpaged.engine.arg_utils import EngineArgs
from jaxpaged.engine.detokenizer import IncrementalDetokenizer
from jaxpaged.tokenizer import load_tokenizer

LLAMA2_TOKENIZER = os.path.join(ROOT, "configs", "tokenizers", "llama2")
SUMMARY = ("wall", "device", "host")


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    EngineArgs.add_cli_args(parser)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--min-prompt-len", type=int, default=16)
    parser.add_argument("--max-prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--detok-lengths", type=int, nargs="+", default=[64, 4096],
                        help="output lengths at which to time detokenization per token")
    parser.add_argument("--detok-tokenizer", default=None,
                        help="tokenizer directory (default: configs/tokenizers/llama2, or the "
                             "model's where the checkout has none)")
    parser.add_argument("--per-step", action="store_true", help="print every step's figures")
    parser.add_argument("--output-json", default=None)


def model_runner(engine):
    """The object whose ``dispatch`` method starts the engine's device step (``execute`` is
    ``dispatch(...).result()``)."""
    return engine.runner


class DeviceTimer:
    """Records each device step of ``model_runner(engine)`` as ``(start, end)``
    ``time.perf_counter`` seconds: from the start of ``dispatch`` (batch preparation and the
    launch) to the return of its ``PendingStep.result`` (the tokens on the host). The same
    span in both modes: with ``async_scheduling`` the engine processes the previous step's
    outputs inside it, while the device runs."""

    def __init__(self, engine):
        runner = model_runner(engine)
        dispatch = runner.dispatch
        #: (start, end, new tokens of each scheduled sequence) of every device step.
        self.calls: list[tuple[float, float, list[int]]] = []

        calls = self.calls

        class TimedPending:
            """The dispatched step, whose ``result`` records the span when it returns."""

            def __init__(self, pending, start, scheduled):
                self._pending, self._start, self._scheduled = pending, start, scheduled

            def result(self):
                try:
                    return self._pending.result()
                finally:
                    calls.append((self._start, time.perf_counter(), self._scheduled))

        def timed_dispatch(scheduler_output, *args, **kwargs):
            start = time.perf_counter()
            pending = dispatch(scheduler_output, *args, **kwargs)
            return TimedPending(pending, start, [s.num_new_tokens
                                                 for s in scheduler_output.scheduled])

        runner.dispatch = timed_dispatch


def run_steps(llm: LLM, requests, timer: DeviceTimer | None = None) -> list[dict]:
    """Submit ``requests`` at once and step the engine until all finish; per step: wall,
    device and host milliseconds (host: before, between and after the device calls), the
    number of sequences the step scheduled, and whether it was a decode step (one new token
    each). Engine steps with no device step are left out (with async scheduling, the last
    one only reports the previous step's outputs)."""
    engine = llm.engine
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=requests[0].output_len)
    for i, q in enumerate(requests):
        engine.add_request(f"host-overhead-{i}", q.prompt, params)
    steps = []
    while engine.has_unfinished_requests():
        first = len(timer.calls) if timer else 0
        t0 = time.perf_counter()
        engine.step()
        t1 = time.perf_counter()
        calls = timer.calls[first:] if timer else []
        if not calls:       # no device step (async: the last step only reports outputs)
            continue
        device = sum(end - start for start, end, _ in calls)
        host = (calls[0][0] - t0) + (t1 - calls[-1][1]) + sum(
            b[0] - a[1] for a, b in zip(calls, calls[1:]))
        new_tokens = [n for *_, scheduled in calls for n in scheduled]
        steps.append({"wall_ms": (t1 - t0) * 1e3, "device_ms": device * 1e3,
                      "host_ms": host * 1e3, "num_seqs": len(new_tokens),
                      "decode": all(n == 1 for n in new_tokens)})
    return steps


def measure_mode(engine_args: EngineArgs, args: argparse.Namespace) -> dict:
    """One engine: warm-up pass, then the timed pass (the same seeded requests in every
    mode); its steps and decode-step summary."""
    llm = LLM(**vars(engine_args))
    requests = random_requests(args.num_requests, (args.min_prompt_len, args.max_prompt_len),
                               args.output_len, seed=0,
                               token_range=(3, llm.engine.model_config.vocab_size))
    run_steps(llm, shifted(requests, llm.engine.model_config.vocab_size))
    compilations = llm.engine.stats().num_compilations
    timer = DeviceTimer(llm.engine)
    t0 = time.perf_counter()
    steps = run_steps(llm, requests, timer)
    elapsed = time.perf_counter() - t0
    decode = [s for s in steps if s["decode"]]
    summary = {}
    for name in SUMMARY:
        values = [s[f"{name}_ms"] for s in decode] or [0.0]
        summary[f"median_{name}_ms"] = float(np.median(values))
        summary[f"mean_{name}_ms"] = float(np.mean(values))
    return {"elapsed_s": elapsed, "num_steps": len(steps), "num_decode_steps": len(decode),
            "num_tokens": sum(s["num_seqs"] for s in steps),
            "num_compilations_during_run": llm.engine.stats().num_compilations - compilations,
            "decode": summary, "steps": steps}


def detok_per_token_us(tokenizer, length: int, seed: int = 0, min_tokens: int = 12288
                       ) -> dict[str, float]:
    """Microseconds per ``add_token`` call over outputs of ``length`` random ids (three
    outputs at least, ``min_tokens`` tokens in all), each call timed on its own: the median,
    and the mean without the slowest 1% of calls (those that include the OS running another
    job on the core: a few milliseconds each on a shared machine, which a long output is far
    more likely to contain than a short one)."""
    rng = np.random.default_rng(seed)
    prompt = tokenizer.encode("Once upon a time")
    times = []
    for _ in range(max(3, -(-min_tokens // length))):
        detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=True)
        for t in rng.integers(3, len(tokenizer), size=length).tolist():
            t0 = time.perf_counter()
            detok.add_token(t)
            times.append(time.perf_counter() - t0)
    us = np.sort(np.asarray(times)) * 1e6
    return {"median_us": float(np.median(us)), "mean_us": float(us[:int(len(us) * 0.99)].mean())}


def cpu_model() -> str:
    """The host CPU's model name (``/proc/cpuinfo``) and the number of cores this process
    may use."""
    name = "unknown"
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f
                         if line.startswith("model name")), name)
    return f"{name} ({len(os.sched_getaffinity(0))} cores)"


def print_table(result: dict, per_step: bool) -> None:
    print(f"Host overhead per decode step: {result['num_requests']} requests of "
          f"{result['prompt_len_range'][0]}-{result['prompt_len_range'][1]} prompt tokens x "
          f"{result['output_len']} tokens, max_num_seqs={result['max_num_seqs']}; "
          f"CPU {result['cpu']}")
    print(f"{'mode':<6} {'steps':>5} {'decode':>6}   {'wall ms med/mean':>16}   "
          f"{'device ms med/mean':>18}   {'host ms med/mean':>16}   host share")
    for mode, m in result["modes"].items():
        d = m["decode"]
        cols = [f"{d[f'median_{n}_ms']:7.2f}/{d[f'mean_{n}_ms']:<7.2f}" for n in SUMMARY]
        share = d["mean_host_ms"] / d["mean_wall_ms"] if d["mean_wall_ms"] else 0.0
        print(f"{mode:<6} {m['num_steps']:>5} {m['num_decode_steps']:>6}   {cols[0]:>16}   "
              f"{cols[1]:>18}   {cols[2]:>16}   {share:6.1%}")
        if per_step:
            for i, s in enumerate(m["steps"]):
                print(f"  {mode} step {i:3d}: seqs {s['num_seqs']:3d} wall {s['wall_ms']:8.3f}"
                      f" device {s['device_ms']:8.3f} host {s['host_ms']:8.3f} ms"
                      f"{'' if s['decode'] else ' (prefill)'}")
    det = result["detokenize"]
    times = ", ".join(f"{n} tokens {t['mean_us']:.1f} us (median {t['median_us']:.1f})"
                      for n, t in det["per_token"].items())
    print(f"Detokenization per token ({det['tokenizer']}, {det['vocab_size']} pieces), mean: "
          f"{times}; ratio longest/shortest {det['ratio']:.2f} (goal <= 1.5)")


def main(args: argparse.Namespace) -> dict:
    """Run the benchmark the flags describe; returns (and prints) the result."""
    for flag in ("num_requests", "min_prompt_len", "output_len"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.max_prompt_len < args.min_prompt_len:
        raise ValueError("--max-prompt-len must be >= --min-prompt-len")
    engine_args = EngineArgs.from_cli_args(args, enforce_eager_default=True)
    modes = {"sync": engine_args}
    if any(f.name == "async_scheduling" for f in dataclasses.fields(EngineArgs)):
        modes = {"sync": dataclasses.replace(engine_args, async_scheduling=False),
                 "async": dataclasses.replace(engine_args, async_scheduling=True)}
    result = {"model": engine_args.model, "num_requests": args.num_requests,
              "prompt_len_range": [args.min_prompt_len, args.max_prompt_len],
              "output_len": args.output_len, "max_num_seqs": engine_args.max_num_seqs,
              "cpu": cpu_model(),
              "modes": {mode: measure_mode(a, args) for mode, a in modes.items()}}
    path = args.detok_tokenizer or (LLAMA2_TOKENIZER if os.path.isdir(LLAMA2_TOKENIZER)
                                    else engine_args.model)
    tok = load_tokenizer(path)
    per_token = {str(n): detok_per_token_us(tok, n) for n in sorted(set(args.detok_lengths))}
    result["detokenize"] = {"tokenizer": os.path.relpath(path, ROOT), "vocab_size": len(tok),
                            "per_token": per_token,
                            "ratio": per_token[str(max(args.detok_lengths))]["mean_us"]
                            / per_token[str(min(args.detok_lengths))]["mean_us"]}
    print_table(result, args.per_step)
    write_outputs(result, args.output_json)
    return result


if __name__ == "__main__":   # without the jaxpaged CLI
    _parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_cli_args(_parser)
    main(_parser.parse_args())
