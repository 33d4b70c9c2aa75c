"""``python -m jaxpaged.benchmarks.host_core_steps``: the JAX-free step contract alone, per decode step.

``jaxpaged bench host-overhead`` times the host side of real engine steps; on a shared
machine its medians move 10-30% between runs of one build, more than the changes it is
meant to judge. This drives ``jaxpaged.core`` without a model: a ``Scheduler`` over a
``KVCacheManager`` (page size 16, prefix caching on) and an ``OutputProcessor`` take
``--num-seqs`` prompts of 16-63 tokens; every step is ``schedule()``, a
``ModelRunnerOutput`` sampling one fixed token per sequence, ``update_from_output()`` and
``OutputProcessor.make_output`` for each request that got a token, as ``Engine.step`` runs
them. The garbage collector is set up as the engine sets it (``jaxpaged.engine.gc_heap``:
the heap frozen, generation-0 threshold 20000). The tokenizer is a stand-in (a character
per id) so that the run imports neither ``transformers`` nor JAX: with
``--output-kind final_only`` (what ``LLM.generate`` and non-streaming routes ask for) no
text is made before a request finishes, so it measures scheduling, KV bookkeeping, token
application and stop checks, not a tokenizer.

Prints the mean wall milliseconds per decode step. For a count that does not depend on the
machine's load, run it under callgrind twice with different ``--steps`` and divide the
difference of the instruction totals by the difference of the step counts; OpenBLAS's
threads (numpy) and hash randomization must be pinned for the count to repeat exactly::

    OPENBLAS_NUM_THREADS=1 PYTHONHASHSEED=0 valgrind --tool=callgrind \\
        --callgrind-out-file=/dev/null python -m jaxpaged.benchmarks.host_core_steps --steps 20

(``docs/benchmarks.md``, "Host step instructions", has the figures.)
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
import types


class _StandInTokenizer:
    """A character per id; no special tokens, no fast backend."""

    all_special_ids: list[int] = []
    added_tokens_decoder: dict = {}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) % 500 for c in text]

    def decode(self, ids: list[int], **kwargs) -> str:
        return "x" * len(ids)

    def get_vocab(self) -> dict[str, int]:
        return {}


def _no_transformers() -> None:
    """Make ``jaxpaged.core.detokenizer.fast_backend``'s import of ``transformers`` cheap
    (an empty stand-in module): the stand-in tokenizer is no ``TokenizersBackend`` whatever
    the class is."""
    if "transformers" not in sys.modules:
        module = types.ModuleType("transformers")
        module.TokenizersBackend = type("TokenizersBackend", (), {})
        sys.modules["transformers"] = module


def main(argv: list[str] | None = None) -> int:
    """Run it; returns the tokens applied (``num_seqs * (steps + 1)``: the prefill step's
    first tokens, then one per sequence per decode step)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="decode steps timed")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--output-kind", default="final_only",
                        choices=["final_only", "cumulative", "delta"])
    args = parser.parse_args(argv)
    from jaxpaged.core.kv_cache_manager import KVCacheManager
    from jaxpaged.core.output_processor import OutputProcessor
    from jaxpaged.core.request import Request
    from jaxpaged.core.runner_output import ModelRunnerOutput
    from jaxpaged.core.scheduler import Scheduler
    from jaxpaged.core.scheduler_config import SchedulerConfig
    from jaxpaged.sampling_params import RequestOutputKind, SamplingParams

    max_tokens = args.steps + 2
    op = OutputProcessor(_StandInTokenizer(), frozenset({2}), 4096)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=args.num_seqs, max_num_batched_tokens=
                                          64 * args.num_seqs, max_model_len=4096),
                          KVCacheManager(64 * args.num_seqs, 16), op)
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=max_tokens,
                            output_kind=RequestOutputKind[args.output_kind.upper()])
    for i in range(args.num_seqs):
        prompt = [3 + (i * 7 + j) % 400 for j in range(16 + i % 48)]
        req = Request(f"r{i}", None, prompt, params, seed=0, max_tokens=max_tokens, arrival=i)
        op.add_request(req, 0.0)
        scheduler.add_request(req)

    def step() -> None:
        plan = scheduler.schedule()
        out = ModelRunnerOutput(sampled_token_ids=[[7 + i % 50] if s.samples else []
                                                   for i, s in enumerate(plan.scheduled)])
        for group in scheduler.update_from_output(plan, out):
            op.make_output(group)

    step()      # every prompt prefills in this one
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, *gc.get_threshold()[1:])
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    ms = (time.perf_counter() - t0) / max(args.steps, 1) * 1e3
    print(f"{args.num_seqs} sequences, {args.output_kind}: {ms:.3f} ms per decode step")
    return scheduler.num_generation_tokens


if __name__ == "__main__":
    _no_transformers()      # (only as a script: an importer may need the real package)
    main()
