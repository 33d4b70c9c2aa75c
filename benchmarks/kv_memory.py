"""KV memory report: paged KV vs contiguous preallocation, and prefix caching's effect on TTFT.

Part 1 (W1's request-length mix through the real engine, the bundled model's weights with its
context stretched to W1's 1024 tokens, page 16): at every step of the steady state (the middle
80% of steps) the fraction of allocated KV slots that hold no token (internal waste); and in
a KV budget of ``--budget-requests`` full ``max_model_len`` requests, the most requests running
at once, side by side with a contiguous per-request preallocation at ``max_model_len`` (the
pre-PagedAttention baseline), which fits exactly ``--budget-requests``.

Part 2 (W1's model shape, dummy weights): TTFT of requests that share a 1024-token system
prompt followed by a 32-token question, prefix caching on vs off; compile time is excluded by
warm-up requests of the same shapes.

Part 3 (a Gemma 3 shape, dummy weights): KV pages by layer kind, per group
(:func:`group_report`).

Usage: ``python benchmarks/kv_memory.py [--output-json FILE]`` (about two minutes on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

from jaxpaged import LLM, SamplingParams
from jaxpaged.benchmarks.datasets import load_w1, w1_requests
from jaxpaged.arg_utils import DEFAULT_MODEL

ROOT = os.path.join(os.path.dirname(os.path.realpath(__file__)), "..")
PAGE = 16


def stretched_model(src: str, max_positions: int, tmp: str) -> str:
    """A copy of ``src`` whose config allows ``max_positions`` tokens."""
    dst = os.path.join(tmp, f"{os.path.basename(src)}-{max_positions}")
    shutil.copytree(src, dst)
    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    cfg["max_position_embeddings"] = max_positions
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return dst


def memory_report(tmp: str, budget_requests: int) -> dict:
    w = load_w1()
    max_model_len = 1024
    model = stretched_model(DEFAULT_MODEL, max_model_len, tmp)
    pages_per_request = max_model_len // PAGE
    llm = LLM(model=model, enforce_eager=True, block_size=PAGE, max_model_len=max_model_len,
              max_num_seqs=256, max_num_batched_tokens=2048, enable_prefix_caching=False,
              num_gpu_blocks_override=budget_requests * pages_per_request + 1)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=w["output_len"], ignore_eos=True)
    for i, prompt in enumerate(q.prompt for q in w1_requests(512)):
        engine.add_request(str(i), prompt, params)
    waste, running = [], []
    kv = engine.kv_cache_manager
    while engine.has_unfinished_requests():
        engine.step()
        seqs = engine.scheduler.running
        tokens = sum(r.num_computed_tokens for r in seqs)
        slots = sum(len(kv.page_table(r.request_id)) for r in seqs) * PAGE
        if slots:
            waste.append(1 - tokens / slots)
            running.append(len(seqs))
    lo, hi = len(waste) // 10, len(waste) - len(waste) // 10
    steady = waste[lo:hi]
    return {
        "requests": w["num_requests"], "page_size": PAGE, "max_model_len": max_model_len,
        "steps": len(waste),
        "internal_waste_mean": statistics.fmean(steady),
        "internal_waste_max": max(steady),
        "budget_tokens": budget_requests * max_model_len,
        "paged_max_concurrency": max(running),
        "contiguous_max_concurrency": budget_requests,
        "concurrency_ratio": max(running) / budget_requests,
        "preemptions": engine.num_preemptions,
    }


def ttft_report(tmp: str, questions: int) -> dict:
    w = load_w1()
    model = stretched_model(os.path.join(ROOT, w["model"]), 2048, tmp)
    tokenizer = os.path.join(ROOT, w["tokenizer"])
    rng = np.random.default_rng(1)
    system = [1] + rng.integers(3, 32000, size=1023).tolist()
    ask = lambda: system + rng.integers(3, 32000, size=32).tolist()
    params = SamplingParams(temperature=0, max_tokens=1)
    result = {"system_prompt_tokens": len(system), "question_tokens": 32, "questions": questions}
    for caching in (True, False):
        llm = LLM(model=model, tokenizer=tokenizer, load_format="dummy", enforce_eager=True,
                  block_size=PAGE, max_model_len=2048, max_num_seqs=8,
                  max_num_batched_tokens=2048, enable_prefix_caching=caching)
        for _ in range(2):     # compiles both shapes (the miss, then the hit) before timing
            llm.generate([ask()], params, use_tqdm=False)
        times = []
        for _ in range(questions):
            t0 = time.perf_counter()
            out = llm.generate([ask()], params, use_tqdm=False)[0]
            times.append(time.perf_counter() - t0)
        key = "on" if caching else "off"
        result[f"ttft_s_cache_{key}"] = statistics.median(times)
        result[f"num_cached_tokens_cache_{key}"] = out.num_cached_tokens
    result["ttft_ratio_off_over_on"] = result["ttft_s_cache_off"] / result["ttft_s_cache_on"]
    return result


def gemma3_config(layers: int, window: int, max_positions: int) -> dict:
    """A small Gemma 3 text config (``Gemma3ForCausalLM``, every sixth layer global, the
    bundled tokenizer's 512 ids) for dummy weights: its KV pages by layer kind do not
    depend on the width."""
    kinds = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
             for i in range(layers)]
    rope = {"rope_theta": 10000.0, "rope_type": "default"}
    return {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
            "head_dim": 16, "hidden_size": 64, "intermediate_size": 128,
            "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": layers,
            "layer_types": kinds, "sliding_window": window, "query_pre_attn_scalar": 16,
            "rms_norm_eps": 1e-6, "hidden_activation": "gelu_pytorch_tanh",
            "max_position_embeddings": max_positions, "vocab_size": 512,
            "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
            "rope_parameters": {"full_attention": {**rope, "rope_theta": 1e6},
                                "sliding_attention": rope}}


def group_report(tmp: str, *, layers: int = 12, window: int = 128, max_model_len: int = 1024,
                 num_requests: int = 16, output_len: int = 64) -> dict:
    """Part 3: KV pages by layer kind (``jaxpaged.core.kv_groups``) on a Gemma 3 shape with
    dummy weights: ``num_requests`` requests of ``max_model_len`` tokens
    (``max_model_len - output_len`` of prompt) run together; at every step each group's pages
    held (the allocator's ``group_usage``). Reports per group its kind, layers, most and mean
    pages held, and pages per sequence at the end; the bytes a sequence holds against a
    one-page-per-token-per-layer pool's; the concurrency start-up reports against that
    pool's for the same bytes."""
    model = os.path.join(tmp, f"gemma3-{layers}x{window}")
    os.makedirs(model, exist_ok=True)
    with open(os.path.join(model, "config.json"), "w") as f:
        json.dump(gemma3_config(layers, window, max_model_len), f)
    pages = max_model_len // PAGE
    llm = LLM(model=model, tokenizer=DEFAULT_MODEL, load_format="dummy", enforce_eager=True,
              block_size=PAGE, max_model_len=max_model_len, max_num_seqs=num_requests,
              max_num_batched_tokens=512, enable_prefix_caching=False)
    engine = llm.engine
    kv = engine.kv_cache_manager
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    rng = np.random.default_rng(0)
    for i in range(num_requests):
        engine.add_request(str(i), rng.integers(3, 512, max_model_len - output_len).tolist(),
                           params)
    usage, per_seq = [], []
    while engine.has_unfinished_requests():
        engine.step()
        usage.append(kv.group_usage())
        seqs = engine.scheduler.running
        if seqs and all(r.num_computed_tokens >= max_model_len - 1 for r in seqs):
            per_seq = [kv.num_held_pages(r.request_id) for r in seqs]
    layout = kv.layout
    groups = [{"kind": "full" if g.window is None else f"window {g.window}",
               "layers": len(g.layers), "max_pages": max(u[k] for u in usage),
               "mean_pages": statistics.fmean(u[k] for u in usage)}
              for k, g in enumerate(layout.groups)]
    layer_page = engine.kv_bytes_per_page // layout.slots
    return {"layers": layers, "window": window, "max_model_len": max_model_len,
            "page_slots": layout.slots, "groups": groups,
            "bytes_per_seq_at_end": max(per_seq) * engine.kv_bytes_per_page,
            "one_page_per_layer_bytes_per_seq": layers * pages * layer_page,
            "max_concurrency": engine.kv_max_concurrency,
            "one_page_per_layer_max_concurrency":
                (kv.num_pages * layout.slots // layers - 1) / pages}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--budget-requests", type=int, default=8,
                   help="KV budget, in max_model_len requests (the contiguous baseline's count)")
    p.add_argument("--questions", type=int, default=5, help="timed shared-prompt requests")
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        mem = memory_report(tmp, args.budget_requests)
        print(f"W1 mix, {mem['requests']} requests, page {PAGE}, budget "
              f"{mem['budget_tokens']} tokens ({args.budget_requests} x max_model_len "
              f"{mem['max_model_len']})")
        print(f"  internal waste (allocated slots holding no token), steady state: "
              f"mean {100 * mem['internal_waste_mean']:.2f}%, max {100 * mem['internal_waste_max']:.2f}%")
        print(f"  max concurrent requests: paged {mem['paged_max_concurrency']} vs contiguous "
              f"{mem['contiguous_max_concurrency']} -> {mem['concurrency_ratio']:.2f}x")
        ttft = ttft_report(tmp, args.questions)
        print(f"shared {ttft['system_prompt_tokens']}-token system prompt + 32-token question, "
              f"median TTFT over {args.questions}:")
        print(f"  prefix caching on  {1e3 * ttft['ttft_s_cache_on']:8.1f} ms "
              f"({ttft['num_cached_tokens_cache_on']} tokens cached)")
        print(f"  prefix caching off {1e3 * ttft['ttft_s_cache_off']:8.1f} ms "
              f"-> {ttft['ttft_ratio_off_over_on']:.1f}x lower with caching")
        groups = group_report(tmp)
        print(f"Gemma 3 shape, {groups['layers']} layers (window {groups['window']}), pages "
              f"of {groups['page_slots']} layers, {groups['max_model_len']}-token requests:")
        for g in groups["groups"]:
            print(f"  {g['kind']:>12} x{g['layers']}: pages held max {g['max_pages']}, "
                  f"mean {g['mean_pages']:.1f}")
        print(f"  bytes per sequence {groups['bytes_per_seq_at_end']} vs "
              f"{groups['one_page_per_layer_bytes_per_seq']} one page per token per layer; "
              f"max concurrency {groups['max_concurrency']:.2f} vs "
              f"{groups['one_page_per_layer_max_concurrency']:.2f}")
    summary = {**mem, **ttft, "kv_groups": groups}
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(summary, f, indent=1)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
