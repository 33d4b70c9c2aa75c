"""``jaxpaged bench throughput``: offline throughput through the engine (``vllm bench
throughput``).

All requests are submitted at once to ``LLM.generate``; each generates exactly its
``output_len`` tokens (greedy, EOS ignored). Compilation is kept out of the timed region: a
warm-up pass runs the same request lengths with other token ids first (the same step shapes,
no prefix-cache hits on the timed pass), and the number of compilations during the timed
pass is reported (0 when the warm-up covered every shape).

Prints the start-up (seconds until ``LLM()`` returned, step shapes compiled or loaded from
the compile cache, compilations during the timed pass: run with ``--no-enforce-eager
--no-warmup`` to time a start-up that precompiles and a first pass that must compile nothing),
then requests/s, output tokens/s and total tokens/s, writes ``--output-json`` with vLLM's
field names (``elapsed_time``, ``num_requests``, ``total_num_tokens``,
``requests_per_second``, ``tokens_per_second``) plus ours, and ends with a one-line JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from jaxpaged import LLM, SamplingParams
from jaxpaged.benchmarks.datasets import SampleRequest, add_dataset_args, requests_from_args
from jaxpaged.benchmarks.results import add_cost, add_cost_arg, add_spec_decode, write_outputs
from jaxpaged.arg_utils import EngineArgs
from jaxpaged.runner.compile_cache import resolve_cache_dir


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    EngineArgs.add_cli_args(parser)
    add_dataset_args(parser)
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--no-warmup", action="store_true",
                        help="time the first pass too (compilation included)")
    parser.add_argument("--compare-plain", action="store_true",
                        help="with --speculative-config: then run the same requests on an "
                             "engine without speculation and print the speed-up")
    add_cost_arg(parser)


def shifted(requests: list[SampleRequest], vocab_size: int) -> list[SampleRequest]:
    """The same lengths with every token id moved (a warm-up that cannot hit the prefix
    cache of the timed pass)."""
    out = []
    for q in requests:
        prompt = q.prompt if isinstance(q.prompt, str) else \
            [3 + (t - 3 + 7919) % (vocab_size - 3) for t in q.prompt]
        out.append(SampleRequest("warm-up " + prompt if isinstance(prompt, str) else prompt,
                                 q.prompt_len, q.output_len))
    return out


def run_requests(llm: LLM, requests: list[SampleRequest], lora_requests=None) -> float:
    """Generate every request to its exact length (``lora_requests``: each one's LoRA
    adapter, as ``LLM.generate`` takes them); returns the seconds it took.

    Raises:
        RuntimeError: an output of the wrong length (the measurement would be wrong).
    """
    params = [SamplingParams(temperature=0, ignore_eos=True, max_tokens=q.output_len)
              for q in requests]
    t0 = time.perf_counter()
    outputs = llm.generate([q.prompt for q in requests], params, use_tqdm=False,
                           lora_request=lora_requests)
    elapsed = time.perf_counter() - t0
    for q, out in zip(requests, outputs):
        if len(out.outputs[0].token_ids) != q.output_len:
            raise RuntimeError(f"a request generated {len(out.outputs[0].token_ids)} tokens, "
                               f"{q.output_len} expected")
    return elapsed


def measure(llm: LLM, requests: list[SampleRequest], warmup: bool = True,
            lora_requests=None) -> dict:
    """Throughput of ``requests`` on ``llm`` (the figures every engine row reports;
    ``lora_requests`` as :func:`run_requests`)."""
    vocab = llm.engine.model_config.vocab_size
    llm.engine.wait_until_compiled()        # (nothing compiling beside the timed pass)
    warmup_time = run_requests(llm, shifted(requests, vocab), lora_requests) if warmup else 0.0
    compilations = llm.engine.stats().num_compilations
    elapsed = run_requests(llm, requests, lora_requests)
    prompt_tokens = sum(q.prompt_len for q in requests)
    output_tokens = sum(q.output_len for q in requests)
    return {
        "elapsed_time": elapsed,
        "num_requests": len(requests),
        "total_num_tokens": prompt_tokens + output_tokens,
        "total_prompt_tokens": prompt_tokens,
        "total_output_tokens": output_tokens,
        "requests_per_second": len(requests) / elapsed,
        "tokens_per_second": (prompt_tokens + output_tokens) / elapsed,
        "output_tokens_per_second": output_tokens / elapsed,
        "warmup_time": warmup_time,
        "num_compilations_during_run": llm.engine.stats().num_compilations - compilations,
    }


def start_engine(engine_args: EngineArgs) -> tuple[LLM, dict]:
    """``LLM(**engine_args)`` and its start-up figures: ``startup_time`` (seconds until it
    returned), ``compiled_time`` (seconds until the step programs it compiles in the
    background were ready, ``jaxpaged.runner.background_compile``), ``num_step_shapes``
    (compiled step programs it holds then: forward shapes and sampler row buckets,
    ``jaxpaged.runner.step_programs``), ``num_compiled`` (those XLA
    compiled afresh, every shape with the cache off: ``ModelRunner.num_fresh_compilations``)
    and ``num_loaded_from_cache`` (the rest), ``compile_cache_dir`` (None: off)."""
    cache_dir = resolve_cache_dir(engine_args.compilation_cache_dir)
    t0 = time.perf_counter()
    llm = LLM(**vars(engine_args))
    startup = time.perf_counter() - t0
    llm.engine.wait_until_compiled()
    compiled_time = time.perf_counter() - t0
    shapes = llm.engine.stats().num_compilations
    compiled = sum(e.runner.num_fresh_compilations
                   for e in getattr(llm.engine, "replicas", [llm.engine]))
    return llm, {"startup_time": startup, "compiled_time": compiled_time,
                 "num_step_shapes": shapes, "num_compiled": compiled,
                 "num_loaded_from_cache": shapes - compiled, "compile_cache_dir": cache_dir}


def main(args: argparse.Namespace) -> dict:
    """Run the benchmark the flags describe; returns (and prints) the result."""
    engine_args = EngineArgs.from_cli_args(args, enforce_eager_default=True)
    llm, startup = start_engine(engine_args)
    requests = requests_from_args(args, llm.get_tokenizer(), llm.engine.model_config.vocab_size,
                                  llm.engine.max_model_len)
    result = {"backend": "jaxpaged", "model": engine_args.model,
              "dataset": args.dataset_name, "startup": startup,
              **measure(llm, requests, not args.no_warmup)}
    print(f"Start-up: {startup['startup_time']:.1f} s, step programs ready at "
          f"{startup['compiled_time']:.1f} s ({startup['num_step_shapes']} step "
          f"programs: {startup['num_compiled']} compiled, {startup['num_loaded_from_cache']} "
          f"loaded from the compile cache {startup['compile_cache_dir'] or '(off)'}); "
          f"compilations during the timed run: {result['num_compilations_during_run']}")
    print(f"Throughput: {result['requests_per_second']:.2f} requests/s, "
          f"{result['tokens_per_second']:.2f} total tokens/s, "
          f"{result['output_tokens_per_second']:.2f} output tokens/s "
          f"({result['num_requests']} requests in {result['elapsed_time']:.2f} s; warm-up "
          f"{result['warmup_time']:.2f} s)")
    add_spec_decode(result, llm)
    if args.compare_plain and engine_args.speculative_config is not None:
        del llm     # (its memory back before the second engine starts)
        plain, _ = start_engine(dataclasses.replace(engine_args, speculative_config=None))
        result["plain"] = measure(plain, requests, not args.no_warmup)
        result["speedup_vs_plain"] = (result["output_tokens_per_second"]
                                      / result["plain"]["output_tokens_per_second"])
        print(f"Speculative vs plain decoding: {result['speedup_vs_plain']:.2f}x output "
              f"tokens/s (plain {result['plain']['output_tokens_per_second']:.2f})")
    add_cost(result, args.cost_per_hour, result["elapsed_time"], result["total_output_tokens"],
             result["total_num_tokens"])
    write_outputs(result, args.output_json)
    return result


if __name__ == "__main__":   # without the jaxpaged CLI (e.g. on a machine without the server deps)
    _parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_cli_args(_parser)
    main(_parser.parse_args())
