"""The throughput cost of multi-LoRA serving on W1 (``docs/lora.md``).

One run, three rows on the same requests (W1: ``configs/workloads/w1.json``, the
stories110M-shaped model with random weights; ``--small``: 8 short requests on the bundled
model): the engine without ``--enable-lora``; with it but every request on the base model
(slot 0); and with ``--num-adapters`` random rank-``--rank`` adapters on all seven
projections, assigned round robin so every step mixes them (``max_loras`` = the adapter
count). Each engine has an untimed warm-up pass (compilation excluded; 0 compilations during
the timed passes are reported); then ``--rounds`` rounds time the three rows one after the
other, so a load that changes over the run (other jobs on the machine) reaches every row
alike; each row reports its median pass.

    .venv/bin/python -m jaxpaged.benchmarks.lora --output-dir docs/results
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile

import numpy as np
from safetensors.numpy import save_file

from jaxpaged import LLM
from jaxpaged.benchmarks.baselines.checkpoint import write_random_checkpoint
from jaxpaged.benchmarks.datasets import ROOT, load_w1, random_requests, w1_requests
from jaxpaged.benchmarks.throughput import measure, run_requests
from jaxpaged.config import ModelConfig
from jaxpaged.lora.request import LoRARequest
from jaxpaged.lora.targets import PARENT, target_shapes


def write_random_adapter(path: str, cfg: ModelConfig, rank: int, seed: int) -> str:
    """A PEFT adapter directory of rank ``rank`` on every supported target of ``cfg``'s
    model, weights ~ N(0, 0.02) from ``default_rng(seed)``; returns ``path``."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for target, (d_in, d_out) in target_shapes(cfg).items():
            key = f"base_model.model.model.layers.{layer}.{PARENT[target]}.{target}"
            tensors[f"{key}.lora_A.weight"] = rng.normal(0, 0.02, (rank, d_in)).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = rng.normal(0, 0.02, (d_out, rank)).astype(np.float32)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                   "target_modules": list(target_shapes(cfg))}, f)
    return path


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--small", action="store_true", help="8 short requests, the bundled model")
    p.add_argument("--work-dir", default=os.path.join(tempfile.gettempdir(), "jaxpaged-w1"))
    p.add_argument("--output-dir", default=None, help="write lora-W1.json (or lora-small.json)")
    args = p.parse_args(argv)
    load_before = os.getloadavg()[0]
    if args.small:
        from jaxpaged.arg_utils import DEFAULT_MODEL
        model, max_len = DEFAULT_MODEL, 128
        requests = random_requests(8, (8, 24), 8, seed=0, token_range=(3, 512))
    else:
        w = load_w1()
        model, max_len = write_random_checkpoint(
            os.path.join(ROOT, w["model"]), os.path.join(ROOT, w["tokenizer"]),
            os.path.join(args.work_dir, "checkpoint")), 1024
        requests = w1_requests()
    cfg = ModelConfig.from_pretrained(model)
    adapters = [LoRARequest(f"r{args.rank}-{i}", i + 1, write_random_adapter(
        os.path.join(args.work_dir, f"lora-r{args.rank}-{i}"), cfg, args.rank, i))
        for i in range(args.num_adapters)]
    engine = dict(model=model, max_model_len=max_len, block_size=16, enforce_eager=True,
                  max_num_seqs=args.max_num_seqs)
    plain = LLM(**engine)
    llm = LLM(enable_lora=True, max_loras=args.num_adapters, max_lora_rank=args.rank, **engine)
    mixed = [adapters[i % len(adapters)] for i in range(len(requests))]
    cases = [("base, LoRA off", plain, None), ("base, --enable-lora", llm, None),
             (f"{args.num_adapters} adapters r{args.rank} mixed", llm, mixed)]
    # (the mixed row's warm-up also covers the base-with-LoRA row: the same engine and shapes)
    measured = {i: {"row": cases[i][0], **measure(cases[i][1], requests, warmup=i != 1,
                                                  lora_requests=cases[i][2])}
                for i in (0, 2, 1)}
    rows = [measured[i] for i in range(3)]
    for row in rows:
        row["elapsed_times"] = [row["elapsed_time"]]
    compilations = [e.engine.stats().num_compilations for e in (plain, llm)]
    for _ in range(args.rounds - 1):
        for row, (_, e, lr) in zip(rows, cases):
            row["elapsed_times"].append(run_requests(e, requests, lr))
    extra = sum(e.engine.stats().num_compilations for e in (plain, llm)) - sum(compilations)
    for row in rows:
        row["elapsed_time"] = float(np.median(row["elapsed_times"]))
        row["output_tokens_per_second"] = row["total_output_tokens"] / row["elapsed_time"]
        row["num_compilations_during_run"] += extra
    base = rows[0]["output_tokens_per_second"]
    for row in rows:
        row["relative_to_base"] = row["output_tokens_per_second"] / base
        times = ", ".join(f"{t:.1f}" for t in row["elapsed_times"])
        print(f"{row['row']:<28}{row['elapsed_time']:>9.2f} s{row['output_tokens_per_second']:>10.1f}"
              f" out tok/s{row['relative_to_base']:>8.3f}x  passes {times} s; compilations in "
              f"the timed passes: {row['num_compilations_during_run']}")
    result = {"workload": "small" if args.small else "W1", "model": model, "rows": rows,
              "cpu": platform.processor() or platform.machine(),
              "load_average_before": load_before, "load_average_after": os.getloadavg()[0]}
    if args.output_dir:
        os.makedirs(args.output_dir, exist_ok=True)
        with open(os.path.join(args.output_dir, f"lora-{result['workload']}.json"), "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
