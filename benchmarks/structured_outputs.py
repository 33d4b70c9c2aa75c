"""``jaxpaged bench structured-outputs``: the throughput cost of grammar-constrained decoding.

One engine, one batch of ``--num-requests`` random-token prompts of ``--prompt-len`` tokens,
each generating exactly ``--output-len`` tokens (EOS ignored), run alternately free and under a
JSON schema whose one string field stays open for the whole output (so every token of every
sequence is masked by llguidance: ``{"story": "...``), ``--repeats`` times each after a warm-up
pass of both (compiles every step shape, the llguidance tokenizer and the grammar). Prints the
median output tokens per second of each and the cost ``1 - constrained / free`` (issue 23's
goal: at most 15 % at batch 64 on the bundled model). The constrained requests run
synchronously (a grammar's next mask needs the previous token on the host,
``docs/structured_outputs.md``), the free ones with the engine's async scheduling.

Ends with the result as one JSON line (also written to ``--output-json``).
"""

from __future__ import annotations

import argparse
import statistics
import time

from jaxpaged import LLM, SamplingParams
from jaxpaged.benchmarks.datasets import random_requests
from jaxpaged.benchmarks.results import add_cost, add_cost_arg, cpu_model, write_outputs
from jaxpaged.arg_utils import EngineArgs
from jaxpaged.sampling_params import StructuredOutputsParams

#: An object whose one string never has to close: every token is constrained (a JSON string).
OPEN_SCHEMA = {"type": "object", "properties": {"story": {"type": "string"}},
               "required": ["story"]}


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    EngineArgs.add_cli_args(parser)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output-json", default=None)
    add_cost_arg(parser)


def _timed(llm: LLM, prompts: list, params: SamplingParams) -> tuple[float, int]:
    """(seconds, output tokens) of one ``generate`` over ``prompts``."""
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t0, sum(len(c.token_ids) for o in outs for c in o.outputs)


def main(args: argparse.Namespace) -> dict:
    """Run the benchmark (see the module docstring); returns the result dict.

    Raises:
        RuntimeError: a pass generated another number of tokens than asked (a sequence
            stopped early), or a step compiled during the timed passes.
    """
    engine_args = EngineArgs.from_cli_args(args, enforce_eager_default=False)
    engine_args.max_num_seqs = max(engine_args.max_num_seqs, args.num_requests)
    llm = LLM(**vars(engine_args))
    llm.engine.wait_until_compiled()
    vocab = llm.engine.model_config.vocab_size
    prompts = [{"prompt_token_ids": q.prompt} for q in random_requests(
        args.num_requests, (args.prompt_len, args.prompt_len), args.output_len, 0, (3, vocab))]
    common = dict(temperature=1.0, seed=0, max_tokens=args.output_len, ignore_eos=True)
    free = SamplingParams(**common)
    constrained = SamplingParams(**common, structured_outputs=StructuredOutputsParams(
        json=OPEN_SCHEMA, disable_any_whitespace=True))
    expected = args.num_requests * args.output_len
    _timed(llm, prompts, free)
    _timed(llm, prompts, constrained)
    compiled = llm.engine.stats().num_compilations
    rates: dict[str, list[float]] = {"free": [], "constrained": []}
    for _ in range(args.repeats):
        for name, params in (("free", free), ("constrained", constrained)):
            seconds, tokens = _timed(llm, prompts, params)
            if tokens != expected:
                raise RuntimeError(f"{name} pass generated {tokens} tokens, not {expected}")
            rates[name].append(tokens / seconds)
    if llm.engine.stats().num_compilations != compiled:
        raise RuntimeError("a step compiled during the timed passes")
    free_rate, constrained_rate = (statistics.median(rates[k]) for k in ("free", "constrained"))
    result = {"num_requests": args.num_requests, "prompt_len": args.prompt_len,
              "output_len": args.output_len, "repeats": args.repeats, "cpu": cpu_model(),
              "free_tokens_per_second": free_rate,
              "constrained_tokens_per_second": constrained_rate,
              "cost": 1 - constrained_rate / free_rate, "rates": rates}
    print(f"free {free_rate:.0f} tok/s, constrained {constrained_rate:.0f} tok/s: "
          f"cost {100 * result['cost']:.1f} % (batch {args.num_requests}, {result['cpu']})")
    seconds = expected / constrained_rate   # a constrained pass: the dearer of the two
    add_cost(result, args.cost_per_hour, seconds, expected,
             expected + args.num_requests * args.prompt_len)
    write_outputs(result, args.output_json)
    return result
