"""gpt-oss beyond the shared family checks (tests/test_families_2026.py): MXFP4 expert
checkpoints dequantized on load exactly as transformers' ``convert_moe_packed_tensors`` does,
into the float checkpoint's weights, and named errors for what is refused or missing."""

import json
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from jaxpaged.config import ModelConfig, UnsupportedModelError
from jaxpaged.errors import TensorParallelError
from jaxpaged.layers.attention import get_attention_backend
from jaxpaged.models.gpt_oss_checkpoint import dequantize_mxfp4
from jaxpaged.models.loader import load_model
from jaxpaged.models.mixtral import use_expert_parallelism
from jaxpaged.models.safetensors_reader import MissingWeightsError
from tests.conftest import FIXTURES
from tests.test_model_logits import full_sequence_logits

FIXTURE = os.path.join(FIXTURES, "gpt_oss")
KERNELS = ("gate_up_proj", "down_proj")


def packed():
    with np.load(os.path.join(FIXTURE, "mxfp4_experts.npz")) as npz:
        return dict(npz)


def checkpoint_copy(tmp_path, change_tensors, config_changes=None):
    """The fixture in ``tmp_path`` with its tensors passed through ``change_tensors`` and
    ``config_changes`` merged into config.json."""
    shutil.copytree(FIXTURE, tmp_path, dirs_exist_ok=True)
    tensors = change_tensors(load_file(os.path.join(FIXTURE, "model.safetensors")))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with open(tmp_path / "config.json") as f:
        cfg = json.load(f)
    with open(tmp_path / "config.json", "w") as f:
        json.dump({**cfg, **(config_changes or {})}, f)
    return str(tmp_path)


def test_mxfp4_dequantization_equals_transformers():
    """The fixture's float expert kernels are transformers' dequantization of its random
    MXFP4 blocks and scales (tests/fixtures/make_family_references.py): bit for bit."""
    floats = load_file(os.path.join(FIXTURE, "model.safetensors"))
    blocks = packed()
    names = [n for n in floats if n.endswith(KERNELS)]
    assert len(names) == 8                                  # 4 layers x 2 kernels
    for name in names:
        got = dequantize_mxfp4(blocks[f"{name}_blocks"], blocks[f"{name}_scales"])
        assert got.shape == floats[name].shape
        np.testing.assert_array_equal(got, floats[name])
    with pytest.raises(ValueError, match="MXFP4 blocks"):
        dequantize_mxfp4(blocks[f"{names[0]}_blocks"][..., :8], blocks[f"{names[0]}_scales"])


def test_mxfp4_checkpoint_loads_the_float_checkpoints_weights(tmp_path):
    """An MXFP4 checkpoint (``quantization_config.quant_method`` mxfp4, ``*_blocks`` and
    ``*_scales`` in place of the float kernels) loads, dequantized, into exactly the weights of
    the float checkpoint, whose logits and greedy tokens are transformers'
    (tests/test_families_2026.py)."""
    def to_mxfp4(tensors):
        kept = {k: v for k, v in tensors.items() if not k.endswith(KERNELS)}
        return {**kept, **packed()}

    model_dir = checkpoint_copy(tmp_path, to_mxfp4, {"quantization_config": {
        "quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                            "model.layers.*.mlp.router",
                                                            "model.embed_tokens", "lm_head"]}})
    backend = get_attention_backend("xla")
    states = [nnx.to_flat_state(nnx.state(load_model(
        d, ModelConfig.from_pretrained(d), dtype=jnp.float32, backend=backend)))
        for d in (model_dir, FIXTURE)]
    paths = [path for path, _ in states[1]]
    assert [path for path, _ in states[0]] == paths
    assert sum("experts" in path for path in paths) == 4 * 6      # w1, w3, w2 and biases
    for (path, got), (_, want) in zip(*states):
        np.testing.assert_array_equal(np.asarray(got.get_value()), np.asarray(want.get_value()),
                                      err_msg=str(path))


def test_missing_sinks_are_named(tmp_path):
    model_dir = checkpoint_copy(tmp_path, lambda t: {k: v for k, v in t.items()
                                                     if k != "model.layers.1.self_attn.sinks"})
    with pytest.raises(MissingWeightsError, match=r"model\.layers\.1\.self_attn\.sinks"):
        full_sequence_logits(model_dir, np.arange(1, 5), page_size=8)


def test_quantizing_the_experts_is_refused():
    cfg = ModelConfig.from_pretrained(FIXTURE).with_quantization("int8")
    with pytest.raises(UnsupportedModelError, match="gpt-oss experts cannot be quantized"):
        load_model(FIXTURE, cfg, dtype=np.float32, backend=get_attention_backend("xla"))


def test_expert_parallelism_is_refused():
    """Its experts split by tensor parallelism only (docs/models.md)."""
    model = load_model(FIXTURE, ModelConfig.from_pretrained(FIXTURE), dtype=jnp.float32,
                       backend=get_attention_backend("xla"))
    with pytest.raises(TensorParallelError, match="enable_expert_parallel is not supported "
                                                  "for GptOssForCausalLM"):
        use_expert_parallelism(model, None)
