"""The tunix rollout sampler (issue 44): tunix's contract over a tiny random Llama; the
check against the google-tunix package itself is skipped where it is not installed."""

import numpy as np
import pytest
from flax import nnx

from jaxpaged import SamplingParams
from jaxpaged.integrations import tunix as adapter
from tests.helpers.rl import llama_tensors, write_checkpoint
from tests.test_weight_update import make_llm

PROMPTS = ["Once upon a time", "The cat sat"]


@pytest.fixture(scope="module")
def sampler(tmp_path_factory):
    llm = make_llm(write_checkpoint(tmp_path_factory.mktemp("w0"), llama_tensors(0)))
    return adapter.JaxpagedSampler(llm)


def test_call_matches_the_engine_and_pads_as_tunix(sampler):
    out = sampler(PROMPTS, max_generation_steps=6, echo=False, pad_output=True)
    ids = [sampler.tokenize(p) for p in PROMPTS]
    want = sampler.llm.generate(ids, SamplingParams(temperature=0, max_tokens=6),
                                use_tqdm=False)
    assert [t.tolist()[:len(w.outputs[0].token_ids)] for t, w in zip(out.tokens, want)] == \
        [w.outputs[0].token_ids for w in want]
    assert out.text == [w.outputs[0].text for w in want]
    assert all(t.dtype == np.int32 and len(t) == 6 for t in out.tokens)
    width = 1 << (max(map(len, ids)) - 1).bit_length()
    assert out.padded_prompt_tokens.shape == (2, width)
    assert out.padded_prompt_tokens[0, width - len(ids[0]):].tolist() == ids[0]
    assert all(lp.shape == (6,) and (lp <= 0).all() for lp in out.logprobs)
    assert out.logits is None
    echoed = sampler(PROMPTS[0], 4, echo=True)
    assert echoed.tokens[0][:len(ids[0])].tolist() == ids[0]
    several = sampler(PROMPTS, 4, temperature=1.0, seed=[1, 2], multi_sampling=3)
    assert len(several.text) == 6
    with pytest.raises(NotImplementedError, match="beam"):
        sampler(PROMPTS, 4, beam_size=2)
    with pytest.raises(ValueError, match="seed"):
        sampler(PROMPTS, 4, seed=[1])


def test_update_params_and_cache_controls(sampler):
    before = sampler(PROMPTS, 6).tokens
    version = sampler.weight_version
    assert sampler.update_params(llama_tensors(1)) == version + 1
    changed = sampler(PROMPTS, 6).tokens
    assert [t.tolist() for t in changed] != [t.tolist() for t in before]
    state = sampler.transformer_state
    sampler.delete_cache()
    assert sampler.llm.is_sleeping()
    sampler.reinitialize_cache()
    assert [t.tolist() for t in sampler(PROMPTS, 6).tokens] == [t.tolist() for t in changed]
    sampler.update_params(llama_tensors(0))
    assert [t.tolist() for t in sampler(PROMPTS, 6).tokens] == [t.tolist() for t in before]
    assert isinstance(sampler.transformer, nnx.Module)
    assert {str(p) for p, _ in nnx.to_flat_state(state)} >= {
        str(p) for p, _ in nnx.to_flat_state(nnx.state(sampler.transformer, nnx.Param))}


@pytest.mark.skipif(not adapter.HAVE_TUNIX,
                    reason="google-tunix is not installed (pip install 'jaxpaged[tunix]')")
def test_is_a_tunix_sampler(sampler):
    from tunix.generate.base_sampler import BaseSampler, SamplerOutput

    assert isinstance(sampler, BaseSampler)
    assert isinstance(sampler(PROMPTS, 3), SamplerOutput)
