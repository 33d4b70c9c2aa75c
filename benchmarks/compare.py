"""Workload W1 on jaxpaged and its baselines, measured in one run on one machine.

Rows (all on the same random-weight checkpoint, written once as a Hugging Face directory):
  * ``jaxpaged``: the engine as shipped (paged KV, continuous batching, chunked prefill);
  * ``contiguous-static-B``: the same model and kernels, but what a contiguous per-request KV
    cache allows: the KV budget of the jaxpaged row split into ``max_model_len`` slots, one
    per request (B of them), filled by static batches of B that each run to completion
    before the next starts (no paging, no continuous batching);
  * ``transformers-static-16`` / ``-1``: Hugging Face ``generate`` with static batches of 16
    (left padding) and of 1 (``benchmarks/baselines/hf_transformers.py``, run with
    ``--hf-python``, a Python that has torch);
  * ``llama.cpp FILE.gguf``: llama.cpp's ``llama-server`` (``--llama-server BIN --gguf FILE``,
    repeatable: e.g. an F32 and an F16 GGUF of the same checkpoint) with ``--parallel 16
    --cont-batching`` on 127.0.0.1, 16 requests in flight
    (``benchmarks/baselines/llama_cpp.py``; docs/benchmarks.md says how to build it and
    convert the checkpoint).
``--rows`` picks the rows to run (all by default; the contiguous row needs the jaxpaged one).
Each row's ratio is jaxpaged's output tokens/s over the row's. Model FLOPs utilisation is
reported against a float32 matmul peak measured in the same run.

Usage: ``python -m jaxpaged.benchmarks.compare --hf-python /path/to/python [--llama-server BIN
--gguf F32.gguf --gguf F16.gguf] [--output-dir DIR]``
(``--small`` runs a seconds-long version on the bundled model, for CI; ``--startup`` adds
the start-up figures: a cold start on an empty compile cache, a timed run on it without a
warm-up, and a warm start on the cache it left).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged import LLM
from jaxpaged.benchmarks.baselines.checkpoint import write_random_checkpoint
from jaxpaged.benchmarks.baselines.llama_cpp import llama_cpp_row
from jaxpaged.benchmarks.datasets import ROOT, SampleRequest, load_w1, random_requests, w1_requests
from jaxpaged.benchmarks.plots import plot_throughput_by_engine, plot_throughput_vs_max_num_seqs
from jaxpaged.benchmarks.results import machine, plot_next_to, write_outputs
from jaxpaged.benchmarks.throughput import measure, run_requests, shifted, start_engine
from jaxpaged.config import ModelConfig
from jaxpaged.arg_utils import EngineArgs
from jaxpaged.distributed.tensor_parallel import request_host_devices
from jaxpaged.runner.compile_cache import configure_compilation_cache, jax_cache_dir


def matmul_peak_flops(n: int = 2048, repeats: int = 10) -> float:
    """Measured float32 matmul FLOP/s of this machine's default JAX device (best of
    ``repeats`` ``n x n`` products, compilation excluded)."""
    a = jnp.asarray(np.random.default_rng(0).standard_normal((n, n), np.float32))
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def model_flops(cfg: ModelConfig, requests: list[SampleRequest]) -> float:
    """Matmul FLOPs of the workload: 2 per parameter per token (lm_head included, embeddings
    excluded), plus attention's 4 * layers * heads * head_dim per (query, key) pair."""
    h, d = cfg.hidden_size, cfg.head_dim
    per_layer = h * d * (2 * cfg.num_heads + 2 * cfg.num_kv_heads) + 3 * h * cfg.intermediate_size
    params = cfg.num_layers * per_layer + h * cfg.vocab_size
    tokens = pairs = 0
    for q in requests:
        total = q.prompt_len + q.output_len
        tokens += total
        pairs += total * (total + 1) // 2
    return 2 * params * tokens + 4 * cfg.num_layers * cfg.num_heads * d * pairs


def contiguous_static(model: str, requests: list[SampleRequest], slots: int, max_model_len: int,
                      page: int, **engine_kwargs) -> dict:
    """The contiguous-KV, static-batch row: batches of ``slots`` requests, each finished
    before the next starts, in a KV pool of exactly ``slots`` full-length requests (split
    evenly over the replicas when ``data_parallel_size`` > 1)."""
    per_replica = slots // engine_kwargs.get("data_parallel_size", 1)
    pages = per_replica * (-(-max_model_len // page)) + 1
    llm = LLM(model=model, max_num_seqs=per_replica, num_gpu_blocks_override=pages,
              enable_prefix_caching=False, max_model_len=max_model_len, block_size=page,
              **engine_kwargs)
    batches = [requests[i:i + slots] for i in range(0, len(requests), slots)]
    vocab = llm.engine.model_config.vocab_size
    for b in batches:    # warm-up: the same shapes, other token ids
        run_requests(llm, shifted(b, vocab))
    elapsed = sum(run_requests(llm, b) for b in batches)
    out = sum(q.output_len for q in requests)
    return {"backend": f"contiguous-static-{slots}", "elapsed_time": elapsed,
            "output_tokens_per_second": out / elapsed,
            "requests_per_second": len(requests) / elapsed}


def startup_figures(engine_args: EngineArgs, requests: list[SampleRequest]) -> dict:
    """Start-up of ``engine_args`` with the precompile on: ``cold`` (an empty compile cache),
    then a run of ``requests`` without a warm-up pass on that engine
    (``num_compilations_during_run``: 0 when the precompile covered every shape it met,
    ``elapsed_time``), then ``warm`` (a second start on the cache the first left); each
    start as :func:`jaxpaged.benchmarks.throughput.start_engine` reports it. The process's
    compile cache is pointed back where it was before the temporary one is deleted (even when
    a start fails), so that later compilations (the matmul peak) do not write into a missing
    directory."""
    before = jax_cache_dir()
    with tempfile.TemporaryDirectory() as cache:
        args = dataclasses.replace(engine_args, enforce_eager=False, compilation_cache_dir=cache)
        try:
            llm, cold = start_engine(args)
            run = measure(llm, requests, warmup=False)
            del llm
            _, warm = start_engine(args)
        finally:
            configure_compilation_cache(before)
    return {"cold": cold, "warm": warm, "elapsed_time": run["elapsed_time"],
            "num_compilations_during_run": run["num_compilations_during_run"]}


def transformers_row(python: str, model: str, requests: list[SampleRequest], batch: int,
                     work: str) -> dict:
    """Run the transformers baseline in ``python`` (a subprocess with torch)."""
    os.makedirs(work, exist_ok=True)
    req_path, out_path = os.path.join(work, "requests.json"), os.path.join(work, f"hf{batch}.json")
    with open(req_path, "w") as f:
        json.dump([{"prompt": q.prompt, "output_len": q.output_len} for q in requests], f)
    script = os.path.join(ROOT, "benchmarks", "baselines", "hf_transformers.py")
    subprocess.run([python, script, "--model", model, "--requests", req_path, "--batch-size",
                    str(batch), "--output-json", out_path], check=True,
                   env={**os.environ, "TRANSFORMERS_VERBOSITY": "error"})
    with open(out_path) as f:
        return json.load(f)


#: The row groups ``--rows`` can pick.
ROWS = ("jaxpaged", "contiguous", "transformers", "llama.cpp")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description="W1: jaxpaged vs baselines, side by side")
    p.add_argument("--rows", default=",".join(ROWS),
                   help=f"comma-separated row groups to run, of {','.join(ROWS)}; "
                        "transformers needs --hf-python, llama.cpp --llama-server and --gguf")
    p.add_argument("--hf-python", default=os.environ.get("JAXPAGED_HF_PYTHON"),
                   help="a Python with torch + transformers for the transformers rows "
                        "(skipped if unset)")
    p.add_argument("--hf-batch-sizes", default="16,1")
    p.add_argument("--llama-server", help="a llama.cpp llama-server binary for the llama.cpp "
                                          "rows (skipped if unset)")
    p.add_argument("--gguf", action="append", default=[],
                   help="a GGUF conversion of the W1 checkpoint (in --work-dir/checkpoint); "
                        "repeat for more rows (e.g. F32 and F16)")
    p.add_argument("--llama-parallel", type=int, default=16,
                   help="llama-server slots, and requests in flight")
    p.add_argument("--llama-threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--llama-server-args", default="",
                   help="more llama-server flags, one string (e.g. '--cache-type-k f32 "
                        "--cache-type-v f32'; its default KV cache type is f16)")
    p.add_argument("--output-dir", default=os.path.join(ROOT, "benchmarks", "results"))
    p.add_argument("--work-dir", default=os.path.join(tempfile.gettempdir(), "jaxpaged-w1"))
    p.add_argument("--max-num-seqs", type=int, default=64,
                   help="concurrent requests in all (each of N replicas gets 1/N)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--sweep-max-num-seqs", default="",
                   help="also measure jaxpaged at these --max-num-seqs values (e.g. 8,16,32)")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="run the jaxpaged rows over this many devices (on a CPU: host devices "
                        "that split the cores); adds a tp=1 row for comparison")
    p.add_argument("--data-parallel-size", type=int, default=1,
                   help="run the jaxpaged rows as this many replicas (on a CPU: one host "
                        "device each); adds a tp=1 row for comparison")
    p.add_argument("--small", action="store_true",
                   help="a seconds-long version on the bundled model (CI)")
    p.add_argument("--attention-backend", default="auto",
                   help="the jaxpaged rows' --attention-backend (e.g. xla against cpu)")
    p.add_argument("--dtype", default="auto",
                   help="the jaxpaged rows' --dtype (W1's checkpoint is float32)")
    p.add_argument("--startup", action="store_true",
                   help="also measure the jaxpaged row's start-up with the precompile on: "
                        "cold, warm, and compilations during a timed run")
    args = p.parse_args(argv)
    args.rows = [r for r in args.rows.split(",") if r]
    if set(args.rows) - set(ROWS):
        p.error(f"--rows: unknown {sorted(set(args.rows) - set(ROWS))}; known: {ROWS}")
    if "contiguous" in args.rows and "jaxpaged" not in args.rows:
        p.error("--rows: the contiguous row takes its KV budget from the jaxpaged row")
    if args.gguf and not args.llama_server:
        p.error("--gguf needs --llama-server")
    return args


def jaxpaged_rows(args: argparse.Namespace, model: str, requests: list[SampleRequest],
                  engine: dict, max_len: int, page: int) -> tuple[list[dict], list]:
    """(jaxpaged rows, the ``--max-num-seqs`` sweep points): the engine as configured, its
    tp=1 twin when tp or dp > 1, and the contiguous static-batch row in its KV budget."""
    tp, dp = args.tensor_parallel_size, args.data_parallel_size
    llm = LLM(model=model, max_num_seqs=args.max_num_seqs // dp, **engine)
    label = "jaxpaged" + (f" tp={tp}" if tp > 1 else "") + (f" dp={dp}" if dp > 1 else "")
    rows = [{"backend": label, **measure(llm, requests)}]
    slots = max(dp, llm.engine.stats().num_pages // -(-max_len // page))
    del llm
    if tp * dp > 1:
        llm = LLM(model=model, max_num_seqs=args.max_num_seqs,
                  **{**engine, "tensor_parallel_size": 1, "data_parallel_size": 1})
        rows.append({"backend": "jaxpaged tp=1", **measure(llm, requests)})
        del llm
    if "contiguous" in args.rows:
        rows.append(contiguous_static(model, requests, min(slots, len(requests)), max_len, page,
                                      max_num_batched_tokens=args.max_num_batched_tokens,
                                      enforce_eager=True, tensor_parallel_size=tp,
                                      data_parallel_size=dp,
                                      attention_backend=args.attention_backend,
                                      dtype=args.dtype))
        rows[-1]["kv_slots"] = slots
    sweep = [(args.max_num_seqs, rows[0]["output_tokens_per_second"])]
    for n in (int(x) for x in args.sweep_max_num_seqs.split(",") if x):
        if n != args.max_num_seqs:
            sweep.append((n, measure(LLM(model=model, max_num_seqs=n // dp, **engine),
                                     requests)["output_tokens_per_second"]))
    return rows, sweep


def print_table(result: dict) -> None:
    """The rows as a fixed-width table, then the peak and roofline line."""
    print(f"{'engine':<28}{'time (s)':>10}{'out tok/s':>12}{'jaxpaged x':>12}{'MFU':>8}")
    for row in result["rows"]:
        ratio = row["ratio_jaxpaged_over_this"]
        print(f"{row['backend']:<28}{row['elapsed_time']:>10.2f}"
              f"{row['output_tokens_per_second']:>12.1f}"
              f"{'-' if ratio is None else f'{ratio:.2f}':>12}{100 * row['mfu']:>7.1f}%")
    print(f"float32 matmul peak {result['matmul_peak_gflops']:.1f} GFLOP/s; workload "
          f"{result['model_tflops']:.2f} TFLOP; roofline {result['roofline_seconds']:.1f} s; "
          f"CPU {result['cpu']}")
    startup = result.get("startup")
    if startup:
        cold, warm = startup["cold"], startup["warm"]
        print(f"Start-up: cold {cold['startup_time']:.1f} s ({cold['num_compiled']} compiled), "
              f"warm {warm['startup_time']:.1f} s ({warm['num_loaded_from_cache']} loaded); "
              f"compilations during the timed run: {startup['num_compilations_during_run']} "
              f"(run {startup['elapsed_time']:.2f} s without a warm-up)")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    tp, dp = args.tensor_parallel_size, args.data_parallel_size
    request_host_devices(tp * dp)      # before anything starts JAX
    load_before = os.getloadavg()[0]
    w = load_w1()
    page, max_len = 16, 1024
    if args.small:
        from jaxpaged.arg_utils import DEFAULT_MODEL
        model, max_len = DEFAULT_MODEL, 128
        requests = random_requests(8, (8, 24), 8, seed=0, token_range=(3, 512))
    else:
        model = write_random_checkpoint(os.path.join(ROOT, w["model"]),
                                        os.path.join(ROOT, w["tokenizer"]),
                                        os.path.join(args.work_dir, "checkpoint"))
        requests = w1_requests()
    os.makedirs(args.output_dir, exist_ok=True)
    cfg = ModelConfig.from_pretrained(model)
    engine = dict(max_model_len=max_len, block_size=page, enforce_eager=True,
                  max_num_batched_tokens=args.max_num_batched_tokens, tensor_parallel_size=tp,
                  data_parallel_size=dp, attention_backend=args.attention_backend,
                  dtype=args.dtype)
    rows, sweep = [], []
    if "jaxpaged" in args.rows:
        rows, sweep = jaxpaged_rows(args, model, requests, engine, max_len, page)
    startup = None
    if args.startup:
        startup = startup_figures(EngineArgs(model=model, max_num_seqs=args.max_num_seqs // dp,
                                             **engine), requests)
    if args.hf_python and "transformers" in args.rows:
        for b in (int(x) for x in args.hf_batch_sizes.split(",")):
            rows.append(transformers_row(args.hf_python, model, requests, b, args.work_dir))
    if args.llama_server and "llama.cpp" in args.rows:
        for gguf in args.gguf:
            rows.append(llama_cpp_row(args.llama_server, gguf, requests, args.work_dir,
                                      args.llama_parallel, args.llama_threads,
                                      shlex.split(args.llama_server_args)))
    peak = matmul_peak_flops(512 if args.small else 2048)
    flops = model_flops(cfg, requests)
    ours = rows[0]["output_tokens_per_second"] if "jaxpaged" in args.rows else None
    for row in rows:
        row["ratio_jaxpaged_over_this"] = (None if ours is None
                                           else ours / row["output_tokens_per_second"])
        row["mfu"] = flops / row["elapsed_time"] / peak
    result = {"workload": "small" if args.small else "W1", "model": model,
              **machine(load_before), "num_requests": len(requests),
              "matmul_peak_gflops": peak / 1e9,
              "model_tflops": flops / 1e12, "roofline_seconds": flops / peak,
              "tensor_parallel_size": tp, "data_parallel_size": dp,
              "attention_backend": args.attention_backend, "dtype": args.dtype, "rows": rows,
              "startup": startup,
              "max_num_seqs_sweep": [{"max_num_seqs": n, "output_tokens_per_second": v}
                                     for n, v in sorted(sweep)]}
    print_table(result)
    out = os.path.join(args.output_dir, f"compare-{result['workload']}.json")
    write_outputs(result, out)
    plot_next_to(out, lambda path: plot_throughput_by_engine(
        rows, path, f"{result['workload']}: output tokens/s (same machine, same run)"))
    if len(sweep) > 1:
        plot_next_to(out.replace(".json", "-max-num-seqs.json"),
                     lambda path: plot_throughput_vs_max_num_seqs(sweep, path))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
