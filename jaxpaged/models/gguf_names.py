"""llama.cpp's tensor names of each GGUF architecture, as the Hugging Face names jaxpaged's
modules ask for.

The names are gguf-py's (``constants.py``: ``TENSOR_NAMES`` and each ``MODEL_ARCH``'s tensor
list; ``tensor_mapping.py`` for which Hugging Face tensor each one is): ``token_embd``,
``output_norm``, ``output`` and per layer ``blk.{i}.<name>``. Families differ in their norms
and fused tensors:

- Llama, SmolLM3, Granite, Qwen3-MoE: ``attn_norm`` before attention, ``ffn_norm`` before the
  MLP (``post_attention_layernorm``); Qwen3-MoE adds per-head ``attn_q_norm`` /
  ``attn_k_norm``, the router ``ffn_gate_inp`` and the experts stacked in one tensor each,
  ``ffn_{gate,up,down}_exps`` (numpy ``[experts, out, in]``), read one expert at a time as
  ``mlp.experts.{e}.{gate,up,down}_proj``.
- Gemma 3: four norms (``attn_norm``, ``post_attention_norm``, ``ffn_norm`` =
  ``pre_feedforward_layernorm``, ``post_ffw_norm``) plus ``attn_q_norm`` / ``attn_k_norm``;
  the converter stores every norm as ``1 + weight`` (``Gemma3Model.norm_shift``), which
  :func:`norm_offset` gives back.
- OLMo 2: only the norms after attention and MLP (``post_attention_norm``,
  ``post_ffw_norm``), ``attn_q_norm`` / ``attn_k_norm`` over the whole projection.
- Phi-3: ``attn_qkv`` (q, k, v rows) and ``ffn_up`` holding gate and up rows, read apart by
  :mod:`jaxpaged.models.checkpoint_names` under transformers' ``qkv_proj`` /
  ``gate_up_proj``; ``rope_factors_long`` / ``rope_factors_short`` are settings
  (:data:`jaxpaged.gguf_arch.CONFIG_TENSORS`).
- gpt-oss: ``attn_norm``, ``post_attention_norm`` (before the MoE), biased projections,
  ``attn_sinks``, the router ``ffn_gate_inp`` (weight and bias) and the stacked experts
  ``ffn_{gate,up,down}_exps`` with their stacked biases, named as the modules ask for them
  (``mlp.experts.{e}.w1.weight``, ``w1_bias``; gate and up already apart, not transformers'
  interleaved ``gate_up_proj``), so no :class:`~jaxpaged.models.gpt_oss_checkpoint.
  GptOssCheckpoint` view (:data:`MODULE_NAMED`).
- Qwen3-Next: the full-attention layers as Qwen3-MoE's (``attn_q`` holding query and gate
  rows as transformers' ``q_proj``), a gated shared expert (``ffn_{gate,up,down}_shexp``,
  ``ffn_gate_inp_shexp``) and the Gated DeltaNet's ``ssm_*`` tensors; the converter stores
  every norm but ``ssm_norm`` as ``1 + weight``, ``ssm_a`` as ``-exp(A_log)``, ``ssm_conv1d``
  squeezed to ``[channels, K]`` and ``in_proj_qkvz`` split into ``attn_qkv`` and
  ``attn_gate`` (:mod:`jaxpaged.models.gguf_deltanet` gives each back).
"""

from __future__ import annotations

import re

from jaxpaged.gguf_arch import CONFIG_TENSORS

GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                "output": "lm_head"}
_ATTENTION = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
              "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj"}
_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_MLP = {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_PRE_NORMS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
_LLAMA = {**_PRE_NORMS, **_ATTENTION, **_MLP}
#: Per architecture: llama.cpp layer tensor -> Hugging Face module under
#: ``model.layers.{i}``.
LAYER_NAMES = {
    "llama": _LLAMA, "smollm3": _LLAMA, "granite": _LLAMA,
    "qwen3moe": {**_PRE_NORMS, **_ATTENTION, **_QK_NORMS, **_MLP, "ffn_gate_inp": "mlp.gate"},
    "phi3": {**_PRE_NORMS, **_ATTENTION, "attn_qkv": "self_attn.qkv_proj",
             "ffn_up": "mlp.gate_up_proj", "ffn_down": "mlp.down_proj"},
    "gemma3": {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
               "ffn_norm": "pre_feedforward_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm", **_ATTENTION, **_QK_NORMS, **_MLP},
    "olmo2": {"post_attention_norm": "post_attention_layernorm",
              "post_ffw_norm": "post_feedforward_layernorm", **_ATTENTION, **_QK_NORMS, **_MLP},
    "gpt-oss": {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
                **_ATTENTION, "attn_sinks": "self_attn.sinks", "ffn_gate_inp": "mlp.router"},
    "qwen3next": {"attn_norm": "input_layernorm",
                  "post_attention_norm": "post_attention_layernorm", **_ATTENTION, **_QK_NORMS,
                  "ffn_gate_inp": "mlp.gate", "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
                  "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
                  "ffn_up_shexp": "mlp.shared_expert.up_proj",
                  "ffn_down_shexp": "mlp.shared_expert.down_proj",
                  "attn_qkv": "linear_attn.in_proj_qkv", "attn_gate": "linear_attn.in_proj_z",
                  "ssm_ba": "linear_attn.in_proj_ba", "ssm_conv1d": "linear_attn.conv1d",
                  "ssm_norm": "linear_attn.norm", "ssm_out": "linear_attn.out_proj"},
}
#: Layer tensors without a ``.weight`` / ``.bias`` leaf of their own in Hugging Face naming:
#: (architecture, llama.cpp name, its leaf or None) -> the name under ``model.layers.{i}``.
_WHOLE_NAMES = {("qwen3next", "ssm_a", None): "linear_attn.A_log",
                ("qwen3next", "ssm_dt", "bias"): "linear_attn.dt_bias"}
_EXPERT_PROJECTIONS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj",
                       "ffn_down_exps": "down_proj"}
#: Per architecture: stacked expert tensors -> the projection each expert's slice is.
EXPERT_NAMES = {"qwen3moe": _EXPERT_PROJECTIONS, "qwen3next": _EXPERT_PROJECTIONS,
                "gpt-oss": {"ffn_gate_exps": "w1", "ffn_up_exps": "w3", "ffn_down_exps": "w2"}}
#: Architectures whose tensors are named as jaxpaged's modules ask for them, read without the
#: family's checkpoint view (:func:`jaxpaged.models.checkpoint_names.checkpoint_view`).
MODULE_NAMED = ("gpt-oss",)
#: Architectures whose norms the converter stores as ``1 + weight`` (but those of
#: :data:`_OWN_SCALE_NORMS`).
_UNIT_OFFSET_NORMS = ("gemma3", "qwen3next")
_OWN_SCALE_NORMS = ("linear_attn.norm.weight",)
_LAYER = re.compile(r"blk\.(\d+)\.(\w+?)(?:\.(weight|bias))?$")
_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(\w+)\.weight$")


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The Hugging Face name of a llama.cpp tensor of architecture ``arch``
    (``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; a stacked expert
    tensor ``blk.0.ffn_up_exps.weight`` -> ``model.layers.0.mlp.experts.up_proj.weight``, the
    stack :func:`expert_slice` reads from; gpt-oss's ``blk.0.ffn_up_exps.bias`` ->
    ``model.layers.0.mlp.experts.w3_bias.weight``), or None for a name outside the
    mapping."""
    base, _, leaf = gguf_name.rpartition(".")
    if base in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[base]}.{leaf}"
    m = _LAYER.match(gguf_name)
    if not m:
        return None
    layer, kind, leaf = m.groups()
    if (arch, kind, leaf) in _WHOLE_NAMES:
        return f"model.layers.{layer}.{_WHOLE_NAMES[arch, kind, leaf]}"
    if leaf is None:
        return None
    if kind in LAYER_NAMES.get(arch, {}):
        return f"model.layers.{layer}.{LAYER_NAMES[arch][kind]}.{leaf}"
    projection = EXPERT_NAMES.get(arch, {}).get(kind)
    if projection is not None and (leaf == "weight" or arch == "gpt-oss"):
        suffix = "" if leaf == "weight" else "_bias"       # gpt-oss's expert biases
        return f"model.layers.{layer}.mlp.experts.{projection}{suffix}.weight"
    return None


def expert_slice(name: str) -> tuple[str, int] | None:
    """(the stacked tensor's Hugging Face-style name, the expert) that one expert's weight
    ``model.layers.{i}.mlp.experts.{e}.{proj}.weight`` is read from, or None for another
    name."""
    m = _EXPERT.match(name)
    return None if m is None else (f"{m.group(1)}.{m.group(3)}.weight", int(m.group(2)))


def norm_offset(arch: str, name: str) -> float:
    """What the converter added to tensor ``name`` (Hugging Face naming) of architecture
    ``arch``: 1 for a Gemma 3 or Qwen3-Next norm's weight (but the DeltaNet's gated norm),
    else 0."""
    return 1.0 if (arch in _UNIT_OFFSET_NORMS and name.endswith("norm.weight")
                   and not name.endswith(_OWN_SCALE_NORMS)) else 0.0


def is_config_tensor(gguf_name: str) -> bool:
    """Whether the tensor is a setting read into the config (Phi-3's RoPE factors)."""
    return gguf_name in CONFIG_TENSORS
