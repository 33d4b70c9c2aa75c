"""Two local processes (coordinator on 127.0.0.1), 2 CPU devices each, one tp=4 engine."""

import os
import subprocess
import sys

from tests.conftest import STORIES_REFERENCE
from tests.helpers.processes import free_port, wait_for_health

PROMPT = "Once upon a time"


def run_job(num_processes: int, tp: int, extra: list[str], timeout: float = 300):
    """Start every process of the job, wait for all (killing them all on a timeout)."""
    port = free_port()
    env = {**os.environ,
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={tp // num_processes}"}
    procs = [subprocess.Popen(
        [sys.executable, "-m", "jaxpaged.cli", "generate", "--tensor-parallel-size", str(tp),
         "--coordinator-address", f"127.0.0.1:{port}", "--num-processes", str(num_processes),
         "--process-id", str(i), *extra, PROMPT],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for i in range(num_processes)]
    try:
        return [(p.wait(timeout=timeout), p.stdout.read(), p.stderr.read()) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_two_processes_tp4_reproduce_the_single_process_output():
    with open(os.path.join(STORIES_REFERENCE,
                           "expected_greedy_prompt_OnceUponATime_n64.txt")) as f:
        expected = f.read()[len(PROMPT):]
    (rc0, out0, err0), (rc1, out1, err1) = run_job(
        2, 4, ["--temperature", "0", "--max-tokens", "60"])
    assert rc0 == 0, err0
    assert rc1 == 0, err1
    assert out0 == expected          # process 0 prints ...
    assert out1 == ""                # ... the others computed the same and stay quiet


def test_tp_not_a_multiple_of_the_processes_is_a_clear_error():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run(
        [sys.executable, "-m", "jaxpaged.cli", "generate", "--tensor-parallel-size", "3",
         "--num-processes", "2", "--process-id", "0", "--coordinator-address",
         "127.0.0.1:1", PROMPT], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2
    assert "tensor_parallel_size=3 must be a multiple of num_processes=2" in proc.stderr


def test_missing_coordinator_is_a_clear_error():
    from jaxpaged.distributed.multihost import MultiHostError, initialize
    import pytest

    with pytest.raises(MultiHostError, match="needs --coordinator-address"):
        initialize(None, 2, 0)
    with pytest.raises(MultiHostError, match=r"--process-id must be in \[0, 2\)"):
        initialize("127.0.0.1:1", 2, 5)


def test_two_process_server_answers_like_one_process():
    """Process 0 serves HTTP; process 1 follows its commands; a greedy completion equals
    LLM.generate on one device, streamed or not; SIGINT to process 0 stops both."""
    import signal

    import httpx

    from jaxpaged import LLM, SamplingParams

    port, http_port = free_port(), free_port()
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    procs = [subprocess.Popen(
        [sys.executable, "-m", "jaxpaged.cli", "serve", "--tensor-parallel-size", "2",
         "--coordinator-address", f"127.0.0.1:{port}", "--num-processes", "2",
         "--process-id", str(i), "--port", str(http_port), "--enforce-eager",
         "--max-num-seqs", "4", "--max-num-batched-tokens", "64"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for i in range(2)]
    try:
        url = f"http://127.0.0.1:{http_port}"
        wait_for_health(url, 200, procs, timeout=240)
        body = {"model": "stories260K", "prompt": PROMPT, "max_tokens": 24, "temperature": 0}
        texts = [httpx.post(url + "/v1/completions", json=body, timeout=120)
                 .json()["choices"][0]["text"] for _ in range(2)]
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True},
                          timeout=120) as r:
            chunks = [line for line in r.iter_lines() if line.startswith("data: {")]
        import json
        streamed = "".join(json.loads(c[6:])["choices"][0]["text"] for c in chunks)
        expected = LLM(enforce_eager=True).generate(
            [PROMPT], SamplingParams(max_tokens=24, temperature=0), use_tqdm=False)[0]
        assert texts == [expected.outputs[0].text] * 2
        assert streamed == expected.outputs[0].text
        procs[0].send_signal(signal.SIGINT)
        assert [p.wait(timeout=60) for p in procs] == [0, 0]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
