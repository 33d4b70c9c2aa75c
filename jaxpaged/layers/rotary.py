"""Rotary position embedding (RoPE), rotate-half layout, with Llama 3 frequency scaling.

Reference: Su et al., "RoFormer: Enhanced Transformer with Rotary Position Embedding" (2021),
section 3.4, in the rotate-half arrangement used by Hugging Face transformers' Llama
(``apply_rotary_pos_emb``): the first half of each head's features pairs with the second half.
Llama 3 scaling follows Meta's Llama 3.1 release (transformers' ``_compute_llama3_parameters``):
long wavelengths are stretched by ``factor``, short ones kept, the band between interpolated.
"""

from __future__ import annotations

import numpy as np
import jax.numpy as jnp

from jaxpaged.config import RopeScaling


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> np.ndarray:
    """The rotation frequencies of one head: [head_dim / 2] float32 (radians per position).

    Args:
        head_dim: D, even.
        theta: the RoPE base (``rope_theta``).
        scaling: Llama 3 scaling, or None for plain RoPE.
    """
    inv_freq = (1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
                ).astype(np.float32)
    if scaling is None:
        return inv_freq
    wavelen = 2 * np.pi / inv_freq
    old_len = scaling.original_max_position_embeddings
    long_wave = wavelen > old_len / scaling.low_freq_factor
    short_wave = wavelen < old_len / scaling.high_freq_factor
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    stretched = inv_freq / scaling.factor
    between = (1 - smooth) * stretched + smooth * inv_freq
    return np.where(long_wave, stretched, np.where(short_wave, inv_freq, between)
                    ).astype(np.float32)


def apply_rope(x: jnp.ndarray, positions: jnp.ndarray, inv_freq,
               mscale: float = 1.0) -> jnp.ndarray:
    """Rotate query or key heads by their positions.

    Args:
        x: [T, H, D] queries or keys (any float dtype; D even).
        positions: [T] int32 absolute token positions.
        inv_freq: [R / 2] frequencies from :func:`rope_inv_freq` (an array or a tuple), R <= D:
            the first R features are rotated (rotate-half within them) and the rest pass
            unchanged (partial rotary, as transformers' Phi-3 ``apply_rotary_pos_emb``).
        mscale: cos and sin are multiplied by it (LongRoPE's ``attention_factor``; the
            features past R are not scaled).

    Returns:
        [T, H, D] in ``x``'s dtype; the rotation itself is computed in float32.
    """
    d = 2 * len(inv_freq)
    if d < x.shape[-1]:
        return jnp.concatenate([apply_rope(x[..., :d], positions, inv_freq, mscale),
                                x[..., d:]], -1)
    freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq, jnp.float32)[None, :]  # [T, D/2]
    cos = jnp.cos(freqs)[:, None, :]
    sin = jnp.sin(freqs)[:, None, :]
    if mscale != 1.0:
        cos, sin = cos * mscale, sin * mscale
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., : d // 2], xf[..., d // 2:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
