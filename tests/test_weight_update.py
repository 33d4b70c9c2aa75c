"""In-place weight updates (issue 44): after ``update_weights(W)`` an engine's greedy tokens
and logits equal a fresh ``LLM`` loaded from W; nothing compiles during the update."""

import jax
import numpy as np
import pytest

from jaxpaged import GenerationPausedError, LLM, SamplingParams, WeightUpdateError
from tests.conftest import STORIES
from tests.helpers.rl import backend_compiles, llama_tensors, write_checkpoint
from tests.test_continuous_batching import random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PROMPTS = random_prompts(4, 512, seed=5, max_len=30)
PROBE = PROMPTS[0] + [7, 9, 11]


def make_llm(model, **kw):
    return LLM(model=model, tokenizer=STORIES, **{
        "enforce_eager": True, "max_num_seqs": 8, "max_num_batched_tokens": 64, **kw})


def greedy(llm):
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], {o.weight_version for o in outs}


def logits(llm):
    return llm.engine.runner.run_prefill(PROBE)[0]


@pytest.fixture(scope="module")
def w0():
    return llama_tensors(0)


@pytest.fixture(scope="module")
def w1():
    return llama_tensors(1)


@pytest.fixture(scope="module")
def dir1(tmp_path_factory, w1):
    return write_checkpoint(tmp_path_factory.mktemp("w1"), w1)


@pytest.fixture(scope="module")
def fresh1(dir1):
    llm = make_llm(dir1)
    return llm, greedy(llm)[0], logits(llm)


def updated(llm, weights):
    """``llm`` after ``update_weights(weights)``, counting compilations during the update."""
    greedy(llm)                   # every step shape of the comparison compiled before
    steps, jax_compiles = llm.engine.stats().num_compilations, backend_compiles()
    version = llm.update_weights(weights)
    assert backend_compiles() == jax_compiles
    assert llm.engine.stats().num_compilations == steps
    return version


def test_full_update_equals_fresh_llm(tmp_path, w0, w1, fresh1):
    llm = make_llm(write_checkpoint(tmp_path / "w0", w0))
    before = greedy(llm)[0]
    fresh_ids, fresh_logits = fresh1[1], fresh1[2]
    assert before != fresh_ids
    mine = {name: np.array(value) for name, value in w1.items()}    # the trainer's buffers
    assert updated(llm, mine) == 1
    for name, value in mine.items():      # written into afterwards: the engine holds a copy
        value[...] = w0[name]
    ids, versions = greedy(llm)
    assert ids == fresh_ids and versions == {1}
    np.testing.assert_array_equal(logits(llm), fresh_logits)


def test_partial_update_changes_only_named_tensors(tmp_path, w0, w1):
    llm = make_llm(write_checkpoint(tmp_path / "w0", w0))
    part = {n: w1[n] for n in w1 if ".layers.1." in n or n == "lm_head.weight"}
    merged = {**w0, **part}
    fresh = make_llm(write_checkpoint(tmp_path / "merged", merged))
    assert updated(llm, part) == 1
    assert greedy(llm)[0] == greedy(fresh)[0]
    np.testing.assert_array_equal(logits(llm), logits(fresh))


def test_nnx_state_directory_and_jax_arrays(tmp_path, w0, dir1, fresh1):
    llm = make_llm(write_checkpoint(tmp_path / "w0", w0))
    assert updated(llm, fresh1[0].engine.runner.state[1]) == 1      # an NNX state
    assert greedy(llm)[0] == fresh1[1]
    assert updated(llm, {n: jax.numpy.asarray(w0[n]) for n in w0}) == 2   # jax arrays
    llm.update_weights(dir1)                                       # a safetensors directory
    assert llm.weight_version == 3 and greedy(llm) == (fresh1[1], {3})
    np.testing.assert_array_equal(logits(llm), fresh1[2])


def test_bad_updates_name_the_tensor_and_keep_the_old_weights(tmp_path, w0, w1):
    llm = make_llm(write_checkpoint(tmp_path / "w0", w0))
    before = greedy(llm)[0]
    bad = [({**w1, "model.layers.0.mlp.up_proj.weight": w1["model.norm.weight"]},
            "model.layers.0.mlp.up_proj.weight: shape (128,)"),
           ({"model.layers.9.mlp.up_proj.weight": w1["model.layers.0.mlp.up_proj.weight"]},
            "model.layers.9.mlp.up_proj.weight"),
           ({"model.norm.weight": w1["model.norm.weight"].astype(np.int32)},
            "model.norm.weight: dtype int32"),
           ({}, "names no tensor of the model")]
    for weights, message in bad:
        with pytest.raises(WeightUpdateError, match=message.replace("(", r"\(")
                           .replace(")", r"\)")):
            llm.update_weights(weights)
    with pytest.raises(TypeError, match="mapping"):
        llm.update_weights([1, 2])
    assert llm.weight_version == 0 and greedy(llm) == (before, {0})


def test_phased_update_holds_steps_until_finished(tmp_path, w0, w1, fresh1):
    llm = make_llm(write_checkpoint(tmp_path / "w0", w0))
    greedy(llm)
    steps = llm.engine.stats().num_compilations
    llm.start_weight_update()
    names = sorted(w1)
    assert llm.update_weights({n: w1[n] for n in names[:10]}) == 0
    with pytest.raises(GenerationPausedError):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    assert llm.update_weights({n: w1[n] for n in names[10:]}) == 0
    with pytest.raises(RuntimeError, match="already open"):
        llm.start_weight_update()
    assert llm.finish_weight_update() == 1
    with pytest.raises(RuntimeError, match="no weight update is open"):
        llm.finish_weight_update()
    assert greedy(llm) == (fresh1[1], {1})
    assert llm.engine.stats().num_compilations == steps


def test_prefix_cache_is_invalidated_by_an_update(tmp_path, w0, w1):
    llm = make_llm(write_checkpoint(tmp_path / "w0", w0), enable_prefix_caching=True)
    long = [PROBE * 3]
    llm.generate(long, GREEDY, use_tqdm=False)
    assert llm.generate(long, GREEDY, use_tqdm=False)[0].num_cached_tokens > 0
    llm.update_weights(w1)
    assert llm.generate(long, GREEDY, use_tqdm=False)[0].num_cached_tokens == 0
    assert llm.reset_prefix_cache() is True
    assert llm.generate(long, GREEDY, use_tqdm=False)[0].num_cached_tokens == 0


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_8bit_update_requantizes(tmp_path, w0, w1, dir1, method):
    llm = make_llm(write_checkpoint(tmp_path / "w0", w0), quantization=method)
    fresh = make_llm(dir1, quantization=method)
    assert updated(llm, w1) == 1
    assert greedy(llm)[0] == greedy(fresh)[0]
    np.testing.assert_array_equal(logits(llm), logits(fresh))


def test_tensor_parallel_update_keeps_shardings(tmp_path, w0, w1, dir1):
    llm = make_llm(write_checkpoint(tmp_path / "w0", w0), tensor_parallel_size=2)
    fresh = make_llm(dir1, tensor_parallel_size=2)
    shardings = [a.sharding for a in jax.tree.leaves(llm.engine.runner.state[1])]
    assert any(len(s.device_set) == 2 and not s.is_fully_replicated for s in shardings)
    # arrays already placed as the engine's own are used as they are (no host round trip)
    placed = {n: jax.device_put(w1[n], s) for n, s in zip(
        ["model.embed_tokens.weight"], [fresh.engine.runner.state[1]["model"]["embed_tokens"]
                                        ["embedding"].get_value().sharding])}
    assert updated(llm, {**w1, **placed}) == 1
    new_leaves = jax.tree.leaves(llm.engine.runner.state[1])
    assert [a.sharding for a in new_leaves] == shardings
    assert any(a is placed["model.embed_tokens.weight"] for a in new_leaves)
    assert greedy(llm)[0] == greedy(fresh)[0]
    np.testing.assert_array_equal(logits(llm), logits(fresh))


def test_a_tied_lm_head_alone_is_refused_not_ignored():
    """On a model whose LM head is its embedding (the bundled one: tie_word_embeddings), an
    update of ``lm_head.weight`` alone would change nothing: it is refused, saying so, and
    the version stays."""
    llm = make_llm(STORIES)
    head = np.zeros((llm.engine.model_config.vocab_size, llm.engine.model_config.hidden_size),
                    np.float32)
    with pytest.raises(WeightUpdateError, match="tied to model.embed_tokens.weight"):
        llm.update_weights({"lm_head.weight": head})
    assert llm.weight_version == 0
