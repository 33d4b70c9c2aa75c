"""End-to-end greedy generation on the bundled real model against its published references."""

import os
import subprocess
import sys

from jaxpaged import SamplingParams
from tests.conftest import STORIES_REFERENCE, read_reference_ids


def test_cli_generate_once_upon_a_time():
    with open(os.path.join(STORIES_REFERENCE, "expected_greedy_prompt_OnceUponATime_n64.txt")) as f:
        expected = f.read()
    prompt = "Once upon a time"
    assert expected.startswith(prompt)
    proc = subprocess.run(
        [sys.executable, "-m", "jaxpaged.cli", "generate", "--temperature", "0",
         "--max-tokens", "60", prompt],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    # The file holds the prompt, the 60 generated tokens' text and a final newline; the CLI
    # prints the generated text followed by a newline.
    assert proc.stdout == expected[len(prompt):]


def test_greedy_from_bos_256_tokens(stories_llm):
    out = stories_llm.generate([[1]], SamplingParams(temperature=0, max_tokens=256),
                               use_tqdm=False)[0]
    assert out.outputs[0].token_ids == read_reference_ids("expected_greedy_t0_n256.token_ids.txt")
    assert out.outputs[0].finish_reason == "length"
    with open(os.path.join(STORIES_REFERENCE, "expected_greedy_t0_n256.txt")) as f:
        assert out.outputs[0].text == f.read().rstrip("\n")


def test_cli_rejects_bad_sampling_value():
    proc = subprocess.run([sys.executable, "-m", "jaxpaged.cli", "generate", "--top-p", "0", "hi"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2
    assert "top_p" in proc.stderr
