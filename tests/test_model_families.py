"""Every supported family against transformers' torch implementation (committed fixtures,
tests/fixtures/NOTES.md): float32 logits within 1e-4 and 32 identical greedy tokens."""

import os

import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.config import SUPPORTED_ARCHITECTURES, ModelConfig, UnsupportedModelError
from jaxpaged.arg_utils import DEFAULT_MODEL
from jaxpaged.models.registry import MODEL_CLASSES
from tests.conftest import FIXTURES
from tests.test_model_logits import full_sequence_logits

#: fixture -> its architecture
FAMILIES = {
    "llama3_rope_scaling": "LlamaForCausalLM",
    "mistral_sliding_window": "MistralForCausalLM",
    "qwen2_bias_untied": "Qwen2ForCausalLM",
    "qwen2_bias_tied": "Qwen2ForCausalLM",
    "qwen3_qk_norm": "Qwen3ForCausalLM",
    "mixtral_moe": "MixtralForCausalLM",
    "gemma2_softcap": "Gemma2ForCausalLM",
}
#: Fixtures whose attention uses a sliding window or soft cap: checked on both backends.
WINDOWED = ("mistral_sliding_window", "gemma2_softcap")
GREEDY_32 = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


def fixture(name, file=None):
    d = os.path.join(FIXTURES, name)
    return d if file is None else np.load(os.path.join(d, file))


def test_every_architecture_has_a_model_class():
    assert set(MODEL_CLASSES) == set(SUPPORTED_ARCHITECTURES)
    from tests.test_families_2026 import FAMILIES as FAMILIES_2026
    from tests.test_qwen3_next import MODEL as QWEN3_NEXT     # (its own file: state slots)
    fixtures = set(FAMILIES.values()) | set(FAMILIES_2026.values()) | {
        ModelConfig.from_pretrained(QWEN3_NEXT).architecture}
    assert fixtures == set(SUPPORTED_ARCHITECTURES)                    # a fixture for each


@pytest.mark.parametrize("name", list(FAMILIES))
def test_logits_match_transformers(name):
    cfg = ModelConfig.from_pretrained(fixture(name))
    assert cfg.architecture == FAMILIES[name]
    ref = fixture(name, "logits.npy")
    logits = full_sequence_logits(fixture(name), fixture(name, "input_ids.npy"), page_size=8)
    assert logits.shape == ref.shape
    assert np.abs(logits - ref).max() < 1e-4


@pytest.mark.parametrize("name", WINDOWED)
def test_windowed_families_on_the_pallas_backend(name):
    ref = fixture(name, "logits.npy")
    logits = full_sequence_logits(fixture(name), fixture(name, "input_ids.npy"), page_size=8,
                                  backend="pallas")
    assert np.abs(logits - ref).max() < 1e-4


@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_32_tokens_match_transformers(name):
    """Prefill of 9 tokens then 32 decode steps (past every sliding window of 8)."""
    llm = LLM(enforce_eager=True, model=fixture(name), tokenizer=DEFAULT_MODEL, max_num_seqs=4,
              block_size=8)
    out = llm.generate([fixture(name, "greedy_prompt.npy").tolist()], GREEDY_32,
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == fixture(name, "greedy_tokens.npy").tolist()


def test_mixtral_experts_split_over_two_devices_match_transformers():
    name = "mixtral_moe"
    llm = LLM(enforce_eager=True, model=fixture(name), tokenizer=DEFAULT_MODEL, max_num_seqs=4,
              block_size=8, tensor_parallel_size=2)
    w1 = llm.engine.runner._state["model"]["layers"][0]["block_sparse_moe"]["experts"]["w1"]
    assert {s.data.shape for s in w1[...].addressable_shards} == {
        (w1.shape[0], w1.shape[1], w1.shape[2] // 2)}
    out = llm.generate([fixture(name, "greedy_prompt.npy").tolist()], GREEDY_32,
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == fixture(name, "greedy_tokens.npy").tolist()


@pytest.mark.parametrize("devices, quantization", [
    (2, None), pytest.param(4, None, marks=pytest.mark.slow),
    pytest.param(2, "int8", marks=pytest.mark.slow)])
def test_mixtral_expert_parallel_holds_whole_experts_and_matches_one_device(devices,
                                                                           quantization):
    name = "mixtral_moe"                       # 4 experts, top-2
    common = dict(enforce_eager=True, model=fixture(name), tokenizer=DEFAULT_MODEL,
                  max_num_seqs=4, block_size=8, quantization=quantization)
    llm = LLM(**common, tensor_parallel_size=devices, enable_expert_parallel=True)
    experts = llm.engine.runner._state["model"]["layers"][0]["block_sparse_moe"]["experts"]
    for w in (experts["w1"], experts["w3"], experts["w2"]):
        e, a, b = w.shape
        assert {s.data.shape for s in w[...].addressable_shards} == {(e // devices, a, b)}
    prompt = fixture(name, "greedy_prompt.npy").tolist()
    out = [o.outputs[0].token_ids for o in llm.generate([prompt, prompt[:5]], GREEDY_32,
                                                        use_tqdm=False)]
    if quantization is None:
        assert out[0] == fixture(name, "greedy_tokens.npy").tolist()    # transformers'
    single = LLM(**common).generate([prompt, prompt[:5]], GREEDY_32, use_tqdm=False)
    assert out == [o.outputs[0].token_ids for o in single]


def test_expert_parallel_refuses_dense_models_and_uneven_splits():
    from jaxpaged.distributed.tensor_parallel import TensorParallelError

    with pytest.raises(TensorParallelError, match="needs a mixture-of-experts model"):
        LLM(enforce_eager=True, model=fixture("llama3_rope_scaling"), tokenizer=DEFAULT_MODEL,
            tensor_parallel_size=2, enable_expert_parallel=True)
    with pytest.raises(TensorParallelError, match="does not divide the model's 4 experts"):
        LLM(enforce_eager=True, model=fixture("mixtral_moe"), tokenizer=DEFAULT_MODEL,
            tensor_parallel_size=8, enable_expert_parallel=True)


def test_family_settings_parsed():
    mistral = ModelConfig.from_pretrained(fixture("mistral_sliding_window"))
    assert set(mistral.sliding_windows) == {8}
    gemma = ModelConfig.from_pretrained(fixture("gemma2_softcap"))
    assert gemma.sliding_windows[0] == 8 and gemma.sliding_windows[1] is None
    assert gemma.attn_logit_softcapping and gemma.final_logit_softcapping
    qwen2 = ModelConfig.from_pretrained(fixture("qwen2_bias_untied"))
    assert (qwen2.qkv_bias, qwen2.o_bias) == (True, False)
    assert ModelConfig.from_pretrained(fixture("qwen3_qk_norm")).qk_norm
    mixtral = ModelConfig.from_pretrained(fixture("mixtral_moe"))
    assert (mixtral.num_experts, mixtral.num_experts_per_tok) == (4, 2)
    llama3 = ModelConfig.from_pretrained(fixture("llama3_rope_scaling"))
    assert llama3.rope_scaling is not None and llama3.rope_scaling.factor == 8.0


@pytest.mark.parametrize("overrides, match", [
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "yarn"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}},
     "low_freq_factor"),
    ({"num_local_experts": 4, "num_experts_per_tok": 5}, "num_experts_per_tok"),
    ({"layer_types": ["sliding_attention"], "sliding_window": 8}, "layer_types"),
    ({"hidden_act": "relu"}, "relu"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": -1.0}}, "rope_theta"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0,
                          "low_freq_factor": 2.0, "high_freq_factor": 2.0,
                          "original_max_position_embeddings": 32}}, "high_freq_factor"),
    ({"sliding_window": 0}, "sliding_window"),
    ({"sliding_window": -4}, "sliding_window"),
    ({"sliding_window": 8.5}, "sliding_window"),
    ({"sliding_window": "8"}, "sliding_window"),
])
def test_unsupported_family_settings_are_named(overrides, match):
    import json
    with open(os.path.join(fixture("mistral_sliding_window"), "config.json")) as f:
        cfg = json.load(f)
    cfg.update(overrides)
    with pytest.raises(UnsupportedModelError, match=match):
        ModelConfig.from_dict(cfg)


def test_quantized_experts_equal_dequantized_float_experts():
    """An int8 MixtralExperts computes what float experts with weights kernel * scale do."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxpaged.models.mixtral import MixtralExperts
    cfg = dataclasses.replace(ModelConfig.from_pretrained(fixture("mixtral_moe")),
                              quantization="int8")
    experts = MixtralExperts(cfg, jnp.float32, nnx.Rngs(0))
    assert experts.w2[...].dtype == jnp.int8 and experts.w2_scale[...].shape == (4, 64)
    dense = MixtralExperts(dataclasses.replace(cfg, quantization=None), jnp.float32,
                           nnx.Rngs(1))
    for name in ("w1", "w2", "w3"):
        q = getattr(experts, name)[...].astype(jnp.float32)
        getattr(dense, name).set_value(q * getattr(experts, f"{name}_scale")[...][:, None, :])
    group_sizes = jnp.asarray([3, 0, 5, 2], jnp.int32)
    row_experts = jnp.repeat(jnp.arange(4), group_sizes, total_repeat_length=10)
    x = jax.random.normal(jax.random.key(0), (10, 64))
    np.testing.assert_allclose(experts(x, group_sizes, row_experts),
                               dense(x, group_sizes, row_experts), rtol=1e-5, atol=1e-6)


@pytest.mark.slow     # ~15 s on 2 cores: two engines
def test_mixtral_int8_experts_close_to_transformers_and_split_over_tp():
    name = "mixtral_moe"
    ref = fixture(name, "logits.npy")
    logits = full_sequence_logits(fixture(name), fixture(name, "input_ids.npy"), page_size=8,
                                  quantization="int8")
    assert (logits.argmax(-1) == ref.argmax(-1)).all()
    assert np.abs(logits - ref).max() < 0.1
    outs = []
    for tp in (1, 2):
        llm = LLM(enforce_eager=True, model=fixture(name), tokenizer=DEFAULT_MODEL,
                  max_num_seqs=4, block_size=8, tensor_parallel_size=tp, quantization="int8")
        outs.append(llm.generate([fixture(name, "greedy_prompt.npy").tolist()], GREEDY_32,
                                 use_tqdm=False)[0].outputs[0].token_ids)
    experts = llm.engine.runner._state["model"]["layers"][0]["block_sparse_moe"]["experts"]
    assert {s.data.shape for s in experts["w1_scale"][...].addressable_shards} == {(4, 48)}
    assert {s.data.shape for s in experts["w2_scale"][...].addressable_shards} == {(4, 64)}
    assert outs[0] == outs[1]


@pytest.mark.parametrize("name", ["mistral_sliding_window", "qwen3_qk_norm", "mixtral_moe",
                                  "gemma2_softcap"])
def test_fp8_kv_cache_close_to_transformers(name):
    """--kv-cache-dtype fp8 (scale 1.0) on the families with their own attention features:
    measured max |diff| 0.14-0.21 (logits' std ~0.8), top-1 95-98% over 41 positions."""
    ref = fixture(name, "logits.npy")
    llm = LLM(enforce_eager=True, model=fixture(name), tokenizer=DEFAULT_MODEL, max_num_seqs=4,
              block_size=8, kv_cache_dtype="fp8")
    logits, pool = llm.engine.runner.run_prefill(fixture(name, "input_ids.npy").tolist())
    assert str(pool[0][0].dtype) == "float8_e4m3fn"
    logits = np.asarray(logits)
    assert np.abs(logits - ref).max() < 0.3
    assert (logits.argmax(-1) == ref.argmax(-1)).mean() >= 0.9


def test_kv_scale_calibration_refuses_a_foreign_tokenizer():
    """The bundled tokenizer's ids (up to 511) do not fit the fixture's 304-token vocabulary."""
    with pytest.raises(ValueError, match="vocabulary of 304"):
        LLM(enforce_eager=True, model=fixture("mistral_sliding_window"), tokenizer=DEFAULT_MODEL,
            max_num_seqs=4, block_size=8, kv_cache_dtype="fp8", calculate_kv_scales=True)


def test_absent_family_settings_take_transformers_defaults():
    """A sparse config.json means what it means to transformers' config classes."""
    import json
    with open(os.path.join(fixture("gemma2_softcap"), "config.json")) as f:
        gemma = json.load(f)
    for key in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"):
        del gemma[key]
    cfg = ModelConfig.from_dict(gemma)
    assert (cfg.query_pre_attn_scalar, cfg.attn_logit_softcapping,
            cfg.final_logit_softcapping) == (256, 50.0, 30.0)
    with open(os.path.join(fixture("mixtral_moe"), "config.json")) as f:
        mixtral = json.load(f)
    del mixtral["rms_norm_eps"], mixtral["num_experts_per_tok"]
    cfg = ModelConfig.from_dict(mixtral)
    assert (cfg.rms_norm_eps, cfg.num_experts_per_tok) == (1e-5, 2)
    with open(os.path.join(fixture("mistral_sliding_window"), "config.json")) as f:
        mistral = json.load(f)
    del mistral["sliding_window"]
    assert set(ModelConfig.from_dict(mistral).sliding_windows) == {4096}
    mistral["sliding_window"] = None                 # written null: no window
    assert set(ModelConfig.from_dict(mistral).sliding_windows) == {None}
