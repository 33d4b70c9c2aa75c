"""Qwen3-Next: Gated DeltaNet (linear attention) layers beside gated full-attention layers,
with Qwen3-MoE's experts plus a gated shared expert.

Reference: Qwen Team, "Qwen3-Next" (2025) model card, and transformers' ``modeling_qwen3_next``
(5.24) for numerics and names:

- ``layer_types``: most layers are ``linear_attention``
  (:class:`jaxpaged.layers.gated_deltanet.GatedDeltaNet`, a per-sequence recurrent state),
  every 4th ``full_attention``: Qwen3's attention over the paged KV pool whose ``q_proj`` also
  yields a per-head output gate (``[heads, 2 * head_dim]``: query, then gate), applied as
  ``o_proj(attn * sigmoid(gate))``; q/k norms per head; RoPE on the first
  ``partial_rotary_factor`` (0.25) of each head.
- Every RMSNorm but the DeltaNet's gated one scales by ``1 + weight`` (zero-centred).
- The feed-forward: routed experts (softmax over all, top-k, renormalised with
  ``norm_topk_prob``) plus ``sigmoid(shared_expert_gate(x)) * shared_expert(x)``; dense on
  ``mlp_only_layers``. Checkpoints name the experts ``mlp.experts.{e}.gate_proj|up_proj|
  down_proj`` (read as Qwen3-MoE's, :mod:`jaxpaged.models.checkpoint_names`).

The pool entry of a linear-attention layer is its ``(conv_state, ssm_state)`` (see
:func:`jaxpaged.layers.recurrent_pool.recurrent_pool`), a full-attention layer's its
``(k_pages, v_pages)``; the decoder walks them in layer order.
"""

from __future__ import annotations

import dataclasses

import jax
from flax import nnx

from jaxpaged.config import ModelConfig
from jaxpaged.layers.attention import AttentionBackend
from jaxpaged.layers.gated_deltanet import GatedDeltaNet
from jaxpaged.layers.linear import linear
from jaxpaged.layers.normalization import RMSNorm
from jaxpaged.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, LlamaModel
from jaxpaged.models.mixtral import MixtralSparseMoeBlock


class Qwen3NextAttention(LlamaAttention):
    """Qwen3's attention with an output gate from ``q_proj`` and ``1 + weight`` q/k norms."""

    def __init__(self, config: ModelConfig, layer_idx: int, backend: AttentionBackend, dtype,
                 rngs: nnx.Rngs):
        super().__init__(config, layer_idx, backend, dtype, rngs)
        quant = (config.quantization, config.quantization_group_size)
        self.q_proj = linear(config.hidden_size, 2 * config.num_heads * config.head_dim,
                             config.qkv_bias, dtype, rngs, *quant)
        norm = lambda: RMSNorm(config.head_dim, config.rms_norm_eps, dtype, unit_offset=True)
        self.q_norm, self.k_norm = norm(), norm()

    def __call__(self, x, positions, kv_pages, metadata):
        """x: [T, H]; positions: [T] int32 -> ([T, H], updated kv_pages)."""
        t, d = x.shape[0], self.head_dim
        qg = self.q_proj(x).reshape(t, self.num_heads, 2 * d)
        out, kv_pages = self.attend(qg[..., :d].reshape(t, -1), self.k_proj(x), self.v_proj(x),
                                    positions, kv_pages, metadata)
        gate = jax.nn.sigmoid(qg[..., d:].reshape(t, -1))
        return self.o_proj(out * gate), kv_pages


class Qwen3NextSparseMoeBlock(MixtralSparseMoeBlock):
    """Routed experts (``moe_intermediate_size`` wide) plus the gated shared expert."""

    def __init__(self, config: ModelConfig, dtype, rngs: nnx.Rngs):
        family = config.family
        super().__init__(dataclasses.replace(
            config, intermediate_size=family.moe_intermediate_size or config.intermediate_size),
            dtype, rngs)
        shared = family.linear_attention.shared_expert_intermediate_size
        self.shared_expert = (LlamaMLP(dataclasses.replace(config, intermediate_size=shared),
                                       dtype, rngs) if shared else None)
        self.shared_expert_gate = (linear(config.hidden_size, 1, False, dtype, rngs)
                                   if shared else None)

    def __call__(self, x):
        """x: [T, H] -> [T, H]."""
        out = super().__call__(x)
        if self.shared_expert is None:
            return out
        return out + jax.nn.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class Qwen3NextDecoderLayer(nnx.Module):
    """Pre-norm block: ``linear_attn`` (recurrent) or ``self_attn``, then the MoE or a dense
    ``mlp``; its cache entry is the recurrent state or the layer's KV pages."""

    def __init__(self, config: ModelConfig, layer_idx: int, backend: AttentionBackend, dtype,
                 rngs: nnx.Rngs):
        family = config.family
        h, eps = config.hidden_size, config.rms_norm_eps
        self.recurrent = family.linear_attention.layers[layer_idx]
        self.input_layernorm = RMSNorm(h, eps, dtype, unit_offset=True)
        if self.recurrent:
            self.linear_attn = GatedDeltaNet(config, dtype, rngs, backend)
        else:
            self.self_attn = Qwen3NextAttention(config, layer_idx, backend, dtype, rngs)
        self.post_attention_layernorm = RMSNorm(h, eps, dtype, unit_offset=True)
        sparse = (bool(family.moe_layers[layer_idx]) if family.moe_layers
                  else config.num_experts > 0)
        self.mlp = (Qwen3NextSparseMoeBlock(config, dtype, rngs) if sparse
                    else LlamaMLP(config, dtype, rngs))

    def __call__(self, x, positions, cache, metadata):
        """x: [T, H] -> ([T, H], the updated cache entry)."""
        mixer = self.linear_attn if self.recurrent else self.self_attn
        out, cache = mixer(self.input_layernorm(x), positions, cache, metadata)
        x = x + out
        return x + self.mlp(self.post_attention_layernorm(x)), cache


class Qwen3NextModel(LlamaModel):
    """Embedding, the mixed layers and the ``1 + weight`` final norm."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend, dtype, rngs: nnx.Rngs):
        super().__init__(config, backend, dtype, rngs, Qwen3NextDecoderLayer)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, unit_offset=True)

    def stack_packed_weights(self) -> int:
        """Nothing is stacked (the layers differ in kind); returns 0."""
        return 0


class Qwen3NextForCausalLM(LlamaForCausalLM):
    """Qwen3-Next (``Qwen3NextForCausalLM``), module docstring.

    Args:
        config, backend, dtype, rngs: as :class:`LlamaForCausalLM`.
    """

    def __init__(self, config: ModelConfig, backend: AttentionBackend, dtype, rngs: nnx.Rngs):
        self.model = Qwen3NextModel(config, backend, dtype, rngs)
        self.lm_head = (None if config.tie_word_embeddings else
                        linear(config.hidden_size, config.vocab_size, False, dtype, rngs))
        self.final_soft_cap = None
