"""4-bit AWQ weights (``--quantization awq``): AutoAWQ checkpoints kept packed on the device.

The checkpoints here are packed by this file's own helper, written from AutoAWQ's format
description (eight 4-bit values per int32 along the output axis, nibble i holding output column
``8c + [0, 2, 4, 6, 1, 3, 5, 7][i]``; ``W = (q - z) * s`` per group of input rows), and
dequantized independently by an element-wise loop over that description.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxpaged.config import ModelConfig, UnsupportedModelError
from jaxpaged.distributed.tensor_parallel import TensorParallel
from jaxpaged.layers.attention import get_attention_backend
from jaxpaged.layers.awq import AWQLinear, dequantize_awq, quantize_awq
from jaxpaged.models.loader import MissingWeightsError, load_model
from tests.test_model_logits import full_sequence_logits
from tests.test_continuous_batching import random_prompts
from tests.test_tensor_parallel import greedy_ids

ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
GROUP = 32
CONFIG = {"architectures": ["LlamaForCausalLM"], "vocab_size": 512, "hidden_size": 128,
          "intermediate_size": 192, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 256,
          "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
          "bos_token_id": 1, "eos_token_id": 2}
AWQ_CONFIG = {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True,
              "version": "gemm"}
PROJECTIONS = {"self_attn.q_proj": (128, 128), "self_attn.k_proj": (128, 64),
               "self_attn.v_proj": (128, 64), "self_attn.o_proj": (128, 128),
               "mlp.gate_proj": (128, 192), "mlp.up_proj": (128, 192), "mlp.down_proj": (192, 128)}


def pack_autoawq(values: np.ndarray) -> np.ndarray:
    """[rows, cols] ints in [0, 16) -> [rows, cols / 8] int32, AutoAWQ's nibble order."""
    rows, cols = values.shape
    out = np.zeros((rows, cols // 8), np.uint32)
    for c in range(cols // 8):
        for nibble, col in enumerate(ORDER):
            out[:, c] |= values[:, 8 * c + col].astype(np.uint32) << np.uint32(4 * nibble)
    return out.view(np.int32)


def reference_dequantize(qweight, qzeros, scales) -> np.ndarray:
    """Element by element from the format description: float64 [in, out]."""
    rows, cols = qweight.shape[0], qweight.shape[1] * 8
    group = rows // qzeros.shape[0]
    nibble = lambda packed, r, n: (int(packed[r, n // 8]) >> (4 * ORDER.index(n % 8))) & 15
    w = np.empty((rows, cols))
    for k in range(rows):
        for n in range(cols):
            w[k, n] = (nibble(qweight, k, n) - nibble(qzeros, k // group, n)) \
                * float(scales[k // group, n])
    return w


def random_awq(rng, din, dout):
    q = rng.integers(0, 16, (din, dout))
    z = rng.integers(0, 16, (din // GROUP, dout))
    s = rng.uniform(0.002, 0.01, (din // GROUP, dout)).astype(np.float16)
    return pack_autoawq(q), pack_autoawq(z), s


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(AWQ checkpoint dir, the same model dequantized as a float checkpoint dir, the packed
    tensors)."""
    rng = np.random.default_rng(0)
    root = tmp_path_factory.mktemp("awq")
    common = {"model.embed_tokens.weight": rng.normal(0, 0.5, (512, 128)),
              "lm_head.weight": rng.normal(0, 0.1, (512, 128)),
              "model.norm.weight": 1 + rng.normal(0, 0.1, 128)}
    awq, floats, packed = {}, {}, {}
    for i in range(CONFIG["num_hidden_layers"]):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            common[f"model.layers.{i}.{norm}.weight"] = 1 + rng.normal(0, 0.1, 128)
        for proj, (din, dout) in PROJECTIONS.items():
            base = f"model.layers.{i}.{proj}"
            qweight, qzeros, scales = random_awq(rng, din, dout)
            packed[base] = (qweight, qzeros, scales)
            awq.update({f"{base}.qweight": qweight, f"{base}.qzeros": qzeros,
                        f"{base}.scales": scales})
            floats[f"{base}.weight"] = reference_dequantize(qweight, qzeros, scales).T
    common = {k: v.astype(np.float32) for k, v in common.items()}
    dirs = []
    for name, tensors, extra in (("awq", awq, {"quantization_config": AWQ_CONFIG}),
                                 ("float", floats, {})):
        d = root / name
        d.mkdir()
        save_file({**common, **{k: np.ascontiguousarray(v.astype(v.dtype if v.dtype != np.float64
                                                                  else np.float32))
                                for k, v in tensors.items()}}, str(d / "model.safetensors"))
        (d / "config.json").write_text(json.dumps({**CONFIG, **extra}))
        dirs.append(str(d))
    return dirs[0], dirs[1], packed


def test_packed_layout_dequantizes_as_the_format_describes():
    rng = np.random.default_rng(1)
    qweight, qzeros, scales = random_awq(rng, 64, 24)
    want = reference_dequantize(qweight, qzeros, scales)
    got = np.asarray(jax.jit(dequantize_awq)(qweight, qzeros, scales.astype(np.float32)))
    np.testing.assert_array_equal(got, want.astype(np.float32))
    np.testing.assert_array_equal(dequantize_awq(qweight, qzeros, scales, xp=np),
                                  want.astype(np.float32))


def test_round_to_nearest_quantizer_packs_in_autoawq_order():
    rng = np.random.default_rng(2)
    w = rng.normal(0, 0.05, (96, 40)).astype(np.float32)
    qweight, qzeros, scales = quantize_awq(w, GROUP)
    assert (qweight.dtype, qzeros.dtype, scales.dtype) == (np.int32, np.int32, np.float32)
    assert (qweight.shape, qzeros.shape, scales.shape) == ((96, 5), (3, 5), (3, 40))
    back = reference_dequantize(qweight, qzeros, scales)
    step = np.repeat(scales, GROUP, axis=0)
    assert (np.abs(back - w) <= step / 2 * (1 + 1e-5)).all()
    assert np.abs(back - w).max() > step.min() / 8      # it did round
    jq = jax.jit(lambda x: quantize_awq(x, GROUP, xp=jnp))(w)
    for ours, theirs in zip(jq, (qweight, qzeros, scales)):
        np.testing.assert_array_equal(np.asarray(ours), theirs)


def test_awq_checkpoint_loads_packed_and_matches_its_float_model(checkpoints):
    awq_dir, float_dir, packed = checkpoints
    cfg = ModelConfig.from_pretrained(awq_dir)
    assert (cfg.quantization, cfg.quantization_group_size) == ("awq", GROUP)
    model = load_model(awq_dir, cfg, dtype=jnp.float32, backend=get_attention_backend("xla"))
    layer = model.model.layers[1].mlp.down_proj
    assert isinstance(layer, AWQLinear)
    qweight, qzeros, scales = packed["model.layers.1.mlp.down_proj"]
    np.testing.assert_array_equal(np.asarray(layer.qweight[...]), qweight)
    np.testing.assert_array_equal(np.asarray(layer.qzeros[...]), qzeros)
    np.testing.assert_array_equal(np.asarray(layer.scales[...]), scales.astype(np.float32))
    ids = np.random.default_rng(3).integers(3, 512, 33).astype(np.int32)
    want = full_sequence_logits(float_dir, ids, page_size=8)
    got = full_sequence_logits(awq_dir, ids, page_size=8)
    assert np.abs(want).max() > 0.5
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_awq_greedy_tokens_equal_the_dequantized_float_models(checkpoints):
    awq_dir, float_dir, _ = checkpoints
    prompts = random_prompts(4, 512, seed=5, max_len=24)
    ref, _ = greedy_ids(float_dir, 1, prompts=prompts)
    out, _ = greedy_ids(awq_dir, 1, prompts=prompts)
    assert out == ref and all(len(t) > 0 for t in out)


def test_float_checkpoint_with_quantization_awq_and_dummy_weights(checkpoints):
    _, float_dir, _ = checkpoints
    cfg = ModelConfig.from_pretrained(float_dir)
    # A float checkpoint quantizes with the default group size, 128, which 192 does not fit.
    with pytest.raises(UnsupportedModelError, match="intermediate_size=192 is not a multiple "
                                                    "of the group size 128"):
        cfg.with_quantization("awq")
    cfg = dataclasses.replace(cfg, quantization="awq", quantization_group_size=GROUP)
    backend = get_attention_backend("xla")
    model = load_model(float_dir, cfg, dtype=jnp.float32, backend=backend)
    weight = load_file(f"{float_dir}/model.safetensors")["model.layers.1.mlp.down_proj.weight"]
    layer = model.model.layers[1].mlp.down_proj
    for got, want in zip((layer.qweight, layer.qzeros, layer.scales),
                         quantize_awq(weight.T, GROUP)):
        np.testing.assert_array_equal(np.asarray(got[...]), want)
    dummy = load_model(None, cfg, dtype=jnp.float32, backend=backend, load_format="dummy")
    assert dummy.model.layers[0].mlp.down_proj.qzeros[...].shape == (192 // GROUP, 16)
    assert dummy.model.layers[0].mlp.down_proj.qweight[...].dtype == jnp.int32


def test_bad_awq_checkpoints_are_refused(checkpoints, tmp_path):
    awq_dir, _, _ = checkpoints
    cfg = ModelConfig.from_pretrained(awq_dir)
    backend = get_attention_backend("xla")
    with pytest.raises(UnsupportedModelError, match="tensor parallelism"):
        load_model(awq_dir, cfg, dtype=jnp.float32, backend=backend,
                   tp=TensorParallel.create(2, cfg))
    tensors = load_file(f"{awq_dir}/model.safetensors")
    del tensors["model.layers.0.mlp.up_proj.scales"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({**CONFIG, "quantization_config": AWQ_CONFIG}))
    with pytest.raises(MissingWeightsError, match=r"model\.layers\.0\.mlp\.up_proj\.scales"):
        load_model(str(tmp_path), cfg, dtype=jnp.float32, backend=backend)
    with pytest.raises(UnsupportedModelError, match="mixture-of-experts"):
        ModelConfig.from_dict({**CONFIG, "architectures": ["MixtralForCausalLM"],
                               "num_local_experts": 4, "quantization_config": AWQ_CONFIG})
