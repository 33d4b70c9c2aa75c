"""Helpers of the RL tests: random checkpoints of the test Llama, counted compilations."""

from __future__ import annotations

import json
import os

import jax
import numpy as np
from safetensors.numpy import save_file

from tests.helpers.random_llama import BASE_CONFIG

_compiles = 0


def _count(event: str, duration: float, **kwargs) -> None:
    global _compiles
    if event == "/jax/core/compile/backend_compile_duration":
        _compiles += 1


jax.monitoring.register_event_duration_secs_listener(_count)


def backend_compiles() -> int:
    """Executables JAX built (compiled or loaded from a cache) in this process so far."""
    return _compiles


def llama_tensors(seed: int, config: dict = BASE_CONFIG) -> dict[str, np.ndarray]:
    """Every tensor of a Llama checkpoint for ``config``, float32, std 0.05 (norms near 1)."""
    rng = np.random.default_rng(seed)
    h, i, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    d = config["head_dim"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,),
              "lm_head.weight": (v, h)}
    for n in range(config["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes.update({p + "input_layernorm.weight": (h,),
                       p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                       p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                       p + "mlp.down_proj.weight": (h, i)})
    return {name: (1.0 + 0.1 * rng.standard_normal(shape) if name.endswith("norm.weight")
                   else 0.05 * rng.standard_normal(shape)).astype(np.float32)
            for name, shape in shapes.items()}


def write_checkpoint(directory, tensors: dict[str, np.ndarray], **overrides) -> str:
    """``directory`` with the test Llama's ``config.json`` and ``tensors`` as
    ``model.safetensors``."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump({**BASE_CONFIG, **overrides}, f)
    save_file(tensors, os.path.join(directory, "model.safetensors"))
    return str(directory)
