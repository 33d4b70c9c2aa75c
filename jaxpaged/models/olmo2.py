"""OLMo 2: norms after the attention and the MLP instead of before, and q/k norms over the
whole projection.

Reference: Team OLMo, "2 OLMo 2 Furious" (2024), section 3.1: the block is
``x + norm(attn(x))`` then ``x + norm(mlp(x))`` (no pre-norms), and queries and keys are
RMS-normalised over all heads at once (weights [heads * head_dim] and [kv_heads * head_dim])
before RoPE; numerics as transformers' ``Olmo2ForCausalLM`` (its norm multiplies by the
weight in float32 before casting back). Checkpoint names are Llama's plus
``self_attn.q_norm`` / ``k_norm`` and ``post_feedforward_layernorm``.
"""

from __future__ import annotations

from flax import nnx

from jaxpaged.config import ModelConfig
from jaxpaged.layers.attention import AttentionBackend
from jaxpaged.layers.normalization import RMSNorm
from jaxpaged.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP


class Olmo2Attention(LlamaAttention):
    """Llama's attention with q and k normalised over their whole width before RoPE."""

    qk_norm_per_head = False

    def __init__(self, config: ModelConfig, layer_idx: int, backend: AttentionBackend, dtype,
                 rngs: nnx.Rngs):
        super().__init__(config, layer_idx, backend, dtype, rngs)
        d, eps = config.head_dim, config.rms_norm_eps
        self.q_norm = nnx.data(RMSNorm(config.num_heads * d, eps, dtype))
        self.k_norm = nnx.data(RMSNorm(config.num_kv_heads * d, eps, dtype))

    def __call__(self, x, positions, kv_pages, metadata):
        """x: [T, H]; positions: [T] int32 -> ([T, H], updated kv_pages)."""
        out, kv_pages = self.attend(self.q_norm(self.q_proj(x)), self.k_norm(self.k_proj(x)),
                                    self.v_proj(x), positions, kv_pages, metadata)
        return self.o_proj(out), kv_pages


class Olmo2DecoderLayer(nnx.Module):
    """x + post_attention_layernorm(attn(x)), then x + post_feedforward_layernorm(mlp(x))."""

    def __init__(self, config: ModelConfig, layer_idx: int, backend: AttentionBackend, dtype,
                 rngs: nnx.Rngs):
        self.self_attn = Olmo2Attention(config, layer_idx, backend, dtype, rngs)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = LlamaMLP(config, dtype, rngs)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def __call__(self, x, positions, kv_pages, metadata):
        """x: [T, H] -> ([T, H], updated kv_pages)."""
        attn, kv_pages = self.self_attn(x, positions, kv_pages, metadata)
        x = x + self.post_attention_layernorm(attn)
        return x + self.post_feedforward_layernorm(self.mlp(x)), kv_pages


class Olmo2ForCausalLM(LlamaForCausalLM):
    """OLMo 2 (``Olmo2ForCausalLM``)."""

    decoder_layer = Olmo2DecoderLayer
