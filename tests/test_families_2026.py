"""The 2026 families (issue 45) against transformers' own classes: committed tiny random
checkpoints (tests/fixtures/make_family_references.py, tests/fixtures/NOTES_2026.md), float32
logits within 1e-4 and 32 identical greedy tokens through ``LLM.generate`` with chunked
prefill, prefix-cache hits and preemption, on the xla, cpu and pallas backends and over two
host devices."""

import json
import os

import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.config import ModelConfig, UnsupportedModelError
from jaxpaged.arg_utils import DEFAULT_MODEL
from jaxpaged.layers.attention.cpu import kernel_available
from tests.conftest import FIXTURES
from tests.test_model_logits import full_sequence_logits

#: fixture -> its architecture
FAMILIES = {
    "gemma3_local_global": "Gemma3ForCausalLM",
    "phi3_longrope": "Phi3ForCausalLM",
    "phi4_mini_partial_rope": "Phi3ForCausalLM",
    "olmo2_post_norm": "Olmo2ForCausalLM",
    "smollm3_nope": "SmolLM3ForCausalLM",
    "granite_multipliers": "GraniteForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
}
GREEDY_32 = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
#: Phi-3's fixture has an original context of 64: a 64-token engine keeps the short factors.
MAX_MODEL_LEN = 64
#: Pool pages where a page is not every layer's: Gemma 3's hold one layer each
#: (jaxpaged.core.kv_groups: its full layer and five window-8 ones are six groups). In 70, one
#: 41-token sequence's 66 page allocations (11 full, 5 x 11 given back as the window passes)
#: evict none of its cached prompt pages, and three at once (11 + 5 x 3-5 pages each) preempt.
POOL_PAGES = {"gemma3_local_global": 71}


def fixture(name, file=None):
    d = os.path.join(FIXTURES, name)
    return d if file is None else np.load(os.path.join(d, file))


def engine(name, **kw):
    """An engine that chunks the 9-token prompt (8 tokens a step), caches 4-token pages and,
    with 24 pages for three 41-token sequences (11 pages each), must preempt
    (:data:`POOL_PAGES` for models whose layers form KV cache groups)."""
    args = dict(enforce_eager=True, model=fixture(name), tokenizer=DEFAULT_MODEL,
                max_num_seqs=3, block_size=4, max_model_len=MAX_MODEL_LEN,
                max_num_batched_tokens=8, enable_prefix_caching=True,
                num_gpu_blocks_override=POOL_PAGES.get(name, 24))
    return LLM(**{**args, **kw})


def check_generate(llm, name):
    """Three copies of the prompt, one after another: greedy tokens equal transformers',
    the later copies hit the prefix cache, and the pool forces preemption."""
    prompt = fixture(name, "greedy_prompt.npy").tolist()
    want = fixture(name, "greedy_tokens.npy").tolist()
    first = llm.generate([prompt], GREEDY_32, use_tqdm=False)[0]
    assert first.outputs[0].token_ids == want
    outs = llm.generate([prompt] * 3, GREEDY_32, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [want] * 3
    assert all(o.num_cached_tokens >= 8 for o in outs)      # two full pages of the prompt
    assert llm.engine.num_preemptions > 0


@pytest.mark.parametrize("name", [n for n in FAMILIES if n != "phi4_mini_partial_rope"])
def test_logits_match_transformers(name):
    """(Phi-4-mini's fixture has only short-factor logits: its engine test checks them.)"""
    cfg = ModelConfig.from_pretrained(fixture(name))
    assert cfg.architecture == FAMILIES[name]
    long = name == "phi3_longrope"    # the checkpoint's own 256 > 64: LongRoPE's long factors
    ids = fixture(name, "input_ids_long.npy" if long else "input_ids.npy")
    ref = fixture(name, "logits_long.npy" if long else "logits.npy")
    logits = full_sequence_logits(fixture(name), ids, page_size=8)
    assert logits.shape == ref.shape
    assert np.abs(logits - ref).max() < 1e-4


@pytest.mark.parametrize("name, backend", [
    (n, b) if b != "pallas" or n == "olmo2_post_norm" else
    pytest.param(n, b, marks=pytest.mark.slow)       # 11-40 s each in interpret mode
    for n in FAMILIES for b in ("xla", "cpu", "pallas")])
def test_generate_matches_transformers(name, backend):
    """Prefill logits on the engine's own backend (short LongRoPE factors for Phi-3), then
    chunked prefill, prefix-cache hits and preemption with identical greedy tokens (on
    ``cpu``, every layer through the C++ kernel, gpt-oss's sinks included)."""
    llm = engine(name, attention_backend=backend)
    if backend == "cpu" and kernel_available():
        assert llm.engine.runner.backend.name == "cpu"
    logits, _ = llm.engine.runner.run_prefill(fixture(name, "input_ids.npy").tolist())
    assert np.abs(np.asarray(logits) - fixture(name, "logits.npy")).max() < 1e-4
    check_generate(llm, name)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_two_devices_match_transformers(name):
    """tp=2 on host devices (heads, MLP columns and every expert's columns split)."""
    check_generate(engine(name, tensor_parallel_size=2), name)


def test_olmo2_whole_width_k_norm_follows_replicated_kv_heads():
    """tp=4 over 2 KV heads: k_proj's heads and OLMo 2's [kv_heads * head_dim] k_norm are
    both replicated twice."""
    llm = engine("olmo2_post_norm", tensor_parallel_size=4)
    attn = llm.engine.runner._state["model"]["layers"][0]["self_attn"]
    assert attn["k_norm"]["weight"].shape == (4 * 16,)
    check_generate(llm, "olmo2_post_norm")


def test_qwen3_moe_expert_parallel_matches_transformers():
    name = "qwen3_moe"                      # 4 experts of 48, top-2; layer 1 dense
    llm = engine(name, tensor_parallel_size=2, enable_expert_parallel=True)
    layers = llm.engine.runner._state["model"]["layers"]
    w1 = layers[0]["mlp"]["experts"]["w1"]
    assert w1.shape == (4, 64, 48)
    assert {s.data.shape for s in w1[...].addressable_shards} == {(2, 64, 48)}
    assert "experts" not in layers[1]["mlp"]
    check_generate(llm, name)


def read_config(name) -> dict:
    with open(os.path.join(fixture(name), "config.json")) as f:
        return json.load(f)


def test_family_settings_parsed():
    gemma = ModelConfig.from_pretrained(fixture("gemma3_local_global"))
    assert gemma.sliding_windows == (8, 8, 8, 8, 8, None) and gemma.qk_norm
    assert [r.theta for r in gemma.family.layer_rope] == [1e4] * 5 + [1e6]
    phi = ModelConfig.from_pretrained(fixture("phi3_longrope")).family.longrope
    assert phi.original_max_position_embeddings == 64 and phi.use_long
    assert phi.attention_factor == pytest.approx(np.sqrt(1 + np.log(4) / np.log(64)))
    phi4 = ModelConfig.from_pretrained(fixture("phi4_mini_partial_rope")).family
    assert phi4.rotary_dim == 12 and len(phi4.longrope.short_factor) == 6
    smol = ModelConfig.from_pretrained(fixture("smollm3_nope")).family.layer_rope
    assert [r is None for r in smol] == [False, True, False, True]
    granite = ModelConfig.from_pretrained(fixture("granite_multipliers")).family
    assert (granite.embedding_multiplier, granite.residual_multiplier,
            granite.attention_multiplier, granite.logits_scaling) == (3.0, 0.5, 0.2, 2.0)
    moe = ModelConfig.from_pretrained(fixture("qwen3_moe"))
    assert (moe.num_experts, moe.num_experts_per_tok, moe.qk_norm) == (4, 2, True)
    assert moe.family.moe_layers == (True, False, True)
    assert (moe.family.moe_intermediate_size, moe.family.norm_topk_prob) == (48, True)
    oss = ModelConfig.from_pretrained(fixture("gpt_oss"))
    assert oss.sliding_windows == (8, None, 8, None) and (oss.qkv_bias, oss.o_bias) == (True, True)
    assert (oss.num_experts, oss.num_experts_per_tok, oss.intermediate_size) == (4, 2, 64)
    assert oss.family.yarn.attention_factor == pytest.approx(0.1 * np.log(4) + 1)
    assert (oss.family.swiglu_limit, oss.family.swiglu_alpha) == (1.0, 1.702)


def test_hub_style_configs_read_as_transformers_reads_them():
    """Keys of configs written by older transformers (Hub checkpoints)."""
    gemma = read_config("gemma3_local_global")
    del gemma["rope_parameters"], gemma["layer_types"]
    gemma.update(rope_theta=1e6, rope_local_base_freq=1e4, sliding_window_pattern=3,
                 rope_scaling={"rope_type": "linear", "factor": 8.0})
    cfg = ModelConfig.from_dict(gemma)
    assert cfg.sliding_windows == (8, 8, None, 8, 8, None)
    assert [(r.theta, r.linear_factor) for r in cfg.family.layer_rope[1:3]] == [
        (1e4, 1.0), (1e6, 8.0)]
    moe = read_config("qwen3_moe")
    moe["num_experts"] = moe.pop("num_local_experts")
    del moe["norm_topk_prob"]
    cfg = ModelConfig.from_dict(moe)
    assert (cfg.num_experts, cfg.family.norm_topk_prob) == (4, False)   # transformers' default
    smol = read_config("smollm3_nope")
    del smol["no_rope_layers"]
    smol["no_rope_layer_interval"] = 4
    assert [r is None for r in ModelConfig.from_dict(smol).family.layer_rope] == [
        False, False, False, True]
    phi = read_config("phi3_longrope")
    phi["rope_scaling"] = {**phi.pop("rope_parameters"), "type": "su"}
    del phi["rope_scaling"]["rope_type"]
    assert ModelConfig.from_dict(phi).family.longrope.short_factor[1] == 1.1


@pytest.mark.parametrize("name, overrides, match", [
    ("phi3_longrope", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                           "partial_rotary_factor": 0.7}},     # 11.2 of 16
     "partial_rotary_factor"),
    ("phi3_longrope", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4,
                                           "short_factor": [1.0], "long_factor": [1.0] * 8}},
     "short_factor"),
    ("phi3_longrope", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4}},
     "dynamic"),
    ("gemma3_local_global", {"rope_parameters": {
        "full_attention": {"rope_type": "yarn", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}, "yarn"),
    ("smollm3_nope", {"no_rope_layers": [1, 0]}, "no_rope_layers"),
    ("gpt_oss", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4}}, "dynamic"),
    ("gpt_oss", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}},
     "original_max_position_embeddings"),
])
def test_unsupported_settings_are_named(name, overrides, match):
    with pytest.raises(UnsupportedModelError, match=match):
        ModelConfig.from_dict({**read_config(name), **overrides})
