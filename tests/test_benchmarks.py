"""Small runs of `jaxpaged bench throughput | latency | host-overhead` and the benchmark
datasets."""

import dataclasses
import json

import numpy as np
import pytest

from benchmarks import host_overhead, latency, throughput
from benchmarks.datasets import (prefix_repetition_requests, random_requests, sharegpt_requests,
                                 w1_requests)
from jaxpaged.cli import build_parser
from jaxpaged.engine.arg_utils import EngineArgs
from jaxpaged.tokenizer import load_tokenizer
from tests.conftest import LLAMA2_TOKENIZER

SMALL_ENGINE = ["--max-num-seqs", "8", "--max-num-batched-tokens", "128"]


def test_bench_throughput_small(tmp_path, capsys):
    out = tmp_path / "tp.json"
    args = build_parser().parse_args(
        ["bench", "throughput", *SMALL_ENGINE, "--num-prompts", "8", "--random-input-len", "20",
         "--random-output-len", "6", "--output-json", str(out)])
    throughput.main(args)
    result = json.loads(out.read_text())
    assert result["num_requests"] == 8 and result["total_output_tokens"] == 48
    for key in ("elapsed_time", "requests_per_second", "tokens_per_second",
                "output_tokens_per_second", "warmup_time"):
        assert result[key] > 0, key
    assert result["num_compilations_during_run"] == 0     # the warm-up compiled every shape
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result


def test_bench_latency_small(tmp_path):
    out = tmp_path / "lat.json"
    args = build_parser().parse_args(
        ["bench", "latency", *SMALL_ENGINE, "--input-len", "12", "--output-len", "4",
         "--batch-size", "2", "--num-iters", "3", "--output-json", str(out)])
    latency.main(args)
    result = json.loads(out.read_text())
    assert len(result["latencies"]) == 3 and result["avg_latency"] > 0
    assert set(result["percentiles"]) == {"10", "25", "50", "75", "90", "99"}
    assert all(v > 0 for v in result["percentiles"].values())


def test_bench_host_overhead_small(tmp_path):
    out = tmp_path / "host.json"
    args = build_parser().parse_args(
        ["bench", "host-overhead", "--max-num-seqs", "8", "--max-num-batched-tokens", "512",
         "--num-requests", "8", "--output-len", "4", "--detok-lengths", "32", "8",
         "--output-json", str(out)])
    result = host_overhead.main(args)
    assert json.loads(out.read_text()) == result
    has_async = any(f.name == "async_scheduling" for f in dataclasses.fields(EngineArgs))
    assert set(result["modes"]) == ({"sync", "async"} if has_async else {"sync"})
    for mode in result["modes"].values():
        # All 8 prompts (<= 64 tokens each) fit one step: a prefill step that samples every
        # first token, then 3 decode steps of 8 sequences.
        assert (mode["num_steps"], mode["num_decode_steps"], mode["num_tokens"]) == (4, 3, 32)
        assert [s["num_seqs"] for s in mode["steps"]] == [8, 8, 8, 8]
        assert [s["decode"] for s in mode["steps"]] == [False, True, True, True]
        assert mode["num_compilations_during_run"] == 0
        for s in mode["steps"]:
            assert s["device_ms"] > 0 and s["host_ms"] > 0
            assert s["device_ms"] + s["host_ms"] == pytest.approx(s["wall_ms"], abs=1e-3)
        assert sum(s["wall_ms"] for s in mode["steps"]) <= mode["elapsed_s"] * 1e3
        decode = mode["steps"][1:]
        for name in ("wall", "device", "host"):
            values = [s[f"{name}_ms"] for s in decode]
            assert mode["decode"][f"mean_{name}_ms"] == pytest.approx(np.mean(values))
            assert mode["decode"][f"median_{name}_ms"] == pytest.approx(np.median(values))
    detok = result["detokenize"]
    assert detok["vocab_size"] == 32000 and set(detok["per_token"]) == {"8", "32"}
    assert all(0 < t["median_us"] and 0 < t["mean_us"] for t in detok["per_token"].values())
    assert detok["ratio"] == pytest.approx(detok["per_token"]["32"]["mean_us"]
                                           / detok["per_token"]["8"]["mean_us"])


def test_w1_recipe():
    requests = w1_requests(32000)
    rng = np.random.default_rng(0)
    lengths = rng.integers(32, 257, size=64)
    assert [q.prompt_len for q in requests] == lengths.tolist()
    assert requests[0].prompt == rng.integers(3, 32000, size=int(lengths[0])).tolist()
    assert all(q.output_len == 128 for q in requests)


def test_random_and_prefix_repetition_sets():
    a = random_requests(5, (4, 9), 3, seed=1, token_range=(3, 100))
    assert a == random_requests(5, (4, 9), 3, seed=1, token_range=(3, 100))
    assert all(4 <= len(q.prompt) <= 9 and all(3 <= t < 100 for t in q.prompt) for q in a)
    reqs = prefix_repetition_requests(12, 3, 10, 4, 5, seed=0, token_range=(3, 100))
    assert len({tuple(q.prompt[:10]) for q in reqs}) == 3
    assert all(q.prompt_len == 14 == len(q.prompt) for q in reqs)


def test_sharegpt_file(tmp_path):
    tok = load_tokenizer(LLAMA2_TOKENIZER)
    data = [{"conversations": [{"from": "human", "value": "Tell me a story"},
                               {"from": "gpt", "value": "Once upon a time there was a cat"}]},
            {"conversations": [{"from": "human", "value": "only one turn"}]},
            {"conversations": [{"from": "human", "value": "Hi"},
                               {"from": "gpt", "value": "Hello there"}]}]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    reqs = sharegpt_requests(str(path), tok, 2, seed=0, output_len=None, max_len=512)
    by_prompt = {q.prompt: q for q in reqs}
    assert set(by_prompt) == {"Tell me a story", "Hi"}
    assert by_prompt["Hi"].output_len == len(tok.encode("Hello there", add_special_tokens=False))
    assert by_prompt["Hi"].prompt_len == len(tok.encode("Hi"))


@pytest.mark.parametrize("flags, ours, others", [
    ([], "jaxpaged", {"contiguous-static-8"}),
    (["--data-parallel-size", "2"], "jaxpaged dp=2", {"jaxpaged tp=1", "contiguous-static-8"}),
])
def test_compare_small(tmp_path, flags, ours, others):
    from benchmarks import compare

    result = compare.main(["--small", "--output-dir", str(tmp_path), "--work-dir",
                           str(tmp_path / "work"), *flags])
    rows = {r["backend"]: r for r in result["rows"]}
    assert set(rows) == {ours} | others
    assert rows[ours]["ratio_jaxpaged_over_this"] == 1.0
    for row in rows.values():
        assert row["elapsed_time"] > 0 and row["output_tokens_per_second"] > 0
        assert 0 < row["mfu"] < 1
    assert result["matmul_peak_gflops"] > 0 and result["roofline_seconds"] > 0
    assert json.loads((tmp_path / "compare-small.json").read_text())["rows"][0]["backend"] == ours
