"""SmolLM2-135M-Instruct from its GGUF (Q4_1) against transformers' GGUF reference.

The reference (``tests/fixtures/smollm2``, made by ``tests/fixtures/make_smollm2_reference.py``)
is transformers 5 reading the same file: its float32 ``LlamaForCausalLM`` over the dequantized
weights, its tokenizer and chat template. The model is fetched into the test-model cache
(``tests/helpers/test_models.py``) on first use.
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import numpy as np
import openai
import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.arg_utils import EngineArgs
from jaxpaged.server.launcher import ServerThread
from jaxpaged.server.server_args import add_server_args, server_config
from jaxpaged.tokenizer import load_tokenizer
from tests.conftest import FIXTURES
from tests.helpers.test_models import smollm2_gguf
from tests.test_model_logits import full_sequence_logits

REF = os.path.join(FIXTURES, "smollm2")
#: A step whose top-2 logit gap is below this is a near-tie: greedy may go either way there.
NEAR_TIE = 1e-3


@pytest.fixture(scope="module")
def gguf_path() -> str:
    return smollm2_gguf()


@pytest.fixture(scope="module")
def answers() -> list[dict]:
    with open(os.path.join(REF, "answers.json")) as f:
        return json.load(f)["answers"]


def messages(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


def agreeing_prefix(ref: dict) -> list[int]:
    """The reference answer up to and including its first near-tie step (the tokens any
    implementation within float32 rounding of the reference must reproduce)."""
    ties = [i for i, gap in enumerate(ref["top2_gaps"]) if gap < NEAR_TIE]
    return ref["answer_ids"][:ties[0] if ties else len(ref["answer_ids"])]


def test_tokenizer_and_chat_template_from_the_gguf(gguf_path, answers):
    tok = load_tokenizer(gguf_path)
    assert (tok.bos_token_id, tok.eos_token_id, len(tok)) == (1, 2, 49152)
    for ref in answers:
        ids = tok.apply_chat_template(messages(ref["question"]), add_generation_prompt=True,
                                      tokenize=True, return_dict=False)
        assert list(ids) == ref["prompt_ids"]
        assert tok.decode(ref["answer_ids"], skip_special_tokens=True) == ref["text"]


@pytest.mark.parametrize("quantization", [None, "gguf"])
def test_chat_prompt_logits_match_transformers(gguf_path, quantization):
    """Dequantized on load, and packed as stored (the C++ kernel; int8 dot products over
    activations split into 24 bits on CPUs with AVX-512 VNNI, float elsewhere)."""
    ids = np.load(os.path.join(REF, "chat_prompt_ids.npy"))
    keep = np.load(os.path.join(REF, "chat_logit_ids.npy"))
    ref = np.load(os.path.join(REF, "chat_logits.npy"))
    ref_last = np.load(os.path.join(REF, "chat_logits_last.npy"))
    logits = full_sequence_logits(gguf_path, ids, quantization=quantization)
    assert logits.shape == (len(ids), 49152) and ref.shape == (len(ids), len(keep))
    assert np.abs(logits[:, keep] - ref).max() < 1e-3
    assert np.abs(logits[-1] - ref_last).max() < 1e-3


def test_served_packed_weights_take_one_step_argument_per_kind(gguf_path, answers):
    """The engine runs the file packed, each kind of a layer's packed array stacked over the
    30 layers (``jaxpaged.layers.layer_stack``): the decode step takes 27 arrays, not 694,
    holding the same bytes, and answers the first question as transformers does."""
    llm = LLM(model=gguf_path, enforce_eager=True, max_model_len=128, max_num_seqs=8)
    runner = llm.engine.runner
    # 7 projections x 3 and 2 norms stacked; the embedding's 3 arrays and the final norm
    assert len(runner._state_leaves) == 27
    assert round(runner.weight_bytes / 2**20, 1) == 93.8
    ref = answers[0]
    want = agreeing_prefix(ref)[:12]
    (out,) = llm.generate([ref["prompt_ids"]], SamplingParams(temperature=0, max_tokens=12),
                          use_tqdm=False)
    assert list(out.outputs[0].token_ids) == want


@pytest.mark.slow
def test_greedy_chat_answers_match_transformers(gguf_path, answers):
    """With the packed model's default float16 KV pool (``--kv-cache-dtype auto``)."""
    llm = LLM(model=gguf_path, enforce_eager=True, max_model_len=256, max_num_seqs=8)
    assert {a.dtype for a in jax.tree.leaves(llm.engine.runner._kv_caches)} == {np.dtype("float16")}
    outs = llm.chat([messages(a["question"]) for a in answers],
                    SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)
    for out, ref in zip(outs, answers):
        assert list(out.prompt_token_ids) == ref["prompt_ids"]
        got, want = list(out.outputs[0].token_ids), agreeing_prefix(ref)
        assert got[:len(want)] == want, ref["question"]
    # No near-tie in these five: the whole answers and their texts agree.
    assert [o.outputs[0].text for o in outs] == [a["text"] for a in answers]


@pytest.mark.slow
def test_openai_client_chat_streaming_equals_non_streaming(gguf_path, answers):
    parser = add_server_args(EngineArgs.add_cli_args(argparse.ArgumentParser()))
    args = parser.parse_args(["--model", gguf_path, "--max-model-len", "256",
                              "--max-num-seqs", "4"])
    server = ServerThread(EngineArgs.from_cli_args(args, enforce_eager_default=True),
                          server_config(args)).start()
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct.Q4_1.gguf"]
        for ref in answers[:2]:
            body = dict(model="SmolLM2-135M-Instruct.Q4_1.gguf", messages=messages(ref["question"]),
                        temperature=0, max_tokens=40)
            whole = client.chat.completions.create(**body)
            stream = client.chat.completions.create(**body, stream=True)
            streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
            assert whole.choices[0].message.content == streamed == ref["text"]
            assert whole.usage.prompt_tokens == len(ref["prompt_ids"])
    finally:
        server.stop()
