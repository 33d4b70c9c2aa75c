"""Which projections an adapter may target, and their shapes, from the model's config.

Pure Python (the host checks adapters without touching the device). The names are PEFT's
``target_modules`` names, which are transformers' module names: ``q_proj``, ``k_proj``,
``v_proj``, ``o_proj`` (every family) and ``gate_proj``, ``up_proj``, ``down_proj`` (dense
MLPs: Llama, Mistral, Qwen2/3, Gemma 2). Mixtral's experts (``w1``, ``w2``, ``w3``) and router
(``gate``) are refused by name: adapters apply to its attention only.
"""

from __future__ import annotations

from jaxpaged.config import ModelConfig

ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
#: Column-parallel targets (output features split under tensor parallelism); the others
#: (``o_proj``, ``down_proj``) are row-parallel.
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
#: The sub-module of a decoder layer each target lives in.
PARENT = {**{t: "self_attn" for t in ATTENTION_TARGETS}, **{t: "mlp" for t in MLP_TARGETS}}


class UnsupportedLoRATargetError(ValueError):
    """An adapter targets a module this engine does not adapt (the message names it)."""


def supported_targets(config: ModelConfig) -> tuple[str, ...]:
    """The targets adapters of ``config``'s model may use (MoE models: attention only)."""
    return ATTENTION_TARGETS if config.num_experts else ATTENTION_TARGETS + MLP_TARGETS


def check_target(name: str, config: ModelConfig) -> None:
    """Raises :class:`UnsupportedLoRATargetError` unless ``name`` is a supported target."""
    if name in supported_targets(config):
        return
    if config.num_experts and name in ("w1", "w2", "w3", "gate", "experts", *MLP_TARGETS):
        raise UnsupportedLoRATargetError(
            f"LoRA target_modules {name!r}: adapters of the mixture-of-experts feed-forward "
            f"(experts and router) are not supported on {config.architecture}; target "
            f"{', '.join(ATTENTION_TARGETS)}")
    raise UnsupportedLoRATargetError(
        f"LoRA target_modules {name!r} is not supported on {config.architecture} "
        f"(supported: {', '.join(supported_targets(config))})")


def target_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """``(d_in, d_out)`` of every supported target (checkpoint KV heads, no TP replicas)."""
    h, d = config.hidden_size, config.head_dim
    q, kv, i = config.num_heads * d, config.num_kv_heads * d, config.intermediate_size
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
              "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
    return {t: shapes[t] for t in supported_targets(config)}
