"""Weight-only quantization against float32: weight bytes, top-1 agreement, logprob error and
the greedy "Once upon a time" text, one engine per variant.

Every number goes through the engine (its KV pool and jitted steps), so a variant is any set
of ``EngineArgs`` fields (:data:`VARIANTS`: weight quantization, fp8 KV cache, both).

Reference positions: for the bundled model, its published float32 reference (BOS + 63 greedy
tokens, with their logits, and the greedy 60-token "Once upon a time" text); for any other
``--model``, the float32 variant's own greedy "Once upon a time" sequence and text.
Teacher-forced over those positions (``prompt_logprobs``), a position agrees when the
variant's most likely next token is the reference's (its rank is 1; the last position by the
variant's greedy token); the logprob error is the largest |variant - reference|
log-probability of the reference's next token.

Usage: ``python -m jaxpaged.benchmarks.quantization_agreement [--model DIR] [--tokenizer DIR]``
(about a minute for the bundled model on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

from jaxpaged import LLM, SamplingParams
from jaxpaged.arg_utils import DEFAULT_MODEL

#: Engine settings of each row, on top of the common ones; the first row is the reference.
VARIANTS = [
    {"label": "float32"},
    {"label": "int8", "quantization": "int8"},
    {"label": "fp8", "quantization": "fp8"},
    {"label": "fp8 KV", "kv_cache_dtype": "fp8"},
    {"label": "fp8 KV calibrated", "kv_cache_dtype": "fp8", "calculate_kv_scales": True},
    {"label": "int8 + fp8 KV", "quantization": "int8", "kv_cache_dtype": "fp8",
     "calculate_kv_scales": True},
]
PROMPT = "Once upon a time"
MAX_TOKENS = 60


def published_reference(model: str) -> dict | None:
    """The bundled model's reference files (None for a model without them)."""
    d = os.path.join(model, "reference")
    if not os.path.isdir(d):
        return None
    logits = np.load(os.path.join(d, "reference_logits_bos_plus_63_greedy.npy"))
    ids = np.load(os.path.join(d, "reference_input_ids_bos_plus_63_greedy.npy")).tolist()
    with open(os.path.join(d, "expected_greedy_prompt_OnceUponATime_n64.txt")) as f:
        text = f.read()[len(PROMPT):].rstrip("\n")
    shifted = logits - logits.max(-1, keepdims=True)
    logprobs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    return {"ids": ids, "text": text, "top1": logits.argmax(-1).tolist(),
            "logprobs": logprobs[np.arange(len(ids) - 1), ids[1:]]}


def measure(llm: LLM, ids: list[int]) -> dict:
    """Teacher-forced over ``ids``: each position's most likely next token (``top1``) and the
    log-probability of the next token of ``ids`` (``logprobs``)."""
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1),
                       use_tqdm=False)[0]
    entries = [out.prompt_logprobs[i][ids[i]] for i in range(1, len(ids))]
    top1 = [next(t for t, lp in out.prompt_logprobs[i].items() if lp.rank == 1)
            for i in range(1, len(ids))]
    return {"top1": top1 + [out.outputs[0].token_ids[0]],
            "logprobs": np.array([e.logprob for e in entries])}


def row(llm: LLM, label: str, greedy_text: str, reference: dict) -> dict:
    """One table row for the engine ``llm`` of variant ``label``."""
    scores = measure(llm, reference["ids"])
    return {
        "variant": label,
        "weight_bytes": llm.engine.runner.weight_bytes,
        "kv_bytes_per_token": (llm.engine.kv_bytes_per_page
                               // llm.engine.kv_cache_manager.page_size),
        "top1_agreement": float(np.mean(np.array(scores["top1"]) == reference["top1"])),
        "max_abs_logprob_diff": float(np.abs(scores["logprobs"] - reference["logprobs"]).max()),
        "greedy_text_matches": greedy_text == reference["text"],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="Hugging Face model directory (default: the bundled stories260K)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer directory, for a model directory without one (default: "
                        "the model's)")
    args = p.parse_args(argv)
    reference = published_reference(args.model)
    source = "published float32 reference" if reference else f"{VARIANTS[0]['label']} variant"
    rows = []
    for variant in VARIANTS:
        settings = {k: v for k, v in variant.items() if k != "label"}
        llm = LLM(model=args.model, tokenizer=args.tokenizer, dtype="float32", enforce_eager=True,
                  enable_prefix_caching=False, max_num_seqs=4, max_num_batched_tokens=256,
                  **settings)
        greedy = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                              use_tqdm=False)[0]
        text = greedy.outputs[0].text
        if reference is None:                        # the first variant is the reference
            ids = greedy.prompt_token_ids + greedy.outputs[0].token_ids
            reference = {"ids": ids, "text": text, **measure(llm, ids)}
        rows.append(row(llm, variant["label"], text, reference))
    print(f"model {args.model}; reference: {source}, {len(reference['ids'])} positions; "
          f"greedy {MAX_TOKENS}-token text of {PROMPT!r}")
    print(f"{'variant':<18} {'weight bytes':>13} {'KV bytes/token':>15} {'top-1 agree':>12} "
          f"{'max |dlogprob|':>15} {'greedy text':>12}")
    for r in rows:
        print(f"{r['variant']:<18} {r['weight_bytes']:>13,} {r['kv_bytes_per_token']:>15,} "
              f"{100 * r['top1_agreement']:>11.1f}% "
              f"{r['max_abs_logprob_diff']:>15.4f} "
              f"{'matches' if r['greedy_text_matches'] else 'differs':>12}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
