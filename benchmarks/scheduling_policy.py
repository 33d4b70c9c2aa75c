"""``jaxpaged bench scheduling-policy``: short requests' latency under ``fcfs`` and ``sjf``.

A mixed workload (``--num-short`` requests of ``--short-input-len`` + ``--short-output-len``
tokens and ``--num-long`` of ``--long-input-len`` + ``--long-output-len``, shuffled by
``--workload-seed``) arrives at once at an engine of ``--max-num-seqs`` seats (default 8, with
``--max-num-batched-tokens`` 1024), so a queue forms; each policy runs it on its own engine (the same flags but ``--scheduling-policy``), after an
untimed warm-up of the same shapes. Per policy and class (short, long): median and p90
end-to-end latency in seconds and in engine steps (every request arrives at step 0, so a
request's steps are the step that returned its last token: a figure the machine's speed does
not change), and for ``sjf`` the aging bound checked: the most requests that arrived after one
and got their first token in an earlier step, against ``--sjf-aging-requests``.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import numpy as np

from jaxpaged import LLM, SamplingParams
from jaxpaged.benchmarks.datasets import SampleRequest, random_requests
from jaxpaged.benchmarks.results import add_cost, add_cost_arg, cpu_model, write_outputs
from jaxpaged.arg_utils import EngineArgs


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    EngineArgs.add_cli_args(parser)
    # Few seats, so that the 64 requests queue and the policy decides who goes first (at
    # the engine's 256 seats every request would be admitted at once under any policy).
    parser.set_defaults(max_num_seqs=8, max_num_batched_tokens=1024)
    for name, default in (("num-short", 48), ("short-input-len", 16), ("short-output-len", 8),
                          ("num-long", 16), ("long-input-len", 128), ("long-output-len", 96)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--workload-seed", type=int, default=0,
                        help="seed of the prompts and their order")
    parser.add_argument("--output-json", default=None)
    add_cost_arg(parser)


def workload(args: argparse.Namespace, vocab: int, seed: int) -> list[tuple[str, SampleRequest]]:
    """The shuffled (class, request) list."""
    short = random_requests(args.num_short, (args.short_input_len,) * 2, args.short_output_len,
                            seed, (3, vocab))
    long = random_requests(args.num_long, (args.long_input_len,) * 2, args.long_output_len,
                           seed + 1, (3, vocab))
    items = [("short", q) for q in short] + [("long", q) for q in long]
    order = np.random.default_rng(seed).permutation(len(items))
    return [items[i] for i in order]


def run_policy(llm: LLM, items: list[tuple[str, SampleRequest]]) -> dict:
    """Submit every request at once and step to the end; per request its class, its first
    and last token's step and its end-to-end seconds, in arrival order."""
    engine = llm.engine
    t0 = time.perf_counter()
    for i, (_, q) in enumerate(items):
        engine.add_request(str(i), {"prompt_token_ids": q.prompt}, SamplingParams(
            temperature=0, ignore_eos=True, max_tokens=q.output_len))
    first, last, seconds = {}, {}, {}
    step = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        step += 1
        now = time.perf_counter() - t0
        for out in outputs:
            if out.outputs and out.outputs[0].token_ids:
                first.setdefault(out.request_id, step)
            if out.finished:
                last[out.request_id], seconds[out.request_id] = step, now
    return {"elapsed_s": time.perf_counter() - t0, "num_steps": step,
            "requests": [{"class": c, "first_step": first[str(i)], "last_step": last[str(i)],
                          "e2e_s": seconds[str(i)]} for i, (c, _) in enumerate(items)]}


def max_overtaken(requests: list[dict]) -> int:
    """The most requests that arrived after one (later in the list) and got their first
    token in an earlier step than it did."""
    firsts = [r["first_step"] for r in requests]
    return max((sum(f < firsts[i] for f in firsts[i + 1:]) for i in range(len(firsts))),
               default=0)


def summary(run: dict) -> dict:
    out = {"elapsed_s": run["elapsed_s"], "num_steps": run["num_steps"],
           "max_overtaken": max_overtaken(run["requests"])}
    for cls in ("short", "long"):
        rs = [r for r in run["requests"] if r["class"] == cls]
        for field, unit in (("e2e_s", "s"), ("last_step", "steps")):
            values = [r[field] for r in rs] or [0]
            out[f"median_{cls}_e2e_{unit}"] = float(np.median(values))
            out[f"p90_{cls}_e2e_{unit}"] = float(np.percentile(values, 90))
    return out


def main(args: argparse.Namespace) -> dict:
    """Run both policies; returns (and prints) the result.

    Raises:
        ValueError: a request count or length below 1 (0 requests of one class is fine).
    """
    for flag in ("short_input_len", "short_output_len", "long_input_len", "long_output_len"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.num_short < 0 or args.num_long < 0 or args.num_short + args.num_long < 1:
        raise ValueError("--num-short and --num-long must be >= 0, and not both 0")
    base = EngineArgs.from_cli_args(args, enforce_eager_default=True)
    result = {"cpu": cpu_model(), "max_num_seqs": base.max_num_seqs,
              "sjf_aging_requests": base.sjf_aging_requests, "policies": {}}
    for policy in ("fcfs", "sjf"):
        llm = LLM(**vars(dataclasses.replace(base, scheduling_policy=policy)))
        vocab = llm.engine.model_config.vocab_size
        run_policy(llm, workload(args, vocab, args.workload_seed + 1000))   # warm-up: shapes
        result["policies"][policy] = summary(run_policy(
            llm, workload(args, vocab, args.workload_seed)))
        del llm
    fcfs, sjf = result["policies"]["fcfs"], result["policies"]["sjf"]
    result["short_median_e2e_ratio"] = (sjf["median_short_e2e_s"] / fcfs["median_short_e2e_s"]
                                        if fcfs["median_short_e2e_s"] else 0.0)
    print(f"{'policy':<7} {'short median/p90 s':>19} {'steps':>11} {'long median/p90 s':>19} "
          f"{'steps':>11} {'max overtaken':>14}")
    for policy, r in result["policies"].items():
        print(f"{policy:<7} {r['median_short_e2e_s']:9.3f}/{r['p90_short_e2e_s']:<9.3f} "
              f"{r['median_short_e2e_steps']:5.0f}/{r['p90_short_e2e_steps']:<5.0f} "
              f"{r['median_long_e2e_s']:9.3f}/{r['p90_long_e2e_s']:<9.3f} "
              f"{r['median_long_e2e_steps']:5.0f}/{r['p90_long_e2e_steps']:<5.0f} "
              f"{r['max_overtaken']:>14}")
    print(f"sjf / fcfs median short-request latency {result['short_median_e2e_ratio']:.3f}; "
          f"sjf's bound: at most {base.sjf_aging_requests} later arrivals ahead of a request "
          f"(measured {sjf['max_overtaken']}); {result['cpu']}")
    tokens = args.num_short * args.short_output_len + args.num_long * args.long_output_len
    add_cost(result, args.cost_per_hour, sjf["elapsed_s"], tokens, tokens
             + args.num_short * args.short_input_len + args.num_long * args.long_input_len)
    write_outputs(result, args.output_json)
    return result


if __name__ == "__main__":   # without the jaxpaged CLI
    _parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_cli_args(_parser)
    main(_parser.parse_args())
