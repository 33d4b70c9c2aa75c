"""Family metadata keys of GGUF files that the committed fixtures do not carry
(``jaxpaged.gguf_arch.family_config``): read as llama.cpp reads them, or refused by name."""

import pytest

from jaxpaged.config import ModelConfig, UnsupportedModelError
from jaxpaged.gguf_arch import family_config

FULL, SLIDING = "full_attention", "sliding_attention"


def shared(layers: int = 6) -> dict:
    """The shared keys ``gguf_config`` hands to :func:`family_config`."""
    return {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "rope_theta": 1e6, "rms_norm_eps": 1e-6,
            "max_position_embeddings": 256, "tie_word_embeddings": True}


def read(arch: str, layers: int = 6, tensors=(), **keys) -> dict:
    meta = {f"{arch}.{k.replace('__', '.')}": v for k, v in keys.items()}
    return family_config(arch, meta, dict.fromkeys(tensors), shared(layers))


@pytest.mark.parametrize("keys, kinds", [
    ({}, [FULL] * 6),                                                  # no window: all full
    ({"attention__sliding_window": 8}, [SLIDING] * 5 + [FULL]),        # llama.cpp's 6
    ({"attention__sliding_window": 8, "attention__sliding_window_pattern": 3},
     [SLIDING, SLIDING, FULL] * 2),
    ({"attention__sliding_window": 8,
      "attention__sliding_window_pattern": [True, False, True, True, False, False]},
     [SLIDING, FULL, SLIDING, SLIDING, FULL, FULL]),
])
def test_gemma3_window_pattern(keys, kinds):
    assert read("gemma3", **keys)["layer_types"] == kinds


def test_gemma3_linear_scaling_local_base_and_27b_scale():
    meta = {"gemma3.attention.sliding_window": 1024, "gemma3.rope.freq_base_swa": 5e4,
            "gemma3.rope.scaling.type": "linear", "gemma3.rope.scaling.factor": 8.0}
    cfg = family_config("gemma3", meta, {}, {**shared(62), "hidden_size": 256})
    assert cfg["query_pre_attn_scalar"] == 64                  # hidden / heads at 62 layers
    parsed = ModelConfig.from_dict({**cfg, "architectures": ["Gemma3ForCausalLM"]})
    ropes = parsed.family.layer_rope
    assert [(r.theta, r.linear_factor) for r in ropes[4:7]] == [(5e4, 1.0), (1e6, 8.0),
                                                                (5e4, 1.0)]
    assert parsed.sliding_windows[:6] == (1024,) * 5 + (None,)
    assert read("gemma3", layers=6)["query_pre_attn_scalar"] == 16      # head_dim


def test_gemma3_pattern_of_the_wrong_length_is_named():
    with pytest.raises(UnsupportedModelError, match="sliding_window_pattern has 2 flags for 6"):
        read("gemma3", attention__sliding_window=8,
             attention__sliding_window_pattern=[True, False])


def test_qwen3moe_shared_expert_is_refused_by_name():
    with pytest.raises(UnsupportedModelError, match="blk.0.ffn_up_shexp.weight"):
        read("qwen3moe", tensors=["blk.0.ffn_gate_inp.weight", "blk.0.ffn_up_shexp.weight"],
             expert_count=4, expert_used_count=2)


def test_qwen3moe_layers_without_a_router_are_dense():
    cfg = read("qwen3moe", layers=3, tensors=["blk.0.ffn_gate_inp.weight",
                                              "blk.2.ffn_gate_inp.weight"],
               expert_count=4, expert_used_count=2, expert_feed_forward_length=48)
    family = ModelConfig.from_dict({**cfg, "architectures": ["Qwen3MoeForCausalLM"]}).family
    assert family.moe_layers == (True, False, True) and family.moe_intermediate_size == 48


def test_olmo3_sliding_layers_are_refused_and_olmo2_reads_plainly():
    with pytest.raises(UnsupportedModelError, match="OLMo 3"):
        read("olmo2", layers=4, attention__sliding_window=4096,
             attention__sliding_window_pattern=[True, True, True, False])
    assert read("olmo2", layers=4, attention__sliding_window=4096,
                attention__sliding_window_pattern=[False] * 4) == shared(4)


def test_granite_without_an_attention_scale_uses_llama_cpps_default():
    cfg = read("granite", layers=2, logit_scale=8.0)
    assert (cfg["attention_multiplier"], cfg["logits_scaling"]) == (0.25, 8.0)
    assert (cfg["embedding_multiplier"], cfg["residual_multiplier"]) == (1.0, 1.0)
