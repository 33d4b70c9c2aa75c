"""Llama-family decoder in Flax NNX: Llama 2/3, Mistral, Qwen2/2.5 and Qwen3.

Reference: Touvron et al., "Llama 2: Open Foundation and Fine-Tuned Chat Models" (2023),
section 2.2 (pre-norm RMSNorm, SwiGLU MLP, RoPE, grouped-query attention); parameter names and
numerics follow Hugging Face transformers' ``LlamaForCausalLM`` so that checkpoints load
one-to-one (module path + ``.weight``/``.bias``). The families this module also serves differ
only in settings its :class:`ModelConfig` carries: Llama 3's RoPE scaling, Mistral's sliding
window (Jiang et al., "Mistral 7B", 2023), Qwen2's q/k/v biases, and Qwen3's per-head RMSNorm
of queries and keys before RoPE. Other families reuse these layers
(:mod:`jaxpaged.models.mixtral`, :mod:`jaxpaged.models.gemma2`).

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
from jaxpaged.layers.kv_group_layers import run_grouped_layers
from jaxpaged.layers.layer_stack import stack_layer_weights
from jaxpaged.layers.linear import linear
from jaxpaged.layers.packed_layout import LANES, PACKED_LEAVES
from jaxpaged.layers.packed_linear import (PackedEmbedding, PackedLinear, kernel_available,
                                           project_packed)
from jaxpaged.layers.normalization import RMSNorm
from jaxpaged.layers.rotary import apply_rope
from jaxpaged.models.layer_rope import layer_rotary

_ACTIVATIONS = {"silu": jax.nn.silu,
                "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True)}


class LlamaAttention(nnx.Module):
    """Multi-head attention with GQA over the paged KV pool.

    Args:
        config: the model's settings (biases, q/k norm, RoPE, scale, soft cap).
        layer_idx: the layer's index (selects its sliding window).
        backend: the paged-attention backend.
        dtype: parameter and activation dtype.
        rngs: initialisers' randomness.
    """

    #: q_norm / k_norm normalise each head (False: the family applies them otherwise).
    qk_norm_per_head = True

    def __init__(self, config: ModelConfig, layer_idx: int, backend: AttentionBackend, dtype,
                 rngs: nnx.Rngs):
        h, d = config.hidden_size, config.head_dim
        quant = (config.quantization, config.quantization_group_size)
        self.q_proj = linear(h, config.num_heads * d, config.qkv_bias, dtype, rngs, *quant)
        self.k_proj = linear(h, config.num_kv_heads * d, config.qkv_bias, dtype, rngs, *quant)
        self.v_proj = linear(h, config.num_kv_heads * d, config.qkv_bias, dtype, rngs, *quant)
        self.o_proj = linear(config.num_heads * d, h, config.o_bias, dtype, rngs, *quant)
        norm = lambda: RMSNorm(d, config.rms_norm_eps, dtype) if config.qk_norm else None
        self.q_norm, self.k_norm = norm(), norm()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, d
        self.inv_freq, self.rope_mscale = layer_rotary(config, layer_idx)  # None: no RoPE
        self.scale = (config.family.attention_multiplier
                      or (config.query_pre_attn_scalar or d) ** -0.5)
        self.sliding_window = (config.sliding_windows[layer_idx] if config.sliding_windows
                               else None)
        self.soft_cap = config.attn_logit_softcapping
        #: Per-head attention sinks (gpt-oss: a module whose ``weight`` is [num_heads]), or None.
        self.sinks = None
        self.backend = backend

    def __call__(self, x, positions, kv_pages: KVPages, metadata):
        """x: [T, H]; positions: [T] int32 -> ([T, H], updated kv_pages)."""
        out, kv_pages = self.attend(self.q_proj(x), self.k_proj(x), self.v_proj(x), positions,
                                    kv_pages, metadata)
        return self.o_proj(out), kv_pages

    def attend(self, q, k, v, positions, kv_pages: KVPages, metadata, rotated: bool = False):
        """The projections' outputs q [T, heads * D], k and v [T, kv_heads * D] (any width
        padding past them dropped) through q/k norms, RoPE (unless ``rotated``: q and k
        come rotated already) and the paged attention -> ([T, heads * D] before ``o_proj``,
        updated kv_pages)."""
        t = q.shape[0]
        q = q[:, :self.num_heads * self.head_dim].reshape(t, self.num_heads, self.head_dim)
        k = k[:, :self.num_kv_heads * self.head_dim].reshape(t, self.num_kv_heads, self.head_dim)
        v = v[:, :self.num_kv_heads * self.head_dim].reshape(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.qk_norm_per_head:
            q, k = self.q_norm(q), self.k_norm(k)
        if not rotated and self.inv_freq is not None:
            q = apply_rope(q, positions, self.inv_freq, self.rope_mscale)
            k = apply_rope(k, positions, self.inv_freq, self.rope_mscale)
        sinks = {} if self.sinks is None else {"sinks": self.sinks.weight[...].astype(jnp.float32)}
        out, kv_pages = self.backend.forward(q, k, v, kv_pages, metadata, scale=self.scale,
                                             sliding_window=self.sliding_window,
                                             soft_cap=self.soft_cap, **sinks)
        return out.reshape(t, self.num_heads * self.head_dim), kv_pages


class LlamaMLP(nnx.Module):
    """Gated feed-forward: down(act(gate(x)) * up(x)), act = SiLU (SwiGLU) or tanh-GELU."""

    def __init__(self, config: ModelConfig, dtype, rngs: nnx.Rngs):
        h, i = config.hidden_size, config.intermediate_size
        quant = (config.quantization, config.quantization_group_size)
        self.gate_proj = linear(h, i, False, dtype, rngs, *quant)
        self.up_proj = linear(h, i, False, dtype, rngs, *quant)
        self.down_proj = linear(i, h, False, dtype, rngs, *quant)
        self.act = _ACTIVATIONS[config.hidden_act]

    def __call__(self, x):
        """x: [T, H] -> [T, H]."""
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nnx.Module):
    """Pre-norm residual block: attention then the feed-forward (:meth:`feed_forward`)."""

    def __init__(self, config: ModelConfig, layer_idx: int, backend: AttentionBackend, dtype,
                 rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = LlamaAttention(config, layer_idx, backend, dtype, rngs)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.build_feed_forward(config, dtype, rngs)

    def build_feed_forward(self, config: ModelConfig, dtype, rngs: nnx.Rngs) -> None:
        """Create the feed-forward sub-module (a dense :class:`LlamaMLP` named ``mlp``)."""
        self.mlp = LlamaMLP(config, dtype, rngs)

    def feed_forward(self, x):
        """x: [T, H] -> [T, H] through the block's feed-forward."""
        return self.mlp(x)

    def __call__(self, x, positions, kv_pages, metadata):
        if fused_packed_layer(self):
            return self.packed_call(x, positions, kv_pages, metadata)
        attn, kv_pages = self.self_attn(self.input_layernorm(x), positions, kv_pages, metadata)
        x = x + attn
        return x + self.feed_forward(self.post_attention_layernorm(x)), kv_pages

    def packed_call(self, x, positions, kv_pages, metadata):
        """:meth:`__call__` for packed projections (:func:`fused_packed_layer`) in four
        kernel calls: norm and q, k, v (and RoPE of q and k); o and the residual; norm, gate
        and up and SiLU; down and the residual."""
        attn, mlp = self.self_attn, self.mlp
        params = lambda layer: (layer.blocks[...], layer.block_scale[...], layer.block_min[...])
        eps = self.input_layernorm.eps
        # RoPE rides on the q/k/v call unless a bias or a q/k norm must come before it.
        rotate = attn.q_norm is None and all(p.bias is None for p in (attn.q_proj, attn.k_proj))
        q, k, v = project_packed(x, [params(attn.q_proj), params(attn.k_proj),
                                     params(attn.v_proj)],
                                 norm=self.input_layernorm.weight[...], eps=eps,
                                 rope=(positions, attn.inv_freq) if rotate else None)
        q, k, v = (y if p.bias is None else y[:, :p.dout] + p.bias[...]
                   for y, p in ((q, attn.q_proj), (k, attn.k_proj), (v, attn.v_proj)))
        out, kv_pages = attn.attend(q, k, v, positions, kv_pages, metadata, rotated=rotate)
        (x,) = project_packed(out, [params(attn.o_proj)], residual=x)
        (h,) = project_packed(x, [params(mlp.gate_proj), params(mlp.up_proj)], gated=True,
                              norm=self.post_attention_layernorm.weight[...],
                              eps=self.post_attention_layernorm.eps)
        (x,) = project_packed(h, [params(mlp.down_proj)], residual=x)
        return x, kv_pages


def fused_packed_layer(layer: LlamaDecoderLayer) -> bool:
    """Whether ``layer`` runs as :meth:`LlamaDecoderLayer.packed_call`: its seven projections
    are :class:`~jaxpaged.layers.packed_linear.PackedLinear` (not wrapped by LoRA) on the
    C++ kernel, its heads rotated whole by plain RoPE (not NoPE, partial or LongRoPE), its
    norms plain RMSNorms, its feed-forward a SiLU :class:`LlamaMLP` without biases past q, k
    and v, and the hidden and intermediate widths multiples of the kernel's 16 lanes."""
    attn, mlp = layer.self_attn, getattr(layer, "mlp", None)
    if not isinstance(mlp, LlamaMLP) or mlp.act is not jax.nn.silu:
        return False
    projections = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj,
                   mlp.up_proj, mlp.down_proj)
    return (all(type(p) is PackedLinear for p in projections)
            and attn.inv_freq is not None and 2 * len(attn.inv_freq) == attn.head_dim
            and attn.rope_mscale == 1.0
            and all(p.bias is None for p in projections[3:])
            and not (layer.input_layernorm.unit_offset or layer.post_attention_layernorm.unit_offset)
            and attn.o_proj.dout % LANES == 0 and mlp.gate_proj.dout % LANES == 0
            and kernel_available())


class LlamaModel(nnx.Module):
    """Embedding, decoder layers and final norm.

    Args:
        config, backend, dtype, rngs: as :class:`LlamaForCausalLM`.
        layer_cls: the decoder-layer class.
        gemma_style: Gemma's ``1 + weight`` final norm and embeddings scaled by
            ``sqrt(hidden_size)`` (rounded to ``dtype``, as transformers does).
    """

    def __init__(self, config: ModelConfig, backend: AttentionBackend, dtype, rngs: nnx.Rngs,
                 layer_cls=LlamaDecoderLayer, gemma_style: bool = False):
        self.embed_tokens = (
            PackedEmbedding(config.vocab_size, config.hidden_size, dtype)
            if config.quantization == "gguf" else
            nnx.Embed(config.vocab_size, config.hidden_size, dtype=dtype, param_dtype=dtype,
                      rngs=rngs, embedding_init=nnx.initializers.normal(0.02)))
        self.layers = nnx.List([layer_cls(config, i, backend, dtype, rngs)
                                for i in range(config.num_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype,
                            unit_offset=gemma_style)
        self.embed_scale = config.hidden_size ** 0.5 if gemma_style else None
        #: The pool's KV cache groups (``jaxpaged.layers.kv_group_layers``; None: one
        #: ``(k_pages, v_pages)`` per layer).
        self.kv_layout = None

    def __call__(self, input_ids, positions, kv_caches: list[KVPages], metadata):
        x = embed(self.embed_tokens, self.embed_scale, input_ids)
        if self.kv_layout is not None:
            x, new_caches = run_grouped_layers(self.layers, x, positions, kv_caches, metadata,
                                               self.kv_layout)
        else:
            x, new_caches = run_layers(self.layers, x, positions, kv_caches, metadata)
        return self.norm(x), new_caches

    def stack_packed_weights(self) -> int:
        """Hold the decoder layers' packed projections and norms as arrays stacked over the
        layers (:func:`jaxpaged.layers.layer_stack.stack_layer_weights`), when every layer
        runs the fused packed calls (:func:`fused_packed_layer`), which read the stacks in
        place; returns how many kinds were stacked (0: none)."""
        if not all(fused_packed_layer(layer) for layer in self.layers):
            return 0
        norms = {("input_layernorm", "weight"), ("post_attention_layernorm", "weight")}
        return stack_layer_weights(
            self.layers, lambda path: path[-1] in PACKED_LEAVES or tuple(path) in norms)


def embed(embed_tokens: nnx.Embed | PackedEmbedding, scale: float | None, input_ids):
    """input_ids [T] int32 -> [T, H] embeddings, times ``scale`` (rounded to their dtype)
    unless None (Gemma's ``sqrt(hidden_size)``)."""
    x = embed_tokens(input_ids)
    return x if scale is None else x * jnp.asarray(scale, x.dtype)


def run_layers(layers, x, positions, kv_caches: list[KVPages], metadata):
    """x [T, H] through ``layers`` in order, layer i on ``kv_caches[i]`` ->
    ([T, H], the updated caches)."""
    new_caches = []
    for layer, kv_pages in zip(layers, kv_caches):
        x, kv_pages = layer(x, positions, kv_pages, metadata)
        new_caches.append(kv_pages)
    return x, new_caches


def lm_logits(hidden, embed_tokens: nnx.Embed | PackedEmbedding | None, lm_head, soft_cap: float | None):
    """hidden [N, H] -> [N, V] float32 logits through ``lm_head`` (or the tied
    ``embed_tokens`` when it is None), soft-capped as ``cap * tanh(logits / cap)`` unless
    ``soft_cap`` is None."""
    logits = (embed_tokens.attend(hidden) if lm_head is None else lm_head(hidden))
    logits = logits.astype(jnp.float32)
    if soft_cap is not None:
        logits = soft_cap * jnp.tanh(logits / soft_cap)
    return logits


class LlamaForCausalLM(nnx.Module):
    """Llama decoder with its language-model head.

    Families built from the same parts set :attr:`decoder_layer` and :attr:`gemma_style`.

    Args:
        config: the model's :class:`ModelConfig`.
        backend: the attention backend every layer calls.
        dtype: parameter and activation dtype (float32 or bfloat16).
        rngs: initialisers' randomness (used by ``--load-format dummy``).
    """

    decoder_layer = LlamaDecoderLayer
    gemma_style = False

    def __init__(self, config: ModelConfig, backend: AttentionBackend, dtype, rngs: nnx.Rngs):
        self.model = LlamaModel(config, backend, dtype, rngs, self.decoder_layer,
                                self.gemma_style)
        self.lm_head = (None if config.tie_word_embeddings else
                        linear(config.hidden_size, config.vocab_size, False, dtype, rngs,
                               "gguf" if config.quantization == "gguf" else None))
        self.final_soft_cap = config.final_logit_softcapping

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
        """hidden: [N, hidden_size] -> [N, vocab_size] float32 logits (soft-capped as
        ``cap * tanh(logits / cap)`` when the model sets ``final_logit_softcapping``)."""
        return lm_logits(hidden, self.model.embed_tokens, self.lm_head, self.final_soft_cap)
