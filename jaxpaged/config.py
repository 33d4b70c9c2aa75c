"""Model configuration parsed from a Hugging Face `config.json`.

Only the fields the engine needs are kept; everything is validated on load so that a
broken or unsupported checkpoint fails at start-up with a message naming the problem.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass

from jaxpaged import gguf_config
from jaxpaged.errors import UnsupportedModelError
from jaxpaged.hf_config import (DEFAULT_AWQ_GROUP_SIZE, RopeScaling, checkpoint_quantization,
                                optional_float, rope_parameters, sliding_windows)
from jaxpaged.classification import (SEQ_CLS_ARCHITECTURES, ClassifierSpec, causal_architectures,
                                     classifier_spec, parse_hf_overrides)
from jaxpaged.family_settings import (ARCHITECTURES_2026, PER_HEAD_QK_NORM,
                                      FamilySettings, FamilySettingsError, family_settings)

#: Architectures (``config.json``'s ``architectures``) with a model class in
#: :mod:`jaxpaged.models`.
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                           "Qwen3ForCausalLM", "MixtralForCausalLM", "Gemma2ForCausalLM"
                           ) + ARCHITECTURES_2026
#: Settings a family's transformers config class defaults when ``config.json`` leaves them
#: out (so a sparse config means what it means to transformers).
_FAMILY_DEFAULTS = {
    "MistralForCausalLM": {"sliding_window": 4096},
    "MixtralForCausalLM": {"rms_norm_eps": 1e-5, "num_experts_per_tok": 2},
    "Gemma2ForCausalLM": {"query_pre_attn_scalar": 256, "attn_logit_softcapping": 50.0,
                          "final_logit_softcapping": 30.0},
}
#: MLP activations by their transformers name.
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
#: Weight-only quantization methods (``--quantization``; ``jaxpaged.layers.quantization`` for
#: int8/fp8, ``jaxpaged.layers.awq`` for 4-bit AWQ).
QUANTIZATION_METHODS = ("int8", "fp8", "awq")


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a decoder-only transformer.

    Attributes:
        architecture: the Hugging Face class name, e.g. ``"LlamaForCausalLM"``.
        vocab_size, hidden_size, intermediate_size, num_layers: the usual sizes.
        num_heads: query heads; ``num_kv_heads`` key/value heads (GQA when fewer, MQA when 1).
        head_dim: per-head width (``hidden_size // num_heads`` unless the config sets it).
        rope_theta: RoPE base frequency.
        rms_norm_eps: epsilon of every RMSNorm.
        max_position_embeddings: trained context length, the default ``max_model_len``.
        tie_word_embeddings: the LM head reuses the input embedding matrix.
        qkv_bias: the q/k/v projections carry biases (Llama's ``attention_bias``; always for
            Qwen2); ``o_bias``: so does the output projection (Llama's ``attention_bias``).
        bos_token_id, eos_token_ids: special ids (several EOS ids are allowed).
        checkpoint_dtype: the stored weights' dtype name (``torch_dtype`` or transformers 5's
            ``dtype``; ``"float32"`` when absent).
        rope_scaling: Llama 3's RoPE frequency scaling, or None.
        sliding_windows: per layer, the sliding-window size (a query at p sees keys in
            (p - window, p]) or None for full causal attention.
        qk_norm: per-head RMSNorm of queries and keys before RoPE (Qwen3).
        num_experts, num_experts_per_tok: a sparse mixture-of-experts MLP with top-k routing
            (Mixtral); 0 experts means a dense MLP.
        hidden_act: the MLP's gating activation (one of :data:`ACTIVATIONS`).
        query_pre_attn_scalar: attention scores are scaled by its inverse square root instead
            of ``head_dim``'s (Gemma 2).
        attn_logit_softcapping, final_logit_softcapping: Gemma 2's tanh soft caps of attention
            scores and of the output logits (None: off).
        quantization: weight-only quantization of the decoder's projections (one of
            :data:`QUANTIZATION_METHODS`), or None; ``"fp8"`` when the checkpoint itself is
            stored in fp8 (its ``quantization_config``), ``"awq"`` when it is AutoAWQ's 4-bit
            GEMM format.
        quantization_group_size: input rows per AWQ scale and zero point (the checkpoint's
            ``group_size``; :data:`DEFAULT_AWQ_GROUP_SIZE` otherwise).
        classifier: a sequence classifier's head (``jaxpaged.classification``; the
            architecture is then its decoder's causal-LM one, and the model is built without
            an LM head: ``tie_word_embeddings`` is set, the logits are never read), or None.
        family: the settings only some families have (:mod:`jaxpaged.family_settings`).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    checkpoint_dtype: str = "float32"
    rope_scaling: RopeScaling | None = None
    sliding_windows: tuple[int | None, ...] = ()
    qk_norm: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0
    hidden_act: str = "silu"
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    quantization: str | None = None
    quantization_group_size: int = DEFAULT_AWQ_GROUP_SIZE
    classifier: ClassifierSpec | None = None
    family: FamilySettings = FamilySettings()

    @classmethod
    def from_dict(cls, cfg: dict) -> "ModelConfig":
        """Build from a parsed ``config.json``.

        Raises:
            UnsupportedModelError: unknown architecture, unsupported rope scaling,
                activation or ``quantization_config``, or head counts that do not divide.
        """
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size",
                               "num_hidden_layers", "num_attention_heads") if k not in cfg]
        if missing:
            raise UnsupportedModelError(f"config.json lacks {missing}")
        archs = cfg.get("architectures") or []
        try:
            classifier = classifier_spec(cfg)
        except ValueError as e:
            raise UnsupportedModelError(str(e)) from None
        arch = next((a for a in causal_architectures(archs) if a in SUPPORTED_ARCHITECTURES),
                    None)
        if arch is None:
            raise UnsupportedModelError(
                f"unsupported architecture {archs!r}; supported: {list(SUPPORTED_ARCHITECTURES)}"
                f" and {list(SEQ_CLS_ARCHITECTURES)}")
        try:
            cfg, family = family_settings(cfg, arch)
        except FamilySettingsError as e:
            raise UnsupportedModelError(f"{arch}: {e}") from None
        act = cfg.get("hidden_activation") or cfg.get("hidden_act", "silu")
        if act not in ACTIVATIONS:
            raise UnsupportedModelError(f"unsupported hidden_act {act!r}; supported: "
                                        f"{list(ACTIVATIONS)}")
        cfg = {**_FAMILY_DEFAULTS.get(arch, {}), **cfg}
        rope_theta, rope_scaling = rope_parameters(cfg)
        if cfg.get("mlp_bias", False):
            raise UnsupportedModelError("mlp_bias=true is not supported")
        num_heads = int(cfg["num_attention_heads"])
        num_kv_heads = int(cfg.get("num_key_value_heads") or num_heads)
        if num_heads % num_kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads={num_heads} is not a multiple of "
                f"num_key_value_heads={num_kv_heads}")
        hidden = int(cfg["hidden_size"])
        head_dim = int(cfg.get("head_dim") or hidden // num_heads)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        attention_bias = bool(cfg.get("attention_bias", False))
        num_experts = int(cfg.get("num_local_experts") or 0)
        top_k = int(cfg.get("num_experts_per_tok") or 0)
        quantization, group_size = checkpoint_quantization(cfg.get("quantization_config"))
        if num_experts and quantization == "awq":
            raise UnsupportedModelError("AWQ checkpoints of mixture-of-experts models are not "
                                        "supported")
        if num_experts and not 1 <= top_k <= num_experts:
            raise UnsupportedModelError(f"num_experts_per_tok={top_k} must be in "
                                        f"[1, num_local_experts={num_experts}]")
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rope_theta=rope_theta,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)) or bool(classifier),
            qkv_bias=attention_bias or arch == "Qwen2ForCausalLM",
            o_bias=attention_bias and arch != "Qwen2ForCausalLM",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            checkpoint_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
            rope_scaling=rope_scaling,
            sliding_windows=sliding_windows(cfg, arch),
            qk_norm=arch in PER_HEAD_QK_NORM,
            num_experts=num_experts,
            num_experts_per_tok=top_k if num_experts else 0,
            hidden_act=act,
            query_pre_attn_scalar=optional_float(cfg, "query_pre_attn_scalar"),
            attn_logit_softcapping=optional_float(cfg, "attn_logit_softcapping"),
            final_logit_softcapping=optional_float(cfg, "final_logit_softcapping"),
            quantization=quantization,
            quantization_group_size=group_size,
            classifier=classifier,
            family=family,
        )._checked_awq_shapes()

    @classmethod
    def from_pretrained(cls, model_dir: str, hf_overrides: str | dict | None = None
                        ) -> "ModelConfig":
        """Read ``<model_dir>/config.json``, or the metadata of a GGUF file when ``model_dir``
        is one (:func:`jaxpaged.gguf_config.gguf_config`), with ``hf_overrides`` (vLLM's
        ``--hf-overrides``: JSON text or a dict) merged over its top level.

        Raises:
            FileNotFoundError: no such path, or the directory has no ``config.json``.
            UnsupportedModelError: invalid JSON (or ``hf_overrides`` that is not a JSON
                object), or see :meth:`from_dict`.
            jaxpaged.gguf_config.BadGGUFError: an unreadable or inconsistent GGUF.
        """
        if not os.path.exists(model_dir):
            raise FileNotFoundError(f"the model path {model_dir!r} does not exist (jaxpaged "
                                    "loads a local model directory or .gguf file)")
        try:
            overrides = parse_hf_overrides(hf_overrides)
        except ValueError as e:
            raise UnsupportedModelError(str(e)) from None
        if gguf_config.is_gguf(model_dir):
            return cls.from_dict({**gguf_config.gguf_config(model_dir), **overrides})
        path = os.path.join(model_dir, "config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no config.json in model directory {model_dir!r}")
        with open(path) as f:
            try:
                cfg = json.load(f)
            except json.JSONDecodeError as e:
                raise UnsupportedModelError(f"{path} is not valid JSON: {e}") from e
        return cls.from_dict({**cfg, **overrides})

    def with_quantization(self, method: str | None) -> "ModelConfig":
        """This config with its projections quantized by ``method`` (``--quantization``;
        None keeps the checkpoint's own, if any).

        Raises:
            UnsupportedModelError: the checkpoint is stored quantized by another method, or
                ``awq`` for a mixture-of-experts model.
        """
        if method is None or method == self.quantization:
            return self
        if method == "awq" and self.num_experts:
            raise UnsupportedModelError("--quantization awq does not support mixture-of-experts "
                                        "models (their experts quantize with int8 or fp8)")
        if self.quantization is not None:
            raise UnsupportedModelError(
                f"the checkpoint is stored quantized ({self.quantization}); it cannot be loaded "
                f"with quantization={method!r} (leave it unset or use {self.quantization!r})")
        return dataclasses.replace(self, quantization=method)._checked_awq_shapes()

    def _checked_awq_shapes(self) -> "ModelConfig":
        """``self``, if every projection fits AWQ's layout (or it is not AWQ).

        Raises:
            UnsupportedModelError: an input width not divisible by the group size or an
                output width not divisible by 8 (eight 4-bit values per int32).
        """
        if self.quantization != "awq":
            return self
        g, attn = self.quantization_group_size, self.num_heads * self.head_dim
        ins = {"hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
               "num_heads * head_dim": attn}
        outs = {**ins, "num_kv_heads * head_dim": self.num_kv_heads * self.head_dim}
        bad = [f"{k}={v} is not a multiple of the group size {g}" for k, v in ins.items() if v % g]
        bad += [f"{k}={v} is not a multiple of 8" for k, v in outs.items() if v % 8]
        if bad:
            raise UnsupportedModelError("AWQ 4-bit weights do not fit this model: " + "; ".join(bad))
        return self

    @property
    def num_queries_per_kv(self) -> int:
        """Query heads sharing one KV head (the GQA group size)."""
        return self.num_heads // self.num_kv_heads
