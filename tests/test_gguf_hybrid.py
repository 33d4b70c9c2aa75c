"""gpt-oss and Qwen3-Next from the GGUF files llama.cpp's own converter writes (issue 45;
``tests/fixtures/make_gguf_hybrid_fixtures.py``, ``tests/fixtures/gguf_2026/NOTES_hybrid.md``):
gpt-oss's MXFP4 experts dequantized on load, Qwen3-Next's Gated DeltaNet tensors given back in
transformers' layout; float32 prefill logits within 1e-4 of transformers' and 32 identical
greedy tokens through ``LLM.generate`` on the xla, cpu and pallas backends (chunked prefill and
preemption; prefix-cache hits for gpt-oss, whose layers are all attention)."""

import numpy as np
import pytest

from jaxpaged.config import ModelConfig, UnsupportedModelError
from jaxpaged.gguf_arch import family_config
from jaxpaged.layers.attention.cpu import kernel_available
from jaxpaged.models.gguf_deltanet import qkvz_rows
from jaxpaged.models.gguf_loader import GGUFCheckpoint
from tests.test_families_2026 import GREEDY_32, check_generate, engine, fixture
from tests.test_gguf_families import gguf
from tests.test_model_logits import full_sequence_logits
from tests.test_qwen3_next import forward_logits

#: GGUF file -> its transformers reference's fixture.
FILES = {"gpt_oss.mxfp4.gguf": "gguf_2026/gpt_oss_gguf",
         "qwen3_next.f32.gguf": "gguf_2026/qwen3_next_gguf"}


def check_hybrid_generate(llm, ref):
    """Qwen3-Next: the greedy tokens alone and three at once, the later copies hitting the
    prefix cache (the 9-token prompt's two full pages, with the recurrent state saved at
    their end), the 24-page pool preempting."""
    prompt = fixture(ref, "greedy_prompt.npy").tolist()
    want = fixture(ref, "greedy_tokens.npy").tolist()
    assert llm.generate([prompt], GREEDY_32, use_tqdm=False)[0].outputs[0].token_ids == want
    outs = llm.generate([prompt] * 3, GREEDY_32, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [want] * 3
    assert [o.num_cached_tokens for o in outs] == [8] * 3
    assert llm.engine.num_preemptions > 0


def test_logits_match_transformers():
    """One forward of the 41-token input through each file's model (no engine)."""
    ref = FILES["gpt_oss.mxfp4.gguf"]
    out = full_sequence_logits(gguf("gpt_oss.mxfp4.gguf"), fixture(ref, "input_ids.npy"),
                               page_size=8)
    assert np.abs(out - fixture(ref, "logits.npy")).max() < 1e-4
    ref = FILES["qwen3_next.f32.gguf"]
    out = forward_logits(fixture(ref, "input_ids.npy"), model=gguf("qwen3_next.f32.gguf"))
    assert np.abs(out - fixture(ref, "logits.npy")).max() < 1e-4


@pytest.mark.slow           # 3-75 s each; pallas (interpret mode) 36 s gpt-oss, 54-89 s Qwen3-Next
@pytest.mark.parametrize("file, backend", [(f, b) for f in FILES
                                           for b in ("xla", "cpu", "pallas")])
def test_generate_matches_transformers(file, backend):
    """Prefill logits and greedy tokens through the family tests' engine (4-token pages,
    8-token chunks, 24 pages: a pool that preempts) on each backend: gpt-oss's sinks and
    window-8 layers, Qwen3-Next's one full-attention layer between DeltaNet layers."""
    ref = FILES[file]
    ids, want = fixture(ref, "input_ids.npy"), fixture(ref, "logits.npy")
    llm = engine(ref, model=gguf(file), dtype="float32", num_gpu_blocks_override=24,
                 attention_backend=backend)
    if backend != "cpu" or kernel_available():
        assert llm.engine.runner.backend.name == backend
    if "gpt_oss" in file:
        logits, _ = llm.engine.runner.run_prefill(ids.tolist())
        assert np.abs(np.asarray(logits) - want).max() < 1e-4
        check_generate(llm, ref)
    else:                   # (the scratch prefill has no recurrent state: 8-token chunks)
        logits = forward_logits(ids, starts=tuple(range(0, len(ids), 8)), width=8,
                                backend=backend, model=gguf(file))
        assert np.abs(logits - want).max() < 1e-4
        check_hybrid_generate(llm, ref)


def test_settings_from_metadata():
    """What llama.cpp runs: gpt-oss's window on the even layers (pattern 2), its built-in
    SwiGLU clamp 7 and ggml's rounded YaRN; Qwen3-Next's recurrent layers from the file's
    flags, value heads as wide as key heads, RoPE on 4 of 16 features."""
    oss = ModelConfig.from_pretrained(gguf("gpt_oss.mxfp4.gguf"))
    assert oss.architecture == "GptOssForCausalLM" and oss.sliding_windows == (8, None, 8, None)
    assert (oss.num_experts, oss.num_experts_per_tok, oss.intermediate_size) == (4, 2, 64)
    fam = oss.family
    assert (fam.swiglu_limit, fam.swiglu_alpha) == (7.0, 1.702)
    want = ModelConfig.from_pretrained(fixture("gpt_oss")).family.yarn   # truncate false
    assert fam.yarn.attention_factor == pytest.approx(1 + 0.1 * np.log(4))
    assert fam.yarn.attention_factor == pytest.approx(want.attention_factor)
    assert fam.yarn.inv_freq != want.inv_freq       # ggml rounds the correction range
    nxt = ModelConfig.from_pretrained(gguf("qwen3_next.f32.gguf"))
    la = nxt.family.linear_attention
    assert la.layers == (True, False, True, True) and nxt.family.rotary_dim == 4
    assert (la.num_k_heads, la.num_v_heads, la.k_head_dim, la.v_head_dim) == (2, 4, 16, 16)
    assert (la.conv_kernel, la.shared_expert_intermediate_size) == (4, 32)
    assert nxt.family.moe_layers == (True,) * 4 and nxt.family.moe_intermediate_size == 48


def test_every_stored_tensor_is_read():
    """Each file's tensors all have a place (gpt-oss's named as its modules ask, without the
    safetensors view; Qwen3-Next's attn_qkv and attn_gate read through in_proj_qkvz)."""
    oss = GGUFCheckpoint(gguf("gpt_oss.mxfp4.gguf"), 4, 2)
    assert oss.module_names and "model.layers.3.mlp.experts.w3_bias.weight" in oss.unread()
    assert oss.get("model.layers.0.mlp.experts.1.w2.weight").shape == (64, 64)
    assert oss.get("model.layers.0.mlp.experts.3.w1_bias.weight").shape == (64,)
    nxt = GGUFCheckpoint(gguf("qwen3_next.f32.gguf"), 4, 2)
    qkvz = nxt.get("model.layers.0.linear_attn.in_proj_qkvz.weight")
    assert qkvz.shape == (2 * 16 * 2 + 2 * 4 * 16, 64)
    assert "model.layers.0.linear_attn.in_proj_z.weight" not in nxt.unread()
    assert nxt.get("model.layers.0.linear_attn.conv1d.weight").shape == (128, 1, 4)
    assert np.all(nxt.get("model.layers.0.linear_attn.A_log") < 5)


def test_mxfp4_experts_lie_on_their_grid():
    """The MXFP4 experts as gguf dequantizes ggml's blocks (the converter's nibble repack,
    E8M0 scales): E2M1 codes times the fixture's scales 2^-6 and 2^-5, both signs and many
    codes present (a scale read off by one power of two would leave the grid)."""
    values = GGUFCheckpoint(gguf("gpt_oss.mxfp4.gguf"), 4, 2).get(
        "model.layers.0.mlp.experts.0.w1.weight")
    codes = np.array([0, .5, 1, 1.5, 2, 3, 4, 6])
    grid = np.unique(np.concatenate([codes, -codes])[:, None] * [2.0 ** -6, 2.0 ** -5])
    assert set(np.unique(values)) <= set(grid) and len(np.unique(values)) > 16


def test_deltanet_rows_interleave_per_key_head():
    """attn_qkv (q, k, v) and attn_gate (z) rows back into transformers' per-key-head
    [q, k, v, z] groups: Hk = 2 heads of Dk = 1, r * Dv = 2 value rows per group."""
    qkv = np.array([[0.], [1.], [10.], [11.], [20.], [21.], [22.], [23.]])   # q0 q1 k0 k1 v..
    z = np.array([[30.], [31.], [32.], [33.]])
    assert qkvz_rows(qkv, z, 2, 1)[:, 0].tolist() == [0, 10, 20, 21, 30, 31,
                                                      1, 11, 22, 23, 32, 33]
    with pytest.raises(ValueError, match="do not split into 3 key heads"):
        qkvz_rows(qkv, z, 3, 1)


def test_files_llama_cpp_reads_otherwise_are_refused():
    """llama.cpp's DeltaNet takes value heads ``ssm.state_size`` wide: a file whose
    ``ssm.inner_size`` says otherwise is refused by name, as is one with MTP layers."""
    meta = {"qwen3next.ssm.state_size": 16, "qwen3next.ssm.time_step_rank": 4,
            "qwen3next.ssm.inner_size": 32, "qwen3next.ssm.group_count": 2}
    cfg = lambda: {"num_hidden_layers": 4, "head_dim": 16, "intermediate_size": 64,
                   "rope_theta": 1e4}
    with pytest.raises(UnsupportedModelError, match="ssm.inner_size=32 is not ssm.state_size"):
        family_config("qwen3next", meta, {}, cfg())
    meta.update({"qwen3next.ssm.inner_size": 64, "qwen3next.nextn_predict_layers": 1})
    with pytest.raises(UnsupportedModelError, match=r"\(nextn\) layers is not supported"):
        family_config("qwen3next", meta, {}, cfg())


@pytest.mark.slow                       # 23-26 s each
@pytest.mark.parametrize("file", list(FILES))
def test_two_devices_match_transformers(file):
    """tp=2 on host devices: heads and expert columns split (Qwen3-Next's DeltaNet too, from
    the in_proj_qkvz the reader interleaves back)."""
    ref = FILES[file]
    llm = engine(ref, model=gguf(file), dtype="float32", num_gpu_blocks_override=24,
                 tensor_parallel_size=2, attention_backend="xla")
    (check_generate if "gpt_oss" in file else check_hybrid_generate)(llm, ref)
