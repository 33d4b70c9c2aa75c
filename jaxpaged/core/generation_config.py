"""A model's ``generation_config.json``: default sampling fields and EOS ids (host only)."""

from __future__ import annotations

import json
import os

from jaxpaged.config import ModelConfig


def load_generation_config(model_dir: str) -> dict:
    """``generation_config.json`` of ``model_dir`` ({} if there is none).

    Raises:
        ValueError: the file is not valid JSON.
    """
    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from e


#: generation_config.json keys vLLM applies as default sampling parameters.
_GENERATION_DEFAULT_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                            "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                            "max_new_tokens": "max_tokens"}


def generation_defaults(generation_config: dict) -> dict:
    """The default sampling fields a generation config sets, by ``SamplingParams`` name (vLLM's
    ``--generation-config auto``)."""
    return {ours: generation_config[theirs] for theirs, ours in _GENERATION_DEFAULT_KEYS.items()
            if generation_config.get(theirs) is not None}


def eos_token_ids(cfg: ModelConfig, generation_config: dict, tokenizer) -> frozenset[int]:
    """EOS ids of the config, ``generation_config.json`` and the tokenizer, together."""
    ids = set(cfg.eos_token_ids)
    eos = generation_config.get("eos_token_id")
    ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(int(i) for i in ids)
