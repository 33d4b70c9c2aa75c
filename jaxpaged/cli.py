"""The ``jaxpaged`` command: ``jaxpaged generate [ENGINE FLAGS] [SAMPLING FLAGS] PROMPT...``."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from jaxpaged.engine.arg_utils import EngineArgs


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with its subcommands."""
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
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``jaxpaged`` console script; returns the exit status."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    # transformers announces at import that torch is absent; jaxpaged never needs torch.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from jaxpaged import LLM, SamplingParams  # heavy imports after argument errors

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k,
                                stop=args.stop, ignore_eos=args.ignore_eos)
        llm = LLM(**vars(EngineArgs.from_cli_args(args, enforce_eager_default=True)))
        outputs = llm.generate(args.prompts, params, use_tqdm=False)
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"jaxpaged: error: {e}", file=sys.stderr)
        return 2
    for out in outputs:
        print(out.outputs[0].text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
