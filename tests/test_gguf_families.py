"""The 2026 families from the GGUF files llama.cpp's own converter writes (issue 45;
``tests/fixtures/make_gguf_fixtures.py``, ``tests/fixtures/gguf_2026/NOTES.md``): the config
read from the metadata, float32 prefill logits within 1e-4 of transformers' and 32 identical
greedy tokens through ``LLM.generate`` with chunked prefill, prefix-cache hits and
preemption (the family tests' engine, ``tests/test_families_2026.py``)."""

import os

import numpy as np
import pytest

from jaxpaged.config import ModelConfig, UnsupportedModelError
from jaxpaged.models.gguf_loader import GGUFCheckpoint, keeps_packed
from jaxpaged.models.safetensors_reader import SafetensorsReader
from tests.conftest import FIXTURES
from tests.test_families_2026 import POOL_PAGES, check_generate, engine, fixture
from tests.test_gguf_loader import write_random_llama
from tests.test_model_logits import full_sequence_logits

GGUF_DIR = os.path.join(FIXTURES, "gguf_2026")
#: GGUF file -> (its transformers reference's fixture, the architecture it loads as)
FILES = {
    "gemma3.f32.gguf": ("gguf_2026/gemma3_gguf", "Gemma3ForCausalLM"),
    "qwen3_moe.f32.gguf": ("gguf_2026/qwen3_moe_gguf", "Qwen3MoeForCausalLM"),
    "phi3_longrope.f32.gguf": ("phi3_longrope", "Phi3ForCausalLM"),
    "phi4_mini_partial_rope.f32.gguf": ("phi4_mini_partial_rope", "Phi3ForCausalLM"),
    "smollm3.f32.gguf": ("gguf_2026/smollm3_gguf", "SmolLM3ForCausalLM"),
    "olmo2.f32.gguf": ("olmo2_post_norm", "Olmo2ForCausalLM"),
    "olmo2.q8_0.gguf": ("gguf_2026/olmo2_q8_0", "Olmo2ForCausalLM"),
    "granite.f32.gguf": ("granite_multipliers", "GraniteForCausalLM"),
}


def gguf(file: str) -> str:
    return os.path.join(GGUF_DIR, file)


@pytest.mark.parametrize("file, backend", [
    (f, "xla") if f != "gemma3.f32.gguf" else
    pytest.param(f, "xla", marks=pytest.mark.slow)          # 90 s: its 6 KV groups
    for f in FILES] + [("olmo2.f32.gguf", "cpu"),
                       pytest.param("olmo2.f32.gguf", "pallas", marks=pytest.mark.slow)])  # 45 s
def test_generate_matches_transformers(file, backend):
    """Prefill logits (Phi-3: its short LongRoPE factors at a 64-token engine) and greedy
    tokens through the family tests' engine (4-token pages, 8-token chunks, a pool that
    preempts; Gemma 3's as many pages as its fixture's) on the ``backend`` attention
    backend."""
    ref, arch = FILES[file]
    cfg = ModelConfig.from_pretrained(gguf(file))
    assert cfg.architecture == arch and cfg.checkpoint_dtype == "float32"
    pages = POOL_PAGES.get("gemma3_local_global") if arch == "Gemma3ForCausalLM" else None
    llm = engine(ref, model=gguf(file), dtype="float32",   # (auto: bfloat16 on some CPUs)
                 num_gpu_blocks_override=pages or 24, attention_backend=backend)
    logits, _ = llm.engine.runner.run_prefill(fixture(ref, "input_ids.npy").tolist())
    assert np.abs(np.asarray(logits) - fixture(ref, "logits.npy")).max() < 1e-4
    check_generate(llm, ref)


@pytest.mark.parametrize("file, ref, ids, logits", [
    ("phi3_longrope.f32.gguf", "phi3_longrope", "input_ids_long.npy", "logits_long.npy"),
    ("gemma3.f32.gguf", "gguf_2026/gemma3_gguf", "input_ids.npy", "logits.npy")])
def test_full_sequence_logits_match_transformers(file, ref, ids, logits):
    """One prefill of the whole input: Phi-3 at the file's context (256) past its original one
    (64), so the long factors from the ``rope_factors_long`` tensor, on an 80-token input;
    Gemma 3 (whose engine test is slow) past its sliding window of 8."""
    out = full_sequence_logits(gguf(file), fixture(ref, ids), page_size=8)
    assert np.abs(out - fixture(ref, logits)).max() < 1e-4


def test_family_settings_from_metadata():
    """What each file's metadata becomes, against the checkpoint it was converted from."""
    read = lambda file: ModelConfig.from_pretrained(gguf(file))
    gemma = read("gemma3.f32.gguf")
    assert gemma.sliding_windows == (8, 8, 8, 8, 8, None) and gemma.qk_norm
    assert [r.theta for r in gemma.family.layer_rope] == [1e4] * 5 + [1e6]
    assert (gemma.query_pre_attn_scalar, gemma.final_logit_softcapping) == (16, 4.0)
    assert gemma.tie_word_embeddings and gemma.hidden_act == "gelu_pytorch_tanh"
    moe = read("qwen3_moe.f32.gguf")
    assert (moe.num_experts, moe.num_experts_per_tok, moe.qk_norm) == (4, 2, True)
    assert moe.family.moe_layers == (True, True) and moe.family.norm_topk_prob
    assert moe.family.moe_intermediate_size == 48
    for file in ("phi3_longrope.f32.gguf", "phi4_mini_partial_rope.f32.gguf"):
        got = read(file).family
        want = ModelConfig.from_pretrained(fixture(FILES[file][0])).family
        assert got.rotary_dim == want.rotary_dim and got.longrope.use_long == want.longrope.use_long
        for field in ("short_factor", "long_factor", "attention_factor",
                      "original_max_position_embeddings"):   # float32 in the file
            assert getattr(got.longrope, field) == pytest.approx(getattr(want.longrope, field))
    smol = read("smollm3.f32.gguf").family.layer_rope
    assert [r is None for r in smol] == [False, False, False, True]
    assert smol[0].theta == 2e6
    assert (read("olmo2.f32.gguf").family == ModelConfig.from_pretrained(
        fixture("olmo2_post_norm")).family)
    granite = read("granite.f32.gguf").family
    assert (granite.embedding_multiplier, granite.residual_multiplier,
            granite.attention_multiplier, granite.logits_scaling) == (3.0, 0.5,
                                                                      pytest.approx(0.2), 2.0)


@pytest.mark.parametrize("file, name", [
    ("gemma3.f32.gguf", "model.layers.0.post_feedforward_layernorm.weight"),
    ("qwen3_moe.f32.gguf", "model.layers.1.mlp.experts.down_proj.weight"),
    ("phi4_mini_partial_rope.f32.gguf", "model.layers.0.self_attn.qkv_proj.weight"),
    ("smollm3.f32.gguf", "model.layers.3.self_attn.k_proj.weight"),
])
def test_every_stored_tensor_has_a_hugging_face_name(file, name):
    """No tensor of the file is left outside the mapping (the loader refuses leftovers; Phi-3's
    RoPE factors are settings), the family's own kinds included; only Llama files keep
    their projections packed."""
    names = GGUFCheckpoint(gguf(file), 4, 2).unread()
    assert name in names
    assert [n for n in names if not n.startswith("model.") and n != "lm_head.weight"] == []
    assert not keeps_packed(gguf(file))


@pytest.mark.parametrize("file", ["phi3_longrope.f32.gguf", "olmo2.f32.gguf",
                                  "granite.f32.gguf"])
def test_float32_tensors_are_the_checkpoints(file):
    """Each tensor read from the file (Granite's q/k rows permuted back) equals the
    safetensors checkpoint it was converted from, bit for bit, and none is left unread."""
    source = SafetensorsReader(fixture(FILES[file][0]))
    reader = GGUFCheckpoint(gguf(file), 4, 2)
    names = source.unread()
    for name in names:
        np.testing.assert_array_equal(reader.get(name), source.get(name), err_msg=name)
    assert reader.unread() == [] and len(names) > 10


@pytest.mark.parametrize("arch", ["qwen2moe", "qwen35", "jamba"])
def test_architectures_still_not_read_are_named(tmp_path, arch):
    path = str(tmp_path / "model.gguf")
    write_random_llama(path, arch=arch)
    with pytest.raises(UnsupportedModelError,
                       match=f"GGUF architecture '{arch}' is not supported; supported: .*'phi3'"):
        ModelConfig.from_pretrained(path)


@pytest.mark.parametrize("file, kw", [
    ("phi3_longrope.f32.gguf", {}), ("qwen3_moe.f32.gguf", {"enable_expert_parallel": True})])
def test_two_devices_match_transformers(file, kw):
    """tp=2 on host devices: Phi-3's fused attn_qkv / ffn_up split per projection before
    their columns are, Qwen3-MoE's stacked experts split over the devices."""
    ref, _ = FILES[file]
    check_generate(engine(ref, model=gguf(file), dtype="float32", tensor_parallel_size=2,
                          **kw), ref)

