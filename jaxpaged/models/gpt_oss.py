"""gpt-oss: Llama's pre-norm block with attention sinks, alternating sliding and full layers,
biases on every attention projection and a top-k mixture of clamped-SwiGLU experts.

Reference: OpenAI, "gpt-oss-120b & gpt-oss-20b Model Card" (2025), section 2.1; numerics as
transformers 5.24's ``GptOssForCausalLM``:

- attention (``GptOssAttention``): q/k/v/o with biases (``attention_bias``), YaRN RoPE
  (:mod:`jaxpaged.yarn_rope`), sliding window on the ``sliding_attention`` layers, and one
  learned *sink* logit per query head that joins each softmax's denominator and nothing else
  (``softmax([scores, sink])`` with the sink's column dropped); the attention backends take
  it as ``sinks`` (:meth:`jaxpaged.layers.attention.base.AttentionBackend.forward`);
- feed-forward (``GptOssMLP``): a router with a bias picks the top-k experts by logit and
  mixes them by the softmax of those k logits; expert e computes
  ``down((clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g)) + down_bias`` with
  ``g = min(gate, limit)``, ``gate``/``up`` the even/odd columns of its biased
  ``gate_up_proj`` (:func:`clamped_swiglu_experts`).

The experts run through Mixtral's grouped matmuls
(:func:`jaxpaged.models.mixtral.route_to_experts`): ``w1``/``w3`` [E, H, I] hold the gate and
up columns, ``w2`` [E, I, H] the down projection, each with its bias;
tensor parallelism splits their intermediate columns as Mixtral's.
Checkpoint names and MXFP4 dequantization: :mod:`jaxpaged.models.gpt_oss_checkpoint`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpaged.config import ModelConfig, UnsupportedModelError
from jaxpaged.layers.attention import AttentionBackend
from jaxpaged.layers.linear import linear
from jaxpaged.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from jaxpaged.models.mixtral import ExpertWeights, route_to_experts


class ExpertBias(ExpertWeights):
    """[E, out] biases of E experts' projections (``w1_bias`` belongs to ``w1``), loaded as
    stacked expert weights (from ``<module path>.{e}.w1_bias.weight``, [out] each)."""


class AttentionSinks(nnx.Module):
    """The per-head sink logits of one attention layer: ``weight`` [num_heads] (the
    checkpoint's ``self_attn.sinks``)."""

    def __init__(self, num_heads: int, dtype):
        self.weight = nnx.Param(jnp.zeros((num_heads,), dtype))


def clamped_swiglu_experts(x, group_sizes, row_experts, w1, w3, w2, b1, b3, b2, *,
                           limit: float | None, alpha: float):
    """gpt-oss's experts over rows grouped by expert (module docstring).

    Args:
        x: [N, H] rows sorted by expert; group_sizes: [E] int32 rows per expert (they sum to
            N); row_experts: [N] int32 each row's expert.
        w1, w3: [E, H, I] gate and up kernels; w2: [E, I, H]; b1, b3: [E, I]; b2: [E, H].
        limit: the clamp of the gate (above) and up (both sides), None for none; alpha: the
            sigmoid's gain.

    Returns:
        [N, H] in x's dtype.
    """
    def matmul(h, w, b):
        y = jax.lax.ragged_dot(h, w.astype(h.dtype), group_sizes)
        return y + b.astype(h.dtype)[row_experts]

    gate, up = matmul(x, w1, b1), matmul(x, w3, b3)
    if limit is not None:
        gate, up = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
    return matmul((up + 1) * (gate * jax.nn.sigmoid(gate * alpha)), w2, b2)


class GptOssExperts(nnx.Module):
    """E clamped-SwiGLU experts with biases (:func:`clamped_swiglu_experts`).

    Raises:
        UnsupportedModelError: ``--quantization`` (the experts stay in the model dtype; only
            MXFP4 checkpoints are read, dequantized).
    """

    def __init__(self, config: ModelConfig, dtype, rngs: nnx.Rngs):
        if config.quantization is not None:
            raise UnsupportedModelError(f"gpt-oss experts cannot be quantized with "
                                        f"{config.quantization!r} (leave --quantization unset)")
        e, h, i = config.num_experts, config.hidden_size, config.intermediate_size
        init = nnx.initializers.normal(0.02)
        for name, shape in (("w1", (e, h, i)), ("w3", (e, h, i)), ("w2", (e, i, h))):
            weight = init(rngs.params(), shape, jnp.float32).astype(dtype)
            setattr(self, name, ExpertWeights(weight))
            setattr(self, f"{name}_bias", ExpertBias(jnp.zeros((e, shape[2]), dtype)))
        self.limit, self.alpha = config.family.swiglu_limit, config.family.swiglu_alpha

    def __call__(self, x, group_sizes, row_experts):
        """x: [N, H] rows sorted by expert -> [N, H]."""
        return clamped_swiglu_experts(
            x, group_sizes, row_experts, *(getattr(self, n)[...] for n in
                                           ("w1", "w3", "w2", "w1_bias", "w3_bias", "w2_bias")),
            limit=self.limit, alpha=self.alpha)


class GptOssMLP(nnx.Module):
    """Top-k routing by the biased router's logits, softmax over the chosen k: x [T, H] ->
    [T, H] in x's dtype."""

    def __init__(self, config: ModelConfig, dtype, rngs: nnx.Rngs):
        self.router = linear(config.hidden_size, config.num_experts, True, dtype, rngs)
        self.experts = GptOssExperts(config, dtype, rngs)
        self.num_experts, self.top_k = config.num_experts, config.num_experts_per_tok

    def __call__(self, x):
        logits, experts = jax.lax.top_k(self.router(x).astype(jnp.float32), self.top_k)
        weights = jax.nn.softmax(logits, axis=-1).astype(x.dtype)            # [T, k]
        return route_to_experts(x, weights, experts, self.num_experts, self.experts)


class GptOssDecoderLayer(LlamaDecoderLayer):
    """Llama's block whose attention has sinks and whose feed-forward is :class:`GptOssMLP`."""

    def __init__(self, config: ModelConfig, layer_idx: int, backend: AttentionBackend, dtype,
                 rngs: nnx.Rngs):
        super().__init__(config, layer_idx, backend, dtype, rngs)
        self.self_attn.sinks = nnx.data(AttentionSinks(config.num_heads, dtype))

    def build_feed_forward(self, config: ModelConfig, dtype, rngs: nnx.Rngs) -> None:
        """``mlp``: the routed experts."""
        self.mlp = GptOssMLP(config, dtype, rngs)


class GptOssForCausalLM(LlamaForCausalLM):
    """gpt-oss (``GptOssForCausalLM``)."""

    decoder_layer = GptOssDecoderLayer
