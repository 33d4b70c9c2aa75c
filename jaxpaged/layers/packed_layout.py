"""The layout of packed 4/8-bit weights (:mod:`jaxpaged.layers.packed_linear`), host side.

Numpy only (the GGUF loader lays weights out with it while the host side stays free of
JAX); :func:`dequantize` also takes ``xp=jax.numpy`` inside a jitted step. The layout:

- ``blocks``: 4-bit weights as uint8 [N/16, K/2, 16] (byte ``[b, j, l]`` holds weights
  ``2j`` (low nibble) and ``2j + 1`` (high nibble) of output feature ``16 b + l``), 8-bit ones
  as int8 [N/16, K, 16];
- ``block_scale``, ``block_min``: float32 [N/16, K/G, 16], so that
  ``W[n, k] = block_scale * q + block_min`` of feature n's group ``k // G``.
"""

from __future__ import annotations

import numpy as np

#: Output features side by side in ``blocks`` (the kernel's vector lanes).
LANES = 16
#: The parameter names of a packed weight (each loads from the checkpoint's ``<name>.weight``).
PACKED_LEAVES = ("blocks", "block_scale", "block_min")


def pack_weight(q: np.ndarray, scale: np.ndarray, offset: np.ndarray, bits: int
                ) -> dict[str, np.ndarray]:
    """Lay out a decoded weight for :class:`PackedLinear` (host, numpy).

    Args:
        q: [N, K] integers (uint8 in [0, 15] for ``bits`` 4, int8 for 8).
        scale, offset: [N, K / G] float32.
        bits: 4 or 8.

    Returns:
        ``blocks``, ``block_scale`` and ``block_min`` as the module docstring lays them out,
        N padded with zero features to a multiple of :data:`LANES`.

    Raises:
        ValueError: ``bits`` not 4 or 8, an odd K for 4 bits, or shapes that disagree.
    """
    n, k = q.shape
    if bits not in (4, 8) or (bits == 4 and k % 2) or scale.shape != offset.shape \
            or scale.shape[0] != n or k % scale.shape[1]:
        raise ValueError(f"cannot pack a [{n}, {k}] weight of {bits} bits with scales "
                         f"{scale.shape} and offsets {offset.shape}")
    pad = -n % LANES
    q, scale, offset = (np.pad(a, ((0, pad), (0, 0))) for a in (q, scale, offset))
    lanes = lambda a: np.ascontiguousarray(a.reshape(-1, LANES, a.shape[1]).transpose(0, 2, 1))
    if bits == 4:
        pairs = q.astype(np.uint8).reshape(n + pad, k // 2, 2)
        blocks = lanes(pairs[..., 0] | (pairs[..., 1] << 4))
    else:
        blocks = lanes(q.astype(np.int8))
    return {"blocks": blocks, "block_scale": lanes(scale.astype(np.float32)),
            "block_min": lanes(offset.astype(np.float32))}


def integers(blocks, k: int, xp):
    """``blocks`` [..., K or K/2, L] -> q [..., K, L] float32."""
    if blocks.dtype == xp.uint8:
        both = xp.stack([blocks & 15, blocks >> 4], axis=-2)      # [..., K/2, 2, L]
        return both.reshape(*blocks.shape[:-2], k, blocks.shape[-1]).astype(xp.float32)
    return blocks.astype(xp.float32)


def dequantize(blocks, block_scale, block_min, din: int, dout: int, xp=np):
    """The float32 weight [dout, din] of a packed one (``xp``: ``jax.numpy`` or ``numpy``)."""
    group = din // block_scale.shape[1]
    widen = lambda a: xp.repeat(a, group, axis=1)                # [V, K, 16]
    w = integers(blocks, din, xp) * widen(block_scale) + widen(block_min)
    return w.transpose(0, 2, 1).reshape(-1, din)[:dout]


