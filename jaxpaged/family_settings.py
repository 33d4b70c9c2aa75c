"""Per-family settings of the 2026 families, read from ``config.json`` beside
:class:`jaxpaged.config.ModelConfig` (which keeps the settings every family shares).

:func:`family_settings` turns one family's own keys into a :class:`FamilySettings` and hands
back the config in the shape the shared parser reads (one RoPE base, ``layer_types``, the
expert count as ``num_local_experts``), as transformers' config classes read them:

- Gemma 3 (``Gemma3TextConfig``): local (sliding) layers rotate with their own RoPE base
  (``rope_parameters["sliding_attention"]``, or the older ``rope_local_base_freq``), global
  layers with ``rope_parameters["full_attention"]`` (or ``rope_theta`` / ``rope_scaling``;
  ``linear`` scaling divides the frequencies by ``factor``); without ``layer_types`` every
  ``sliding_window_pattern``-th layer (6) is global.
- Phi-3 (``Phi3Config``): RoPE on the first ``partial_rotary_factor`` of each head's
  features (Phi-4-mini: 0.75); LongRoPE (``rope_type`` ``longrope``, or the older ``su`` /
  ``yarn``) divides the frequencies by ``short_factor`` or ``long_factor`` and scales cos and
  sin by ``attention_factor`` (default ``sqrt(1 + ln(f) / ln(original))``, ``f`` = max /
  original context). transformers picks the long factors for the whole forward pass once the
  sequence passes ``original_max_position_embeddings``; a paged cache would then hold keys
  rotated both ways, so jaxpaged fixes one set per engine: long when ``max_model_len``
  exceeds the original context (:func:`with_max_model_len`), short otherwise. Both agree with
  transformers on every sequence inside their range.
- SmolLM3: ``no_rope_layers[i] == 0`` marks a layer without RoPE (default: every
  ``no_rope_layer_interval``-th, 4).
- Granite: ``embedding_multiplier``, ``residual_multiplier``, ``attention_multiplier`` (the
  attention scale itself) and ``logits_scaling`` (logits are divided by it).
- gpt-oss (``GptOssConfig``): alternating sliding (even layers, window ``sliding_window``,
  128) and full layers unless ``layer_types`` says otherwise; YaRN RoPE
  (:mod:`jaxpaged.yarn_rope`) or plain; the experts' clamped SwiGLU ``swiglu_limit`` (7.0) and
  ``swiglu_alpha`` (1.702); an MXFP4 ``quantization_config`` is dropped (the experts are
  dequantized on load, :mod:`jaxpaged.models.gpt_oss_checkpoint`).
- Qwen3-MoE: ``num_experts`` experts of width ``moe_intermediate_size`` on the layers that are
  not in ``mlp_only_layers`` and whose ``(i + 1) % decoder_sparse_step == 0``, the rest dense
  (``intermediate_size``); ``norm_topk_prob`` renormalises the top-k weights (default off).
- Qwen3-Next: Qwen3-MoE's experts (plus a gated shared expert of
  ``shared_expert_intermediate_size``) under ``layer_types`` of ``linear_attention`` (Gated
  DeltaNet: ``linear_num_key_heads`` / ``linear_num_value_heads`` heads of
  ``linear_key_head_dim`` / ``linear_value_head_dim``, a causal conv of
  ``linear_conv_kernel_dim``) and ``full_attention`` (default: every
  ``full_attention_interval``-th layer, 4); RoPE on the first ``partial_rotary_factor``
  (default 0.25) of each full-attention head (:class:`LinearAttention`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from jaxpaged.yarn_rope import yarn_frequencies

#: The architectures this module reads settings for (all served).
ARCHITECTURES_2026 = ("Gemma3ForCausalLM", "Phi3ForCausalLM", "Olmo2ForCausalLM",
                      "SmolLM3ForCausalLM", "GraniteForCausalLM", "Qwen3MoeForCausalLM",
                      "GptOssForCausalLM", "Qwen3NextForCausalLM")
#: Architectures whose queries and keys get a per-head RMSNorm before RoPE.
PER_HEAD_QK_NORM = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM",
                    "Qwen3NextForCausalLM")


class FamilySettingsError(ValueError):
    """A family's own ``config.json`` keys are malformed or unsupported (the message names
    the key); :class:`jaxpaged.config.ModelConfig` re-raises it as UnsupportedModelError."""


@dataclass(frozen=True)
class LayerRope:
    """One layer's RoPE: base ``theta``, frequencies divided by ``linear_factor``."""

    theta: float
    linear_factor: float = 1.0


@dataclass(frozen=True)
class LongRope:
    """Phi-3's LongRoPE (module docstring): per-frequency divisors, [head_dim / 2] each."""

    short_factor: tuple[float, ...]
    long_factor: tuple[float, ...]
    original_max_position_embeddings: int
    attention_factor: float
    use_long: bool


@dataclass(frozen=True)
class Yarn:
    """YaRN RoPE (:mod:`jaxpaged.yarn_rope`): [head_dim / 2] frequencies, and the factor cos
    and sin are multiplied by."""

    inv_freq: tuple[float, ...]
    attention_factor: float


@dataclass(frozen=True)
class LinearAttention:
    """Qwen3-Next's Gated DeltaNet layers (module docstring).

    Attributes:
        layers: per layer, True for a linear-attention (recurrent) layer, False for full
            attention.
        num_k_heads, num_v_heads: query/key heads and value heads (each query/key head
            serves ``num_v_heads / num_k_heads`` value heads).
        k_head_dim, v_head_dim: their widths.
        conv_kernel: the causal depthwise convolution's width (its state keeps
            ``conv_kernel - 1`` inputs).
        shared_expert_intermediate_size: the shared expert's width (0: none).
    """

    layers: tuple[bool, ...]
    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int
    shared_expert_intermediate_size: int = 0


@dataclass(frozen=True)
class FamilySettings:
    """Settings only some families have (defaults: none of them).

    Attributes:
        layer_rope: per layer, its :class:`LayerRope` or None for a layer without RoPE;
            empty: every layer uses ``ModelConfig.rope_theta`` / ``rope_scaling``.
        longrope: Phi-3's LongRoPE, or None.
        embedding_multiplier: embeddings are multiplied by it (Granite), or None.
        residual_multiplier: each block's attention and MLP outputs are multiplied by it
            before the residual add (Granite; 1.0: off).
        attention_multiplier: the attention scale (Granite), or None for
            ``head_dim ** -0.5``.
        logits_scaling: logits are divided by it (Granite; 1.0: off).
        rotary_dim: RoPE turns the first ``rotary_dim`` features of each head (Phi-4-mini's
            ``partial_rotary_factor``); 0: all of them.
        moe_layers: per layer, whether its feed-forward is the mixture of experts (empty:
            every layer, when the model has experts).
        moe_intermediate_size: each expert's width (0: ``intermediate_size``).
        norm_topk_prob: the top-k routing weights are renormalised to sum to 1.
        yarn: every layer's YaRN RoPE (gpt-oss), or None.
        swiglu_limit, swiglu_alpha: gpt-oss's clamped SwiGLU experts (None: not clamped).
        linear_attention: Qwen3-Next's recurrent layers, or None.
    """

    layer_rope: tuple[LayerRope | None, ...] = ()
    longrope: LongRope | None = None
    embedding_multiplier: float | None = None
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    rotary_dim: int = 0
    moe_layers: tuple[bool, ...] = ()
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    yarn: Yarn | None = None
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    linear_attention: LinearAttention | None = None


def family_settings(cfg: dict, arch: str) -> tuple[dict, FamilySettings]:
    """The family's own settings and the config for the shared parser.

    Args:
        cfg: the ``config.json`` dict; arch: its architecture.

    Returns:
        (cfg with the shared keys normalised, the :class:`FamilySettings`); other
        architectures get ``cfg`` unchanged and the defaults.

    Raises:
        FamilySettingsError: a RoPE type the family does not have, LongRoPE factors that do
            not fit the head, a partial rotary factor, per-layer lists of the wrong length.
    """
    parse = _PARSERS.get(arch)
    return (cfg, FamilySettings()) if parse is None else parse(dict(cfg))


def with_max_model_len(settings: FamilySettings, max_model_len: int) -> FamilySettings:
    """``settings`` with LongRoPE's factor set chosen for sequences up to ``max_model_len``
    (long past the original context; module docstring); unchanged without LongRoPE."""
    rope = settings.longrope
    if rope is None:
        return settings
    return dataclasses.replace(settings, longrope=dataclasses.replace(
        rope, use_long=max_model_len > rope.original_max_position_embeddings))


def _layers(cfg: dict) -> int:
    return int(cfg["num_hidden_layers"])


def _per_layer(cfg: dict, key: str, values) -> list:
    values = list(values)
    if len(values) != _layers(cfg):
        raise FamilySettingsError(f"{key} has {len(values)} entries for "
                                  f"{_layers(cfg)} layers")
    return values


def _layer_rope(params: dict, key: str) -> LayerRope:
    kind = params.get("rope_type", params.get("type")) or "default"
    if kind not in ("default", "linear"):
        raise FamilySettingsError(f"{key}: rope_type {kind!r} is not supported for this "
                                  "family; supported: default, linear")
    theta = float(params["rope_theta"])
    factor = float(params.get("factor", 1.0)) if kind == "linear" else 1.0
    if not theta > 0 or not factor > 0:
        raise FamilySettingsError(f"{key}: rope_theta and factor must be positive")
    return LayerRope(theta, factor)


def _gemma3(cfg: dict) -> tuple[dict, FamilySettings]:
    for key, value in (("query_pre_attn_scalar", 256), ("sliding_window", 4096),
                       ("hidden_activation", "gelu_pytorch_tanh"),
                       ("tie_word_embeddings", True)):
        cfg.setdefault(key, value)
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:
        full = {"rope_theta": 1e6, **(params.get("full_attention") or {})}
        local = {"rope_theta": 1e4, **(params.get("sliding_attention") or {})}
    else:
        scaling = cfg.get("rope_scaling") or params or {}
        full = {**scaling, "rope_theta": scaling.get("rope_theta", cfg.get("rope_theta", 1e6))}
        local = {"rope_theta": cfg.get("rope_local_base_freq", 1e4)}
    full_rope = _layer_rope(full, "rope_parameters.full_attention")
    local_rope = _layer_rope(local, "rope_parameters.sliding_attention")
    if cfg.get("layer_types") is None:
        pattern = int(cfg.get("sliding_window_pattern", 6))
        cfg["layer_types"] = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                              for i in range(_layers(cfg))]
    kinds = _per_layer(cfg, "layer_types", cfg["layer_types"])
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": full_rope.theta}
    cfg.pop("rope_scaling", None)
    return cfg, FamilySettings(layer_rope=tuple(
        local_rope if k == "sliding_attention" else full_rope for k in kinds))


def _rotary_features(cfg: dict, params: dict, default: float) -> tuple[int, int]:
    """(head_dim, features RoPE rotates) from ``partial_rotary_factor`` (``default`` when
    neither ``params`` nor ``cfg`` names it).

    Raises:
        FamilySettingsError: a factor outside (0, 1] or one leaving an odd feature count.
    """
    partial = float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor",
                                                                default)))
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"])
                   // int(cfg["num_attention_heads"]))
    rotary = int(head_dim * partial)
    if not 0 < partial <= 1 or rotary % 2:
        raise FamilySettingsError(f"partial_rotary_factor={partial} must leave an even number "
                                  f"of the {head_dim} head features to rotate")
    return head_dim, rotary


def _phi3(cfg: dict) -> tuple[dict, FamilySettings]:
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    head_dim, rotary = _rotary_features(cfg, params, 1.0)
    kind = params.get("rope_type", params.get("type")) or "default"
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    cfg.pop("rope_scaling", None)
    rotary_dim = 0 if rotary == head_dim else rotary
    if kind == "default":
        return cfg, FamilySettings(rotary_dim=rotary_dim)
    if kind not in ("longrope", "su", "yarn"):
        raise FamilySettingsError(f"Phi-3 rope_type {kind!r} is not supported; supported: "
                                  "default, longrope")
    max_len = int(cfg.get("max_position_embeddings", 4096))
    original = int(params.get("original_max_position_embeddings")
                   or cfg.get("original_max_position_embeddings") or max_len)
    factor = params.get("factor") or max_len / original
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    factors = []
    for key in ("short_factor", "long_factor"):
        values = params.get(key)
        if not isinstance(values, list) or len(values) != rotary // 2:
            raise FamilySettingsError(f"longrope {key} must list {rotary // 2} numbers (half "
                                      f"the rotated features), got {values!r}")
        factors.append(tuple(float(v) for v in values))
    return cfg, FamilySettings(rotary_dim=rotary_dim, longrope=LongRope(
        *factors, original, float(attention), use_long=max_len > original))


def _smollm3(cfg: dict) -> tuple[dict, FamilySettings]:
    if not cfg.get("use_sliding_window", False):
        cfg["sliding_window"] = None
    params = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 2000000.0)))
    interval = int(cfg.get("no_rope_layer_interval", 4))
    flags = cfg.get("no_rope_layers")
    if flags is None:
        flags = [int((i + 1) % interval != 0) for i in range(_layers(cfg))]
    flags = _per_layer(cfg, "no_rope_layers", flags)
    cfg["rope_parameters"] = {**params, "rope_theta": theta}
    cfg.pop("rope_scaling", None)
    return cfg, FamilySettings(layer_rope=tuple(LayerRope(theta) if f else None for f in flags))


def _granite(cfg: dict) -> tuple[dict, FamilySettings]:
    get = lambda key: float(cfg.get(key, 1.0))
    return cfg, FamilySettings(embedding_multiplier=get("embedding_multiplier"),
                               residual_multiplier=get("residual_multiplier"),
                               attention_multiplier=get("attention_multiplier"),
                               logits_scaling=get("logits_scaling"))


def _qwen3_moe(cfg: dict) -> tuple[dict, FamilySettings]:
    experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    cfg["num_local_experts"] = experts
    cfg.setdefault("num_experts_per_tok", 8)
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense = set(cfg.get("mlp_only_layers") or ())
    moe = tuple(experts > 0 and i not in dense and (i + 1) % step == 0
                for i in range(_layers(cfg)))
    return cfg, FamilySettings(moe_layers=moe,
                               moe_intermediate_size=int(cfg.get("moe_intermediate_size", 768)),
                               norm_topk_prob=bool(cfg.get("norm_topk_prob", False)))


#: GptOssConfig's RoPE when config.json names none.
_GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                 "truncate": False, "original_max_position_embeddings": 4096}


def _gpt_oss(cfg: dict) -> tuple[dict, FamilySettings]:
    for key, value in (("sliding_window", 128), ("attention_bias", True), ("head_dim", 64),
                       ("rms_norm_eps", 1e-5), ("num_local_experts", 128),
                       ("num_experts_per_tok", 4), ("max_position_embeddings", 131072)):
        cfg.setdefault(key, value)             # GptOssConfig's defaults
    if cfg.get("layer_types") is None:
        cfg["layer_types"] = ["sliding_attention" if (i + 1) % 2 else "full_attention"
                              for i in range(_layers(cfg))]
    qc = cfg.get("quantization_config")
    if isinstance(qc, dict) and qc.get("quant_method") == "mxfp4":
        del cfg["quantization_config"]          # the experts are dequantized on load
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or _GPT_OSS_ROPE
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 150000.0)))
    kind = params.get("rope_type", params.get("type")) or "default"
    head_dim = int(cfg["head_dim"] or int(cfg["hidden_size"]) // int(cfg["num_attention_heads"]))
    yarn = None
    if kind == "yarn":
        try:
            yarn = Yarn(*yarn_frequencies({**params, "rope_theta": theta}, head_dim,
                                          int(cfg["max_position_embeddings"])))
        except (KeyError, ValueError) as e:
            raise FamilySettingsError(f"rope_parameters: {e}") from None
    elif kind != "default":
        raise FamilySettingsError(f"gpt-oss rope_type {kind!r} is not supported; supported: "
                                  "default, yarn")
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    cfg.pop("rope_scaling", None)
    limit = cfg.get("swiglu_limit", 7.0)
    return cfg, FamilySettings(yarn=yarn, swiglu_limit=None if limit is None else float(limit),
                               swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)))


def _qwen3_next(cfg: dict) -> tuple[dict, FamilySettings]:
    cfg, moe = _qwen3_moe(cfg)
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    kind = params.get("rope_type", params.get("type")) or "default"
    if kind != "default":
        raise FamilySettingsError(f"Qwen3-Next rope_type {kind!r} is not supported; "
                                  "supported: default")
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    head_dim, rotary = _rotary_features(cfg, params, 0.25)
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    cfg.pop("rope_scaling", None)
    interval = int(cfg.get("full_attention_interval", 4))
    kinds = cfg.get("layer_types") or ["full_attention" if (i + 1) % interval == 0
                                       else "linear_attention" for i in range(_layers(cfg))]
    kinds = _per_layer(cfg, "layer_types", kinds)
    unknown = sorted(set(kinds) - {"linear_attention", "full_attention"})
    if unknown:
        raise FamilySettingsError(f"layer_types has unknown kinds {unknown}; supported: "
                                  "linear_attention, full_attention")
    cfg.pop("layer_types", None)            # (not sliding windows: hf_config.sliding_windows)
    get = lambda key, default: int(cfg.get(key, default))
    linear = LinearAttention(
        layers=tuple(k == "linear_attention" for k in kinds),
        num_k_heads=get("linear_num_key_heads", 16), num_v_heads=get("linear_num_value_heads", 32),
        k_head_dim=get("linear_key_head_dim", 128), v_head_dim=get("linear_value_head_dim", 128),
        conv_kernel=get("linear_conv_kernel_dim", 4),
        shared_expert_intermediate_size=get("shared_expert_intermediate_size", 0))
    if linear.num_v_heads % linear.num_k_heads:
        raise FamilySettingsError(f"linear_num_value_heads={linear.num_v_heads} is not a "
                                  f"multiple of linear_num_key_heads={linear.num_k_heads}")
    if linear.conv_kernel < 1:
        raise FamilySettingsError(f"linear_conv_kernel_dim={linear.conv_kernel} must be >= 1")
    return cfg, dataclasses.replace(moe, rotary_dim=0 if rotary == head_dim else rotary,
                                    linear_attention=linear)


_PARSERS = {"Gemma3ForCausalLM": _gemma3, "Phi3ForCausalLM": _phi3,
            "SmolLM3ForCausalLM": _smollm3, "GraniteForCausalLM": _granite,
            "Qwen3MoeForCausalLM": _qwen3_moe, "GptOssForCausalLM": _gpt_oss,
            "Qwen3NextForCausalLM": _qwen3_next}
