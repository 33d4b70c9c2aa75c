"""Multi-host jobs of local processes (coordinator on 127.0.0.1): the same output as one
process, clear errors for inconsistent launches, and clean endings when any process is
stopped or killed. Every subprocess has a timeout and is killed at the end."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from jaxpaged.distributed.multihost import MultiHostError, initialize
from tests.conftest import STORIES_REFERENCE
from tests.helpers.processes import free_port, wait_for_health, wait_for_text

PROMPT = "Once upon a time"


class Job:
    """``num_processes`` local processes of one ``jaxpaged`` job, stdout and stderr in files
    under ``tmp_path``. ``extra[i]`` are process i's own flags."""

    def __init__(self, tmp_path, command: str, tp: int, extra: list[list[str]],
                 env: dict | None = None, num_processes: int | None = None):
        n = num_processes or len(extra)
        self.port = free_port()
        env = {**os.environ, **(env or {}),
               "XLA_FLAGS": f"--xla_force_host_platform_device_count={tp // n}"}
        tmp_path.mkdir()
        self.out = [tmp_path / f"out{i}.txt" for i in range(len(extra))]
        self.err = [tmp_path / f"err{i}.txt" for i in range(len(extra))]
        self.procs = []
        for i in range(len(extra)):
            with open(self.out[i], "w") as out, open(self.err[i], "w") as err:
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-m", "jaxpaged.cli", command, "--tensor-parallel-size",
                     str(tp), "--coordinator-address", f"127.0.0.1:{self.port}",
                     "--num-processes", str(n), *extra[i]],
                    stdout=out, stderr=err, env=env))

    def wait(self, timeout: float = 300) -> list[int]:
        return [p.wait(timeout=timeout) for p in self.procs]

    def stdout(self, i: int) -> str:
        return self.out[i].read_text()

    def stderr(self, i: int) -> str:
        return self.err[i].read_text()

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.fixture
def job(tmp_path):
    """``job(command, tp, extra, env)`` starts a :class:`Job`; all are killed at the end."""
    jobs = []

    def start(command, tp, extra, env=None, num_processes=None):
        jobs.append(Job(tmp_path / str(len(jobs)), command, tp, extra, env, num_processes))
        return jobs[-1]

    yield start
    for j in jobs:
        j.kill()


def generate_flags(*args: str) -> list[list[str]]:
    return [["--process-id", str(i), *args] for i in range(2)]


def test_two_processes_tp4_reproduce_the_single_process_output(job):
    with open(os.path.join(STORIES_REFERENCE,
                           "expected_greedy_prompt_OnceUponATime_n64.txt")) as f:
        expected = f.read()[len(PROMPT):]
    j = job("generate", 4, generate_flags("--temperature", "0", "--max-tokens", "60", PROMPT))
    assert j.wait() == [0, 0], j.stderr(0) + j.stderr(1)
    assert j.stdout(0) == expected          # process 0 prints ...
    assert j.stdout(1) == ""                # ... the others computed the same and stay quiet


def test_processes_given_different_settings_or_prompts_all_refuse(job):
    settings = job("generate", 2, [["--process-id", "0", "--max-num-seqs", "8", PROMPT],
                                   ["--process-id", "1", PROMPT]])
    prompts = job("generate", 2, [["--process-id", "0", PROMPT], ["--process-id", "1", "Hi"]])
    assert settings.wait(120) == [2, 2]
    assert prompts.wait(120) == [2, 2]
    for i in range(2):
        assert ("the processes of the job were given different engine settings: "
                "--max-num-seqs is 256 on process 1 but 8 on process 0") in settings.stderr(i)
        assert ("given different inputs: the prompt list is not the same on process 0 and "
                "process 1" in prompts.stderr(i))


@pytest.mark.parametrize("command, process, sig, status", [
    ("generate", 1, signal.SIGINT, 130),
    ("serve", 0, signal.SIGTERM, 0),
])
def test_a_process_stopped_while_waiting_for_its_peers_leaves_at_once(job, command, process,
                                                                        sig, status):
    own = ["-v", PROMPT] if command == "generate" else ["--enforce-eager", "--port",
                                                        str(free_port())]
    lone = job(command, 2, [["--process-id", str(process), *own]], num_processes=2)
    wait_for_text(lone.err[0], "waiting up to 60 s for the job to form", lone.procs, timeout=120)
    lone.procs[0].send_signal(sig)
    assert lone.wait(20) == [status]
    assert ("while waiting for the other processes" if command == "generate" else
            "stopping before the other processes joined") in lone.stderr(0)


def test_a_process_whose_peers_never_come_says_so_in_one_line(job):
    lone = job("generate", 2, [["--process-id", "1", PROMPT]],
               env={"JAXPAGED_MULTIHOST_TIMEOUT_S": "3"}, num_processes=2)
    assert lone.wait(60) == [1]
    assert lone.stderr(0).strip().splitlines()[-1] == (
        f"jaxpaged: error: process 1 of 2 could not form the job within 3 s (waiting for "
        f"process 0 at 127.0.0.1:{lone.port}); start every process with the same "
        "--coordinator-address and --num-processes and its own --process-id in 0..1")


@pytest.mark.parametrize("target, sig, expected", [
    (1, signal.SIGTERM, [143, 143]),    # every process stops at the same step
    (1, signal.SIGKILL, [1, -9]),       # process 0 sees the broken collective at once
])
def test_generate_ends_on_every_process_when_one_is_stopped_or_killed(job, target, sig, expected):
    j = job("generate", 2, generate_flags("--max-tokens", "400", "--ignore-eos",
                                          *[PROMPT] * 8))
    for err in j.err:    # past the first collective: Gloo has connected the two processes
        wait_for_text(err, "is connected to 1 peer ranks", j.procs, timeout=120)
    j.procs[target].send_signal(sig)
    codes = j.wait(60)
    assert j.stdout(0) == ""
    if sig == signal.SIGTERM:
        assert codes == expected
        for i in range(2):
            assert "jaxpaged: process 1 received SIGTERM; the job is stopping" in j.stderr(i)
    elif codes[0] == -signal.SIGABRT:
        # Killed while process 0 still waited at the barrier before the first step (the start
        # is fast with few step shapes): XLA's coordination agent aborts it on the missing
        # heartbeat, at once too.
        assert codes[1] == -9 and "Task 1 heartbeat timeout" in j.stderr(0)
    else:
        assert codes == expected
        assert j.stderr(0).strip().splitlines()[-1].startswith(
            "jaxpaged: error: the multi-host job failed: ")


def test_initialize_refuses_inconsistent_flags(monkeypatch):
    with pytest.raises(MultiHostError, match="needs --coordinator-address"):
        initialize(None, 2, 0)
    with pytest.raises(MultiHostError, match=r"--process-id must be in \[0, 2\)"):
        initialize("127.0.0.1:1", 2, 5)
    with pytest.raises(MultiHostError, match="--process-id is required with --num-processes 2"):
        initialize("127.0.0.1:1", 2, None)
    for address in ("127.0.0.1", "127.0.0.1:0", "127.0.0.1:http", ":1234"):
        with pytest.raises(MultiHostError, match="must be HOST:PORT"):
            initialize(address, 2, 1)
    with pytest.raises(MultiHostError, match="'no-such-host.invalid' does not resolve"):
        initialize("no-such-host.invalid:1234", 2, 1)
    with pytest.raises(MultiHostError, match="need --num-processes > 1"):
        initialize("127.0.0.1:1234", 1, None)
    with pytest.raises(MultiHostError, match="need --num-processes > 1"):
        initialize(None, 1, 1)
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        with pytest.raises(MultiHostError, match="cannot listen on --coordinator-address port"):
            initialize(f"127.0.0.1:{busy.getsockname()[1]}", 2, 0)
    monkeypatch.setenv("JAXPAGED_MULTIHOST_TIMEOUT_S", "soon")
    with pytest.raises(MultiHostError, match="JAXPAGED_MULTIHOST_TIMEOUT_S must be a positive"):
        initialize("127.0.0.1:1234", 2, 1)


def test_tp_not_a_multiple_of_the_processes_is_a_clear_error():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run(
        [sys.executable, "-m", "jaxpaged.cli", "generate", "--tensor-parallel-size", "3",
         "--num-processes", "2", "--process-id", "0", "--coordinator-address",
         "127.0.0.1:1", PROMPT], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2
    assert proc.stderr == ("jaxpaged: error: --tensor-parallel-size=3 must be a multiple of "
                           "--num-processes=2 (every process holds the same number of "
                           "devices)\n")


#: Two-process ``serve`` jobs: on the 2-core AMD EPYC (Zen 4) VMs of 2026-12-06 both processes
#: wait forever in the warm-up step's first cross-process collective (Gloo never reports its
#: peers connected; py-spy: both engines in ``multihost.to_host``), at 98edeb5 as well as now,
#: while the same job as ``jaxpaged generate`` (tp 2 and tp 4) passes. Until that is found
#: they run with the nightly target (``-m slow``), not in the default suite.
SERVE_JOB = pytest.mark.slow


def serve_job(job, http_port: int):
    return job("serve", 2, [["--process-id", str(i), "--port", str(http_port), "--enforce-eager",
                             "--max-num-seqs", "4", "--max-num-batched-tokens", "64"]
                            for i in range(2)])


def stream_events(url: str, body: dict, events: list[str] | None = None) -> list[str]:
    """The ``data:`` payloads of a streamed completion, appended to ``events`` as they come."""
    events = [] if events is None else events
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True},
                      timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    return events


@SERVE_JOB
def test_two_process_server_answers_like_one_process(job):
    """Process 0 serves HTTP; process 1 follows its commands; a greedy completion equals
    LLM.generate on one device, streamed or not; SIGINT to process 0 stops both."""
    from jaxpaged import LLM, SamplingParams

    http_port = free_port()
    j = serve_job(job, http_port)
    url = f"http://127.0.0.1:{http_port}"
    wait_for_health(url, 200, j.procs, timeout=240)
    body = {"model": "stories260K", "prompt": PROMPT, "max_tokens": 24, "temperature": 0}
    texts = [httpx.post(url + "/v1/completions", json=body, timeout=120)
             .json()["choices"][0]["text"] for _ in range(2)]
    streamed = "".join(json.loads(e)["choices"][0]["text"]
                       for e in stream_events(url, body) if e.startswith("{"))
    expected = LLM(enforce_eager=True).generate(
        [PROMPT], SamplingParams(max_tokens=24, temperature=0), use_tqdm=False)[0]
    assert texts == [expected.outputs[0].text] * 2
    assert streamed == expected.outputs[0].text
    j.procs[0].send_signal(signal.SIGINT)
    assert j.wait(60) == [0, 0]


@SERVE_JOB
@pytest.mark.parametrize("sig, expected, message", [
    (signal.SIGTERM, [0, 0], "the server is shutting down"),
    (signal.SIGKILL, [1, -9], "the engine failed"),
])
def test_server_stops_when_the_other_process_is_stopped_or_killed(job, sig, expected, message):
    """A stream in flight ends with an error event and [DONE]; process 0 exits (0 after a
    stop signal, 1 with a one-line reason after a killed peer)."""
    http_port = free_port()
    j = serve_job(job, http_port)
    url = f"http://127.0.0.1:{http_port}"
    wait_for_health(url, 200, j.procs, timeout=240)
    events = []
    body = {"model": "stories260K", "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True,
            "temperature": 0}
    client = threading.Thread(target=stream_events, args=(url, body, events))
    client.start()
    while not events:                                  # the request is running
        assert client.is_alive()
        time.sleep(0.05)
    j.procs[1].send_signal(sig)
    assert j.wait(60) == expected
    client.join(30)
    assert events[-1] == "[DONE]"
    assert message in json.loads(events[-2])["error"]["message"]
    if sig == signal.SIGKILL:
        assert j.stderr(0).strip().splitlines()[-1].startswith(
            "jaxpaged: error: the multi-host job failed: ")


@SERVE_JOB
@pytest.mark.parametrize("target", [0, 1])
def test_a_stop_while_the_server_starts_stops_every_process(job, target):
    """SIGTERM during the precompile: every process cuts it short, meets at the first step,
    and exits 0 (none is left alone with a vanished coordinator)."""
    j = job("serve", 2, [["--process-id", str(i), "--port", str(free_port()),
                          "--max-num-seqs", "8"] for i in range(2)])
    wait_for_text(j.err[target], "INFO jaxpaged.runner.worker: KV cache:", j.procs, timeout=120)
    j.procs[target].send_signal(signal.SIGTERM)
    assert j.wait(120) == [0, 0], j.stderr(0) + j.stderr(1)
    assert "process 0 stopped the job" in j.stderr(1) if target == 0 else \
        "process 1 received SIGTERM; the job is stopping" in j.stderr(0)
