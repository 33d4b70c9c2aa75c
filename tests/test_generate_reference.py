"""End-to-end greedy generation on the bundled real model against its published references."""

import os
import subprocess
import sys

from jaxpaged import SamplingParams
from jaxpaged.sampling_params import RequestOutputKind
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


def test_generate_asks_for_final_outputs_only_and_leaves_the_params_alone(stories_llm):
    # vLLM's LLM submits FINAL_ONLY: the engine returns nothing until a request finishes, and
    # a DELTA params object still gets its whole text back (not only the last delta).
    params = SamplingParams(temperature=0, max_tokens=64, output_kind=RequestOutputKind.DELTA)
    engine, returned, num_steps = stories_llm.engine, [], [0]
    step = engine.step

    def counting_step():
        outs = step()
        returned.extend(outs)
        num_steps[0] += 1
        return outs

    engine.step = counting_step
    try:
        outs = stories_llm.generate([[1]] * 3, params, use_tqdm=False)
    finally:
        engine.step = step
    assert params.output_kind is RequestOutputKind.DELTA
    assert num_steps[0] >= 64 and len(returned) == 3 and all(o.finished for o in returned)
    expected = read_reference_ids("expected_greedy_t0_n256.token_ids.txt")[:64]
    assert [o.outputs[0].token_ids for o in outs] == [expected] * 3
    with open(os.path.join(STORIES_REFERENCE, "expected_greedy_t0_n256.txt")) as f:
        reference = f.read()
    assert len(outs[0].outputs[0].text) > 100 and reference.startswith(outs[0].outputs[0].text)
    assert len({o.outputs[0].text for o in outs}) == 1
