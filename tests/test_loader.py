"""Model loading: config parsing, checkpoint errors, dummy weights."""

import json
import os
import re
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxpaged.config import ModelConfig, UnsupportedModelError
from jaxpaged.layers.attention import get_attention_backend
from jaxpaged.models.loader import MissingWeightsError, load_model
from tests.conftest import FIXTURES, STORIES

XLA = get_attention_backend("xla")


def _config(**overrides):
    with open(os.path.join(STORIES, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(overrides)
    return cfg


def test_rope_theta_from_either_layout():
    assert ModelConfig.from_dict(_config(rope_theta=12345.0)).rope_theta == 12345.0
    cfg = _config(rope_parameters={"rope_theta": 500000.0, "rope_type": "default"})
    del cfg["rope_theta"]
    assert ModelConfig.from_dict(cfg).rope_theta == 500000.0
    fixture = ModelConfig.from_pretrained(os.path.join(FIXTURES, "llama_gqa_untied"))
    assert (fixture.rope_theta, fixture.head_dim, fixture.num_kv_heads) == (500000.0, 16, 2)


def test_unknown_architecture_is_named():
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        ModelConfig.from_dict(_config(architectures=["GPT2LMHeadModel"]))


def test_unsupported_rope_scaling_is_named():
    with pytest.raises(UnsupportedModelError, match="yarn"):
        ModelConfig.from_dict(_config(rope_scaling={"rope_type": "yarn", "factor": 4.0}))


def test_missing_tensor_is_named(tmp_path):
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(STORIES, name), tmp_path)
    tensors = load_file(os.path.join(STORIES, "model.safetensors"))
    del tensors["model.layers.3.mlp.up_proj.weight"]
    save_file(tensors, os.path.join(tmp_path, "model.safetensors"))
    cfg = ModelConfig.from_pretrained(str(tmp_path))
    with pytest.raises(MissingWeightsError, match=r"model\.layers\.3\.mlp\.up_proj\.weight"):
        load_model(str(tmp_path), cfg, dtype=jnp.float32, backend=XLA)


def _edited_checkpoint(directory, source: str, edit) -> str:
    """``source``'s config.json and its tensors after ``edit(tensors)`` (in place)."""
    os.makedirs(directory, exist_ok=True)
    shutil.copy(os.path.join(source, "config.json"), directory)
    tensors = load_file(os.path.join(source, "model.safetensors"))
    edit(tensors)
    save_file(tensors, os.path.join(directory, "model.safetensors"))
    return str(directory)


def test_tensors_the_config_has_no_place_for_are_named(tmp_path):
    """An extra layer or expert is a checkpoint/config mismatch (vLLM refuses unexpected
    names too); rotary caches and fp8 activation / KV scales are skipped."""
    def extra(tensors):
        tensors["model.layers.5.mlp.up_proj.weight"] = tensors["model.layers.0.mlp.up_proj.weight"]
        tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(4, np.float32)
        tensors["model.layers.0.self_attn.k_proj.input_scale"] = np.ones(1, np.float32)
        tensors["model.layers.0.self_attn.k_scale"] = np.ones(1, np.float32)

    model = _edited_checkpoint(tmp_path, STORIES, extra)
    with pytest.raises(MissingWeightsError, match=r"does not match the LlamaForCausalLM config: "
                       r"tensors the config has no place for \['model\.layers\.5\.mlp\.up_proj"
                       r"\.weight'\]$"):
        load_model(model, ModelConfig.from_pretrained(model), dtype=jnp.float32, backend=XLA)


def test_an_extra_expert_and_an_odd_expert_shape_are_named(tmp_path):
    source = os.path.join(FIXTURES, "mixtral_moe")
    cfg = ModelConfig.from_pretrained(source)
    w1 = "model.layers.0.block_sparse_moe.experts.{}.w1.weight"

    def add_expert(tensors):
        tensors[w1.format(cfg.num_experts)] = tensors[w1.format(0)]

    model = _edited_checkpoint(tmp_path / "extra", source, add_expert)
    with pytest.raises(MissingWeightsError, match=rf"no place for \['{re.escape(w1.format(4))}'"):
        load_model(model, cfg, dtype=jnp.float32, backend=XLA)

    def odd_shape(tensors):
        tensors[w1.format(2)] = tensors[w1.format(2)][:-1]

    model = _edited_checkpoint(tmp_path / "odd", source, odd_shape)
    out, inp = load_file(os.path.join(source, "model.safetensors"))[w1.format(0)].shape
    with pytest.raises(MissingWeightsError, match=re.escape(
            f"wrong shapes ['{w1.format(2)}: checkpoint ({out - 1}, {inp})']: the other experts "
            f"of model.layers.0.block_sparse_moe.experts.{{e}}.w1.weight are ({out}, {inp})")):
        load_model(model, cfg, dtype=jnp.float32, backend=XLA)


def test_lm_head_beside_tied_embeddings_is_skipped_with_a_warning(tmp_path, caplog):
    def add_head(tensors):
        tensors["lm_head.weight"] = np.zeros_like(tensors["model.embed_tokens.weight"])

    model = _edited_checkpoint(tmp_path, STORIES, add_head)
    cfg = ModelConfig.from_pretrained(model)
    assert cfg.tie_word_embeddings
    loaded = load_model(model, cfg, dtype=jnp.float32, backend=XLA)
    embedding = load_file(os.path.join(STORIES, "model.safetensors"))["model.embed_tokens.weight"]
    np.testing.assert_array_equal(np.asarray(loaded.model.embed_tokens.embedding[...]), embedding)
    assert "lm_head.weight is not used" in caplog.text


def test_missing_checkpoint_files(tmp_path):
    shutil.copy(os.path.join(STORIES, "config.json"), tmp_path)
    cfg = ModelConfig.from_pretrained(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_model(str(tmp_path), cfg, dtype=jnp.float32, backend=XLA)


def test_missing_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelConfig.from_pretrained(str(tmp_path))


def test_dummy_weights_from_config_alone(tmp_path):
    shutil.copy(os.path.join(FIXTURES, "llama_gqa_untied", "config.json"), tmp_path)
    cfg = ModelConfig.from_pretrained(str(tmp_path))
    model = load_model(str(tmp_path), cfg, dtype=jnp.bfloat16, backend=XLA, load_format="dummy")
    weight = model.lm_head.weight[...]
    assert weight.shape == (320, 96) and weight.dtype == jnp.bfloat16
    assert 0.01 < float(jnp.std(weight.astype(jnp.float32))) < 0.05
    np.testing.assert_array_equal(np.asarray(model.model.norm.weight[...], np.float32), 1.0)


def test_bfloat16_checkpoint_loads(tmp_path):
    import ml_dtypes

    for name in ("config.json",):
        shutil.copy(os.path.join(STORIES, name), tmp_path)
    tensors = {k: v.astype(ml_dtypes.bfloat16)
               for k, v in load_file(os.path.join(STORIES, "model.safetensors")).items()}
    save_file(tensors, os.path.join(tmp_path, "model.safetensors"))
    cfg = ModelConfig.from_pretrained(str(tmp_path))
    model = load_model(str(tmp_path), cfg, dtype=jnp.float32, backend=XLA)
    emb = np.asarray(model.model.embed_tokens.embedding[...])
    np.testing.assert_array_equal(emb, tensors["model.embed_tokens.weight"].astype(np.float32))


def test_tensor_of_an_unloadable_dtype_is_named(tmp_path):
    """float8_e5m2 has no numpy dtype: a typed error naming the tensor and its dtype."""
    import json as _json
    header = _json.dumps({"model.norm.weight": {"dtype": "F8_E5M2", "shape": [64],
                                                "data_offsets": [0, 64]}}).encode()
    header += b" " * (-len(header) % 8)
    (tmp_path / "model.safetensors").write_bytes(
        len(header).to_bytes(8, "little") + header + bytes(64))
    from jaxpaged.models.safetensors_reader import SafetensorsReader as _SafetensorsReader
    with pytest.raises(UnsupportedModelError, match=r"model\.norm\.weight.*F8_E5M2"):
        _SafetensorsReader(str(tmp_path)).get("model.norm.weight")
