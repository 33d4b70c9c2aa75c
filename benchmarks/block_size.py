"""``jaxpaged bench block-size``: workload W1 at several ``--block-size`` values, side by side.

Every size (default ``16,32,64,auto``) runs W1 (``configs/workloads/w1.json``: 64 prompts of
32-256 random ids, 128 greedy output tokens each, on the stories110M-shaped random
checkpoint) through its own engine with the same KV budget, one after the other, for
``--rounds`` rounds (each round starts one size later than the one before, so no size is
always first or last after the others; each size's best round counts, so a burst of load
on a shared machine hurts one round, not one size). Each measurement is
:func:`jaxpaged.benchmarks.throughput.measure` (a warm-up pass of the same shapes first).
Prints a table of output tokens/s and each size's ratio to the best fixed size, every
round's figure (``rounds_output_tokens_per_second``, to judge the noise), the page size
``auto`` chose, and ``auto_over_best_fixed`` (the acceptance: at least 0.95).

Usage: ``jaxpaged bench block-size [--sizes 16,32,64,auto] [--rounds 3] [--num-requests 64]
[--output-json FILE] [--cost-per-hour USD]`` (each row's cost per million tokens); ``--small`` runs the bundled model on 8 short requests (CI).
"""

from __future__ import annotations

import argparse
import gc
import os
import tempfile

from jaxpaged import LLM
from jaxpaged.benchmarks.baselines.checkpoint import write_random_checkpoint
from jaxpaged.benchmarks.datasets import ROOT, load_w1, random_requests, w1_requests
from jaxpaged.benchmarks.results import add_cost, add_cost_arg, machine, write_outputs
from jaxpaged.benchmarks.throughput import measure


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", default="16,32,64,auto",
                        help="comma-separated --block-size values (integers and auto)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-requests", type=int, default=None,
                        help="the first N requests of W1 (default: all 64)")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=2 << 30,
                        help="the same KV budget for every size")
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--work-dir", default=os.path.join(tempfile.gettempdir(), "jaxpaged-w1"))
    parser.add_argument("--small", action="store_true",
                        help="the bundled model on 8 short requests (seconds; CI)")
    parser.add_argument("--output-json", default=None)
    add_cost_arg(parser)


def run(args: argparse.Namespace) -> dict:
    """Measure every size; returns the result (also printed and written)."""
    load_before = os.getloadavg()[0]
    sizes = [s if s == "auto" else int(s) for s in args.sizes.split(",") if s]
    if args.small:
        from jaxpaged.arg_utils import DEFAULT_MODEL
        model, max_len = DEFAULT_MODEL, 128
        requests = random_requests(8, (8, 24), 8, seed=0, token_range=(3, 512))
    else:
        w = load_w1()
        model = write_random_checkpoint(os.path.join(ROOT, w["model"]),
                                        os.path.join(ROOT, w["tokenizer"]),
                                        os.path.join(args.work_dir, "checkpoint"))
        max_len, requests = args.max_model_len, w1_requests()[:args.num_requests]
    best: dict = {}
    rounds: dict = {}      # size -> output tokens/s of each round, in the order run
    chosen = None
    for r in range(args.rounds):
        for size in sizes[r % len(sizes):] + sizes[:r % len(sizes)]:
            llm = LLM(model=model, block_size=size, max_model_len=max_len, enforce_eager=True,
                      max_num_seqs=64, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                      attention_backend=args.attention_backend)
            if size == "auto":
                chosen = llm.engine.kv_cache_manager.page_size
            row = measure(llm, requests)
            rounds.setdefault(size, []).append(row["output_tokens_per_second"])
            if size not in best or row["output_tokens_per_second"] > \
                    best[size]["output_tokens_per_second"]:
                best[size] = row
            del llm
            gc.collect()
    fixed = [s for s in sizes if s != "auto"]
    top = max((best[s]["output_tokens_per_second"] for s in fixed), default=None)
    rows = [{"block_size": s, "output_tokens_per_second": best[s]["output_tokens_per_second"],
             "elapsed_time": best[s]["elapsed_time"],
             "ratio_to_best_fixed": best[s]["output_tokens_per_second"] / top if top else None,
             "rounds_output_tokens_per_second": rounds[s]}
            for s in sizes]
    for r in rows:
        add_cost(r, args.cost_per_hour, r["elapsed_time"],
                 best[r["block_size"]]["total_output_tokens"],
                 best[r["block_size"]]["total_num_tokens"])
    result = {"workload": "small" if args.small else "W1", "num_requests": len(requests),
              "rounds": args.rounds, **machine(load_before), "auto_page_size": chosen,
              "rows": rows,
              "auto_over_best_fixed": (best["auto"]["output_tokens_per_second"] / top
                                       if "auto" in best and top else None)}
    print(f"{'block size':<14}{'out tok/s':>12}{'time (s)':>10}{'/ best fixed':>14}")
    for r in rows:
        label = f"auto ({chosen})" if r["block_size"] == "auto" else str(r["block_size"])
        ratio = r["ratio_to_best_fixed"]
        print(f"{label:<14}{r['output_tokens_per_second']:>12.1f}{r['elapsed_time']:>10.2f}"
              f"{'-' if ratio is None else f'{ratio:.3f}':>14}")
    for r in rows:
        print(f"  {r['block_size']}: rounds " + ", ".join(
            f"{x:.1f}" for x in r["rounds_output_tokens_per_second"]) + " out tok/s")
    print(f"CPU {result['cpu']}; load {result['load_average_before_after']}")
    write_outputs(result, args.output_json)
    return result


def main(args: argparse.Namespace) -> dict:
    return run(args)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_cli_args(p)
    run(p.parse_args())
