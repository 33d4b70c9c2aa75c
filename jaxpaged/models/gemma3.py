"""Gemma 3 (text): Gemma 2's sandwich-norm block with per-head q/k norms, five local layers
to one global, and separate local and global RoPE bases.

Reference: Gemma Team, "Gemma 3 Technical Report" (2025), section 2: local sliding-window and
global layers interleaved 5:1, the local layers' RoPE base 10k and the global ones' 1M, QK-norm
in place of Gemma 2's attention soft cap; numerics as transformers' ``Gemma3ForCausalLM``
(q/k norms scale by ``1 + weight`` like every Gemma norm, applied per head before RoPE).
The per-layer bases and the window pattern are :class:`jaxpaged.family_settings.FamilySettings`
and ``sliding_windows``; soft caps apply where ``config.json`` sets them.
"""

from __future__ import annotations

from flax import nnx

from jaxpaged.config import ModelConfig
from jaxpaged.layers.attention import AttentionBackend
from jaxpaged.layers.normalization import RMSNorm
from jaxpaged.models.gemma2 import Gemma2DecoderLayer
from jaxpaged.models.llama import LlamaForCausalLM


class Gemma3DecoderLayer(Gemma2DecoderLayer):
    """Gemma 2's block whose attention normalises q and k per head by ``1 + weight``."""

    def __init__(self, config: ModelConfig, layer_idx: int, backend: AttentionBackend, dtype,
                 rngs: nnx.Rngs):
        super().__init__(config, layer_idx, backend, dtype, rngs)
        norm = lambda: RMSNorm(config.head_dim, config.rms_norm_eps, dtype, unit_offset=True)
        self.self_attn.q_norm, self.self_attn.k_norm = norm(), norm()


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3 text model (``Gemma3ForCausalLM``)."""

    decoder_layer = Gemma3DecoderLayer
    gemma_style = True
