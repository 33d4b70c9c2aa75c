"""The device pool of a model with recurrent layers (Qwen3-Next): per layer either its KV
pages or its recurrent state slots.

The pool the runner donates to each step is a list with one entry per layer, in layer order:
a full-attention layer's ``(k_pages, v_pages)`` (``jaxpaged.layers.attention.base``), a
linear-attention layer's ``(conv_state, ssm_state)``
(:mod:`jaxpaged.layers.gated_deltanet`): [S + 1, K - 1, conv_dim] in the model dtype and
[S + 1, Hv, Dk, Dv] float32, S state slots (one per running sequence, ``max_num_seqs``, then
with prefix caching the cached-state slots: ``jaxpaged.core.state_slots``) plus the scratch
slot padding writes; :func:`copy_state_rows` copies rows between slots. Pages are sized for the attention layers alone
(:func:`num_kv_layers`); the states take :func:`state_bytes` besides.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.config import ModelConfig, UnsupportedModelError


def recurrent_layers(config: ModelConfig) -> tuple[bool, ...]:
    """Per layer, whether it is recurrent (empty: the model has no recurrent layer)."""
    la = config.family.linear_attention
    return la.layers if la is not None else ()


def num_kv_layers(config: ModelConfig) -> int:
    """Layers that keep KV pages (every layer but the recurrent ones)."""
    return config.num_layers - sum(recurrent_layers(config))


def state_shapes(config: ModelConfig, num_slots: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shapes of one recurrent layer's ``(conv_state, ssm_state)`` for ``num_slots``
    slots plus the scratch slot.

    Raises:
        ValueError: the model has no recurrent layers.
    """
    la = config.family.linear_attention
    if la is None:
        raise ValueError(f"{config.architecture} has no recurrent layers")
    conv_dim = 2 * la.num_k_heads * la.k_head_dim + la.num_v_heads * la.v_head_dim
    return ((num_slots + 1, la.conv_kernel - 1, conv_dim),
            (num_slots + 1, la.num_v_heads, la.k_head_dim, la.v_head_dim))


def state_bytes(config: ModelConfig, num_slots: int, dtype) -> int:
    """Bytes of every recurrent layer's states (conv states in ``dtype``, SSM states in
    float32)."""
    if not recurrent_layers(config):
        return 0
    conv, ssm = state_shapes(config, num_slots)
    per_layer = (int(np.prod(conv)) * jnp.dtype(dtype).itemsize + int(np.prod(ssm)) * 4)
    return sum(recurrent_layers(config)) * per_layer


def recurrent_pool(config: ModelConfig, kv_pairs: Callable[[int], list], num_slots: int,
                   dtype, sharding: jax.sharding.Sharding | None = None) -> list:
    """The per-layer pool (module docstring).

    Args:
        config: the model's settings.
        kv_pairs: ``n -> n`` zero-filled ``(k_pages, v_pages)`` pairs (the attention
            layers', in order).
        num_slots: state slots (``max_num_seqs``).
        dtype: the conv states' dtype (the model's).
        sharding: where the states live (replicated over the mesh), or the default device.
    """
    flags = recurrent_layers(config)
    pairs = iter(kv_pairs(num_kv_layers(config)))
    conv, ssm = state_shapes(config, num_slots)
    zeros = jax.jit(lambda: (jnp.zeros(conv, dtype), jnp.zeros(ssm, jnp.float32)),
                    out_shardings=sharding)
    return [zeros() if recurrent else next(pairs) for recurrent in flags]


def is_state_pair(pair) -> bool:
    """Whether a pool entry is a recurrent layer's ``(conv_state, ssm_state)`` (their shapes
    differ; a KV layer's ``(k_pages, v_pages)`` share one)."""
    return pair[0].shape != pair[1].shape


@partial(jax.jit, donate_argnums=(0,))
def copy_state_rows(pool: list, src: jax.Array, dst: jax.Array) -> list:
    """Every recurrent layer's state rows ``src`` [n] int32 copied over rows ``dst`` [n]
    (the cached-state slots of prefix caching, ``jaxpaged.core.state_slots``); ``-1`` in
    either names the scratch row (padding). KV entries pass through; the pool is donated."""
    def copy(a):
        scratch = a.shape[0] - 1
        return a.at[jnp.where(dst < 0, scratch, dst)].set(a[jnp.where(src < 0, scratch, src)])
    return [(copy(c), copy(s)) if is_state_pair((c, s)) else (c, s) for c, s in pool]


def state_copy_indices(copies: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """``(src, dst)`` int32 slot indices of ``copies`` padded with ``-1`` (scratch) to a
    power of two of at least 4 (one executable per size)."""
    n = max(4, 1 << (len(copies) - 1).bit_length())
    src, dst = np.full(n, -1, np.int32), np.full(n, -1, np.int32)
    src[:len(copies)], dst[:len(copies)] = zip(*copies)
    return src, dst


def refuse_unsupported(config: ModelConfig, *, pipeline: bool, speculative: bool,
                       calculate_kv_scales: bool) -> None:
    """Refuse what a model with recurrent layers does not support yet (no-op for others).
    Tensor parallelism works: the recurrent layers' weights and states are replicated (each
    device runs them whole), the attention heads and MLP/expert columns are split.

    Raises:
        UnsupportedModelError: naming the setting (pipeline parallelism, speculative
            decoding, ``--calculate-kv-scales``).
    """
    if not recurrent_layers(config):
        return
    refused = [name for name, on in (
        ("pipeline_parallel_size > 1", pipeline), ("speculative decoding", speculative),
        ("calculate_kv_scales", calculate_kv_scales)) if on]
    if refused:
        raise UnsupportedModelError(
            f"{config.architecture} (recurrent Gated DeltaNet layers) does not support "
            f"{', '.join(refused)} yet")
