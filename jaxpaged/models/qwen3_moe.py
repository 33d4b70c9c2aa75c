"""Qwen3-MoE: Qwen3's attention (per-head q/k norms) with a routed mixture of experts on the
sparse layers and a dense MLP on the others.

Reference: Qwen Team, "Qwen3 Technical Report" (2025), section 2: top-k of E SwiGLU experts
per token, no shared expert; numerics as transformers' ``Qwen3MoeSparseMoeBlock`` (softmax in
float32 over all experts, top-k, renormalised only with ``norm_topk_prob``). The experts run
through Mixtral's block (:class:`jaxpaged.models.mixtral.MixtralSparseMoeBlock`, grouped
matmuls, tensor and expert parallelism alike) with ``moe_intermediate_size`` columns; the
block is named ``mlp`` (``mlp.gate``, ``mlp.experts.{e}.gate_proj|up_proj|down_proj`` in
checkpoints, read by :mod:`jaxpaged.models.checkpoint_names`). Layers listed in
``mlp_only_layers`` (or off the ``decoder_sparse_step``) keep a dense ``intermediate_size``
MLP.
"""

from __future__ import annotations

import dataclasses

from flax import nnx

from jaxpaged.config import ModelConfig
from jaxpaged.layers.attention import AttentionBackend
from jaxpaged.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from jaxpaged.models.mixtral import MixtralSparseMoeBlock


class Qwen3MoeDecoderLayer(LlamaDecoderLayer):
    """Llama's block whose feed-forward ``mlp`` is the routed experts on sparse layers."""

    def __init__(self, config: ModelConfig, layer_idx: int, backend: AttentionBackend, dtype,
                 rngs: nnx.Rngs):
        moe = config.family.moe_layers
        self.sparse = bool(moe[layer_idx]) if moe else config.num_experts > 0
        super().__init__(config, layer_idx, backend, dtype, rngs)

    def build_feed_forward(self, config: ModelConfig, dtype, rngs: nnx.Rngs) -> None:
        """``mlp``: the experts (``moe_intermediate_size`` wide) or a dense MLP."""
        if not self.sparse:
            self.mlp = LlamaMLP(config, dtype, rngs)
            return
        width = config.family.moe_intermediate_size or config.intermediate_size
        self.mlp = MixtralSparseMoeBlock(
            dataclasses.replace(config, intermediate_size=width), dtype, rngs)


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    """Qwen3-MoE (``Qwen3MoeForCausalLM``)."""

    decoder_layer = Qwen3MoeDecoderLayer
