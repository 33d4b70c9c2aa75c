"""A tiny random-weight Llama directory with Qwen2's real tokenizer (``../shared/tokenizers``),
for tests that need a real byte-level BPE vocabulary and chat template but no real weights."""

from __future__ import annotations

import json
import os
import shutil

from tests.conftest import TOKENIZERS


def write_qwen_random(directory, vocab_size: int) -> str:
    """Write Qwen2's tokenizer files and a 1-layer, 16-wide Llama ``config.json`` with
    ``vocab_size`` logits (Qwen2 has 151646 tokens: a larger size pads the vocabulary) into
    ``directory`` (a ``pathlib.Path``); returns it as a string. Load it with
    ``load_format="dummy"``."""
    for f in os.listdir(os.path.join(TOKENIZERS, "qwen2")):
        shutil.copy(os.path.join(TOKENIZERS, "qwen2", f), directory)
    (directory / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": vocab_size, "hidden_size": 16,
        "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 1, "max_position_embeddings": 256, "eos_token_id": 151645}))
    return str(directory)
