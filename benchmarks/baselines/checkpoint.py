"""A Hugging Face Llama directory with random weights, loadable by jaxpaged and transformers.

Both engines of a comparison load the same ``model.safetensors`` (torch's ``[out, in]`` layout,
transformers' tensor names), so they run identical weights.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
from safetensors.numpy import save_file


def llama_tensor_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of a ``LlamaForCausalLM`` checkpoint and its shape."""
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    d = cfg.get("head_dim") or h // heads
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not cfg.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (v, h)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (heads * d, h), p + "self_attn.k_proj.weight": (kv * d, h),
            p + "self_attn.v_proj.weight": (kv * d, h), p + "self_attn.o_proj.weight": (h, heads * d),
            p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter)})
    return shapes


def write_random_checkpoint(config_dir: str, tokenizer_dir: str, out_dir: str,
                            seed: int = 0) -> str:
    """Write ``out_dir`` = ``config_dir``'s config.json + the tokenizer + random float32
    weights (normal, std 0.02; norm weights 1). Reuses ``out_dir`` if already complete.

    Returns:
        ``out_dir``.
    """
    weights = os.path.join(out_dir, "model.safetensors")
    if os.path.isfile(weights):
        return out_dir
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(config_dir, "config.json")) as f:
        cfg = json.load(f)
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape in llama_tensor_shapes(cfg).items():
        if name.endswith("norm.weight"):
            tensors[name] = np.ones(shape, np.float32)
        else:
            tensors[name] = (rng.standard_normal(shape, np.float32) * 0.02)
    for f in os.listdir(tokenizer_dir):
        if f.startswith("tokenizer"):
            shutil.copy(os.path.join(tokenizer_dir, f), out_dir)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    save_file(tensors, weights + ".tmp")
    os.replace(weights + ".tmp", weights)
    return out_dir
