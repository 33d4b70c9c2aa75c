"""``jaxpaged bench compare-chat`` (benchmarks/compare_chat.py): the table and JSON assembly,
the RSS sampler, the server process, the chat client against a stand-in llama-server
(tests/helpers/fake_llama_server.py), and the whole harness on the bundled model."""

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time

import pytest

from jaxpaged.benchmarks import compare_chat
from jaxpaged.benchmarks.baselines.llama_cpp import free_port, server_command
from jaxpaged.benchmarks.datasets import chat_requests, load_chat
from jaxpaged.benchmarks.server_process import RssSampler, ServerProcess, child_pids, rss_bytes
from jaxpaged.cli import build_parser
from tests.test_llama_cpp_baseline import events, fake_binary, gone  # noqa: F401 (fixture)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLAIN_TEMPLATE = os.path.join(ROOT, "configs", "chat_templates", "plain.jinja")


def parse(*argv):
    return build_parser().parse_args(["bench", "compare-chat", *argv])


def run_figures(tok_s, tpot_ms, ttft50=0.0, ttft90=0.0):
    return {"output_throughput": tok_s, "median_tpot_ms": tpot_ms, "median_ttft_ms": ttft50,
            "p90_ttft_ms": ttft90}


ENGINES = {
    "jaxpaged": {"runs": {"single_user": run_figures(100.0, 9.5),
                          "concurrent": run_figures(800.0, 18.0, 40.0, 90.0)},
                 "startup_empty_cache_s": 30.0, "startup_warm_s": 5.0, "peak_rss_mb": 1000.0},
    "llama.cpp": {"runs": {"single_user": run_figures(50.0, 19.0),
                           "concurrent": run_figures(400.0, 36.0, 80.0, 45.0)},
                  "startup_s": 1.5, "peak_rss_mb": 250.0},
}


def test_table_ratios_say_how_many_times_better_jaxpaged_does():
    table = compare_chat.comparison_table(ENGINES, 16)
    assert [r["measure"] for r in table] == [
        "1 user: output tok/s (TPOT p50)", "16 users: output tok/s (TPOT p50)",
        "16 users: TTFT p50 / p90", "start-up to /health 200, empty compile cache / warm",
        "peak RSS (MB, of the server process tree)"]
    assert [r["jaxpaged"] for r in table] == [[100.0, 9.5], [800.0, 18.0], [40.0, 90.0],
                                              [30.0, 5.0], [1000.0]]
    assert [r["llama.cpp"] for r in table] == [[50.0, 19.0], [400.0, 36.0], [80.0, 45.0],
                                               [1.5], [250.0]]
    # tok/s: ours over theirs; ms, s, MB: theirs over ours (llama.cpp's one start-up twice)
    assert [r["ratio"] for r in table] == [[2.0], [2.0], [2.0, 0.5], [0.05, 0.3], [0.25]]
    lines = compare_chat.markdown_table(table).splitlines()
    assert lines[:2] == ["| measure | jaxpaged | llama.cpp | ratio |", "|---|---|---|---|"]
    assert lines[2] == ("| 1 user: output tok/s (TPOT p50) | 100.0 (9.50 ms) | "
                        "50.0 (19.00 ms) | 2.00 |")
    assert lines[4] == ("| 16 users: TTFT p50 / p90 | 40.0 / 90.0 ms | 80.0 / 45.0 ms | "
                        "2.00 / 0.50 |")
    assert lines[5] == ("| start-up to /health 200, empty compile cache / warm | 30.0 / 5.0 s | "
                        "1.5 s | 0.05 / 0.30 |")
    assert lines[6] == "| peak RSS (MB, of the server process tree) | 1000 | 250 | 0.25 |"

    alone = compare_chat.comparison_table({"jaxpaged": ENGINES["jaxpaged"]}, 16)
    assert all(r["llama.cpp"] is None and r["ratio"] is None for r in alone)
    assert compare_chat.markdown_table(alone).splitlines()[3] == \
        "| 16 users: output tok/s (TPOT p50) | 800.0 (18.00 ms) | - | - |"
    panels = compare_chat.plot_panels(ENGINES, 16)
    assert panels[2] == ("start-up to /health 200 (s)", ["empty cache", "warm"],
                         {"jaxpaged": [30.0, 5.0], "llama.cpp": [1.5, 1.5]})


def test_workload_defaults_flags_and_checks():
    w = compare_chat.workload(parse("m.gguf"))
    assert w == {"num_prompts": 64, "single_user_prompts": 8, "concurrency": 16,
                 "output_len": 128}
    questions = load_chat()["questions"]
    assert len(questions) == len(set(questions)) == 64
    reqs = chat_requests(66, 128)
    assert reqs[0].prompt == [{"role": "user", "content": "What is the capital of France?"}]
    assert reqs[64].prompt == reqs[0].prompt and reqs[0].is_chat and reqs[0].prompt_len == 0
    assert {q.output_len for q in reqs} == {128}
    assert compare_chat.workload(parse("m.gguf", "--num-prompts", "4", "--concurrency", "2",
                                       "--single-user-prompts", "2", "--output-len", "16")) == {
        "num_prompts": 4, "single_user_prompts": 2, "concurrency": 2, "output_len": 16}
    with pytest.raises(ValueError, match="more than --num-prompts 4"):
        compare_chat.workload(parse("m.gguf", "--num-prompts", "4"))
    for flag in ("--concurrency", "--output-len"):
        with pytest.raises(ValueError, match=f"{flag} must be >= 1, got 0"):
            compare_chat.workload(parse("m.gguf", flag, "0"))
    with pytest.raises(FileNotFoundError, match="no model at /nope.gguf"):
        compare_chat.main(parse("/nope.gguf"))
    with pytest.raises(FileNotFoundError, match="is not an executable"):
        compare_chat.main(parse(ROOT, "--llama-server", os.path.join(ROOT, "README.md")))
    # the chat set is for a server: bench serve offers it, the offline benchmarks do not
    assert build_parser().parse_args(["bench", "serve", "--dataset-name", "chat"]).dataset_name \
        == "chat"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "throughput", "--dataset-name", "chat"])


def test_precompile_figures_read_from_the_log(tmp_path):
    log = tmp_path / "serve.log"
    log.write_text("INFO x: y\nINFO jaxpaged.runner.model_runner: precompiled 27 executables in "
                   "34.2 s (25 compiled, 2 loaded from the compile cache /tmp/c)\n")
    assert compare_chat.precompile_figures(str(log)) == {
        "executables": 27, "seconds": 34.2, "compiled": 25, "loaded": 2}
    log.write_text("INFO: nothing precompiled (--enforce-eager)\n")
    assert compare_chat.precompile_figures(str(log)) is None


def test_background_compilation_read_from_the_servers_own_log_lines(tmp_path, caplog):
    """The harness waits for the lines ``jaxpaged.runner.background_compile`` writes (a
    stand-in runner compiles nothing)."""
    import logging

    from jaxpaged.runner.background_compile import BackgroundCompile

    class Runner:
        def precompile(self, **kwargs):
            pass

        def defer_shapes(self, shapes):
            pass

    with caplog.at_level(logging.INFO, logger="jaxpaged.runner.background_compile"):
        assert BackgroundCompile(Runner(), [([(8, 8, 4, True)], True, True)], pad=True).wait(10)
    log = tmp_path / "serve.log"
    log.write_text("".join(f"INFO {r.name}: {r.getMessage()}\n" for r in caplog.records))
    assert "compiling 1 more step shapes" in log.read_text()
    assert compare_chat.wait_for_background_compile(str(log), 5) >= 0.0
    log.write_text("INFO x: y\n")      # a server that compiles nothing in the background
    assert compare_chat.wait_for_background_compile(str(log), 5) is None


def test_rss_sampler_keeps_the_peak_of_the_process_and_its_children():
    me = os.getpid()
    with RssSampler(me, interval_s=0.01) as sampler:
        base = rss_bytes(me)
        block = b"\1" * 200_000_000           # touched: resident
        time.sleep(0.1)
        del block
    assert base > 10_000_000
    assert sampler.peak_bytes >= base + 190_000_000 and sampler.num_samples >= 5
    assert sampler.peak_mb == sampler.peak_bytes / 1e6

    hold = "import time; b = b'\\1' * 100_000_000; print('ready', flush=True); time.sleep(60)"
    child = subprocess.Popen([sys.executable, "-c", hold], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "ready\n"
        assert child.pid in child_pids(me)
        tree = RssSampler(me).sample()
        assert tree >= rss_bytes(me) + rss_bytes(child.pid) - 5_000_000
        assert rss_bytes(child.pid) >= 100_000_000
    finally:
        child.kill()
        child.wait()
    assert rss_bytes(child.pid) == 0 and child.pid not in child_pids(me)


def test_chat_client_and_server_process_against_a_stand_in(fake_binary, tmp_path,  # noqa: F811
                                                           monkeypatch):
    binary, log = fake_binary
    monkeypatch.setenv("FAKE_STARTUP_S", "0.5")       # /health 503 for 0.5 s
    monkeypatch.setenv("FAKE_ALLOC_MB", "150")        # the server holds 150 MB
    monkeypatch.setenv("FAKE_TOKEN_S", "0.01")        # a token every 10 ms
    command = server_command(binary, "m.gguf", free_port(), 16, 8192, 2)
    with ServerProcess(command, str(tmp_path / "s.log"), rss_interval_s=0.02) as server:
        assert server.startup_time >= 0.5
        out = compare_chat.measure_server(server.url, chat_requests(6, 5), 2, 3)
    assert gone(server.proc.pid) and server.rss.peak_mb >= 150
    assert out["model"] == "fake.gguf" and set(out["runs"]) == {"single_user", "concurrent"}
    chats = [e for e in events(log) if e.get("path") == "/v1/chat/completions"]
    assert len(chats) == 1 + 3 + 2 + 6               # warm-ups (1, then 3), 1 user, 3 users
    assert [e["body"]["max_tokens"] for e in chats] == [8] * 4 + [5] * 8
    assert max(e["in_flight"] for e in chats[4:6]) == 1
    assert max(e["in_flight"] for e in chats[6:]) == 3
    for e in chats:
        assert {k: v for k, v in e["body"].items() if k not in ("messages", "max_tokens")} == {
            "model": "fake.gguf", "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    one, three = out["runs"]["single_user"], out["runs"]["concurrent"]
    assert one["max_concurrency"] == 1 and three["max_concurrency"] == 3
    assert one["completed"] == 2 and three["completed"] == 6 and three["failed"] == 0
    assert three["total_output_tokens"] == 30
    # the prompt length is the server's usage.prompt_tokens (the stand-in: words + 5)
    assert three["input_lens"] == [len(q.prompt[0]["content"].split()) + 5
                                   for q in chat_requests(6, 5)]
    # 5 tokens, 10 ms apart: TPOT (E2E - TTFT) / 4 is about 10 ms
    assert 9 <= one["median_tpot_ms"] < 30 and one["median_ttft_ms"] >= 10
    assert len(three["ttfts"]) == 6 and all(t > 0 for t in three["tpots"])


def test_whole_harness_on_the_bundled_model_and_a_stand_in(fake_binary, tmp_path,  # noqa: F811
                                                           monkeypatch):
    """jaxpaged serve of the bundled model (eager: nothing to precompile, so the two starts
    take seconds) and the stand-in llama-server, in one compare-chat run."""
    binary, log = fake_binary
    monkeypatch.setenv("FAKE_ALLOC_MB", "50")
    monkeypatch.setenv("FAKE_TOKEN_S", "0.005")
    from jaxpaged.arg_utils import DEFAULT_MODEL
    out_json = tmp_path / "out" / "chat.json"
    args = parse(DEFAULT_MODEL, "--llama-server", binary, "--serve-args",
                 f"--enforce-eager --max-model-len 128 --chat-template {PLAIN_TEMPLATE}",
                 "--num-prompts", "4", "--single-user-prompts", "2", "--concurrency", "2",
                 "--output-len", "6", "--work-dir", str(tmp_path / "work"),
                 "--output-json", str(out_json))
    result = compare_chat.main(args)
    assert json.loads(out_json.read_text()) == json.loads(json.dumps(result))
    j, ll = result["engines"]["jaxpaged"], result["engines"]["llama.cpp"]
    for e in (j, ll):
        assert e["runs"]["concurrent"]["total_output_tokens"] == 4 * 6
        assert e["runs"]["single_user"]["completed"] == 2
        assert e["runs"]["concurrent"]["failed"] == 0
    assert 0 < j["startup_warm_s"] and 0 < j["startup_empty_cache_s"] < 120
    assert j["peak_rss_mb"] > 100 and ll["peak_rss_mb"] >= 50
    # the plain template renders "user: <question>\nassistant:" for the bundled tokenizer
    assert all(n > 5 for n in j["runs"]["concurrent"]["input_lens"])
    first, second = (c.split() for c in result["commands"]["jaxpaged"])
    flag = first.index("--compilation-cache-dir")
    assert first[flag + 1] == second[flag + 1]       # the warm start reuses the first's cache
    assert not os.path.exists(first[flag + 1])       # a temporary directory, removed
    for argv in (first, second):                     # both servers stopped
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", int(argv[argv.index("--port") + 1])), 1)
    table = result["table"]
    assert table[1]["ratio"] == [pytest.approx(j["runs"]["concurrent"]["output_throughput"]
                                               / ll["runs"]["concurrent"]["output_throughput"])]
    assert table[3]["jaxpaged"] == [j["startup_empty_cache_s"], j["startup_warm_s"]]
    assert result["cpu"] and result["workload"]["num_prompts"] == 4
    assert out_json.with_suffix(".png").exists() == bool(importlib.util.find_spec("matplotlib"))
    starts = [e for e in events(log) if "argv" in e]
    assert len(starts) == 1 and gone(starts[0]["pid"])
