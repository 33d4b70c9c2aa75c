"""YaRN RoPE frequencies (gpt-oss's ``rope_type: yarn``), computed once on the host.

Reference: Peng et al., "YaRN: Efficient Context Window Extension of Large Language Models"
(2023), sections 3.2-3.4, with the conventions of transformers 5.24's
``_compute_yarn_parameters``: frequency i of a head of ``dim`` rotated features is
``theta ** (-2i / dim)`` kept as it is (extrapolated) below the correction range, divided by
``factor`` (interpolated) above it and blended linearly inside it; the range's ends are the
dimensions where a frequency turns ``beta_fast`` and ``beta_slow`` times over the original
context (rounded outwards unless ``truncate`` is false), and cos and sin are multiplied by
``attention_factor`` (default ``0.1 ln(factor) + 1``, or DeepSeek's ``mscale`` ratio).
Numpy only (the config floor).
"""

from __future__ import annotations

import math

import numpy as np


def yarn_frequencies(params: dict, head_dim: int, max_position_embeddings: int
                     ) -> tuple[tuple[float, ...], float]:
    """The YaRN frequencies of one head and the factor of cos and sin.

    Args:
        params: the ``rope_parameters`` dict (``rope_theta``, ``factor``,
            ``original_max_position_embeddings``; optional ``beta_fast`` (32), ``beta_slow``
            (1), ``truncate`` (true), ``attention_factor``, ``mscale``, ``mscale_all_dim``).
        head_dim: the rotated width (even).
        max_position_embeddings: the model's context (``factor`` defaults to it over the
            original context).

    Returns:
        ([head_dim / 2] float32 frequencies as a tuple, the float attention factor).

    Raises:
        ValueError: a missing ``original_max_position_embeddings``, a ``partial_rotary_factor``
            other than 1, or a non-positive theta or factor (the message names the key).
    """
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("yarn with partial_rotary_factor is not supported")
    original = params.get("original_max_position_embeddings")
    if not original:
        raise ValueError("yarn rope_parameters lack original_max_position_embeddings")
    base = float(params["rope_theta"])
    factor = float(params.get("factor") or max_position_embeddings / original)
    if not base > 0 or not factor > 0:
        raise ValueError(f"yarn rope_theta ({base}) and factor ({factor}) must be positive")
    attention = params.get("attention_factor")
    if attention is None:
        mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
        attention = (_mscale(factor, mscale) / _mscale(factor, mscale_all) if mscale and mscale_all
                     else _mscale(factor))
    dim = head_dim

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = correction_dim(params.get("beta_fast") or 32)
    high = correction_dim(params.get("beta_slow") or 1)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low))
                   / np.float32(high - low), 0, 1)
    extrapolated = 1 - ramp                       # share of the unscaled frequency
    pos_freqs = np.float32(base) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    inv_freq = (1 / (np.float32(factor) * pos_freqs)) * (1 - extrapolated) \
        + (1 / pos_freqs) * extrapolated
    return tuple(inv_freq.astype(np.float32).tolist()), float(attention)


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0
