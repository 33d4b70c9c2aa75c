"""Weight-only quantization (``--quantization int8|fp8``): the quantizer, the layer, the
bundled model's agreement with its float32 reference, tensor parallelism, fp8 checkpoints."""

import argparse
import json
import os
import re
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file, save_file

from jaxpaged import LLM, SamplingParams
from jaxpaged.config import ModelConfig, UnsupportedModelError
from jaxpaged.arg_utils import EngineArgs
from jaxpaged.layers.attention import get_attention_backend
from jaxpaged.layers.linear import linear
from jaxpaged.layers.quantization import QuantizedLinear, per_channel_scale, quantize_weight
from jaxpaged.models.loader import MissingWeightsError, load_model
from tests.conftest import STORIES, STORIES_REFERENCE
from tests.test_model_logits import full_sequence_logits
from tests.test_continuous_batching import random_prompts
from tests.test_tensor_parallel import greedy_ids

REFERENCE_IDS = np.load(os.path.join(STORIES_REFERENCE,
                                     "reference_input_ids_bos_plus_63_greedy.npy"))
REFERENCE_LOGITS = np.load(os.path.join(STORIES_REFERENCE,
                                        "reference_logits_bos_plus_63_greedy.npy"))


def _weight(seed=0, shape=(48, 24)):
    """A kernel whose channels span four orders of magnitude, with one all-zero channel."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(shape, np.float32) * np.logspace(-3, 1, shape[1], dtype=np.float32)
    w[:, 5] = 0.0
    return w


def _dequantize(kernel, scale):
    return np.asarray(kernel).astype(np.float32) * np.asarray(scale)


def test_int8_error_at_most_half_a_step_per_channel():
    w = _weight()
    q, scale = quantize_weight(w, "int8")
    assert q.dtype == np.int8 and q.shape == w.shape
    assert scale.dtype == np.float32 and scale.shape == (w.shape[1],)
    np.testing.assert_allclose(scale[w.any(0)], np.abs(w).max(0)[w.any(0)] / 127, rtol=1e-6)
    assert np.abs(q).max() == 127 and q.min() >= -127
    err = np.abs(_dequantize(q, scale) - w)
    assert (err <= scale / 2 * (1 + 1e-5)).all()
    assert (err.max(0) >= scale / 8).sum() > 20      # real rounding happened in most channels


def test_fp8_error_within_e4m3_rounding_per_channel():
    w = _weight(1)
    q, scale = quantize_weight(w, "fp8")
    assert q.dtype == ml_dtypes.float8_e4m3fn and scale.shape == (w.shape[1],)
    np.testing.assert_allclose(scale[w.any(0)], np.abs(w).max(0)[w.any(0)] / 448, rtol=1e-6)
    assert np.abs(q.astype(np.float32)).max() == 448
    err = np.abs(_dequantize(q, scale) - w)
    # Half a unit in the last place: 2**-4 of the value (3 mantissa bits), 2**-10 * scale in
    # E4M3's subnormal range.
    bound = np.maximum(np.abs(w) * 2.0**-4, scale * 2.0**-10) * (1 + 1e-5)
    assert (err <= bound).all()
    assert err.max() > 0


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_zero_channel_and_numpy_jax_agree(method):
    w = _weight(2)
    q, scale = quantize_weight(w, method)
    assert np.isfinite(scale).all() and scale[5] == 1.0
    assert not np.asarray(q[:, 5], np.float32).any()
    qj, sj = jax.jit(lambda x: quantize_weight(x, method, xp=jnp))(w)
    np.testing.assert_array_equal(np.asarray(qj), q)
    np.testing.assert_array_equal(np.asarray(sj), scale)


def test_unknown_method_is_refused():
    with pytest.raises(ValueError, match="unknown quantization method 'int4'"):
        quantize_weight(_weight(), "int4")
    with pytest.raises(ValueError, match="unknown quantization method 'int4'"):
        linear(4, 4, False, jnp.float32, nnx.Rngs(0), "int4")


@pytest.mark.parametrize("method", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_quantized_linear_equals_float_matmul_with_dequantized_weights(method, dtype):
    layer = linear(48, 24, True, dtype, nnx.Rngs(0), method)
    assert isinstance(layer, QuantizedLinear)
    q, scale = quantize_weight(_weight(3), method)
    bias = np.random.default_rng(4).standard_normal(24).astype(np.float32)
    layer.kernel.set_value(jnp.asarray(q))
    layer.scale.set_value(jnp.asarray(scale))
    layer.bias.set_value(jnp.asarray(bias, dtype))
    x = jnp.asarray(np.random.default_rng(5).standard_normal((7, 48)), dtype)
    y = layer(x)
    assert y.dtype == dtype and y.shape == (7, 24)
    as_f32 = lambda a: np.asarray(a, np.float32)     # the bfloat16 inputs, exactly
    expected = as_f32(x) @ _dequantize(q, scale) + as_f32(layer.bias[...])
    tol = 1e-5 if dtype == jnp.float32 else 3e-2
    np.testing.assert_allclose(np.asarray(y, np.float32), expected,
                               rtol=tol, atol=tol * np.abs(expected).max())


def test_per_channel_scale_layouts():
    np.testing.assert_array_equal(per_channel_scale(np.float32(0.5), 3), [0.5] * 3)
    np.testing.assert_array_equal(per_channel_scale(np.array([0.5]), 3), [0.5] * 3)
    np.testing.assert_array_equal(per_channel_scale(np.array([[1.0], [2.0], [3.0]]), 3), [1, 2, 3])
    with pytest.raises(ValueError, match=r"weight_scale of shape \[2, 2\] is neither"):
        per_channel_scale(np.ones((2, 2)), 3)


# ---- the bundled model --------------------------------------------------------------------

def _top1_agreement(logits):
    return (logits.argmax(-1) == REFERENCE_LOGITS.argmax(-1)).mean()


def test_int8_bundled_model_agrees_with_float32_reference():
    logits = full_sequence_logits(STORIES, REFERENCE_IDS, quantization="int8")
    assert logits.shape == REFERENCE_LOGITS.shape == (64, 512)
    assert _top1_agreement(logits) >= 0.99
    diff = np.abs(logits - REFERENCE_LOGITS).max()
    assert 1e-3 < diff < 0.5          # quantized (not the float weights), and close


def test_int8_greedy_once_upon_a_time_equals_reference_text():
    with open(os.path.join(STORIES_REFERENCE, "expected_greedy_prompt_OnceUponATime_n64.txt")) as f:
        expected = f.read()
    prompt = "Once upon a time"
    llm = LLM(quantization="int8", enforce_eager=True, max_num_seqs=8, max_num_batched_tokens=64)
    assert llm.engine.model_config.quantization == "int8"
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=60), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 60
    assert out.outputs[0].text == expected[len(prompt):].rstrip("\n")


def _flat_params(model_dir, cfg, **kw) -> dict[tuple, np.ndarray]:
    model = load_model(model_dir, cfg, dtype=jnp.float32, backend=get_attention_backend("xla"),
                       **kw)
    return {path: np.asarray(var.get_value()) for path, var in nnx.to_flat_state(nnx.state(model))}


def test_dummy_weights_are_the_float_dummy_weights_quantized():
    with open(os.path.join(STORIES, "config.json")) as f:
        cfg = ModelConfig.from_dict({**json.load(f), "num_hidden_layers": 2})
    floats = _flat_params(None, cfg, load_format="dummy", seed=3)
    ints = _flat_params(None, cfg.with_quantization("int8"), load_format="dummy", seed=3)
    path = ("model", "layers", 1, "mlp", "down_proj")
    kernel, scale = quantize_weight(floats[path + ("weight",)].T, "int8")
    assert ints[path + ("kernel",)].dtype == np.int8
    np.testing.assert_array_equal(ints[path + ("kernel",)], kernel)
    np.testing.assert_array_equal(ints[path + ("scale",)], scale)
    embed = ("model", "embed_tokens", "embedding")
    np.testing.assert_array_equal(ints[embed], floats[embed])


# ---- flags ----------------------------------------------------------------------------------

def test_bad_quantization_value_is_a_clear_error(capsys):
    with pytest.raises(ValueError, match=r"EngineArgs\.quantization must be one of "
                                         r"\('int8', 'fp8', 'awq'\) or None, got 'int4'"):
        EngineArgs(quantization="int4")
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert EngineArgs.from_cli_args(parser.parse_args(["-q", "fp8"])).quantization == "fp8"
    assert EngineArgs.from_cli_args(parser.parse_args([])).quantization is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "int4"])
    assert "argument --quantization/-q: invalid choice: 'int4'" in capsys.readouterr().err


# ---- tensor parallelism ---------------------------------------------------------------------

PROMPTS = random_prompts(3, 512, seed=3, max_len=24)


def test_int8_tp2_greedy_equals_tp1_and_scales_shard_with_output_features():
    ref, _ = greedy_ids(STORIES, 1, prompts=PROMPTS, quantization="int8")
    out, two = greedy_ids(STORIES, 2, prompts=PROMPTS, quantization="int8")
    assert out == ref
    state = dict(nnx.to_flat_state(two.engine.runner._state))
    layer = ("model", "layers", 0)
    spec = lambda *p: state[layer + p].get_value().sharding.spec
    for column in (("self_attn", "q_proj"), ("mlp", "gate_proj")):
        assert state[layer + column + ("kernel",)].get_value().dtype == jnp.int8
        assert spec(*column, "kernel") == P(None, "tp")
        assert spec(*column, "scale") == P("tp")
    for row in (("self_attn", "o_proj"), ("mlp", "down_proj")):
        assert spec(*row, "kernel") == P("tp", None)
        assert spec(*row, "scale") == P()


@pytest.mark.slow
@pytest.mark.parametrize("load_format", ["auto", "dummy"])
def test_int8_tp8_greedy_equals_tp1(load_format):
    """8 devices, 4 KV heads: each k/v scale column is copied to two devices."""
    kw = dict(prompts=PROMPTS, quantization="int8", load_format=load_format)
    assert greedy_ids(STORIES, 8, **kw)[0] == greedy_ids(STORIES, 1, **kw)[0]


# ---- checkpoints stored in fp8 --------------------------------------------------------------

COMPRESSED_TENSORS_FP8 = {
    "quant_method": "compressed-tensors", "format": "float-quantized",
    "config_groups": {"group_0": {
        "targets": ["Linear"], "input_activations": None,
        "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True}}},
    "ignore": ["lm_head"]}
FP8 = {"quant_method": "fp8", "activation_scheme": "dynamic"}


def _fp8_checkpoint(directory, quantization_config, per_channel: bool, without=(),
                    edit=None) -> str:
    """The bundled model with its projections stored in fp8 and a ``weight_scale`` each
    ([out, 1] per channel, [1] per tensor), as llm-compressor and AutoFP8 write them; the
    tensors named in ``without`` left out; ``edit(tensors)`` last."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(STORIES, name), directory)
    with open(os.path.join(STORIES, "config.json")) as f:
        cfg = json.load(f)
    if quantization_config is not None:
        cfg["quantization_config"] = quantization_config
    (directory / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(os.path.join(STORIES, "model.safetensors"))
    for name in [n for n in tensors if n.endswith("_proj.weight")]:
        w = tensors[name]                                          # [out, in]
        if per_channel:
            kernel, scale = quantize_weight(w.T, "fp8")
            tensors[name], tensors[f"{name}_scale"] = kernel.T.copy(), scale[:, None]
        else:
            flat, scale = quantize_weight(w.reshape(-1, 1), "fp8")
            tensors[name], tensors[f"{name}_scale"] = flat.reshape(w.shape), scale
    if edit is not None:
        edit(tensors)
    save_file({k: v for k, v in tensors.items() if k not in without},
              os.path.join(directory, "model.safetensors"))
    return str(directory)


def test_compressed_tensors_fp8_per_channel_checkpoint_loads_as_stored(tmp_path):
    """The same bytes as quantizing the float checkpoint while loading."""
    model = _fp8_checkpoint(tmp_path, COMPRESSED_TENSORS_FP8, per_channel=True)
    cfg = ModelConfig.from_pretrained(model)
    assert cfg.quantization == "fp8"
    stored, quantized = (_flat_params(d, cfg) for d in (model, STORIES))
    assert stored.keys() == quantized.keys()
    for path, value in stored.items():
        assert value.dtype == quantized[path].dtype, path
        assert value.tobytes() == quantized[path].tobytes(), path
    assert stored[("model", "layers", 0, "self_attn", "v_proj", "kernel")].dtype == \
        ml_dtypes.float8_e4m3fn


def test_fp8_per_tensor_checkpoint_loads(tmp_path):
    model = _fp8_checkpoint(tmp_path, FP8, per_channel=False)
    logits = full_sequence_logits(model, REFERENCE_IDS)
    assert 1e-3 < np.abs(logits - REFERENCE_LOGITS).max() < 3.0
    assert _top1_agreement(logits) >= 0.9


def test_fp8_checkpoint_refuses_int8_and_missing_scales(tmp_path):
    model = _fp8_checkpoint(tmp_path, FP8, per_channel=False,
                            without=["model.layers.1.self_attn.k_proj.weight_scale"])
    with pytest.raises(UnsupportedModelError, match=r"stored quantized \(fp8\).*'int8'"):
        ModelConfig.from_pretrained(model).with_quantization("int8")
    with pytest.raises(MissingWeightsError, match=r"k_proj\.weight is stored in fp8 but the "
                                                  r"checkpoint has no .*k_proj\.weight_scale"):
        full_sequence_logits(model, REFERENCE_IDS)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -0.5])
def test_fp8_checkpoint_with_a_corrupt_scale_is_refused(tmp_path, bad):
    name = "model.layers.1.self_attn.k_proj.weight_scale"

    def corrupt(tensors):
        tensors[name][3] = bad

    model = _fp8_checkpoint(tmp_path, FP8, per_channel=True, edit=corrupt)
    with pytest.raises(MissingWeightsError, match=re.escape(
            f"{name}: weight_scale holds 1 value(s) that are NaN, infinite or negative (e.g. "
            f"{np.float32(bad)}); the checkpoint is corrupt")):
        full_sequence_logits(model, REFERENCE_IDS)


def test_fp8_tensors_never_load_as_floats(tmp_path):
    """fp8 projections in a checkpoint whose config.json declares no quantization."""
    model = _fp8_checkpoint(tmp_path, None, per_channel=True)
    with pytest.raises(UnsupportedModelError, match=r"_proj\.weight is stored in 8 bits "
                                                    r"\(float8_e4m3fn\) but loads into a float"):
        full_sequence_logits(model, REFERENCE_IDS)
    with pytest.raises(UnsupportedModelError, match="float8_e4m3fn: 8-bit checkpoint weights load "
                                                    r"only as float8_e4m3fn into an fp8 model "
                                                    r"\(this model: int8\)"):
        full_sequence_logits(model, REFERENCE_IDS, quantization="int8")


@pytest.mark.parametrize("quantization_config, named", [
    ({"quant_method": "gptq", "bits": 4, "group_size": 128}, r"quant_method 'gptq'.*this method"),
    ({"quant_method": "awq", "bits": 8, "group_size": 128},
     r"AWQ checkpoint with bits/zero_point/version \(8, True, 'gemm'\)"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv", "group_size": 128}, "'gemv'"),
    ({**FP8, "weight_block_size": [128, 128]}, r"quant_method 'fp8'.*block-wise scales"),
    ({**COMPRESSED_TENSORS_FP8, "format": "int-quantized"},
     r"quant_method 'compressed-tensors'.*format 'int-quantized'"),
    ({**COMPRESSED_TENSORS_FP8, "config_groups": {"group_0": {"weights": {
        "num_bits": 8, "type": "float", "strategy": "group", "group_size": 128}}}},
     r"quant_method 'compressed-tensors'.*weight schemes"),
])
def test_other_quantized_checkpoints_are_refused_by_name(quantization_config, named):
    with open(os.path.join(STORIES, "config.json")) as f:
        cfg = json.load(f)
    with pytest.raises(UnsupportedModelError, match=named):
        ModelConfig.from_dict({**cfg, "quantization_config": quantization_config})


def test_agreement_benchmark_measures_float32_as_the_published_reference(stories_llm):
    from jaxpaged.benchmarks.quantization_agreement import measure, published_reference

    reference = published_reference(STORIES)
    assert len(reference["ids"]) == 64 and reference["text"].startswith(", there was")
    scores = measure(stories_llm, reference["ids"])
    assert scores["top1"] == reference["top1"]
    assert np.abs(scores["logprobs"] - reference["logprobs"]).max() < 1e-4
