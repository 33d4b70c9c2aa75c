"""What each GGUF architecture's metadata means as a transformers ``config.json``: the
architectures llama.cpp's converter (``convert_hf_to_gguf.py``) writes for the families jaxpaged
serves, and the family keys each one carries, as llama.cpp's loader reads them
(``src/models/<arch>.cpp``, ``load_arch_hparams``; key names from gguf-py's ``Keys``).

A leaf module (no weights, no JAX): :func:`jaxpaged.gguf_config.gguf_config` builds the keys
every architecture shares (``{arch}.block_count``, ``embedding_length``, ...) and calls
:func:`family_config` for the rest:

- ``gemma3``: the norms are stored as ``1 + weight`` (undone by the weight loader);
  ``attention.sliding_window`` and ``attention.sliding_window_pattern`` (an int ``n``: layer
  ``i`` slides when ``i % n < n - 1``, llama.cpp's default 6; or one flag per layer) make
  ``layer_types``; ``rope.freq_base`` is the global layers' RoPE base, ``rope.freq_base_swa``
  the local ones' (default 10000); ``final_logit_softcapping``. The file has no
  ``query_pre_attn_scalar``: llama.cpp scales scores by ``1/sqrt(head_dim)``, or
  ``1/sqrt(hidden/heads)`` for the 62-layer 27B, and so does jaxpaged for a Gemma 3 GGUF.
- ``qwen3moe``: ``expert_count``, ``expert_used_count``, ``expert_feed_forward_length``; the
  top-k weights are always renormalised (llama.cpp's ``build_moe_ffn(..., norm_w=true)``);
  a layer without ``blk.{i}.ffn_gate_inp`` is dense (``mlp_only_layers``).
- ``phi3``: ``rope.dimension_count`` (Phi-4-mini rotates 3/4 of each head), LongRoPE from the
  ``rope_factors_long`` / ``rope_factors_short`` tensors with
  ``rope.scaling.original_context_length`` and ``rope.scaling.attn_factor``;
  ``attention.sliding_window`` (0: none).
- ``smollm3``: no key; llama.cpp leaves RoPE out of every 4th layer
  (``n_no_rope_layer_step = 4``, SmolLM3-3B's ``no_rope_layer_interval``).
- ``olmo2``: nothing beyond the shared keys (OLMo 3's sliding layers are refused).
- ``granite``: ``attention.scale``, ``embedding_scale``, ``residual_scale``, ``logit_scale``
  (transformers' ``attention_multiplier``, ``embedding_multiplier``, ``residual_multiplier``,
  ``logits_scaling``).
- ``gpt-oss`` (``src/models/openai-moe.cpp``): ``expert_count``, ``expert_used_count``,
  ``expert_feed_forward_length``; ``attention.sliding_window`` on the layers of
  ``attention.sliding_window_pattern`` (default 2: the even layers); YaRN from
  ``rope.scaling.{type,factor,original_context_length}`` with ggml's rounded correction range
  (``truncate``) and its fixed ``beta_fast`` 32 / ``beta_slow`` 1 (the file's
  ``yarn_beta_*`` keys are not read by llama.cpp's gpt-oss, nor here), the factor of cos and
  sin ``(1 + 0.1 ln factor) * rope.scaling.attn_factor``; the experts' clamped SwiGLU is
  llama.cpp's built-in ``limit`` 7, ``alpha`` 1.702 (``LLM_FFN_SWIGLU_OAI_MOE``).
- ``qwen3next`` (``src/models/qwen3next.cpp``): the experts as ``qwen3moe`` plus a gated
  shared expert of ``expert_shared_feed_forward_length`` (default ``feed_forward_length``);
  ``attention.recurrent_layers`` (or every ``full_attention_interval``-th layer full, default
  4) make ``layer_types``; the Gated DeltaNet's ``ssm.group_count`` key heads and
  ``ssm.time_step_rank`` value heads, each ``ssm.state_size`` wide (llama.cpp's value head is
  a key head wide: ``ssm.inner_size`` must be ``state_size * time_step_rank``), a causal
  convolution of ``ssm.conv_kernel``; ``rope.dimension_count`` rotated features per head. A
  file with multi-token-prediction layers (``nextn_predict_layers``) is refused.
"""

from __future__ import annotations

import math

from jaxpaged.errors import UnsupportedModelError

#: GGUF ``general.architecture`` -> the Hugging Face class jaxpaged builds for it.
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "gemma3": "Gemma3ForCausalLM",
                      "qwen3moe": "Qwen3MoeForCausalLM", "phi3": "Phi3ForCausalLM",
                      "smollm3": "SmolLM3ForCausalLM", "olmo2": "Olmo2ForCausalLM",
                      "granite": "GraniteForCausalLM", "gpt-oss": "GptOssForCausalLM",
                      "qwen3next": "Qwen3NextForCausalLM"}
#: Architectures whose converter class permutes the q/k rows for ggml's RoPE on adjacent
#: pairs (``LlamaModel.permute``: Llama and its subclasses SmolLM3 and Granite); the others
#: use ggml's NeoX RoPE and store the rows as transformers does.
PERMUTED_QK = ("llama", "smollm3", "granite")
#: Architectures whose RoPE may turn only part of each head (``rope.dimension_count``).
PARTIAL_ROTARY = ("phi3", "qwen3next")
#: Architectures that may carry ``rope.scaling.type`` ``linear`` (Gemma 3's global layers).
LINEAR_ROPE_SCALING = ("gemma3",)
#: Architectures that may carry ``rope.scaling.type`` ``yarn``.
YARN_ROPE_SCALING = ("gpt-oss",)
#: Tensors that are settings, read into the config rather than the model.
CONFIG_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")
#: llama.cpp's default Gemma 3 window pattern and SmolLM3 no-RoPE step.
_GEMMA3_PATTERN, _SMOLLM3_NO_ROPE_STEP = 6, 4
#: llama.cpp's default gpt-oss window pattern and its built-in clamped SwiGLU and YaRN betas.
_GPT_OSS_PATTERN, _GPT_OSS_SWIGLU, _GPT_OSS_BETAS = 2, (7.0, 1.702), (32.0, 1.0)


def family_config(arch: str, meta: dict, tensors: dict, cfg: dict) -> dict:
    """``cfg`` (the shared ``config.json`` keys, ``rope_theta`` among them) with the family
    keys of GGUF architecture ``arch`` (module docstring).

    Args:
        arch: ``general.architecture`` (a key of :data:`GGUF_ARCHITECTURES`).
        meta: the file's metadata; tensors: its tensor table by name (``.shape`` in ggml
            order, ``.data`` the stored values).
        cfg: the shared keys, updated in place and returned.

    Raises:
        UnsupportedModelError: a setting the family's jaxpaged model does not have (named).
    """
    build = _FAMILIES.get(arch)
    return cfg if build is None else build(lambda key, default=None: meta.get(
        f"{arch}.{key}", default), tensors, cfg)


def _sliding_layers(key, layers: int, default: int) -> list[bool]:
    """Which layers slide (llama.cpp's ``load_swa_pattern``): one flag per layer, or an int
    ``n`` (default ``default``): layer ``i`` slides when ``i % n < n - 1`` (all when 0).

    Raises:
        UnsupportedModelError: a list of flags that is not one per layer.
    """
    pattern = key("attention.sliding_window_pattern", default)
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise UnsupportedModelError(f"GGUF attention.sliding_window_pattern has "
                                        f"{len(pattern)} flags for {layers} layers")
        return [bool(p) for p in pattern]
    n = int(pattern)
    return [n == 0 or i % n < n - 1 for i in range(layers)]


def _gemma3(key, tensors: dict, cfg: dict) -> dict:
    layers, head_dim = cfg["num_hidden_layers"], cfg["head_dim"]
    window = int(key("attention.sliding_window", 0) or 0)
    sliding = _sliding_layers(key, layers, _GEMMA3_PATTERN)
    full = {"rope_type": "default", "rope_theta": cfg.pop("rope_theta")}
    if key("rope.scaling.type") == "linear":
        full.update(rope_type="linear", factor=float(key("rope.scaling.factor", 1.0)))
    scalar = cfg["hidden_size"] // cfg["num_attention_heads"] if layers == 62 else head_dim
    cfg.update(
        query_pre_attn_scalar=scalar, sliding_window=window or None,
        layer_types=["sliding_attention" if window and s else "full_attention"
                     for s in sliding],
        rope_parameters={"full_attention": full, "sliding_attention": {
            "rope_type": "default", "rope_theta": float(key("rope.freq_base_swa", 10000.0))}},
        final_logit_softcapping=key("final_logit_softcapping"), attn_logit_softcapping=None,
        hidden_activation="gelu_pytorch_tanh")
    return cfg


def _qwen3moe(key, tensors: dict, cfg: dict) -> dict:
    shared = sorted(n for n in tensors if "_shexp" in n)
    if shared:
        raise UnsupportedModelError(f"GGUF qwen3moe with a shared expert ({shared[0]}): "
                                    "Qwen3-MoE has none and jaxpaged does not read one")
    return _experts(key, tensors, cfg)


def _experts(key, tensors: dict, cfg: dict) -> dict:
    """Qwen3-MoE's expert keys (module docstring), shared by Qwen3-Next."""
    layers = cfg["num_hidden_layers"]
    cfg.update(num_experts=int(key("expert_count", 0)),
               num_experts_per_tok=int(key("expert_used_count", 0)),
               moe_intermediate_size=int(key("expert_feed_forward_length",
                                             cfg["intermediate_size"])),
               norm_topk_prob=True, decoder_sparse_step=1,
               mlp_only_layers=[i for i in range(layers)
                                if f"blk.{i}.ffn_gate_inp.weight" not in tensors])
    return cfg


def _phi3(key, tensors: dict, cfg: dict) -> dict:
    rotary = int(key("rope.dimension_count", cfg["head_dim"]))
    params = {"rope_type": "default", "rope_theta": cfg.pop("rope_theta"),
              "partial_rotary_factor": rotary / cfg["head_dim"]}
    if "rope_factors_long.weight" in tensors:
        original = int(key("rope.scaling.original_context_length",
                           cfg["max_position_embeddings"]))
        params.update(rope_type="longrope", original_max_position_embeddings=original,
                      long_factor=_values(tensors, "rope_factors_long.weight"),
                      short_factor=_values(tensors, "rope_factors_short.weight"))
        if key("rope.scaling.attn_factor") is not None:
            params["attention_factor"] = float(key("rope.scaling.attn_factor"))
        cfg["original_max_position_embeddings"] = original
    cfg.update(rope_parameters=params,
               sliding_window=int(key("attention.sliding_window", 0) or 0) or None)
    return cfg


def _values(tensors: dict, name: str) -> list[float]:
    """A small settings tensor's values (``rope_factors_*``), or None if absent."""
    t = tensors.get(name)
    return None if t is None else [float(v) for v in t.data.reshape(-1).tolist()]


def _smollm3(key, tensors: dict, cfg: dict) -> dict:
    cfg.update(rope_parameters={"rope_type": "default", "rope_theta": cfg.pop("rope_theta")},
               no_rope_layers=[int((i + 1) % _SMOLLM3_NO_ROPE_STEP != 0)
                               for i in range(cfg["num_hidden_layers"])])
    return cfg


def _olmo2(key, tensors: dict, cfg: dict) -> dict:
    pattern = key("attention.sliding_window_pattern")
    if key("attention.sliding_window") and (not isinstance(pattern, list) or any(pattern)):
        raise UnsupportedModelError("GGUF olmo2 with sliding-window layers (OLMo 3) is not "
                                    "supported")
    return cfg


def _granite(key, tensors: dict, cfg: dict) -> dict:
    """llama.cpp's defaults where a scale is absent: 1, and ``1/sqrt(head_dim)`` for the
    attention."""
    cfg.update(attention_multiplier=float(key("attention.scale", 0.0)
                                          or cfg["head_dim"] ** -0.5),
               embedding_multiplier=float(key("embedding_scale", 1.0)),
               residual_multiplier=float(key("residual_scale", 1.0)),
               logits_scaling=float(key("logit_scale", 1.0)))
    return cfg


def _gpt_oss(key, tensors: dict, cfg: dict) -> dict:
    sliding = _sliding_layers(key, cfg["num_hidden_layers"], _GPT_OSS_PATTERN)
    params = {"rope_type": "default", "rope_theta": cfg.pop("rope_theta")}
    if key("rope.scaling.type") == "yarn":
        factor = float(key("rope.scaling.factor", 1.0))
        beta_fast, beta_slow = _GPT_OSS_BETAS
        params.update(
            rope_type="yarn", factor=factor, beta_fast=beta_fast, beta_slow=beta_slow,
            original_max_position_embeddings=int(key("rope.scaling.original_context_length",
                                                     cfg["max_position_embeddings"])),
            truncate=True, attention_factor=(
                (1.0 + 0.1 * math.log(factor) if factor > 1 else 1.0)
                * float(key("rope.scaling.attn_factor", 1.0))))
    limit, alpha = _GPT_OSS_SWIGLU
    cfg.update(num_local_experts=int(key("expert_count", 0)),
               num_experts_per_tok=int(key("expert_used_count", 0)),
               intermediate_size=int(key("expert_feed_forward_length",
                                         cfg["intermediate_size"])),
               sliding_window=int(key("attention.sliding_window", 0) or 0) or None,
               layer_types=["sliding_attention" if s else "full_attention" for s in sliding],
               rope_parameters=params, swiglu_limit=limit, swiglu_alpha=alpha)
    return cfg


def _qwen3next(key, tensors: dict, cfg: dict) -> dict:
    if int(key("nextn_predict_layers", 0) or 0):
        raise UnsupportedModelError("GGUF qwen3next with multi-token-prediction (nextn) layers "
                                    "is not supported; convert with --no-mtp")
    layers = cfg["num_hidden_layers"]
    recurrent = key("attention.recurrent_layers")
    if recurrent is None:
        interval = int(key("full_attention_interval", 4))
        recurrent = [(i + 1) % interval != 0 for i in range(layers)]
    if len(recurrent) < layers:
        raise UnsupportedModelError(f"GGUF qwen3next.attention.recurrent_layers has "
                                    f"{len(recurrent)} flags for {layers} layers")
    width, v_heads = int(key("ssm.state_size", 0)), int(key("ssm.time_step_rank", 0))
    inner = int(key("ssm.inner_size", width * v_heads))
    if inner != width * v_heads:
        raise UnsupportedModelError(
            f"GGUF qwen3next.ssm.inner_size={inner} is not ssm.state_size * "
            f"ssm.time_step_rank ({width} * {v_heads}): llama.cpp's value heads are "
            "ssm.state_size wide, and jaxpaged reads such files only")
    cfg = _experts(key, tensors, cfg)
    cfg.update(
        layer_types=["linear_attention" if r else "full_attention"
                     for r in recurrent[:layers]],
        linear_num_key_heads=int(key("ssm.group_count", 0)), linear_num_value_heads=v_heads,
        linear_key_head_dim=width, linear_value_head_dim=width,
        linear_conv_kernel_dim=int(key("ssm.conv_kernel", 4)),
        shared_expert_intermediate_size=int(key("expert_shared_feed_forward_length", 0)
                                            or cfg["intermediate_size"]),
        rope_parameters={"rope_type": "default", "rope_theta": cfg.pop("rope_theta"),
                         "partial_rotary_factor": int(key("rope.dimension_count",
                                                          cfg["head_dim"])) / cfg["head_dim"]})
    return cfg


_FAMILIES = {"gemma3": _gemma3, "qwen3moe": _qwen3moe, "phi3": _phi3, "smollm3": _smollm3,
             "olmo2": _olmo2, "granite": _granite, "gpt-oss": _gpt_oss, "qwen3next": _qwen3next}
