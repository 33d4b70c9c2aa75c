"""The llama.cpp baseline's client (benchmarks/baselines/llama_cpp.py) against a fake
``llama-server`` on loopback (tests/helpers/fake_llama_server.py): the command line, the exact
requests, the concurrency, the wall-time accounting and that the server is stopped."""

import json
import os
import stat
import sys
from pathlib import Path

import pytest

from jaxpaged.benchmarks.baselines.llama_cpp import (LlamaServer, free_port, llama_cpp_row,
                                                     server_command, slot_context)
from jaxpaged.benchmarks.datasets import SampleRequest, random_requests
from jaxpaged.benchmarks.results import cpu_model

FAKE = Path(__file__).parent / "helpers" / "fake_llama_server.py"


@pytest.fixture
def fake_binary(tmp_path, monkeypatch):
    """An executable ``llama-server`` that execs the fake (same PID), logging to a file."""
    binary = tmp_path / "llama-server"
    binary.write_text(f"#!/bin/sh\nexec {sys.executable} {FAKE} \"$@\"\n")
    binary.chmod(binary.stat().st_mode | stat.S_IEXEC)
    log = tmp_path / "fake.jsonl"
    monkeypatch.setenv("FAKE_LOG", str(log))
    return str(binary), log


def events(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_row_sends_each_prompt_once_16_in_flight_and_times_only_the_pass(fake_binary, tmp_path,
                                                                         monkeypatch):
    binary, log = fake_binary
    monkeypatch.setenv("FAKE_STARTUP_S", "1.0")      # /health 503 for 1 s: not timed
    monkeypatch.setenv("FAKE_DELAY_S", "0.1")        # each completion takes 0.1 s
    requests = random_requests(64, (32, 256), 128, seed=0, token_range=(3, 32000))
    row = llama_cpp_row(binary, "/models/w1-f32.gguf", requests, str(tmp_path / "work"))

    start, warmup, *completions = events(log)
    assert start["argv"] == row["llama_server_command"][1:]
    argv = start["argv"]
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert argv[argv.index("--parallel") + 1] == "16" and "--cont-batching" in argv
    assert argv[argv.index("--threads") + 1] == "2"
    assert argv[argv.index("--ctx-size") + 1] == str(16 * 512)     # 256 + 128, to 256s
    assert argv[argv.index("--model") + 1] == "/models/w1-f32.gguf"
    assert gone(start["pid"])                                     # stopped and reaped

    assert warmup["body"]["prompt"] == requests[0].prompt[:16]
    assert warmup["body"]["n_predict"] == 8
    assert len(completions) == 64
    assert all(e["path"] == "/completion" for e in completions)
    assert sorted(json.dumps(e["body"]["prompt"]) for e in completions) == sorted(
        json.dumps(q.prompt) for q in requests)
    for e in completions:
        assert {k: v for k, v in e["body"].items() if k != "prompt"} == {
            "n_predict": 128, "ignore_eos": True, "temperature": 0.0, "cache_prompt": False}
    assert max(e["in_flight"] for e in completions) == 16

    # 64 requests, 16 at a time, 0.1 s each: >= 0.4 s; the 1 s start-up is not counted.
    assert 0.4 <= row["elapsed_time"] < 1.0
    assert row["startup_time"] >= 1.0
    assert row["backend"] == "llama.cpp w1-f32.gguf"
    assert row["total_output_tokens"] == 64 * 128
    assert row["total_prompt_tokens"] == sum(q.prompt_len for q in requests)
    assert row["output_tokens_per_second"] == pytest.approx(64 * 128 / row["elapsed_time"])
    assert row["llama_server_version"] == "version: 1 (fake)"


def test_server_ignoring_sigterm_is_killed(fake_binary, tmp_path, monkeypatch):
    binary, log = fake_binary
    monkeypatch.setenv("FAKE_IGNORE_TERM", "1")
    cmd = server_command(binary, "m.gguf", free_port(), 2, 512, 1)
    with LlamaServer(cmd, str(tmp_path / "s.log"), stop_timeout_s=0.5) as server:
        assert server.complete([5, 6, 7], 3)["tokens_predicted"] == 3
    assert server.proc.returncode == -9                   # SIGTERM ignored, then SIGKILL
    assert gone(events(log)[0]["pid"])


def test_server_that_exits_is_reported(tmp_path):
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\nexit 3\n")
    binary.chmod(binary.stat().st_mode | stat.S_IEXEC)
    cmd = server_command(str(binary), "m.gguf", free_port(), 2, 512, 1)
    with pytest.raises(RuntimeError, match="exited with 3"):
        with LlamaServer(cmd, str(tmp_path / "s.log")):
            pass


def test_slot_context():
    reqs = [SampleRequest([1] * n, n, 128) for n in (32, 129)]
    assert slot_context(reqs, 16) == 16 * 512        # 129 + 128 = 257 -> 512
    assert slot_context(reqs[:1], 4) == 4 * 256


def test_compare_runs_one_llama_row_per_gguf(fake_binary, tmp_path):
    from jaxpaged.benchmarks import compare

    binary, log = fake_binary
    result = compare.main(["--small", "--rows", "llama.cpp", "--llama-server", binary,
                           "--gguf", "/m/w1-f32.gguf", "--gguf", "/m/w1-f16.gguf",
                           "--llama-server-args", "--cache-type-k f32",
                           "--output-dir", str(tmp_path), "--work-dir", str(tmp_path / "w")])
    assert [r["backend"] for r in result["rows"]] == ["llama.cpp w1-f32.gguf",
                                                      "llama.cpp w1-f16.gguf"]
    for row in result["rows"]:
        assert row["ratio_jaxpaged_over_this"] is None          # no jaxpaged row this run
        assert row["total_output_tokens"] == 8 * 8 and 0 < row["mfu"] < 1
    starts = [e for e in events(log) if "argv" in e]
    assert [s["argv"][s["argv"].index("--model") + 1] for s in starts] == [
        "/m/w1-f32.gguf", "/m/w1-f16.gguf"]
    assert all(gone(s["pid"]) and s["argv"][-2:] == ["--cache-type-k", "f32"] for s in starts)
    assert result["cpu"] == cpu_model() and len(result["load_average_before_after"]) == 2
