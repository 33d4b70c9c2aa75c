"""Llama-family decoder (Llama 2/3 shapes, GQA/MQA, tied or untied embeddings) in Flax NNX.

Reference: Touvron et al., "Llama 2: Open Foundation and Fine-Tuned Chat Models" (2023),
section 2.2 (pre-norm RMSNorm, SwiGLU MLP, RoPE, grouped-query attention); parameter names and
numerics follow Hugging Face transformers' ``LlamaForCausalLM`` so that checkpoints load
one-to-one (module path + ``.weight``/``.bias``).

The model works on a flat, ragged batch: T tokens from any mix of prefill chunks and decodes.
The KV pool is not part of the module: it is passed in and returned (see
``jaxpaged.layers.attention.base`` for its layout), so the jitted step can donate it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpaged.config import ModelConfig
from jaxpaged.layers.attention import AttentionBackend, KVPages
from jaxpaged.layers.linear import linear
from jaxpaged.layers.normalization import RMSNorm
from jaxpaged.layers.rotary import apply_rope


class LlamaAttention(nnx.Module):
    """Multi-head attention with GQA over the paged KV pool."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend, dtype, rngs: nnx.Rngs):
        h, d = config.hidden_size, config.head_dim
        bias = config.attention_bias
        self.q_proj = linear(h, config.num_heads * d, bias, dtype, rngs, config.quantization)
        self.k_proj = linear(h, config.num_kv_heads * d, bias, dtype, rngs, config.quantization)
        self.v_proj = linear(h, config.num_kv_heads * d, bias, dtype, rngs, config.quantization)
        self.o_proj = linear(config.num_heads * d, h, bias, dtype, rngs, config.quantization)
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, d
        self.rope_theta = config.rope_theta
        self.backend = backend

    def __call__(self, x, positions, kv_pages: KVPages, metadata):
        """x: [T, H]; positions: [T] int32 -> ([T, H], updated kv_pages)."""
        t = x.shape[0]
        q = self.q_proj(x).reshape(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(t, self.num_kv_heads, self.head_dim)
        q = apply_rope(q, positions, self.rope_theta)
        k = apply_rope(k, positions, self.rope_theta)
        out, kv_pages = self.backend.forward(q, k, v, kv_pages, metadata,
                                             scale=self.head_dim ** -0.5)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim)), kv_pages


class LlamaMLP(nnx.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig, dtype, rngs: nnx.Rngs):
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = linear(h, i, False, dtype, rngs, config.quantization)
        self.up_proj = linear(h, i, False, dtype, rngs, config.quantization)
        self.down_proj = linear(i, h, False, dtype, rngs, config.quantization)

    def __call__(self, x):
        """x: [T, H] -> [T, H]."""
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nnx.Module):
    """Pre-norm residual block: attention then MLP."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend, dtype, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = LlamaAttention(config, backend, dtype, rngs)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = LlamaMLP(config, dtype, rngs)

    def __call__(self, x, positions, kv_pages, metadata):
        attn, kv_pages = self.self_attn(self.input_layernorm(x), positions, kv_pages, metadata)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), kv_pages


class LlamaModel(nnx.Module):
    """Embedding, decoder layers and final norm."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend, dtype, rngs: nnx.Rngs):
        self.embed_tokens = nnx.Embed(config.vocab_size, config.hidden_size, dtype=dtype,
                                      param_dtype=dtype, rngs=rngs,
                                      embedding_init=nnx.initializers.normal(0.02))
        self.layers = nnx.List([LlamaDecoderLayer(config, backend, dtype, rngs)
                                for _ in range(config.num_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def __call__(self, input_ids, positions, kv_caches: list[KVPages], metadata):
        x = self.embed_tokens(input_ids)
        new_caches = []
        for layer, kv_pages in zip(self.layers, kv_caches):
            x, kv_pages = layer(x, positions, kv_pages, metadata)
            new_caches.append(kv_pages)
        return self.norm(x), new_caches


class LlamaForCausalLM(nnx.Module):
    """Llama decoder with its language-model head.

    Args:
        config: the model's :class:`ModelConfig`.
        backend: the attention backend every layer calls.
        dtype: parameter and activation dtype (float32 or bfloat16).
        rngs: initialisers' randomness (used by ``--load-format dummy``).
    """

    def __init__(self, config: ModelConfig, backend: AttentionBackend, dtype, rngs: nnx.Rngs):
        self.model = LlamaModel(config, backend, dtype, rngs)
        self.lm_head = (None if config.tie_word_embeddings else
                        linear(config.hidden_size, config.vocab_size, False, dtype, rngs))

    def __call__(self, input_ids, positions, kv_caches: list[KVPages], metadata):
        """Run the decoder over one ragged batch.

        Args:
            input_ids: [T] int32 token ids; positions: [T] int32 positions.
            kv_caches: one ``(k_pages, v_pages)`` per layer.
            metadata: the attention backend's per-step device arrays.

        Returns:
            ([T, hidden_size] final hidden states, updated kv_caches).
        """
        return self.model(input_ids, positions, kv_caches, metadata)

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """hidden: [N, hidden_size] -> [N, vocab_size] float32 logits."""
        if self.lm_head is None:
            logits = self.model.embed_tokens.attend(hidden)
        else:
            logits = self.lm_head(hidden)
        return logits.astype(jnp.float32)
