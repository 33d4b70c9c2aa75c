"""A small `jaxpaged bench serve` run against the live server."""

import json

import pytest

from jaxpaged.benchmarks import serve
from jaxpaged.cli import build_parser


@pytest.mark.parametrize("rate", ["inf", "20"])
def test_bench_serve_small(live_server, tmp_path, rate):
    out = tmp_path / "serve.json"
    args = build_parser().parse_args(
        ["bench", "serve", "--base-url", live_server.url, "--num-prompts", "12",
         "--random-input-len", "16", "--random-output-len", "8", "--request-rate", rate,
         "--max-concurrency", "6", "--cost-per-hour", "2.5", "--output-json", str(out)])
    serve.main(args)
    result = json.loads(out.read_text())
    assert result["completed"] == 12 and result["failed"] == 0, result["errors"]
    assert result["total_output_tokens"] == 12 * 8 and result["total_input_tokens"] == 12 * 16
    dollars = 2.5 * result["duration"] / 3600
    assert result["cost_per_million_output_tokens"] == pytest.approx(dollars / 96 * 1e6)
    assert result["cost_per_million_total_tokens"] == pytest.approx(dollars / 288 * 1e6)
    for key in ("duration", "request_throughput", "output_throughput", "total_token_throughput",
                "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "mean_itl_ms",
                "p99_itl_ms", "mean_e2el_ms", "p99_e2el_ms"):
        assert result[key] > 0, key
    assert result["p99_e2el_ms"] >= result["median_e2el_ms"] > result["median_ttft_ms"]
    live_server.wait_idle()


@pytest.mark.parametrize("flags, needle", [
    (["--base-url", "http://127.0.0.1:9"], "no OpenAI-compatible server"),
    (["--model", "nope"], "not 'nope'"), (["--request-rate", "-1"], "> 0")])
def test_bench_serve_bad_arguments(live_server, flags, needle):
    args = build_parser().parse_args(["bench", "serve", "--base-url", live_server.url,
                                      "--num-prompts", "2", *flags])
    with pytest.raises(ValueError, match=needle):
        serve.main(args)


def test_bench_serve_sampled_requests(live_server, tmp_path):
    """vLLM's sampling flags go into every request (the default stays greedy)."""
    parser = build_parser()
    base = ["bench", "serve", "--base-url", live_server.url, "--num-prompts", "4",
            "--random-input-len", "16", "--random-output-len", "8"]
    assert serve.sampling_fields(parser.parse_args(base)) == {"temperature": 0.0}
    out = tmp_path / "sampled.json"
    args = parser.parse_args([*base, "--temperature", "0.8", "--top-k", "40", "--top-p", "0.95",
                              "--min-p", "0.05", "--output-json", str(out)])
    serve.main(args)
    result = json.loads(out.read_text())
    assert result["sampling"] == {"temperature": 0.8, "top_p": 0.95, "top_k": 40, "min_p": 0.05}
    assert result["completed"] == 4 and result["total_output_tokens"] == 32
    live_server.wait_idle()
