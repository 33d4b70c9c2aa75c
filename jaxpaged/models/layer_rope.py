"""Each attention layer's RoPE frequencies: the model-wide RoPE, a per-layer base (Gemma 3's
local and global layers), none at all (SmolLM3's NoPE layers), Phi-3's LongRoPE or gpt-oss's YaRN
(:mod:`jaxpaged.yarn_rope`, frequencies and attention factor computed while parsing the config).

LongRoPE (Ding et al., "LongRoPE: Extending LLM Context Window Beyond 2 Million Tokens",
2024; transformers' ``_compute_longrope_parameters``): frequency i is
``1 / (factor[i] * theta ** (2i / head_dim))`` with the short or the long factors
(:class:`jaxpaged.family_settings.LongRope`), and cos and sin are multiplied by
``attention_factor`` (so only the rotated features of a partially rotated head are scaled).
"""

from __future__ import annotations

import numpy as np

from jaxpaged.config import ModelConfig
from jaxpaged.layers.rotary import rope_inv_freq


def layer_rotary(config: ModelConfig, layer_idx: int) -> tuple[tuple[float, ...] | None, float]:
    """Layer ``layer_idx``'s RoPE.

    Returns:
        (its [rotary_dim / 2] float32 frequencies as a tuple (rotary_dim: the head width
        unless the family rotates fewer features), or None when the layer has no RoPE;
        the factor cos and sin are multiplied by, 1.0 but for LongRoPE).
    """
    family = config.family
    d = family.rotary_dim or config.head_dim      # the rotated features of each head
    if family.yarn is not None:                   # gpt-oss: jaxpaged.yarn_rope
        return family.yarn.inv_freq, family.yarn.attention_factor
    if family.longrope is not None:
        rope = family.longrope
        factors = np.asarray(rope.long_factor if rope.use_long else rope.short_factor,
                             np.float32)
        exponents = np.arange(0, d, 2, dtype=np.float32) / np.float32(d)
        inv_freq = (1.0 / (factors * np.float32(config.rope_theta) ** exponents)
                    ).astype(np.float32)
        return tuple(inv_freq.tolist()), rope.attention_factor
    if family.layer_rope:
        rope = family.layer_rope[layer_idx]
        if rope is None:
            return None, 1.0
        inv_freq = rope_inv_freq(d, rope.theta) / np.float32(rope.linear_factor)
        return tuple(inv_freq.astype(np.float32).tolist()), 1.0
    return tuple(rope_inv_freq(d, config.rope_theta, config.rope_scaling).tolist()), 1.0
