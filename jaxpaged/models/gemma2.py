"""Gemma 2: Llama's attention and gated MLP in a sandwich-norm block.

Reference: Gemma Team, "Gemma 2: Improving Open Language Models at a Practical Size" (2024),
section 2: RMSNorm before and after both the attention and the feed-forward, tanh-GELU gated
MLP, attention-score and final-logit soft caps, sliding-window attention on alternate layers,
scores scaled by ``query_pre_attn_scalar ** -0.5``, embeddings multiplied by
``sqrt(hidden_size)``, and norms scaling by ``1 + weight`` (numerics as transformers'
``Gemma2ForCausalLM``). The soft caps, window and scale are :class:`ModelConfig` settings the
shared :class:`LlamaAttention` applies.
"""

from __future__ import annotations

from flax import nnx

from jaxpaged.config import ModelConfig
from jaxpaged.layers.attention import AttentionBackend
from jaxpaged.layers.normalization import RMSNorm
from jaxpaged.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP


class Gemma2DecoderLayer(nnx.Module):
    """x + post_norm(attn(pre_norm(x))), then the same around the MLP."""

    def __init__(self, config: ModelConfig, layer_idx: int, backend: AttentionBackend, dtype,
                 rngs: nnx.Rngs):
        norm = lambda: RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, unit_offset=True)
        self.input_layernorm = norm()
        self.self_attn = LlamaAttention(config, layer_idx, backend, dtype, rngs)
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.mlp = LlamaMLP(config, dtype, rngs)
        self.post_feedforward_layernorm = norm()

    def __call__(self, x, positions, kv_pages, metadata):
        """x: [T, H] -> ([T, H], updated kv_pages)."""
        attn, kv_pages = self.self_attn(self.input_layernorm(x), positions, kv_pages, metadata)
        x = x + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(mlp), kv_pages


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Gemma 2 (``Gemma2ForCausalLM``)."""

    decoder_layer = Gemma2DecoderLayer
    gemma_style = True
