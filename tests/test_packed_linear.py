"""GGUF projections kept packed (``jaxpaged.layers.packed_linear``): the block decoding equals
``gguf.quants.dequantize`` bit for bit, the C++ kernel equals a float64 matmul with those
weights, and a packed model's logits equal the dequantized model's."""

from __future__ import annotations

import contextlib

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from jaxpaged.arg_utils import EngineArgs
from jaxpaged.layers import packed_linear
from jaxpaged.models import llama
from jaxpaged.layers.attention.base import resolve_kv_cache_dtype
from jaxpaged.layers.cpu_build import packed_int8_dots
from jaxpaged.layers.packed_layout import (dequantize, integers, pack_weight, reference_product,
                                           split_activations)
from jaxpaged.layers.packed_linear import packed_matmul, packed_projections
from jaxpaged.layers.rotary import apply_rope, rope_inv_freq
from jaxpaged.models.gguf_blocks import PACKABLE_TYPES, decode_blocks
from jaxpaged.models.gguf_loader import GGUFCheckpoint, keeps_packed
from jaxpaged.runner import worker
from jaxpaged.runner.worker import auto_kv_cache_dtype, gguf_auto_dtype, keeps_gguf_packed
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
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 17, 130])
@pytest.mark.parametrize("int8", [True, False])
def test_kernel_equals_float64_matmul_of_the_dequantized_weight(type_name, rows, int8):
    """Every register-block shape (float paths: 1-4 rows, then a remainder; 17 rows: the
    float panel of 8 rows and more; int8 path: 4 rows at a time, then 2, then 1; 130 rows:
    the float panel always), 3, 2 and 1 vectors of features (48 = 3 vectors, 40 padded to
    3), 4-bit and 8-bit, groups of 32 and 16. Where the call multiplies in int8
    (``packed_int8_dots``, fewer than 128 rows) the float64 product is of the activations it
    splits (``reference_product``), and the error against the exact product stays within
    the bound the split allows: each activation within half its group's step e (plus
    float32's rounding), so |error| <= sum_k |scale * (q - c)| * e_k / 2."""
    rng = np.random.default_rng(rows)
    for n, k in ((48, 256), (40, 512), (64, 256)):
        data = blocks_of(type_name, n, k, seed=n)
        w = gguf.quants.dequantize(data, getattr(T, type_name)).reshape(n, k)
        q, scale, offset = decode_blocks(data, type_name, k)
        packed = pack_weight(q, scale, offset, PACKABLE_TYPES[type_name][0])
        # GGUF's half-precision scales stay half; Q6_K's products of two scales need float32.
        assert packed["block_scale"].dtype == packed["block_min"].dtype == (
            np.float32 if type_name == "Q6_K" else np.float16)
        x = rng.normal(size=(rows, k)).astype(np.float32)
        got = np.asarray(jax.jit(packed_matmul, static_argnames="int8")(
            x, *packed.values(), int8=int8))
        assert got.shape == (rows, 48 if n == 40 else n)
        split = int8 and rows < 128 and packed_int8_dots()
        want = reference_product(x, packed, k, n, split=split)
        np.testing.assert_allclose(got[:, :n], want, rtol=0, atol=2e-6 * np.abs(want).max())
        assert not got[:, n:].any()                    # padding features are zero
        exact = x.astype(np.float64) @ w.astype(np.float64).T
        if split:
            assert np.abs(got[:, :n] - exact).max() > 0     # the split is not the identity
            assert np.all(np.abs(got[:, :n] - exact) <= split_bound(x, packed, k, n)
                          + 2e-6 * np.abs(exact).max())
        else:
            np.testing.assert_allclose(got[:, :n], exact, rtol=0,
                                       atol=2e-6 * np.abs(exact).max())


def split_bound(x, packed, k, n):
    """[M, n]: sum_k |scale * (q - c)| * e_k / 2, e_k = amax of k's group / (127 * 2^16)."""
    group = k // packed["block_scale"].shape[1]
    step = np.abs(x).reshape(len(x), -1, group).max(-1) / (127 * 65536)    # [M, K/G]
    q = integers(packed["blocks"], k, np).transpose(0, 2, 1).reshape(-1, k)[:n]
    c = 8 if packed["blocks"].dtype == np.uint8 else 0
    scale = np.repeat(packed["block_scale"].transpose(0, 2, 1).reshape(-1, k // group)[:n],
                      group, 1)
    return (np.repeat(step, group, 1) / 2) @ np.abs(scale * (q - c)).T


def test_split_activations_are_24_bit_fixed_point_per_group():
    """Each group of 8 is e * T with e = amax / (127 * 2^16) (float32) and T an integer: the
    group's largest value is T = +-127 * 2^16, and every value is within a step (half a
    step, plus float32's rounding of x / e)."""
    x = np.array([[1.0, -1.0, 0.5, 0.25, 1 / 3, 0.0, 1e-9, -0.123456789],
                  [3.0, 2.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]], np.float32)
    got = split_activations(x, 8)
    e = (np.abs(x).max(axis=1, keepdims=True) / np.float32(127 * 65536)).astype(np.float32)
    ints = got / e.astype(np.float64)
    np.testing.assert_allclose(ints, np.round(ints), rtol=0, atol=1e-6)
    assert np.round(ints)[0, 0] == -np.round(ints)[0, 1] == np.round(ints)[1, 0] == 127 * 65536
    assert np.all(np.abs(got - x) <= e)
    assert got[0, 6] == 0.0                           # 1e-9 is below half a step
    assert not split_activations(np.zeros((1, 8), np.float32), 8).any()


@pytest.mark.parametrize("reference,length", [(False, 19), (False, 5), (True, 19)])
def test_packed_model_logits_equal_the_dequantized_model(tmp_path, monkeypatch, reference,
                                                         length):
    """The whole random Llama through the packed layers (the kernel, or with ``reference``
    the jnp dequantization it replaces) against the same file dequantized on load, every
    block type in the fused four calls a layer: 5 and 19 tokens take the kernel's int8 dot
    products on CPUs with AVX-512 VNNI (its float integer path and float panel elsewhere)."""
    path = str(tmp_path / "packed.gguf")
    write_random_llama(path, tied=False, types=PACKED_TYPES, embedding_type=T.Q4_K)
    assert keeps_packed(path)
    ckpt = GGUFCheckpoint(path, HEADS, KV_HEADS)
    assert ckpt.get_packed("model.layers.0.self_attn.v_proj.weight")["blocks"].dtype == np.int8
    with pytest.raises(Exception, match="F32.*not kept packed"):
        ckpt.get_packed("model.norm.weight")
    ids = np.random.default_rng(2).integers(3, VOCAB, length).astype(np.int32)
    want = full_sequence_logits(path, ids, page_size=8)
    if reference:
        monkeypatch.setattr(packed_linear, "kernel_available", lambda: False)
        monkeypatch.setattr(llama, "kernel_available", lambda: False)
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


def test_auto_kv_cache_dtype_rule():
    """--kv-cache-dtype auto: float16 under a packed float32 GGUF model, else the model's
    dtype; float16 asked for under a bfloat16 model is refused, naming the field."""
    assert auto_kv_cache_dtype("auto", True, jnp.float32) == "float16"
    assert auto_kv_cache_dtype("auto", False, jnp.float32) == "auto"
    assert auto_kv_cache_dtype("auto", True, jnp.bfloat16) == "auto"
    assert auto_kv_cache_dtype("fp8", True, jnp.float32) == "fp8"
    assert auto_kv_cache_dtype("float16", False, jnp.float32) == "float16"
    assert resolve_kv_cache_dtype("float16", jnp.float32) == jnp.float16
    with pytest.raises(ValueError, match="kv_cache_dtype 'float16' needs a float32 model"):
        resolve_kv_cache_dtype(auto_kv_cache_dtype("float16", False, jnp.bfloat16),
                               jnp.bfloat16)


def test_gguf_auto_dtype_rule(monkeypatch):
    """--dtype auto for a GGUF: float32 when packed; dequantized, bfloat16 on a GPU and on
    a CPU with AVX-512 BF16, float32 on other CPUs."""
    monkeypatch.setattr(worker, "cpu_flags", lambda: "flags : fpu avx512f avx512_bf16 sse")
    assert gguf_auto_dtype(True, "cpu") == "float32"
    assert gguf_auto_dtype(False, "cpu") == "bfloat16"
    assert gguf_auto_dtype(False, "gpu") == gguf_auto_dtype(False, "cuda") == "bfloat16"
    monkeypatch.setattr(worker, "cpu_flags", lambda: "flags : fpu avx512f avx2")
    assert gguf_auto_dtype(False, "cpu") == "float32"
    assert gguf_auto_dtype(True, "cuda") == "float32"


@pytest.mark.skipif(not packed_linear.kernel_available(), reason="no C++ compiler for the kernel")
def test_kernel_rope_equals_apply_rope_of_its_outputs():
    """rope=(positions, inv_freq) rotates the first two outputs (q: 3 heads of 16, k: 1
    head) as jaxpaged.layers.rotary.apply_rope does, only the computed rows, the third
    output (v) untouched."""
    rng = np.random.default_rng(7)
    weights = [pack_weight(rng.integers(0, 16, (n, 64)), rng.uniform(0.01, 0.1, (n, 2)),
                           rng.uniform(-0.2, 0.2, (n, 2)), 4) for n in (48, 16, 16)]
    params = [tuple(jnp.asarray(p[name]) for name in ("blocks", "block_scale", "block_min"))
              for p in weights]
    x = jnp.asarray(rng.normal(size=(5, 64)).astype(np.float32))
    positions = jnp.asarray([0, 3, 17, 1000, 9], jnp.int32)
    inv_freq = rope_inv_freq(16, 10000.0)
    rows = jnp.asarray(4, jnp.int32)
    plain = packed_projections(x, params, rows=rows)
    q, k, v = packed_projections(x, params, rows=rows, rope=(positions, inv_freq))
    for got, want, heads in ((q, plain[0], 3), (k, plain[1], 1)):
        rotated = apply_rope(want.reshape(5, heads, 16), positions, inv_freq).reshape(5, -1)
        np.testing.assert_allclose(np.asarray(got)[:4], np.asarray(rotated)[:4], rtol=0,
                                   atol=1e-5 * float(np.abs(np.asarray(want)).max()))
        assert not np.asarray(got)[4:].any()
    np.testing.assert_array_equal(np.asarray(v), np.asarray(plain[2]))
    assert not np.allclose(np.asarray(q), np.asarray(plain[0]))


@pytest.mark.skipif(not packed_linear.kernel_available(), reason="no C++ compiler for the kernel")
def test_weights_stacked_over_layers_give_the_same_logits(tmp_path):
    """Each kind of packed array stacked over the layers (``jaxpaged.layers.layer_stack``)
    is read in place by the kernel: logits equal the per-layer arrays' bit for bit; a file
    whose layers mix block types stacks only the kinds of one shape and dtype (its norms
    here, and o_proj's int8 blocks), and one call then mixes stacked and per-layer weights."""
    ids = np.random.default_rng(3).integers(3, VOCAB, 11).astype(np.int32)
    stacked = []

    def stack(model, cfg, num_tokens):
        stacked.append(model.model.stack_packed_weights())
        return contextlib.nullcontext()

    for name, types in (("same", [PACKED_TYPES[0]] * 2), ("mixed", PACKED_TYPES)):
        path = str(tmp_path / f"{name}.gguf")
        write_random_llama(path, tied=False, types=types, embedding_type=T.Q8_0)
        want = full_sequence_logits(path, ids, page_size=8, quantization="gguf")
        got = full_sequence_logits(path, ids, page_size=8, quantization="gguf", prepare=stack)
        np.testing.assert_array_equal(got, want)
    assert stacked == [23, 3]     # 7 projections x 3 arrays and 2 norms; 2 norms and 1


@pytest.mark.skipif(not packed_linear.kernel_available(), reason="no C++ compiler for the kernel")
def test_one_call_takes_one_layer():
    from jaxpaged.layers.layer_stack import LayerSlice

    rng = np.random.default_rng(1)
    p = pack_weight(rng.integers(0, 16, (16, 64)), rng.uniform(0.01, 0.1, (16, 2)),
                    rng.uniform(-0.2, 0.2, (16, 2)), 4)
    stacks = [jnp.stack([jnp.asarray(p[n])] * 3) for n in ("blocks", "block_scale", "block_min")]
    x = jnp.asarray(rng.normal(size=(2, 64)), jnp.float32)
    (want,) = packed_projections(x, [tuple(jnp.asarray(p[n]) for n in p)])
    (got,) = packed_projections(x, [tuple(LayerSlice(s, 2) for s in stacks)])
    np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="one layer"):
        packed_projections(x, [(LayerSlice(stacks[0], 0), LayerSlice(stacks[1], 1),
                                LayerSlice(stacks[2], 1))])
