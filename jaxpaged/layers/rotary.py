"""Rotary position embedding (RoPE), rotate-half layout.

Reference: Su et al., "RoFormer: Enhanced Transformer with Rotary Position Embedding" (2021),
section 3.4, in the rotate-half arrangement used by Hugging Face transformers' Llama
(``apply_rotary_pos_emb``): the first half of each head's features pairs with the second half.
"""

import jax.numpy as jnp


def apply_rope(x: jnp.ndarray, positions: jnp.ndarray, theta: float) -> jnp.ndarray:
    """Rotate query or key heads by their positions.

    Args:
        x: [T, H, D] queries or keys (any float dtype; D even).
        positions: [T] int32 absolute token positions.
        theta: the RoPE base frequency (``rope_theta``).

    Returns:
        [T, H, D] in ``x``'s dtype; the rotation itself is computed in float32.
    """
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))  # [D/2]
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]      # [T, D/2]
    cos = jnp.cos(freqs)[:, None, :]
    sin = jnp.sin(freqs)[:, None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., : d // 2], xf[..., d // 2:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
