"""Logprobs a trainer can trust (issue 44): the sampled tokens' logprobs equal a plain
whole-sequence forward pass within 1e-5 (float32), whatever the batch, prefix-cache hits and
chunked prefill did."""

import numpy as np
import pytest

from jaxpaged import SamplingParams
from tests.helpers.rl import llama_tensors, write_checkpoint
from tests.test_weight_update import make_llm

SHARED = list(range(3, 43))       # 40 tokens: two full 16-token pages are shared


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("w0"), llama_tensors(0))


def forward_logprobs(llm, prompt, output) -> np.ndarray:
    """log softmax of a single whole-sequence prefill's logits at each output token."""
    logits = llm.engine.runner.run_prefill(prompt + output)[0].astype(np.float64)
    rows = logits[len(prompt) - 1:len(prompt) - 1 + len(output)]
    rows = rows - rows.max(axis=1, keepdims=True)
    logp = rows - np.log(np.exp(rows).sum(axis=1, keepdims=True))
    return logp[np.arange(len(output)), output]


#: Largest difference allowed, by dtype: 1e-5 in float32 (issue 44; measured 8.9e-7 on CPU);
#: bfloat16 measured 2.7e-7 here (the logits are float32 in both paths), bound at 1e-3.
TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-3}


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.slow)])
def test_sampled_logprobs_equal_a_plain_forward_pass(model_dir, dtype):
    llm = make_llm(model_dir, enable_prefix_caching=True, max_num_batched_tokens=16,
                   block_size=16, dtype=dtype)
    rng = np.random.default_rng(3)
    prompts = [SHARED + rng.integers(3, 500, size=int(k)).tolist() for k in (1, 7, 20, 33)]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=8, logprobs=0,
                             ignore_eos=True) for i in range(len(prompts))]
    first = llm.generate(prompts, params, use_tqdm=False)         # batched, chunked
    again = llm.generate(prompts[::-1], params[::-1], use_tqdm=False)   # prefix hits
    assert all(o.num_cached_tokens >= 32 for o in again)
    worst = 0.0
    for out, prompt in zip(first + again, prompts + prompts[::-1]):
        ids = out.outputs[0].token_ids
        got = np.array([lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, ids)])
        want = forward_logprobs(llm, prompt, ids)
        worst = max(worst, float(np.abs(got - want).max()))
    assert worst <= TOLERANCE[dtype], worst
    print(f"largest |logprob - forward| in {dtype}: {worst:.2e}")
