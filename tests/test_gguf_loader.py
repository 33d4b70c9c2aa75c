"""GGUF files written by the test with ``gguf``'s writer: the mapping to Hugging Face Llama
names, llama.cpp's Q/K row permutation, shapes, dtypes, tied embeddings, and bad files.

The loader dequantizes with ``gguf.quants.dequantize`` itself, so the expected weights here are
that function's output put back in Hugging Face order by this file's own index arithmetic; the
same weights saved as a safetensors checkpoint must then give the same logits through the
project's float path (whose Llama matches transformers': ``tests/test_model_logits.py``).
"""

from __future__ import annotations

import json
import subprocess
import sys

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from safetensors.numpy import save_file

from jaxpaged.config import ModelConfig, UnsupportedModelError
from jaxpaged.models.gguf_loader import BadGGUFError, GGUFCheckpoint
from tests.test_model_logits import full_sequence_logits

LAYERS, HIDDEN, FFN, HEADS, KV_HEADS, VOCAB = 2, 256, 512, 4, 2, 96
HEAD_DIM = HIDDEN // HEADS
#: Each layer's projection types: every supported type appears, on q and k as well.
TYPES = [{"attn_q": T.Q4_K, "attn_k": T.Q5_K, "attn_v": T.Q6_K, "attn_output": T.Q8_0,
          "ffn_gate": T.Q4_0, "ffn_up": T.Q4_1, "ffn_down": T.BF16},
         {"attn_q": T.Q8_0, "attn_k": T.Q4_1, "attn_v": T.F32, "attn_output": T.F16,
          "ffn_gate": T.Q6_K, "ffn_up": T.Q5_K, "ffn_down": T.Q4_K}]
HF = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
      "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
      "ffn_down": "mlp.down_proj"}
SHAPES = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (KV_HEADS * HEAD_DIM, HIDDEN),
          "attn_v": (KV_HEADS * HEAD_DIM, HIDDEN), "attn_output": (HIDDEN, HIDDEN),
          "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN), "ffn_down": (HIDDEN, FFN)}
#: Byte offsets of the float16 super-block scales in each K-quant block (ggml-common.h:
#: block_q4_K / block_q5_K start with d, dmin; block_q6_K ends with d).
_K_SCALE_OFFSETS = {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}


def to_gguf_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter order of q/k rows: within each head, row ``i + j * D/2`` of the
    Hugging Face weight becomes row ``2i + j`` (RoPE on adjacent pairs instead of halves)."""
    out = np.empty_like(w)
    for h in range(n_heads):
        for i in range(HEAD_DIM // 2):
            for j in range(2):
                out[h * HEAD_DIM + 2 * i + j] = w[h * HEAD_DIM + i + j * HEAD_DIM // 2]
    return out


def from_gguf_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """The inverse of :func:`to_gguf_rows`, by a gather index."""
    index = [h * HEAD_DIM + 2 * i + j for h in range(n_heads) for j in range(2)
             for i in range(HEAD_DIM // 2)]
    return w[index]


def encode(w: np.ndarray, qtype: T, rng: np.random.Generator) -> np.ndarray:
    """``w`` [out, in] as the GGUF stores it: floats, ``gguf.quants.quantize`` blocks, or for
    the K-quants (which that numpy writer cannot produce) random blocks whose float16 scales
    are finite and small."""
    if qtype in _K_SCALE_OFFSETS:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, (w.shape[0], w.shape[1] // block, size), dtype=np.uint8)
        for off in _K_SCALE_OFFSETS[qtype]:
            scales = rng.uniform(-0.002, 0.002, raw.shape[:2]).astype(np.float16)
            raw[..., off:off + 2] = scales.view(np.uint8).reshape(*raw.shape[:2], 2)
        return raw.reshape(w.shape[0], -1)
    return gguf.quants.quantize(w, qtype)


def write_random_llama(path: str, tied: bool = True, arch: str = "llama", tokens: int | None = None,
                       seed: int = 0, types: list[dict] = TYPES, embedding_type: T = T.F16
                       ) -> dict[str, np.ndarray]:
    """A random Llama as a GGUF at ``path`` (each layer's projections of ``types``, the
    embedding of ``embedding_type``); returns the Hugging Face tensors it should load as
    (the GGUF's own dequantized values, rows in Hugging Face order)."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, arch)
    for key, value in [("block_count", LAYERS), ("context_length", 256),
                       ("embedding_length", HIDDEN), ("feed_forward_length", FFN),
                       ("attention.head_count", HEADS), ("attention.head_count_kv", KV_HEADS),
                       ("vocab_size", VOCAB)]:
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.rope.freq_base", 50000.0)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if tokens is not None:
        w.add_tokenizer_model("gpt2")
        w.add_token_list([f"t{i}" for i in range(tokens)])
    expected = {}

    def add(gguf_name, hf_name, value, qtype, heads=None):
        stored = to_gguf_rows(value, heads) if heads else value
        data = encode(stored, qtype, rng)
        w.add_tensor(gguf_name, data, raw_dtype=qtype)
        back = gguf.quants.dequantize(data, qtype).reshape(value.shape)
        expected[hf_name] = from_gguf_rows(back, heads) if heads else back

    add("token_embd.weight", "model.embed_tokens.weight",
        rng.normal(0, 0.3, (VOCAB, HIDDEN)).astype(np.float32), embedding_type)
    for i, layer_types in enumerate(types):
        for norm, hf_norm in (("attn_norm", "input_layernorm"),
                              ("ffn_norm", "post_attention_layernorm")):
            add(f"blk.{i}.{norm}.weight", f"model.layers.{i}.{hf_norm}.weight",
                1 + rng.normal(0, 0.1, HIDDEN).astype(np.float32), T.F32)
        for name, qtype in layer_types.items():
            heads = {"attn_q": HEADS, "attn_k": KV_HEADS}.get(name)
            add(f"blk.{i}.{name}.weight", f"model.layers.{i}.{HF[name]}.weight",
                rng.normal(0, 0.08, SHAPES[name]).astype(np.float32), qtype, heads)
    add("output_norm.weight", "model.norm.weight",
        1 + rng.normal(0, 0.1, HIDDEN).astype(np.float32), T.F32)
    if not tied:
        add("output.weight", "lm_head.weight",
            rng.normal(0, 0.08, (VOCAB, HIDDEN)).astype(np.float32), T.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


def hf_config(tied: bool) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "vocab_size": VOCAB, "hidden_size": HIDDEN,
            "intermediate_size": FFN, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
            "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "rope_theta": 50000.0,
            "rms_norm_eps": float(np.float32(1e-5)),   # as the GGUF stores it
            "max_position_embeddings": 256, "tie_word_embeddings": tied,
            "bos_token_id": 1, "eos_token_id": 2}


@pytest.mark.parametrize("tied", [True, False])
def test_random_llama_gguf_loads_as_its_dequantized_weights(tmp_path, tied):
    path = str(tmp_path / "model.gguf")
    expected = write_random_llama(path, tied=tied)
    assert ModelConfig.from_pretrained(path) == ModelConfig.from_dict(hf_config(tied))
    ckpt = GGUFCheckpoint(path, HEADS, KV_HEADS)
    assert ckpt.unread() == sorted(expected)
    for name, want in expected.items():
        got = ckpt.get(name)
        assert got.dtype == np.float32 and got.shape == want.shape, name
        np.testing.assert_array_equal(got, want, err_msg=name)
    assert ckpt.unread() == [] and ckpt.get("lm_head.weight" if tied else "nope") is None

    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    save_file(expected, str(hf_dir / "model.safetensors"))
    (hf_dir / "config.json").write_text(json.dumps(hf_config(tied)))
    ids = np.random.default_rng(1).integers(3, VOCAB, 21).astype(np.int32)
    got = full_sequence_logits(path, ids, page_size=8)
    want = full_sequence_logits(str(hf_dir), ids, page_size=8)
    assert np.abs(want).max() > 0.5           # a model whose logits say something
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_permutation_matters(tmp_path):
    """The q/k rows the GGUF stores are not Hugging Face's: loading them unpermuted would
    change the weights (so the test above checks the permutation, not a no-op)."""
    path = str(tmp_path / "model.gguf")
    expected = write_random_llama(path)
    raw = {t.name: t for t in gguf.GGUFReader(path).tensors}["blk.1.attn_q.weight"]
    stored = gguf.quants.dequantize(raw.data, raw.tensor_type)
    want = expected["model.layers.1.self_attn.q_proj.weight"]
    assert np.abs(stored - want).max() > 0.1
    np.testing.assert_array_equal(from_gguf_rows(stored, HEADS), want)


def test_truncated_file_is_a_typed_error(tmp_path):
    path = str(tmp_path / "model.gguf")
    write_random_llama(path)
    data = open(path, "rb").read()
    for cut in (len(data) - 1000, 200):
        short = tmp_path / f"short{cut}.gguf"
        short.write_bytes(data[:cut])
        with pytest.raises(BadGGUFError, match="truncated or corrupt"):
            ModelConfig.from_pretrained(str(short))
    # the command line names the problem, without a traceback
    run = subprocess.run([sys.executable, "-m", "jaxpaged.cli", "generate", "--model", str(short),
                          "hello"], capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "Traceback" not in run.stderr
    assert run.stderr.startswith("jaxpaged: error: ") and "truncated or corrupt" in run.stderr


def test_unknown_and_unsupported_tensor_types_are_refused_by_name(tmp_path):
    path = str(tmp_path / "model.gguf")
    write_random_llama(path)
    data = bytearray(open(path, "rb").read())
    # The tensor table entry: name, n_dims (u32), dims (u64 each), then the type id (u32).
    name = b"blk.0.ffn_down.weight"
    at = data.index(name) + len(name) + 4 + 2 * 8
    assert int.from_bytes(data[at:at + 4], "little") == T.BF16
    unknown = tmp_path / "unknown.gguf"
    unknown.write_bytes(bytes(data[:at]) + (99).to_bytes(4, "little") + bytes(data[at + 4:]))
    with pytest.raises(UnsupportedModelError, match="unknown ggml type.*99"):
        ModelConfig.from_pretrained(str(unknown))

    q2k = tmp_path / "q2k.gguf"
    w = gguf.GGUFWriter(str(q2k), "llama")
    w.add_uint32("llama.block_count", 1)
    w.add_tensor("token_embd.weight", np.zeros((VOCAB, 84), np.uint8), raw_dtype=T.Q2_K)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(UnsupportedModelError, match=r"\['Q2_K'\].*token_embd.weight"):
        ModelConfig.from_pretrained(str(q2k))


def test_vocabulary_that_does_not_match_the_embedding_is_refused(tmp_path):
    path = str(tmp_path / "model.gguf")
    write_random_llama(path, tokens=VOCAB - 1)
    with pytest.raises(BadGGUFError, match=f"{VOCAB - 1} tokenizer tokens.*{VOCAB} rows"):
        ModelConfig.from_pretrained(path)


def test_other_architectures_are_refused_by_name(tmp_path):
    path = str(tmp_path / "model.gguf")
    write_random_llama(path, arch="qwen2")
    with pytest.raises(UnsupportedModelError, match="GGUF architecture 'qwen2'"):
        ModelConfig.from_pretrained(path)
    with pytest.raises(FileNotFoundError):
        ModelConfig.from_pretrained(str(tmp_path / "absent.gguf"))


def test_served_model_name_of_a_gguf_is_its_file_name():
    import argparse

    from jaxpaged.arg_utils import EngineArgs
    from jaxpaged.server.server_args import add_server_args, server_config

    parser = add_server_args(EngineArgs.add_cli_args(argparse.ArgumentParser()))
    names = lambda *flags: server_config(parser.parse_args(list(flags))).served_model_names
    assert names("--model", "/models/SmolLM2-135M-Instruct.Q4_1.gguf") == \
        ["SmolLM2-135M-Instruct.Q4_1.gguf"]
    assert names("--model", "/models/llama") == ["/models/llama"]
    assert names("--model", "/m/x.gguf", "--served-model-name", "x") == ["x"]


@pytest.mark.parametrize("merges", [None, ["t t"]])
def test_broken_tokenizer_metadata_is_a_typed_error(tmp_path, merges):
    # A BPE ("gpt2") tokenizer with no merges or scores, or merges of tokens it does not
    # have: transformers' converter raises a KeyError / tokenizers' Exception, reported as
    # a BadGGUFError naming the file.
    from jaxpaged.models.gguf_tokenizer import gguf_tokenizer

    path = str(tmp_path / "model.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(VOCAB)])
    if merges is not None:
        w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    with pytest.raises(BadGGUFError, match="model.gguf.*tokenizer metadata does not make a "
                                           "tokenizer"):
        gguf_tokenizer(path)


def test_the_file_is_unmapped_once_its_weights_are_loaded(tmp_path):
    """The loader copies every tensor out of the GGUF mapping and then drops the file, so
    its pages no longer count in the process's resident memory (Linux: /proc/self/maps)."""
    import gc

    import jax.numpy as jnp

    from jaxpaged.layers.attention.xla import XlaAttentionBackend
    from jaxpaged.models.loader import load_model

    path = str(tmp_path / "unmapped.gguf")
    expected = write_random_llama(path)
    mapped = lambda: sum(path in line for line in open("/proc/self/maps"))
    model = load_model(path, ModelConfig.from_pretrained(path), dtype=jnp.float32,
                       backend=XlaAttentionBackend(), load_format="auto", seed=0)
    gc.collect()
    assert mapped() == 0
    np.testing.assert_array_equal(np.asarray(model.model.norm.weight[...]),
                                  expected["model.norm.weight"])
