"""Granite 3: the Llama decoder with four scalar multipliers.

Reference: IBM Granite Team, "Granite 3.0 Language Models" (2024), and transformers'
``GraniteForCausalLM``, whose only differences from Llama are: embeddings times
``embedding_multiplier``, each block's attention and MLP outputs times
``residual_multiplier`` before their residual adds, attention scores scaled by
``attention_multiplier`` (instead of ``head_dim ** -0.5``; :class:`LlamaAttention` reads it
from :class:`jaxpaged.family_settings.FamilySettings`) and logits divided by
``logits_scaling``. Checkpoint names are Llama's.
"""

from __future__ import annotations

import jax

from jaxpaged.models.llama import LlamaDecoderLayer, LlamaForCausalLM


class GraniteDecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm block with both residual branches scaled by ``residual_multiplier``."""

    def __call__(self, x, positions, kv_pages, metadata):
        """x: [T, H] -> ([T, H], updated kv_pages)."""
        scale = self.residual_multiplier
        attn, kv_pages = self.self_attn(self.input_layernorm(x), positions, kv_pages, metadata)
        x = x + attn * scale
        return x + self.feed_forward(self.post_attention_layernorm(x)) * scale, kv_pages


class GraniteForCausalLM(LlamaForCausalLM):
    """Granite (``GraniteForCausalLM``)."""

    decoder_layer = GraniteDecoderLayer

    def __init__(self, config, backend, dtype, rngs):
        super().__init__(config, backend, dtype, rngs)
        family = config.family
        self.model.embed_scale = family.embedding_multiplier
        for layer in self.model.layers:
            layer.residual_multiplier = family.residual_multiplier
        self.logits_scaling = family.logits_scaling

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """hidden: [N, hidden_size] -> [N, vocab_size] float32 logits / ``logits_scaling``."""
        return super().compute_logits(hidden) / self.logits_scaling
