"""Model configuration parsed from a Hugging Face `config.json`.

Only the fields the engine needs are kept; everything is validated on load so that a
broken or unsupported checkpoint fails at start-up with a message naming the problem.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass

#: Architectures (``config.json``'s ``architectures``) that the Llama module serves.
LLAMA_ARCHITECTURES = ("LlamaForCausalLM",)
#: Weight-only quantization methods (``--quantization``; ``jaxpaged.layers.quantization``).
QUANTIZATION_METHODS = ("int8", "fp8")


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture or configuration is not supported."""


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
        attention_bias: q/k/v/o projections carry biases.
        bos_token_id, eos_token_ids: special ids (several EOS ids are allowed).
        checkpoint_dtype: the stored weights' dtype name (``torch_dtype`` or transformers 5's
            ``dtype``; ``"float32"`` when absent).
        quantization: weight-only quantization of the decoder's projections (one of
            :data:`QUANTIZATION_METHODS`), or None; ``"fp8"`` when the checkpoint itself is
            stored in fp8 (its ``quantization_config``).
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
    attention_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    checkpoint_dtype: str = "float32"
    quantization: str | None = None

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
        arch = next((a for a in archs if a in LLAMA_ARCHITECTURES), None)
        if arch is None:
            raise UnsupportedModelError(
                f"unsupported architecture {archs!r}; supported: {list(LLAMA_ARCHITECTURES)}")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"unsupported hidden_act {act!r}; only 'silu' is supported")
        rope_theta, rope_type = _rope(cfg)
        if rope_type not in (None, "default"):
            raise UnsupportedModelError(f"unsupported rope scaling type {rope_type!r}")
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
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            checkpoint_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
            quantization=_checkpoint_quantization(cfg.get("quantization_config")),
        )

    @classmethod
    def from_pretrained(cls, model_dir: str) -> "ModelConfig":
        """Read ``<model_dir>/config.json``.

        Raises:
            FileNotFoundError: the directory has no ``config.json``.
            UnsupportedModelError: invalid JSON, or see :meth:`from_dict`.
        """
        path = os.path.join(model_dir, "config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no config.json in model directory {model_dir!r}")
        with open(path) as f:
            try:
                cfg = json.load(f)
            except json.JSONDecodeError as e:
                raise UnsupportedModelError(f"{path} is not valid JSON: {e}") from e
        return cls.from_dict(cfg)

    def with_quantization(self, method: str | None) -> "ModelConfig":
        """This config with its projections quantized by ``method`` (``--quantization``;
        None keeps the checkpoint's own, if any).

        Raises:
            UnsupportedModelError: the checkpoint is stored quantized by another method.
        """
        if method is None or method == self.quantization:
            return self
        if self.quantization is not None:
            raise UnsupportedModelError(
                f"the checkpoint is stored quantized ({self.quantization}); it cannot be loaded "
                f"with quantization={method!r} (leave it unset or use {self.quantization!r})")
        return dataclasses.replace(self, quantization=method)

    @property
    def num_queries_per_kv(self) -> int:
        """Query heads sharing one KV head (the GQA group size)."""
        return self.num_heads // self.num_kv_heads


def _rope(cfg: dict) -> tuple[float, str | None]:
    """RoPE theta and scaling type from either layout.

    transformers < 5 writes ``rope_theta`` and ``rope_scaling``; transformers 5 writes one
    ``rope_parameters`` dict holding ``rope_theta`` and ``rope_type``.
    """
    params = cfg.get("rope_parameters")
    if isinstance(params, dict):
        return float(params.get("rope_theta", cfg.get("rope_theta", 10000.0))), params.get("rope_type")
    scaling = cfg.get("rope_scaling")
    rope_type = None
    if isinstance(scaling, dict):
        rope_type = scaling.get("rope_type", scaling.get("type"))
    return float(cfg.get("rope_theta", 10000.0)), rope_type


def _checkpoint_quantization(qc: dict | None) -> str | None:
    """The quantization a checkpoint is stored in, from ``config.json``'s
    ``quantization_config``: None for a float checkpoint, ``"fp8"`` for fp8 weights with
    per-tensor or per-channel scales (``quant_method`` ``"fp8"``, or ``"compressed-tensors"``
    in its ``float-quantized`` format).

    Raises:
        UnsupportedModelError: any other layout, naming its ``quant_method``.
    """
    if qc is None:
        return None
    method = qc.get("quant_method")
    if method == "fp8":
        block = qc.get("weight_block_size")
        problem = f"block-wise scales (weight_block_size {block})" if block else None
    elif method == "compressed-tensors":
        schemes = [g.get("weights") or {} for g in (qc.get("config_groups") or {}).values()]
        fp8 = schemes and all((w.get("type"), w.get("num_bits")) == ("float", 8)
                              and w.get("strategy") in ("tensor", "channel") for w in schemes)
        problem = (f"format {qc.get('format')!r}" if qc.get("format") != "float-quantized" else
                   None if fp8 else f"weight schemes {schemes}")
    else:
        problem = "this method"
    if problem is None:
        return "fp8"
    raise UnsupportedModelError(
        f"quantized checkpoint with quant_method {method!r} is not supported ({problem}); "
        "jaxpaged loads fp8 checkpoints with per-tensor or per-channel scales (quant_method "
        "'fp8', or 'compressed-tensors' in format 'float-quantized'), and quantizes float "
        "checkpoints itself with --quantization int8 or fp8")
