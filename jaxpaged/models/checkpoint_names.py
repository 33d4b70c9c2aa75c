"""Checkpoint tensors a family stores under other names or fused, as the shared modules ask
for them.

The loader asks a reader for each parameter by its module path (``...q_proj.weight``,
``...experts.{e}.w1.weight``). Two families store theirs otherwise:

- Phi-3 fuses the attention input projections into ``self_attn.qkv_proj.weight``
  ([(heads + 2 * kv_heads) * head_dim, hidden]: q rows, then k, then v) and the MLP's into
  ``mlp.gate_up_proj.weight`` ([2 * intermediate, hidden]: gate rows, then up), as
  transformers' ``Phi3Attention`` / ``Phi3MLP`` split them. Reading the pieces apart keeps
  tensor parallelism's column split per projection (a split of the fused rows would hand a
  device parts of q, k and v).
- Qwen3-MoE and Qwen3-Next name their experts' projections ``gate_proj`` / ``up_proj`` /
  ``down_proj`` (Mixtral's ``w1`` / ``w3`` / ``w2``, which
  :class:`jaxpaged.models.mixtral.MixtralExperts` is named after).
"""

from __future__ import annotations

import re

import numpy as np

from jaxpaged.config import ModelConfig
from jaxpaged.models.gpt_oss_checkpoint import GptOssCheckpoint

_EXPERT_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_EXPERT = re.compile(r"^(.*\.experts\.\d+\.)(w[123])(\.weight)$")


class CheckpointView:
    """A checkpoint reader seen through a family's names (module docstring): ``get`` of a
    name the family stores fused returns its rows of the fused tensor; other attributes
    (``unread``, ``get_packed``) are the reader's.

    Args:
        reader: the loader's safetensors or GGUF reader (``get(name) -> np.ndarray | None``).
        config: the model's config (head counts and widths locate the rows).
    """

    def __init__(self, reader, config: ModelConfig):
        self._reader = reader
        q = config.num_heads * config.head_dim
        kv = config.num_kv_heads * config.head_dim
        i = config.intermediate_size
        self._fused = {"self_attn.q_proj": ("self_attn.qkv_proj", 0, q),
                       "self_attn.k_proj": ("self_attn.qkv_proj", q, q + kv),
                       "self_attn.v_proj": ("self_attn.qkv_proj", q + kv, q + 2 * kv),
                       "mlp.gate_proj": ("mlp.gate_up_proj", 0, i),
                       "mlp.up_proj": ("mlp.gate_up_proj", i, 2 * i)}
        self._renames = config.architecture in ("Qwen3MoeForCausalLM", "Qwen3NextForCausalLM")

    def __getattr__(self, name):
        return getattr(self._reader, name)

    def get(self, name: str) -> np.ndarray | None:
        """Tensor ``name`` ([out, in] rows for a weight), from its own or the family's
        storage; None when neither holds it."""
        if self._renames:
            m = _EXPERT.match(name)
            if m:
                name = m.group(1) + _EXPERT_NAMES[m.group(2)] + m.group(3)
        arr = self._reader.get(name)
        if arr is not None:
            return arr
        base, _, leaf = name.rpartition(".")
        for piece, (fused, begin, end) in self._fused.items():
            if base.endswith("." + piece):
                whole = self._reader.get(base[:-len(piece)] + fused + "." + leaf)
                return None if whole is None else whole[begin:end]
        return None


def checkpoint_view(reader, config: ModelConfig):
    """``reader`` as the model's modules ask it (:class:`CheckpointView`) for the families
    that store tensors otherwise (Phi-3, Qwen3-MoE, Qwen3-Next; gpt-oss:
    :class:`GptOssCheckpoint`, unless the reader's ``module_names`` says its names are the
    modules' already, as a gpt-oss GGUF's are); ``reader`` itself for the rest."""
    if config.architecture in ("Phi3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen3NextForCausalLM"):
        return CheckpointView(reader, config)
    if config.architecture == "GptOssForCausalLM" and not getattr(reader, "module_names", False):
        return GptOssCheckpoint(reader)
    return reader
