"""The batched sampler's transforms, and seeds independent of the batch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged import SamplingParams
from jaxpaged.sampling.sampler import SamplingMetadata, sample

sample_jit = jax.jit(sample)


def run(logits, rows):
    meta = SamplingMetadata.from_host(rows, len(rows))
    return np.asarray(sample_jit(jnp.asarray(logits, jnp.float32), meta).token_ids)


def row(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, pos=0):
    return (temperature, top_k, top_p, min_p, temperature < 1e-5, seed, pos)


LOGITS = np.log(np.array([0.05, 0.4, 0.3, 0.15, 0.1]))


def draws(n, **kw):
    return run(np.tile(LOGITS, (n, 1)), [row(seed=i, **kw) for i in range(n)])


def test_greedy_is_argmax():
    logits = np.random.default_rng(0).normal(size=(6, 50))
    assert run(logits, [row(temperature=0)] * 6).tolist() == logits.argmax(-1).tolist()


def test_top_k_keeps_only_the_k_best():
    assert set(draws(400, top_k=2)) == {1, 2}
    assert set(draws(400, top_k=1)) == {1}


def test_top_p_keeps_the_smallest_set_reaching_p():
    # sorted probs .4 .3 .15 .1 .05: p=0.6 needs {1, 2}; p=0.75 needs {1, 2, 3}
    assert set(draws(400, top_p=0.6)) == {1, 2}
    assert set(draws(600, top_p=0.75)) == {1, 2, 3}
    assert set(draws(400, top_p=0.3)) == {1}


def test_min_p_drops_tokens_below_fraction_of_max():
    # p_max = 0.4: min_p 0.5 keeps p >= 0.2 -> {1, 2}
    assert set(draws(400, min_p=0.5)) == {1, 2}


def test_temperature_sharpens_and_flattens():
    cold = np.bincount(draws(2000, temperature=0.3), minlength=5) / 2000
    hot = np.bincount(draws(2000, temperature=1.0), minlength=5) / 2000
    assert cold[1] > 0.6 and abs(hot[1] - 0.4) < 0.05 and abs(hot[0] - 0.05) < 0.02


def test_same_seed_and_position_same_token_whatever_the_batch():
    rng = np.random.default_rng(1)
    target = rng.normal(size=100)
    alone = run(target[None], [row(seed=1234, pos=17)])[0]
    others = rng.normal(size=(7, 100))
    batch = np.concatenate([others[:3], target[None], others[3:]])
    rows = [row(seed=s, pos=5) for s in range(3)] + [row(seed=1234, pos=17)] + \
           [row(temperature=0)] * 4
    assert run(batch, rows)[3] == alone
    # a different position or seed gives an independent draw (not always the same token)
    assert len({run(target[None], [row(seed=1234, pos=p)])[0] for p in range(30)}) > 5


def test_seeded_requests_reproducible_through_the_engine(stories_llm):
    params = SamplingParams(temperature=1.0, top_k=50, seed=99, max_tokens=24, ignore_eos=True)
    alone = stories_llm.generate(["Once upon a time"], params, use_tqdm=False)[0]
    mixed = stories_llm.generate(
        ["The dog", "Once upon a time", "Lily went to"],
        [SamplingParams(temperature=0.7, max_tokens=30), params, SamplingParams(temperature=0)],
        use_tqdm=False)[1]
    assert mixed.outputs[0].token_ids == alone.outputs[0].token_ids
    other_seed = stories_llm.generate(
        ["Once upon a time"],
        SamplingParams(temperature=1.0, top_k=50, seed=100, max_tokens=24, ignore_eos=True),
        use_tqdm=False)[0]
    assert other_seed.outputs[0].token_ids != alone.outputs[0].token_ids


@pytest.mark.parametrize("seed", [0, 2**40 + 3, -5])
def test_large_and_negative_seeds_accepted(seed):
    assert run(LOGITS[None], [row(seed=seed)])[0] in range(5)


def test_seeded_outputs_alone_in_a_mixed_batch_of_32_and_under_preemption():
    from jaxpaged import LLM
    from tests.test_continuous_batching import random_prompts

    seeded = [SamplingParams(temperature=0.9, top_p=0.95, seed=s, max_tokens=24, ignore_eos=True,
                             presence_penalty=0.5, repetition_penalty=1.2) for s in range(4)]
    targets = ["Once upon a time", "Lily and Tom", [1, 300, 301], "The sun"]
    big = LLM(enforce_eager=True, max_num_seqs=40, max_model_len=128, block_size=8)
    alone = [big.generate([t], p, use_tqdm=False)[0].outputs[0].token_ids
             for t, p in zip(targets, seeded)]
    others = random_prompts(28, 512, seed=9, max_len=60)
    mixed = targets + others
    params = seeded + [SamplingParams(temperature=0.7, top_k=40, max_tokens=30)] * 28
    order = np.random.default_rng(2).permutation(32)
    outs = big.generate([mixed[i] for i in order], [params[i] for i in order], use_tqdm=False)
    by_index = {int(i): o for i, o in zip(order, outs)}
    assert [by_index[i].outputs[0].token_ids for i in range(4)] == alone
    small = LLM(enforce_eager=True, max_num_seqs=40, max_model_len=128, block_size=8,
                num_gpu_blocks_override=30)
    outs = small.generate(mixed, params, use_tqdm=False)
    assert small.engine.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs[:4]] == alone


@pytest.mark.parametrize("case", ["ties", "nan", "neg_inf", "random"])
def test_argmax_first_matches_jnp_argmax(case):
    from jaxpaged.sampling.sampler import argmax_first
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(8, 1000)).astype(np.float32)
    if case == "ties":          # the largest value at two places: the first one wins
        logits[:, 7] = logits[:, 900] = 10.0
        logits[3, 2] = 10.0
    elif case == "nan":         # NaN counts as the largest, first NaN wins
        logits[0, 500] = logits[0, 20] = np.nan
        logits[5, 999] = np.nan
    elif case == "neg_inf":     # every logit banned
        logits[2] = -np.inf
    got = np.asarray(jax.jit(argmax_first)(jnp.asarray(logits)))
    want = np.asarray(jnp.argmax(jnp.asarray(logits), axis=-1))
    assert got.dtype == np.int32
    assert got.tolist() == want.tolist()
    if case == "ties":
        assert got[3] == 2 and got[0] == 7
    if case == "nan":
        assert got[0] == 20 and got[5] == 999
    if case == "neg_inf":
        assert got[2] == 0
