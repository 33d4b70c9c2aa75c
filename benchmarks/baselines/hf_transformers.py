"""Baseline: Hugging Face transformers ``generate`` with static batches (left padding).

Standalone (it needs torch, which jaxpaged does not): run it with a Python that has torch and
transformers, e.g. a Python 3.11 venv made with ``pip install torch==2.13.0 transformers``.
``benchmarks/compare.py`` runs it as a subprocess on the same checkpoint and requests.

Usage: ``python hf_transformers.py --model DIR --requests REQUESTS.json --batch-size 16
--output-json OUT.json``, where REQUESTS.json is ``[{"prompt": [ids], "output_len": n}, ...]``.
Requests run in batches of ``--batch-size`` in file order; each batch is left-padded to its
longest prompt and generates the batch's largest ``output_len`` greedily with EOS ignored
(``min_new_tokens`` = ``max_new_tokens``). One small batch first warms up (untimed).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import AutoModelForCausalLM


def run_batch(model, batch: list[dict], pad_id: int) -> int:
    """Generate one static batch; returns the number of useful output tokens."""
    longest = max(len(r["prompt"]) for r in batch)
    new = max(r["output_len"] for r in batch)
    ids = torch.full((len(batch), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), longest), dtype=torch.long)
    for i, r in enumerate(batch):
        ids[i, longest - len(r["prompt"]):] = torch.tensor(r["prompt"])
        mask[i, longest - len(r["prompt"]):] = 1
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                             min_new_tokens=new, do_sample=False, pad_token_id=pad_id)
    if out.shape[1] - longest != new:
        raise RuntimeError(f"generated {out.shape[1] - longest} tokens, {new} expected")
    return sum(r["output_len"] for r in batch)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--requests", required=True)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--output-json", required=True)
    args = p.parse_args()
    with open(args.requests) as f:
        requests = json.load(f)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model.eval()
    load_time = time.perf_counter() - t0
    pad_id = model.config.pad_token_id or 0
    run_batch(model, [{"prompt": requests[0]["prompt"][:8], "output_len": 2}], pad_id)
    t0 = time.perf_counter()
    output_tokens = 0
    for i in range(0, len(requests), args.batch_size):
        output_tokens += run_batch(model, requests[i:i + args.batch_size], pad_id)
    elapsed = time.perf_counter() - t0
    prompt_tokens = sum(len(r["prompt"]) for r in requests)
    result = {"backend": f"transformers-static-batch-{args.batch_size}",
              "elapsed_time": elapsed, "num_requests": len(requests),
              "total_num_tokens": prompt_tokens + output_tokens,
              "total_output_tokens": output_tokens,
              "requests_per_second": len(requests) / elapsed,
              "tokens_per_second": (prompt_tokens + output_tokens) / elapsed,
              "output_tokens_per_second": output_tokens / elapsed, "load_time": load_time,
              "torch_version": torch.__version__, "torch_threads": torch.get_num_threads()}
    with open(args.output_json, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
