"""Continuous batching: batched outputs equal solo outputs; requests join between steps."""

import os

import numpy as np

from jaxpaged import LLM, SamplingParams
from jaxpaged.arg_utils import DEFAULT_MODEL
from tests.conftest import FIXTURES

GREEDY_32 = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


def random_prompts(n: int, vocab: int, seed: int = 0, max_len: int = 120) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[1] + rng.integers(3, vocab, size=int(k)).tolist()
            for k in rng.integers(0, max_len, size=n)]


def test_32_prompts_batched_equal_solo(stories_llm):
    prompts = random_prompts(32, 512)
    assert len({len(p) for p in prompts}) > 20
    batched = stories_llm.generate(prompts, GREEDY_32, use_tqdm=False)
    for prompt, out in zip(prompts, batched):
        solo = stories_llm.generate([prompt], GREEDY_32, use_tqdm=False)[0]
        assert out.prompt_token_ids == prompt
        assert out.outputs[0].token_ids == solo.outputs[0].token_ids
        assert len(out.outputs[0].token_ids) == 32


def test_outputs_keep_input_order_with_text_prompts(stories_llm):
    prompts = ["Lily", "Once upon a time there was a big dog", "The sun"]
    outs = stories_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5),
                                use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    tok = stories_llm.get_tokenizer()
    assert [o.prompt_token_ids for o in outs] == [tok.encode(p) for p in prompts]


def test_requests_added_between_steps(stories_llm):
    engine = stories_llm.engine
    prompts = random_prompts(6, 512, seed=1)
    expected = [o.outputs[0].token_ids for o in
                stories_llm.generate(prompts, GREEDY_32, use_tqdm=False)]
    finished = {}
    added = 0
    steps = 0
    while added < len(prompts) or engine.has_unfinished_requests():
        if added < len(prompts) and steps % 3 == 0:  # a new request every third step
            engine.add_request(f"late-{added}", prompts[added], GREEDY_32)
            added += 1
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
        steps += 1
    assert [finished[f"late-{i}"] for i in range(len(prompts))] == expected
    assert engine.kv_cache_manager.num_free_pages == engine.kv_cache_manager.num_usable_pages


def test_chunked_prefill_matches_whole_prefill():
    prompts = random_prompts(4, 512, seed=2, max_len=200)
    whole = LLM(enforce_eager=True, max_num_batched_tokens=512, max_num_seqs=8).generate(prompts, GREEDY_32,
                                                                      use_tqdm=False)
    chunked = LLM(enforce_eager=True, max_num_batched_tokens=32, max_num_seqs=8).generate(prompts, GREEDY_32,
                                                                      use_tqdm=False)
    capped = LLM(enforce_eager=True, max_num_batched_tokens=64, max_num_seqs=8,
                 long_prefill_token_threshold=24, max_num_partial_prefills=2).generate(
        prompts, GREEDY_32, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in whole] == [o.outputs[0].token_ids for o in chunked]
    assert [o.outputs[0].token_ids for o in whole] == [o.outputs[0].token_ids for o in capped]


def test_transformers_greedy_tokens_through_engine():
    """32 greedy steps of the GQA fixture equal transformers' argmax loop."""
    d = os.path.join(FIXTURES, "llama_gqa_untied")
    llm = LLM(enforce_eager=True, model=d, tokenizer=DEFAULT_MODEL, max_num_seqs=8, block_size=8)
    prompt = np.load(os.path.join(d, "greedy_prompt.npy")).tolist()
    expected = np.load(os.path.join(d, "greedy_tokens.npy")).tolist()
    out = llm.generate([prompt], GREEDY_32, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == expected
