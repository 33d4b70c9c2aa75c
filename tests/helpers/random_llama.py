"""A random-weight Llama for tests: a ``config.json`` only (``load_format="dummy"`` draws the
weights from the engine seed)."""

from __future__ import annotations

import json
import os

#: The base config: 2 layers, 16 query heads and 8 KV heads of 8, vocabulary 512, untied.
BASE_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512,
               "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
               "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 8,
               "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
               "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
               "torch_dtype": "float32"}


def write_random_llama(directory, **overrides) -> str:
    """Write ``BASE_CONFIG`` with ``overrides`` as ``directory/config.json``; returns the
    directory."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump({**BASE_CONFIG, **overrides}, f)
    return str(directory)
