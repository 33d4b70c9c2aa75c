"""A model's ``generation_config.json``: default sampling fields and EOS ids (host only)."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

from jaxpaged.config import ModelConfig
from jaxpaged.sampling_params import SamplingParams


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


def apply_generation_defaults(params: SamplingParams, defaults: Mapping[str, Any]
                              ) -> SamplingParams:
    """``params`` with each of its ``model_default_fields`` that ``defaults`` (of
    :func:`generation_defaults`) sets taken from it: a new, verified ``SamplingParams`` (greedy
    decoding resets ``top_p``, ``top_k`` and ``min_p`` again) whose ``model_default_fields``
    is empty (the fields ``defaults`` lacks keep their value), or ``params`` itself when it
    leaves nothing to the model.
    The engine's input processor calls it for every request, and ``LLM`` for its default
    parameters: the one place a model's defaults are applied.

    Raises:
        SamplingParamsError: a default out of its field's range (naming the field).
    """
    if not params.model_default_fields:
        return params
    values = {name: defaults[name] for name in params.model_default_fields if name in defaults}
    return dataclasses.replace(params, **values, model_default_fields=frozenset())


def eos_token_ids(cfg: ModelConfig, generation_config: dict, tokenizer) -> frozenset[int]:
    """EOS ids of the config, ``generation_config.json`` and the tokenizer, together."""
    ids = set(cfg.eos_token_ids)
    eos = generation_config.get("eos_token_id")
    ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(int(i) for i in ids)
