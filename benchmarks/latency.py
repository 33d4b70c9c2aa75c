"""``jaxpaged bench latency``: end-to-end latency of one batch, repeated (``vllm bench latency``).

Each iteration generates ``--batch-size`` random prompts of ``--input-len`` tokens for exactly
``--output-len`` tokens (greedy, EOS ignored); every iteration draws new token ids, so the
prefix cache never serves one iteration from another. ``--num-iters-warmup`` untimed
iterations compile the step shapes first. Writes ``avg_latency``, ``latencies`` and
``percentiles`` (vLLM's field names) to ``--output-json``, and beside it a PNG of each
iteration's latency (:func:`plot_panels`). With ``--speculative-config`` and
``--compare-plain`` a second engine without speculation runs the same batches, interleaved
with the speculative ones (a noisy machine then slows both alike), and the result adds
``plain_latencies``, ``plain_avg_latency`` and ``speedup_vs_plain`` (plain latency /
speculative latency: the ratio of output tokens/s).
"""

from __future__ import annotations

import argparse

import numpy as np

from jaxpaged import LLM
from jaxpaged.benchmarks.datasets import prompt_lookup_requests, random_requests
from jaxpaged.benchmarks.plots import plot_grouped_bars
from jaxpaged.benchmarks.results import (PERCENTILES, add_cost, add_cost_arg, add_spec_decode,
                                         plot_next_to, write_outputs)
from jaxpaged.benchmarks.throughput import run_requests
from jaxpaged.arg_utils import EngineArgs


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    EngineArgs.add_cli_args(parser)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--num-iters-warmup", type=int, default=1)
    parser.add_argument("--num-iters", type=int, default=5)
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--dataset-name", choices=("random", "prompt_lookup"), default="random",
                        help="prompt_lookup: a random passage of --input-len / 2 tokens "
                             "written twice (the output can copy it)")
    parser.add_argument("--compare-plain", action="store_true",
                        help="with --speculative-config: also run every batch without "
                             "speculation (a second engine) and print the speed-up")
    add_cost_arg(parser)


def main(args: argparse.Namespace) -> dict:
    """Run the benchmark the flags describe; returns (and prints) the result."""
    for flag in ("input_len", "output_len", "batch_size", "num_iters"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    engine_args = vars(EngineArgs.from_cli_args(args, enforce_eager_default=True))
    llm = LLM(**engine_args)
    plain = LLM(**{**engine_args, "speculative_config": None}) \
        if args.compare_plain and engine_args["speculative_config"] is not None else None
    for e in (llm, plain):
        if e is not None:
            e.engine.wait_until_compiled()
    vocab, limit = llm.engine.model_config.vocab_size, llm.engine.max_model_len
    if args.input_len + args.output_len > limit:
        raise ValueError(f"--input-len + --output-len = {args.input_len + args.output_len} "
                         f"exceeds max_model_len={limit}")

    def batch(i):
        if args.dataset_name == "prompt_lookup":
            return prompt_lookup_requests(args.batch_size, args.input_len, args.output_len,
                                          seed=i, token_range=(3, vocab))
        return random_requests(args.batch_size, (args.input_len, args.input_len),
                               args.output_len, seed=i, token_range=(3, vocab))

    engines = [llm] if plain is None else [llm, plain]
    for i in range(args.num_iters_warmup):
        for e in engines:
            run_requests(e, batch(10_000 + i))
    runs = [[run_requests(e, batch(i)) for e in engines] for i in range(args.num_iters)]
    latencies = [r[0] for r in runs]
    result = {"backend": "jaxpaged", "batch_size": args.batch_size, "input_len": args.input_len,
              "output_len": args.output_len, "avg_latency": float(np.mean(latencies)),
              "latencies": latencies,
              "percentiles": {str(p): float(np.percentile(latencies, p)) for p in PERCENTILES}}
    print(f"Avg latency: {result['avg_latency']:.4f} s over {args.num_iters} iterations")
    for p, v in result["percentiles"].items():
        print(f"{p}% percentile latency: {v:.4f} s")
    add_spec_decode(result, llm)
    if plain is not None:
        result["plain_latencies"] = [r[1] for r in runs]
        result["plain_avg_latency"] = float(np.mean(result["plain_latencies"]))
        result["speedup_vs_plain"] = result["plain_avg_latency"] / result["avg_latency"]
        pairs = [r[1] / r[0] for r in runs]
        print(f"Speculative vs plain decoding: {result['speedup_vs_plain']:.2f}x output "
              f"tokens/s (plain {result['plain_avg_latency']:.4f} s, interleaved; per "
              f"iteration {min(pairs):.2f}x to {max(pairs):.2f}x)")
    tokens = args.batch_size * args.output_len
    add_cost(result, args.cost_per_hour, result["avg_latency"], tokens,
             tokens + args.batch_size * args.input_len)
    write_outputs(result, args.output_json)
    if args.output_json:
        plot_next_to(args.output_json, lambda path: plot_grouped_bars(
            plot_panels(result), path,
            f"bench latency: batch {args.batch_size} x {args.input_len} + "
            f"{args.output_len} tokens\naverage {result['avg_latency']:.3f} s"))
    return result


def plot_panels(result: dict) -> list[tuple]:
    """The plot's one panel for :func:`~jaxpaged.benchmarks.plots.plot_grouped_bars`: each
    timed iteration's latency in seconds, beside the plain engine's where
    ``--compare-plain`` ran one (``speculative`` and ``plain`` then)."""
    iterations = [f"iter {i + 1}" for i in range(len(result["latencies"]))]
    if "plain_latencies" not in result:
        return [("latency (s)", iterations, {"jaxpaged": result["latencies"]})]
    return [("latency (s)", iterations, {"speculative": result["latencies"],
                                         "plain": result["plain_latencies"]})]
