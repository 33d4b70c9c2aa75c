"""The ``jaxpaged`` command line builds the benchmark subcommands only for ``jaxpaged bench``
(``jaxpaged/cli.py``): their modules and the HTTP client they import are not a server's."""

from __future__ import annotations

import subprocess
import sys

import pytest

from jaxpaged.cli import build_parser

_PROBE = """
import sys
from jaxpaged.cli import build_parser
args = build_parser(with_benchmarks={flag}).parse_args({argv!r})
print(args.command, "jaxpaged.benchmarks.serve" in sys.modules, "httpx" in sys.modules)
"""


@pytest.mark.parametrize("flag, argv, want", [
    (False, ["serve", "--port", "8123"], "serve False False"),
    (True, ["bench", "serve", "--num-prompts", "3"], "bench True True"),
])
def test_benchmark_modules_are_imported_only_for_bench(flag, argv, want):
    out = subprocess.run([sys.executable, "-c", _PROBE.format(flag=flag, argv=argv)],
                         capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split("\n")[-2] == want


def test_bench_subcommands_keep_their_flags():
    args = build_parser().parse_args(["bench", "compare-chat", "model.gguf", "--concurrency",
                                      "4"])
    assert (args.bench_command, args.model, args.concurrency) == ("compare-chat", "model.gguf", 4)
    with pytest.raises(SystemExit):         # serve's parser has no bench flags
        build_parser(with_benchmarks=False).parse_args(["bench", "serve"])
