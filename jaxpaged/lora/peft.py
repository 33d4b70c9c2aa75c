"""Read a PEFT LoRA adapter (``adapter_config.json`` + ``adapter_model.safetensors``).

PEFT's format (``peft.LoraConfig``; Hu et al., "LoRA", 2021): tensors
``base_model.model.model.layers.{i}.<self_attn|mlp>.<target>.lora_A.weight`` [r, d_in] and
``...lora_B.weight`` [d_out, r]; the update is ``scaling * B @ A`` with ``scaling =
lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with ``use_rslora`` (Kalajdzievski, "A Rank
Stabilization Scaling Factor for Fine-Tuning with LoRA", 2023). Host side, numpy only: the
tensors are returned transposed to the engine's [in, out] layout, scaling folded into B.
Anything this engine cannot apply exactly is refused with a typed error naming the field.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy before safetensors reads it)
import numpy as np
from safetensors import SafetensorError, safe_open

from jaxpaged.config import ModelConfig
from jaxpaged.lora.request import LoRARequest
from jaxpaged.lora.targets import (PARENT, UnsupportedLoRATargetError, check_target,
                                   target_shapes)

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(r"^(?:.*\.)?layers\.(\d+)\.([\w.]+?)\.(\w+)\.lora_([AB])\.weight$")


class LoRAAdapterError(ValueError):
    """An adapter that cannot be loaded: missing files, bad config fields, ranks above
    ``max_lora_rank``, unsupported targets or shapes that do not fit the model (the message
    names the adapter and the field or tensor)."""


class LoRAAdapterNotFoundError(LoRAAdapterError):
    """No adapter at the path: ``adapter_config.json`` does not exist."""


@dataclass(frozen=True)
class LoRAAdapter:
    """A loaded adapter on the host.

    Attributes:
        name, int_id, path: from its :class:`LoRARequest`.
        rank: ``r``.
        scaling: ``lora_alpha / r`` (or ``/ sqrt(r)`` with rslora), folded into ``weights``.
        weights: ``{(layer, target): (A [d_in, r], B [r, d_out] * scaling)}`` float32.
    """

    name: str
    int_id: int
    path: str
    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]


def _field(config: dict, name: str, kind, where: str):
    value = config.get(name)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise LoRAAdapterError(f"{where}: {CONFIG_FILE} field {name!r} must be "
                               f"{getattr(kind, '__name__', 'a number')}, got {value!r}")
    return value


def _check_target(name: str, model: ModelConfig, where: str) -> None:
    """:func:`~jaxpaged.lora.targets.check_target`, its error naming the adapter."""
    try:
        check_target(name, model)
    except UnsupportedLoRATargetError as e:
        raise UnsupportedLoRATargetError(f"{where}: {e}") from None


def _check_config(config: dict, where: str, model: ModelConfig, max_rank: int) -> tuple:
    """(r, scaling, the targets ``target_modules`` lists or None for a pattern) of a checked
    ``adapter_config.json``."""
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRAAdapterError(f"{where}: peft_type {config['peft_type']!r} is not LORA")
    r = _field(config, "r", int, where)
    alpha = _field(config, "lora_alpha", (int, float), where)
    if r < 1:
        raise LoRAAdapterError(f"{where}: r must be >= 1, got {r}")
    if not math.isfinite(alpha):
        raise LoRAAdapterError(f"{where}: lora_alpha must be finite, got {alpha!r}")
    if r > max_rank:
        raise LoRAAdapterError(f"{where}: LoRA rank r={r} is greater than max_lora_rank="
                               f"{max_rank}")
    for name, off in (("use_dora", False), ("bias", "none"), ("lora_bias", False),
                      ("fan_in_fan_out", False), ("modules_to_save", None),
                      ("layer_replication", None), ("rank_pattern", {}),
                      ("alpha_pattern", {})):
        if config.get(name, off) not in (off, None, [], {}):
            raise LoRAAdapterError(f"{where}: {CONFIG_FILE} field {name}="
                                   f"{config[name]!r} is not supported")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        for t in targets:
            _check_target(t.rsplit(".", 1)[-1], model, where)
    elif not isinstance(targets, str):     # (a regex, or "all-linear": peft saves what matched)
        raise LoRAAdapterError(f"{where}: {CONFIG_FILE} field target_modules must be a list "
                               f"or a string, got {targets!r}")
    use_rslora = bool(config.get("use_rslora", False))
    listed = {t.rsplit(".", 1)[-1] for t in targets} if isinstance(targets, list) else None
    return r, alpha / (math.sqrt(r) if use_rslora else r), listed


def load_adapter(request: LoRARequest, model: ModelConfig, max_rank: int) -> LoRAAdapter:
    """Read and check ``request.lora_path`` against ``model``.

    Raises:
        LoRAAdapterNotFoundError: no ``adapter_config.json`` at the path.
        LoRAAdapterError: unreadable files, bad fields (a non-finite ``lora_alpha``
            among them), ``r > max_rank``, a tensor of a layer the model lacks or of a
            module a ``target_modules`` list leaves out, non-finite weights, or a shape
            that does not match the target's.
        UnsupportedLoRATargetError: a target this engine does not adapt on this model.
    """
    where = f"LoRA adapter {request.lora_name!r} ({request.lora_path})"
    if not os.path.isfile(os.path.join(request.lora_path, CONFIG_FILE)):
        raise LoRAAdapterNotFoundError(f"{where}: No adapter found ({CONFIG_FILE} does not "
                                       "exist)")
    try:
        with open(os.path.join(request.lora_path, CONFIG_FILE)) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise LoRAAdapterError(f"{where}: cannot read {CONFIG_FILE}: {e}") from None
    if not isinstance(config, dict):
        raise LoRAAdapterError(f"{where}: {CONFIG_FILE} is not a JSON object")
    r, scaling, listed = _check_config(config, where, model, max_rank)
    shapes = target_shapes(model)
    halves: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    try:
        with safe_open(os.path.join(request.lora_path, WEIGHTS_FILE), "np") as f:
            for key in f.keys():
                m = _KEY.match(key)
                if m is None:
                    raise LoRAAdapterError(f"{where}: tensor {key!r} is not a LoRA A/B weight "
                                           "of a decoder layer")
                layer, parent, target, half = int(m[1]), m[2], m[3], m[4]
                _check_target(target, model, where)
                if listed is not None and target not in listed:
                    raise LoRAAdapterError(f"{where}: tensor {key!r} adapts {target}, which "
                                           f"target_modules {sorted(listed)} does not list")
                if parent != PARENT[target] or layer >= model.num_layers:
                    raise LoRAAdapterError(f"{where}: tensor {key!r} names a module the model "
                                           "does not have")
                halves.setdefault((layer, target), {})[half] = f.get_tensor(key)
    except (OSError, SafetensorError) as e:
        raise LoRAAdapterError(f"{where}: cannot read {WEIGHTS_FILE}: {e}") from None
    weights = {}
    for (layer, target), pair in sorted(halves.items()):
        d_in, d_out = shapes[target]
        a, b = pair.get("A"), pair.get("B")
        name = f"layers.{layer}.{PARENT[target]}.{target}"
        if a is None or b is None:
            raise LoRAAdapterError(f"{where}: {name} has lora_{'A' if a is None else 'B'} "
                                   "missing")
        if not (np.isfinite(a).all() and np.isfinite(b).all()):
            raise LoRAAdapterError(f"{where}: {name} has non-finite (NaN or infinite) "
                                   "lora_A / lora_B values")
        if a.shape != (r, d_in) or b.shape != (d_out, r):
            raise LoRAAdapterError(f"{where}: {name} lora_A {a.shape} / lora_B {b.shape} do "
                                   f"not fit r={r} and the model's [{d_out}, {d_in}] weight")
        weights[(layer, target)] = (
            np.ascontiguousarray(a.astype(np.float32).T),
            np.ascontiguousarray(b.astype(np.float32).T) * np.float32(scaling))
    if not weights:
        raise LoRAAdapterError(f"{where}: {WEIGHTS_FILE} holds no LoRA weights")
    return LoRAAdapter(request.lora_name, request.lora_int_id, request.lora_path, r,
                       scaling, weights)
