"""``jaxpaged bench host-overhead``: host time per engine step outside the device call, and
the per-token cost of incremental detokenization (issue 20's acceptance benchmark).

Part 1 drives ``Engine.step()`` by hand on ``--num-requests`` random prompts of
``--min-prompt-len``..``--max-prompt-len`` tokens, each generating exactly ``--output-len``
greedy tokens (EOS ignored), all submitted at once, in synchronous mode and with async
scheduling (vLLM's ``--async-scheduling``). The requests ask for final outputs only
(``output_kind=FINAL_ONLY``), as ``LLM.generate`` and the server's non-streaming routes
submit them (vLLM's ``LLM`` does the same); the synchronous engine then runs the same
requests again asking for an output every step, cumulative (``Engine.step``'s default) and
delta (what streaming routes ask for), printed as two more rows. Every engine step is timed with
``time.perf_counter``: its wall time, the time inside the model runner's device calls
(``dispatch``: batch assembly and the launch; ``result``: waiting for the device and copying
the tokens back), and the host time outside them (scheduling, applying tokens, stop checks,
detokenization, outputs). Synchronously the device calls are the device step's time and the
host time adds to it; with async scheduling the host work overlaps the next device step, so
the goal is an async wall time per step close to the synchronous device call (the ratio is
printed). Medians and means are taken over the decode steps: the steps after every request
has its first token (no prompt token left to run). A warm-up pass with the same lengths and
other token ids compiles every step shape first.

Part 2 feeds :class:`~jaxpaged.core.detokenizer.IncrementalDetokenizer` one random token
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
from jaxpaged.benchmarks.results import add_cost, add_cost_arg, cpu_model, write_outputs
from jaxpaged.benchmarks.throughput import shifted
from jaxpaged import LLM, SamplingParams
from jaxpaged.sampling_params import RequestOutputKind
from jaxpaged.arg_utils import EngineArgs
from jaxpaged.core.detokenizer import IncrementalDetokenizer
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
    add_cost_arg(parser)


def model_runner(engine):
    """The object whose ``dispatch`` method starts the engine's device step (``execute`` is
    ``dispatch(...).result()``)."""
    return engine.runner


class DeviceTimer:
    """Records the time spent inside the device calls of ``model_runner(engine)``:
    ``dispatch`` (batch preparation and the launch) and its ``PendingStep.result`` (waiting
    for the device and copying the tokens to the host), as ``time.perf_counter`` intervals.
    Synchronously the two follow each other within one engine step; with async scheduling a
    step's ``result`` is called in the next engine step, after that step's ``dispatch``,
    and the host work in between overlaps the device."""

    def __init__(self, engine):
        runner = model_runner(engine)
        dispatch = runner.dispatch
        #: (start, end) of every dispatch and result call, in order.
        self.intervals: list[tuple[float, float]] = []
        #: New tokens of each scheduled sequence, per dispatched step.
        self.dispatched: list[list[int]] = []
        intervals = self.intervals

        class TimedPending:
            """The dispatched step, whose ``result`` call is timed."""

            def __init__(self, pending):
                self._pending = pending

            def result(self):
                start = time.perf_counter()
                try:
                    return self._pending.result()
                finally:
                    intervals.append((start, time.perf_counter()))

        def timed_dispatch(scheduler_output, *args, **kwargs):
            start = time.perf_counter()
            try:
                return TimedPending(dispatch(scheduler_output, *args, **kwargs))
            finally:
                intervals.append((start, time.perf_counter()))
                self.dispatched.append([s.num_new_tokens for s in scheduler_output.scheduled])

        runner.dispatch = timed_dispatch


def run_steps(llm: LLM, requests, timer: DeviceTimer | None = None,
              output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY) -> list[dict]:
    """Submit ``requests`` at once and step the engine until all finish; per engine step that
    dispatched a device step: wall, device-call and host milliseconds (host: the wall time
    outside the runner's dispatch and result calls), the number of sequences the dispatched
    step scheduled, and whether it was a decode step (one new token each). With async
    scheduling the last engine step only applies the previous step's tokens: left out.
    ``output_kind``: the outputs the requests ask for."""
    engine = llm.engine
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=requests[0].output_len,
                            output_kind=output_kind)
    for i, q in enumerate(requests):
        engine.add_request(f"host-overhead-{i}", q.prompt, params)
    steps = []
    while engine.has_unfinished_requests():
        first, first_step = (len(timer.intervals), len(timer.dispatched)) if timer else (0, 0)
        t0 = time.perf_counter()
        engine.step()
        t1 = time.perf_counter()
        if timer is None or len(timer.dispatched) == first_step:
            continue
        device = sum(end - start for start, end in timer.intervals[first:])
        new_tokens = [n for scheduled in timer.dispatched[first_step:] for n in scheduled]
        steps.append({"wall_ms": (t1 - t0) * 1e3, "device_ms": device * 1e3,
                      "host_ms": (t1 - t0 - device) * 1e3, "num_seqs": len(new_tokens),
                      "decode": all(n == 1 for n in new_tokens)})
    return steps


def measure_mode(engine_args: EngineArgs, args: argparse.Namespace,
                 output_kinds: dict[str, RequestOutputKind]) -> dict[str, dict]:
    """One engine: warm-up pass, then a timed pass for each of ``output_kinds`` (the same
    seeded requests in every mode), by name: its steps and decode-step summary."""
    llm = LLM(**vars(engine_args))
    llm.engine.wait_until_compiled()
    requests = random_requests(args.num_requests, (args.min_prompt_len, args.max_prompt_len),
                               args.output_len, seed=0,
                               token_range=(3, llm.engine.model_config.vocab_size))
    run_steps(llm, shifted(requests, llm.engine.model_config.vocab_size))
    timer = DeviceTimer(llm.engine)
    results = {}
    for name, kind in output_kinds.items():
        llm.engine.kv_cache_manager.reset_prefix_cache()   # each pass prefills its prompts
        compilations = llm.engine.stats().num_compilations
        timer.intervals.clear()
        timer.dispatched.clear()
        t0 = time.perf_counter()
        steps = run_steps(llm, requests, timer, kind)
        elapsed = time.perf_counter() - t0
        decode = [s for s in steps if s["decode"]]
        summary = {}
        for field in SUMMARY:
            values = [s[f"{field}_ms"] for s in decode] or [0.0]
            summary[f"median_{field}_ms"] = float(np.median(values))
            summary[f"mean_{field}_ms"] = float(np.mean(values))
        results[name] = {
            "output_kind": kind.name.lower(), "elapsed_s": elapsed, "num_steps": len(steps),
            "num_decode_steps": len(decode), "num_tokens": sum(s["num_seqs"] for s in steps),
            "num_prompt_tokens": sum(q.prompt_len for q in requests),
            "num_compilations_during_run": llm.engine.stats().num_compilations - compilations,
            "decode": summary, "steps": steps}
    return results


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


def print_table(result: dict, per_step: bool) -> None:
    print(f"Host overhead per decode step: {result['num_requests']} requests of "
          f"{result['prompt_len_range'][0]}-{result['prompt_len_range'][1]} prompt tokens x "
          f"{result['output_len']} tokens, max_num_seqs={result['max_num_seqs']}; "
          f"CPU {result['cpu']}")
    print(f"{'mode':<15} {'outputs':<10} {'steps':>5} {'decode':>6}   {'wall ms med/mean':>16}   "
          f"{'device ms med/mean':>18}   {'host ms med/mean':>16}   host share")
    for mode, m in result["modes"].items():
        d = m["decode"]
        cols = [f"{d[f'median_{n}_ms']:7.2f}/{d[f'mean_{n}_ms']:<7.2f}" for n in SUMMARY]
        share = d["mean_host_ms"] / d["mean_wall_ms"] if d["mean_wall_ms"] else 0.0
        print(f"{mode:<15} {m['output_kind']:<10} {m['num_steps']:>5} "
              f"{m['num_decode_steps']:>6}   {cols[0]:>16}   {cols[1]:>18}   {cols[2]:>16}   "
              f"{share:6.1%}")
        if per_step:
            for i, s in enumerate(m["steps"]):
                print(f"  {mode} step {i:3d}: seqs {s['num_seqs']:3d} wall {s['wall_ms']:8.3f}"
                      f" device {s['device_ms']:8.3f} host {s['host_ms']:8.3f} ms"
                      f"{'' if s['decode'] else ' (prefill)'}")
    sync = result["modes"]["sync"]["decode"]
    print(f"Goals: sync host per decode step {sync['median_host_ms']:.2f} ms median (<= 3 ms; "
          f"final-only outputs, as LLM.generate submits); "
          f"async wall / sync device call {result['async_wall_over_sync_device']:.3f} "
          f"(median; <= 1.10)")
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
    kinds = RequestOutputKind
    modes = measure_mode(dataclasses.replace(engine_args, async_scheduling=False), args, {
        "sync": kinds.FINAL_ONLY, "sync-cumulative": kinds.CUMULATIVE, "sync-delta": kinds.DELTA})
    modes.update(measure_mode(dataclasses.replace(engine_args, async_scheduling=True), args,
                              {"async": kinds.FINAL_ONLY}))
    result = {"model": engine_args.model, "num_requests": args.num_requests,
              "prompt_len_range": [args.min_prompt_len, args.max_prompt_len],
              "output_len": args.output_len, "max_num_seqs": engine_args.max_num_seqs,
              "cpu": cpu_model(), "modes": modes}
    sync, async_ = (result["modes"][m]["decode"] for m in ("sync", "async"))
    result["async_wall_over_sync_device"] = (async_["median_wall_ms"] / sync["median_device_ms"]
                                             if sync["median_device_ms"] else 0.0)
    path = args.detok_tokenizer or (LLAMA2_TOKENIZER if os.path.isdir(LLAMA2_TOKENIZER)
                                    else engine_args.model)
    tok = load_tokenizer(path)
    per_token = {str(n): detok_per_token_us(tok, n, seed=n) for n in sorted(set(args.detok_lengths))}
    result["detokenize"] = {"tokenizer": os.path.relpath(path, ROOT), "vocab_size": len(tok),
                            "per_token": per_token,
                            "ratio": per_token[str(max(args.detok_lengths))]["mean_us"]
                            / per_token[str(min(args.detok_lengths))]["mean_us"]}
    print_table(result, args.per_step)
    timed = result["modes"]["async"]   # the engine's default mode
    outputs = args.num_requests * args.output_len   # every request runs to output_len
    add_cost(result, args.cost_per_hour, timed["elapsed_s"], outputs,
             outputs + timed["num_prompt_tokens"])
    write_outputs(result, args.output_json)
    return result


if __name__ == "__main__":   # without the jaxpaged CLI
    _parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_cli_args(_parser)
    main(_parser.parse_args())
