"""The model runner: KV pool sizing, in-place (donated) pool updates, bounded compilation."""

import jax.numpy as jnp
import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.layers.attention import kv_bytes_per_page
from jaxpaged.runner.buckets import bucket_sizes, pick_bucket


def test_bucket_sizes():
    assert bucket_sizes(16, 2048) == [16, 32, 64, 128, 256, 512, 1024, 2048]
    assert bucket_sizes(8, 12) == [8, 12]
    assert pick_bucket([8, 12], 9) == 12 and pick_bucket([8, 12], 8) == 8


def test_kv_cache_memory_bytes_sets_the_page_count():
    # stories260K: 5 layers * 2 (K, V) * 16 tokens * 4 KV heads * 8 dims * 4 bytes
    per_page = kv_bytes_per_page(5, 16, 4, 8, jnp.float32)
    assert per_page == 20480
    llm = LLM(enforce_eager=True, kv_cache_memory_bytes=100 * per_page + 7, max_model_len=256)
    kv = llm.engine.kv_cache_manager
    assert kv.num_pages == 100 and kv.num_usable_pages == 99
    k_pages, _ = llm.engine.runner._kv_caches[0]
    assert k_pages.shape == (100, 16, 4, 8)


def test_pool_is_donated_and_compilations_are_bounded():
    llm = LLM(enforce_eager=True, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128,
              enable_prefix_caching=False)
    runner = llm.engine.runner
    before = runner._kv_caches[0][0]
    llm.generate([[1, 5, 6]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert before.is_deleted()  # the step consumed the old buffer: updated in place
    prompts = [[1] + [7 + i] * (3 + 9 * i) for i in range(8)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                 use_tqdm=False)
    compiled = runner.num_compilations
    # T in {16, 64} (the bundled model's ladder skips 32), B in {8}, P 8, decode-only or
    # not: at most 4 forward shapes, and the sampler of rows 8.
    assert compiled <= 5
    llm.generate(prompts[::-1], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                 use_tqdm=False)
    assert compiled <= runner.num_compilations <= 5  # new mixes reuse the same few buckets


def test_precompile_then_a_w1_like_run_compiles_nothing():
    """W1's length mix (prompts uniform in [32, 256], 128 greedy tokens, EOS ignored) scaled
    by 1/4 to the bundled model: after the start-up precompile, no step shape is new."""
    import numpy as np

    llm = LLM(max_num_seqs=16, max_num_batched_tokens=128, max_model_len=128, block_size=16)
    runner = llm.engine.runner
    assert llm.engine.wait_until_compiled()     # (LLM() compiles them in the background)
    # forward: decode B {8, 16}, mixed T {16, 128} (the bundled model is small enough for
    # the ladder to skip 32 and 64), P 8 (the xla backend's one bucket); the sampler: rows
    # {8, 16}
    assert runner.num_compilations == 6
    rng = np.random.default_rng(0)
    prompts = [[1] + rng.integers(3, 512, size=int(n) - 1).tolist()
               for n in rng.integers(8, 65, size=24)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
                        use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 32 for o in outs)
    assert llm.engine.stats().num_compilations == 6


def test_plain_greedy_steps_take_the_forwards_tokens_which_are_the_samplers():
    """A step of greedy rows without logprobs, adjustments or grammar takes the forward
    program's argmax tokens and runs no sampler; those tokens are ``sample``'s (the C++
    argmax of the real rows on the CPU, XLA's elsewhere); any of those features selects
    ``sample``."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxpaged.runner.dummy_step import dummy_layout
    from jaxpaged.runner.step_programs import greedy_step_rows, is_plain_greedy, sample_inputs
    from jaxpaged.sampling.logits_adjust import LogitsAdjustment

    runner = LLM(max_num_seqs=16, max_num_batched_tokens=128, max_model_len=128,
                 block_size=16).engine.runner
    layout = dummy_layout(8, 8, runner._page_buckets[-1], True)
    inputs = runner._dummy_inputs(layout)
    free = runner._free_bitmask(8)
    assert not is_plain_greedy(inputs, free)    # a host mask: the start-up runs `sample`
    inputs = dataclasses.replace(inputs, token_bitmask=free, num_rows=np.asarray(8, np.int32))
    assert is_plain_greedy(inputs, free)
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(8, 512)), jnp.float32)
    logits = logits.at[3, 7].set(logits[3].max()).at[3, 9].set(logits[3].max())  # a tie
    prev = jnp.full(16, -1, jnp.int32)
    info = jax.ShapeDtypeStruct(logits.shape, logits.dtype)
    sample = runner._sampler_for(info, inputs)
    full_out, full_prev = sample(logits, sample_inputs(inputs), prev)
    for cpu_argmax in (False, True):
        ids, greedy_prev = jax.jit(greedy_step_rows, static_argnums=3)(
            logits, np.int32(8), prev, cpu_argmax)
        np.testing.assert_array_equal(ids, full_out.token_ids)
        np.testing.assert_array_equal(greedy_prev, full_prev)
        assert int(ids[3]) == 7

    sampled = []
    runner._sampler_for = lambda *a, **k: lambda *args: sampled.append(1) or sample(*args)
    greedy_out, _, _ = runner._launch(layout, inputs)
    assert sampled == [] and greedy_out.logprobs is None
    ids = np.array(inputs.adjust.ids)
    ids[0, 0] = 5                                   # one logit bias entry
    for other in (dataclasses.replace(inputs, with_logprobs=np.asarray(True)),
                  dataclasses.replace(inputs, adjust=LogitsAdjustment(
                      ids, *dataclasses.astuple(inputs.adjust)[1:])),
                  dataclasses.replace(inputs, token_bitmask=np.array(inputs.token_bitmask)),
                  dataclasses.replace(inputs, sampling=dataclasses.replace(
                      inputs.sampling, greedy=np.arange(8) != 2))):
        assert not is_plain_greedy(other, free)
    out, _, _ = runner._launch(layout, dataclasses.replace(inputs, with_logprobs=np.asarray(True)))
    assert sampled == [1] and out.logprobs is not None
    # the same dummy step, its rows greedy: the sampler's tokens are the forward's
    np.testing.assert_array_equal(out.token_ids, greedy_out.token_ids)


@pytest.mark.slow
def test_kv_memory_report_meets_its_targets(tmp_path):
    """Nightly: the KV memory report's non-timing figures (waste, concurrency)."""
    from jaxpaged.benchmarks import kv_memory

    mem = kv_memory.memory_report(str(tmp_path), budget_requests=8)
    assert mem["internal_waste_mean"] <= 0.04
    assert mem["concurrency_ratio"] >= 3
