"""The ``jaxpaged`` command.

* ``jaxpaged generate [ENGINE FLAGS] [SAMPLING FLAGS] PROMPT...`` prints completions (and,
  with ``--speculative-config``, the acceptance line of ``jaxpaged bench`` on stderr).
* ``jaxpaged serve [MODEL] [ENGINE FLAGS] [SERVER FLAGS]`` runs the OpenAI-compatible server
  (``server/``).
* ``jaxpaged bench {throughput,latency,serve,soak,host-overhead,structured-outputs,
  scheduling-policy,block-size,compare-chat} ...``
  runs a benchmark (``benchmarks/``).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys

from jaxpaged.arg_utils import EngineArgs, cli_error_message
from jaxpaged.engine.gc_heap import pause_for_start_up


@contextlib.contextmanager
def _native_output_to_stderr():
    """Send file descriptor 1 to stderr for a while: native libraries (Gloo's connection
    messages in a multi-host job) print there, and stdout carries only the completions."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def build_parser(with_benchmarks: bool = True) -> argparse.ArgumentParser:
    """The top-level parser with its subcommands; ``with_benchmarks=False`` leaves the
    ``bench`` subcommand without its own (the benchmark modules and the HTTP client they
    import cost every ``serve`` start ~0.15 s of single-threaded Python)."""
    parser = argparse.ArgumentParser(prog="jaxpaged", description="JAX/Pallas LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate completions for prompts and print them")
    EngineArgs.add_cli_args(gen)
    s = gen.add_argument_group("sampling")
    s.add_argument("--max-tokens", type=int, default=16)
    s.add_argument("--temperature", type=float, default=1.0)
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--top-k", type=int, default=0)
    s.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    s.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("-v", "--verbose", action="store_true", help="log engine start-up details")
    gen.add_argument("prompts", nargs="+", metavar="PROMPT")

    from jaxpaged.server.server_args import add_server_args
    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    serve.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                       help="model directory (same as --model)")
    EngineArgs.add_cli_args(serve)
    add_server_args(serve)

    bench = sub.add_parser("bench", help="benchmarks (vllm bench equivalents)")
    if with_benchmarks:
        _add_benchmarks(bench)
    return parser


def _add_benchmarks(bench: argparse.ArgumentParser) -> None:
    """The ``bench`` subcommands and their flags (importing every benchmark module, and
    with them an HTTP client: ``build_parser`` adds them only for ``jaxpaged bench``)."""
    from jaxpaged.benchmarks import host_overhead, latency, serve as serve_bench, soak, throughput
    from jaxpaged.benchmarks import block_size, compare_chat, scheduling_policy, structured_outputs
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    for name, module, text in (
            ("throughput", throughput, "offline throughput through the engine"),
            ("latency", latency, "end-to-end latency of one batch, repeated"),
            ("serve", serve_bench, "online serving benchmark against a running jaxpaged serve"),
            ("soak", soak, "soak test of the server: many clients, random disconnects, then "
                           "leak and output checks"),
            ("host-overhead", host_overhead, "host time per engine step outside the device "
                                             "call, and detokenization cost per token"),
            ("structured-outputs", structured_outputs, "throughput of grammar-constrained "
                                                       "against free decoding"),
            ("scheduling-policy", scheduling_policy, "short requests' latency under fcfs "
                                                     "and sjf on a mixed workload"),
            ("block-size", block_size, "W1 at several --block-size values (auto too), "
                                       "side by side"),
            ("compare-chat", compare_chat, "a chat workload on jaxpaged serve and on "
                                           "llama.cpp's llama-server, one after the other")):
        module.add_cli_args(kinds.add_parser(name, help=text))


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``jaxpaged`` console script; returns the exit status (130 after
    Ctrl-C)."""
    try:
        return _main(argv)
    except KeyboardInterrupt:
        return 130


def _main(argv: list[str] | None) -> int:
    # transformers announces at import that torch is absent; jaxpaged never needs torch.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:       # until its warm-up request is served (gc_heap)
        pause_for_start_up()
    args = build_parser(with_benchmarks=argv[:1] == ["bench"]).parse_args(argv)
    verbose = args.command == "serve" or getattr(args, "verbose", False)
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("jax").setLevel(logging.WARNING)   # backend probing is not news
    if args.command == "bench":
        from jaxpaged.benchmarks import host_overhead, latency, serve as serve_bench, soak, throughput
        from jaxpaged.benchmarks import block_size, scheduling_policy, structured_outputs
        from jaxpaged.benchmarks import compare_chat

        module = {"block-size": block_size, "compare-chat": compare_chat,
                  "throughput": throughput, "latency": latency, "serve": serve_bench,
                  "soak": soak, "host-overhead": host_overhead,
                  "structured-outputs": structured_outputs,
                  "scheduling-policy": scheduling_policy}
        try:
            module[args.bench_command].main(args)
        except (ValueError, FileNotFoundError, RuntimeError) as e:
            print(f"jaxpaged: error: {e}", file=sys.stderr)
            return 2
        return 0
    if args.command == "serve":
        from jaxpaged.server.launcher import run_server

        if args.model_tag is not None:
            args.model = args.model_tag
        return run_server(args)
    from jaxpaged import LLM, SamplingParams  # heavy imports after argument errors
    from jaxpaged.distributed.multihost import JobFailed, is_leader, leave_failed_job
    from jaxpaged.distributed.step_sync import JobStopped

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k,
                                stop=args.stop, ignore_eos=args.ignore_eos)
        with _native_output_to_stderr():
            llm = LLM(**vars(EngineArgs.from_cli_args(args, enforce_eager_default=True)))
            outputs = llm.generate(args.prompts, params, use_tqdm=False)
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"jaxpaged: error: {cli_error_message(e)}", file=sys.stderr)
        return 2
    except JobStopped as e:      # every process of the job stops at the same step
        print(f"jaxpaged: {e}", file=sys.stderr)
        return 128 + e.signum
    except JobFailed as e:
        leave_failed_job(e)
    if is_leader():          # every process of a multi-host job computed the same outputs
        for out in outputs:
            print(out.outputs[0].text)
        from jaxpaged.benchmarks.results import spec_decode_line, spec_decode_totals

        if (totals := spec_decode_totals(llm)) is not None:   # stdout keeps the completions
            print(spec_decode_line(totals), file=sys.stderr)
    failed = [(i, out.error) for i, out in enumerate(outputs) if out.error is not None]
    for i, error in failed:
        print(f"jaxpaged: error: prompt {i + 1} failed: {error}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
