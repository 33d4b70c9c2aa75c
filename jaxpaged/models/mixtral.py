"""Mixtral: the Llama decoder with a sparse mixture-of-experts feed-forward.

Reference: Jiang et al., "Mixtral of Experts" (2024), section 2.1: a router picks the top-k of
E SwiGLU experts per token and mixes their outputs with the renormalised softmax weights of
the chosen experts (transformers' ``MixtralSparseMoeBlock``: softmax in float32 over all
experts, top-k, divide by the top-k sum, cast to the activation dtype).

The experts run as grouped matmuls (``jax.lax.ragged_dot``): the T * k (token, expert) pairs
are sorted by expert, so expert e's rows are one contiguous group of the left operand, and
each matmul is one call over all experts. Under tensor parallelism every expert's
intermediate columns are split over the ``tp`` axis (w1/w3 column-parallel, w2 row-parallel,
see :mod:`jaxpaged.distributed.tensor_parallel`), so each device runs every expert on its
slice and one all-reduce follows, as for a dense MLP.

Checkpoint names are the Hub layout: ``block_sparse_moe.gate.weight`` [E, H] and
``block_sparse_moe.experts.{e}.w1|w3.weight`` [I, H], ``w2.weight`` [H, I]; the loader stacks
each expert's tensors into the [E, in, out] :class:`ExpertWeights`. ``--quantization``
quantizes the experts as it does dense projections (per expert and output channel); the router
stays in the model dtype, as in vLLM.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpaged.config import ModelConfig
from jaxpaged.layers.linear import linear
from jaxpaged.layers.quantization import quantize_weight
from jaxpaged.models.llama import LlamaDecoderLayer, LlamaForCausalLM


class ExpertWeights(nnx.Param):
    """[E, in, out] kernels of E experts, stacked from per-expert checkpoint tensors
    ``<module path>.{e}.<name>.weight`` ([out, in] each); 8-bit with ``--quantization``."""


class ExpertScales(nnx.Param):
    """[E, out] float32 per-output-channel scales of quantized :class:`ExpertWeights`
    (``w1_scale`` belongs to ``w1``), computed while loading or read from an fp8 checkpoint's
    ``weight_scale``."""


class MixtralExperts(nnx.Module):
    """E SwiGLU experts: w2(silu(w1 x) * w3 x) with w1, w3 [E, H, I] and w2 [E, I, H].

    With ``config.quantization`` the kernels are stored in 8 bits with per-expert,
    per-output-channel scales (:mod:`jaxpaged.layers.quantization`), applied to each row's
    result by the row's expert.
    """

    def __init__(self, config: ModelConfig, dtype, rngs: nnx.Rngs):
        e, h, i = config.num_experts, config.hidden_size, config.intermediate_size
        init = nnx.initializers.normal(0.02)
        self.quantized = config.quantization is not None
        for name, shape in (("w1", (e, h, i)), ("w3", (e, h, i)), ("w2", (e, i, h))):
            weight = init(rngs.params(), shape, jnp.float32)
            if self.quantized:
                kernel, scale = quantize_weight(weight, config.quantization, xp=jnp)
                setattr(self, name, ExpertWeights(kernel))
                setattr(self, f"{name}_scale", ExpertScales(scale))
            else:
                setattr(self, name, ExpertWeights(weight.astype(dtype)))

    def _matmul(self, name, x, group_sizes, row_experts):
        y = jax.lax.ragged_dot(x, getattr(self, name)[...].astype(x.dtype), group_sizes)
        if self.quantized:
            y = (y * getattr(self, f"{name}_scale")[...][row_experts]).astype(x.dtype)
        return y

    def __call__(self, x, group_sizes, row_experts):
        """x: [N, H] rows sorted by expert; group_sizes: [E] int32 rows per expert;
        row_experts: [N] int32 each row's expert -> [N, H]."""
        gate = self._matmul("w1", x, group_sizes, row_experts)
        up = self._matmul("w3", x, group_sizes, row_experts)
        return self._matmul("w2", jax.nn.silu(gate) * up, group_sizes, row_experts)


class MixtralSparseMoeBlock(nnx.Module):
    """Top-k routed mixture of experts: x [T, H] -> [T, H] in x's dtype."""

    def __init__(self, config: ModelConfig, dtype, rngs: nnx.Rngs):
        self.gate = linear(config.hidden_size, config.num_experts, False, dtype, rngs)
        self.experts = MixtralExperts(config, dtype, rngs)
        self.num_experts, self.top_k = config.num_experts, config.num_experts_per_tok

    def __call__(self, x):
        t = x.shape[0]
        probs = jax.nn.softmax(self.gate(x).astype(jnp.float32), axis=-1)       # [T, E]
        weights, experts = jax.lax.top_k(probs, self.top_k)                      # [T, k]
        weights = (weights / weights.sum(-1, keepdims=True)).astype(x.dtype)
        flat = experts.reshape(-1)                                               # [T * k]
        order = jnp.argsort(flat, stable=True)
        rows = order // self.top_k                                               # their tokens
        group_sizes = jnp.bincount(flat, length=self.num_experts).astype(jnp.int32)
        out = self.experts(x[rows], group_sizes, flat[order]) * weights.reshape(-1)[order][:, None]
        return jnp.zeros((t, x.shape[1]), x.dtype).at[rows].add(out)


class MixtralDecoderLayer(LlamaDecoderLayer):
    """Llama's block with the MoE feed-forward, named ``block_sparse_moe`` as in checkpoints."""

    def build_feed_forward(self, config: ModelConfig, dtype, rngs: nnx.Rngs) -> None:
        """Create the ``block_sparse_moe`` sub-module."""
        self.block_sparse_moe = MixtralSparseMoeBlock(config, dtype, rngs)

    def feed_forward(self, x):
        """x: [T, H] -> [T, H] through the routed experts."""
        return self.block_sparse_moe(x)


class MixtralForCausalLM(LlamaForCausalLM):
    """Mixtral (``MixtralForCausalLM``): Llama with MoE feed-forwards."""

    decoder_layer = MixtralDecoderLayer
