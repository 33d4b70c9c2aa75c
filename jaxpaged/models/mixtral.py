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

With expert parallelism (``--enable-expert-parallel``, :func:`use_expert_parallelism`) each
of the N devices holds E / N whole experts instead and the block runs under ``shard_map``:
the tokens are already on every device (attention's output is all-reduced), so dispatch
needs no communication: each device routes every token (the replicated router), keeps the
(token, expert) pairs of its own experts, sorted first, runs them through its experts (the
other pairs sort last, past the groups' sum, where ``ragged_dot`` leaves zeros), scatters the
weighted results into a [T, H] partial sum, and one ``psum`` over the axis combines the
devices' parts: the same single all-reduce of [T, H] per layer as the column/row split. An
all-to-all dispatch (DeepSpeed-MoE, GShard) would pay off only where the tokens are split over
the devices (data-parallel attention), which this engine does not do.

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

from jax import shard_map
from jax.sharding import Mesh, PartitionSpec as P

from jaxpaged.config import ModelConfig
from jaxpaged.distributed.tensor_parallel import TP_AXIS
from jaxpaged.errors import TensorParallelError
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

    def arrays(self) -> tuple:
        """(w1, w3, w2) and, when quantized, their scales (w1_scale, w3_scale, w2_scale)."""
        names = ("w1", "w3", "w2") + (("w1_scale", "w3_scale", "w2_scale")
                                      if self.quantized else ())
        return tuple(getattr(self, n)[...] for n in names)

    def __call__(self, x, group_sizes, row_experts):
        """x: [N, H] rows sorted by expert; group_sizes: [E] int32 rows per expert;
        row_experts: [N] int32 each row's expert -> [N, H]."""
        return swiglu_experts(x, group_sizes, row_experts, *self.arrays())


def swiglu_experts(x, group_sizes, row_experts, w1, w3, w2, *scales):
    """E SwiGLU experts over rows grouped by expert: w2(silu(w1 x) * w3 x) per group.

    Args:
        x: [N, H] rows sorted by expert; rows past ``group_sizes.sum()`` come out as zeros.
        group_sizes: [E] int32 rows per expert; row_experts: [N] int32 each row's expert
            (indexes the scales; any valid index for the rows past the groups).
        w1, w3: [E, H, I], w2: [E, I, H] kernels; scales: none, or their [E, out] float32
            per-output-channel scales (8-bit kernels).

    Returns:
        [N, H] in x's dtype.
    """
    def matmul(h, w, scale):
        y = jax.lax.ragged_dot(h, w.astype(h.dtype), group_sizes)
        return y if scale is None else (y * scale[row_experts]).astype(h.dtype)

    s1, s3, s2 = scales or (None, None, None)
    return matmul(jax.nn.silu(matmul(x, w1, s1)) * matmul(x, w3, s3), w2, s2)


def route_to_experts(x, weights, experts, num_experts: int, run_experts):
    """Top-k routed tokens through grouped experts and back: x [T, H]; weights [T, k] in x's
    dtype and experts [T, k] int32, each token's chosen experts and their mixing weights;
    ``run_experts(rows, group_sizes, row_experts)`` maps the T * k (token, expert) rows sorted
    by expert ([T * k, H], group_sizes [num_experts] int32, row_experts [T * k] int32) to
    their [T * k, H] outputs. Returns [T, H] in x's dtype: each token's weighted sum of its
    experts' outputs."""
    flat = experts.reshape(-1)                                               # [T * k]
    order = jnp.argsort(flat, stable=True)
    rows = order // experts.shape[1]                                          # their tokens
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    out = run_experts(x[rows], group_sizes, flat[order]) * weights.reshape(-1)[order][:, None]
    return jnp.zeros_like(x).at[rows].add(out)


class MixtralSparseMoeBlock(nnx.Module):
    """Top-k routed mixture of experts: x [T, H] -> [T, H] in x's dtype (the top-k weights
    renormalised unless the family says otherwise, ``FamilySettings.norm_topk_prob``)."""

    def __init__(self, config: ModelConfig, dtype, rngs: nnx.Rngs):
        self.gate = linear(config.hidden_size, config.num_experts, False, dtype, rngs)
        self.experts = MixtralExperts(config, dtype, rngs)
        self.num_experts, self.top_k = config.num_experts, config.num_experts_per_tok
        self.renormalize = config.family.norm_topk_prob      # Qwen3-MoE's norm_topk_prob
        self.expert_mesh: Mesh | None = None       # set by use_expert_parallelism

    def __call__(self, x):
        probs = jax.nn.softmax(self.gate(x).astype(jnp.float32), axis=-1)       # [T, E]
        weights, experts = jax.lax.top_k(probs, self.top_k)                      # [T, k]
        if self.renormalize:
            weights = weights / weights.sum(-1, keepdims=True)
        weights = weights.astype(x.dtype)
        if self.expert_mesh is not None:
            return self._expert_parallel(x, weights, experts)
        return route_to_experts(x, weights, experts, self.num_experts, self.experts)

    def _expert_parallel(self, x, weights, experts):
        """The block with E / N experts per device (module docstring): x [T, H], weights and
        experts [T, k] (replicated) -> [T, H]."""
        mesh, k = self.expert_mesh, self.top_k
        local_count = self.num_experts // mesh.shape[TP_AXIS]
        arrays = self.experts.arrays()

        def per_device(x, weights, experts, *arrays):
            flat = experts.reshape(-1) - jax.lax.axis_index(TP_AXIS) * local_count
            mine = (flat >= 0) & (flat < local_count)
            key = jnp.where(mine, flat, local_count)        # other devices' pairs sort last
            order = jnp.argsort(key, stable=True)
            rows = order // k
            group_sizes = jnp.bincount(key, length=local_count + 1)[:local_count]
            out = swiglu_experts(x[rows], group_sizes.astype(jnp.int32),
                                 jnp.minimum(key[order], local_count - 1), *arrays)
            out = out * jnp.where(mine, weights.reshape(-1), 0)[order][:, None]
            return jax.lax.psum(jnp.zeros_like(x).at[rows].add(out), TP_AXIS)

        split = tuple(P(TP_AXIS, *[None] * (a.ndim - 1)) for a in arrays)
        return shard_map(per_device, mesh=mesh, in_specs=(P(), P(), P(), *split),
                         out_specs=P(), check_vma=False)(x, weights, experts, *arrays)


def use_expert_parallelism(model: nnx.Module, mesh: Mesh) -> None:
    """Run every MoE block of ``model`` expert-parallel over ``mesh``'s ``tp`` axis (its
    expert kernels must be split on their expert dimension: ``TensorParallel`` with
    ``expert_parallel``).

    Raises:
        TensorParallelError: the model's experts are not Mixtral's block (gpt-oss's: expert
            parallelism is not wired for them).
    """
    blocks = [m for _, m in model.iter_modules() if isinstance(m, MixtralSparseMoeBlock)]
    if not blocks:
        raise TensorParallelError(f"enable_expert_parallel is not supported for "
                                  f"{type(model).__name__} (its experts split by tensor "
                                  "parallelism only)")
    for module in blocks:
        module.expert_mesh = mesh


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
