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
"""

from __future__ import annotations

from jaxpaged.errors import UnsupportedModelError

#: GGUF ``general.architecture`` -> the Hugging Face class jaxpaged builds for it.
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "gemma3": "Gemma3ForCausalLM",
                      "qwen3moe": "Qwen3MoeForCausalLM", "phi3": "Phi3ForCausalLM",
                      "smollm3": "SmolLM3ForCausalLM", "olmo2": "Olmo2ForCausalLM",
                      "granite": "GraniteForCausalLM"}
#: Architectures whose converter class permutes the q/k rows for ggml's RoPE on adjacent
#: pairs (``LlamaModel.permute``: Llama and its subclasses SmolLM3 and Granite); the others
#: use ggml's NeoX RoPE and store the rows as transformers does.
PERMUTED_QK = ("llama", "smollm3", "granite")
#: Architectures whose RoPE may turn only part of each head (``rope.dimension_count``).
PARTIAL_ROTARY = ("phi3",)
#: Architectures that may carry ``rope.scaling.type`` ``linear`` (Gemma 3's global layers).
LINEAR_ROPE_SCALING = ("gemma3",)
#: Tensors that are settings, read into the config rather than the model.
CONFIG_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")
#: llama.cpp's default Gemma 3 window pattern and SmolLM3 no-RoPE step.
_GEMMA3_PATTERN, _SMOLLM3_NO_ROPE_STEP = 6, 4


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


def _gemma3(key, tensors: dict, cfg: dict) -> dict:
    layers, head_dim = cfg["num_hidden_layers"], cfg["head_dim"]
    window = int(key("attention.sliding_window", 0) or 0)
    pattern = key("attention.sliding_window_pattern", _GEMMA3_PATTERN)
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise UnsupportedModelError(f"GGUF gemma3.attention.sliding_window_pattern has "
                                        f"{len(pattern)} flags for {layers} layers")
        sliding = [bool(p) for p in pattern]
    else:
        n = int(pattern)
        sliding = [n == 0 or i % n < n - 1 for i in range(layers)]
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


_FAMILIES = {"gemma3": _gemma3, "qwen3moe": _qwen3moe, "phi3": _phi3, "smollm3": _smollm3,
             "olmo2": _olmo2, "granite": _granite}
