"""GGUF projections kept packed (``jaxpaged.layers.packed_linear``): the block decoding equals
``gguf.quants.dequantize`` bit for bit, the C++ kernel equals a float64 matmul with those
weights, and a packed model's logits equal the dequantized model's."""

from __future__ import annotations

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from jaxpaged.engine.arg_utils import EngineArgs
from jaxpaged.layers import packed_linear
from jaxpaged.layers.packed_layout import dequantize, pack_weight
from jaxpaged.layers.packed_linear import PackedEmbedding, packed_matmul
from jaxpaged.models.gguf_blocks import PACKABLE_TYPES, decode_blocks
from jaxpaged.models.gguf_loader import GGUFCheckpoint, keeps_packed
from jaxpaged.runner.worker import keeps_gguf_packed
from tests.test_gguf_loader import HEADS, KV_HEADS, VOCAB, encode, write_random_llama
from tests.test_model_logits import full_sequence_logits

#: Every packable type on every projection, so each appears on q and k (whose rows the
#: loader unpermutes) and on wide and narrow inputs.
PACKED_TYPES = [{"attn_q": T.Q4_K, "attn_k": T.Q5_K, "attn_v": T.Q6_K, "attn_output": T.Q8_0,
                 "ffn_gate": T.Q4_0, "ffn_up": T.Q4_1, "ffn_down": T.Q4_K},
                {"attn_q": T.Q8_0, "attn_k": T.Q4_1, "attn_v": T.Q4_0, "attn_output": T.Q5_K,
                 "ffn_gate": T.Q6_K, "ffn_up": T.Q5_K, "ffn_down": T.Q6_K}]


def blocks_of(type_name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = rng.normal(0, 0.1, (rows, cols)).astype(np.float32)
    return encode(w, getattr(T, type_name), rng)


@pytest.mark.parametrize("type_name", sorted(PACKABLE_TYPES))
def test_decoded_blocks_are_gguf_dequantize_bit_for_bit(type_name):
    rows, cols = 40, 512           # 40 rows: two and a half lane groups (padding)
    data = blocks_of(type_name, rows, cols)
    want = gguf.quants.dequantize(data, getattr(T, type_name)).reshape(rows, cols)
    q, scale, offset = decode_blocks(data, type_name, cols)
    bits, group = PACKABLE_TYPES[type_name]
    assert q.shape == (rows, cols) and scale.shape == offset.shape == (rows, cols // group)
    packed = pack_weight(q, scale, offset, bits)
    assert packed["blocks"].dtype == (np.uint8 if bits == 4 else np.int8)
    assert packed["blocks"].shape == (3, cols // 2 if bits == 4 else cols, 16)
    got = dequantize(*packed.values(), cols, rows)
    np.testing.assert_array_equal(got, want)
    got_jnp = np.asarray(jax.jit(lambda *p: dequantize(*p, cols, rows, xp=jnp))(
        *packed.values()))
    np.testing.assert_array_equal(got_jnp, want)


def test_decode_refuses_what_it_cannot_read():
    with pytest.raises(ValueError, match="F16"):
        decode_blocks(np.zeros((2, 64), np.uint8), "F16", 32)
    with pytest.raises(ValueError, match="does not hold 64 weights"):
        decode_blocks(np.zeros((2, 20), np.uint8), "Q4_1", 64)
    with pytest.raises(ValueError, match="cannot pack"):
        pack_weight(np.zeros((4, 33), np.uint8), np.ones((4, 1), np.float32),
                    np.zeros((4, 1), np.float32), 4)


@pytest.mark.skipif(not packed_linear.kernel_available(), reason="no C++ compiler for the kernel")
@pytest.mark.parametrize("type_name", ["Q4_1", "Q8_0", "Q6_K"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 17])
def test_kernel_equals_float64_matmul_of_the_dequantized_weight(type_name, rows):
    """Every register-block shape (1-4 rows, then a remainder; 17 rows: the float panel of
    8 rows and more), 3, 2 and 1 vectors of
    features (48 = 3 vectors, 40 padded to 3), 4-bit and 8-bit, groups of 32 and 16."""
    rng = np.random.default_rng(rows)
    for n, k in ((48, 256), (40, 512), (64, 256)):
        data = blocks_of(type_name, n, k, seed=n)
        w = gguf.quants.dequantize(data, getattr(T, type_name)).reshape(n, k)
        q, scale, offset = decode_blocks(data, type_name, k)
        packed = pack_weight(q, scale, offset, PACKABLE_TYPES[type_name][0])
        x = rng.normal(size=(rows, k)).astype(np.float32)
        got = np.asarray(jax.jit(packed_matmul)(x, *packed.values()))
        assert got.shape == (rows, 48 if n == 40 else n)
        want = x.astype(np.float64) @ w.astype(np.float64).T
        np.testing.assert_allclose(got[:, :n], want, rtol=0, atol=2e-6 * np.abs(want).max())
        assert not got[:, n:].any()                    # padding features are zero


def test_packed_embedding_rows_equal_the_dequantized_rows():
    data = blocks_of("Q8_0", VOCAB, 256)
    table = gguf.quants.dequantize(data, T.Q8_0).reshape(VOCAB, 256)
    emb = PackedEmbedding(VOCAB, 256, jnp.float32)
    for name, value in pack_weight(*decode_blocks(data, "Q8_0", 256), 8).items():
        getattr(emb, name).set_value(jnp.asarray(value))
    ids = np.array([0, 5, 17, 95, 5, 64], np.int32)
    np.testing.assert_array_equal(np.asarray(emb(jnp.asarray(ids))), table[ids])
    h = np.random.default_rng(0).normal(size=(3, 256)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(emb.attend(jnp.asarray(h))), h @ table.T, atol=1e-4)


@pytest.mark.parametrize("reference", [False, True])
def test_packed_model_logits_equal_the_dequantized_model(tmp_path, monkeypatch, reference):
    """The whole random Llama through the packed layers (the kernel, or with ``reference``
    the jnp dequantization it replaces) against the same file dequantized on load."""
    path = str(tmp_path / "packed.gguf")
    write_random_llama(path, tied=False, types=PACKED_TYPES, embedding_type=T.Q4_K)
    assert keeps_packed(path)
    ckpt = GGUFCheckpoint(path, HEADS, KV_HEADS)
    assert ckpt.get_packed("model.layers.0.self_attn.v_proj.weight")["blocks"].dtype == np.int8
    with pytest.raises(Exception, match="F32.*not kept packed"):
        ckpt.get_packed("model.norm.weight")
    ids = np.random.default_rng(2).integers(3, VOCAB, 19).astype(np.int32)
    want = full_sequence_logits(path, ids, page_size=8)
    if reference:
        monkeypatch.setattr(packed_linear, "kernel_available", lambda: False)
    got = full_sequence_logits(path, ids, page_size=8, quantization="gguf")
    assert np.abs(want).max() > 0.5
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)


def test_which_files_and_setups_stay_packed(tmp_path):
    mixed = str(tmp_path / "mixed.gguf")
    write_random_llama(mixed)                     # BF16, F32 and F16 tensors among them
    packed = str(tmp_path / "packed.gguf")
    write_random_llama(packed, types=PACKED_TYPES, embedding_type=T.Q8_0)
    assert not keeps_packed(mixed) and keeps_packed(packed)
    from jaxpaged.config import ModelConfig
    cfg = ModelConfig.from_pretrained(packed)
    args = EngineArgs(model=packed)
    assert keeps_gguf_packed(args, cfg, 1, "cpu")
    assert not keeps_gguf_packed(args, cfg, 2, "cpu")            # tensor parallel
    assert not keeps_gguf_packed(args, cfg, 1, "gpu")
    assert not keeps_gguf_packed(EngineArgs(model=mixed), ModelConfig.from_pretrained(mixed),
                                 1, "cpu")
    assert not keeps_gguf_packed(args, cfg.with_quantization("int8"), 1, "cpu")
