"""The layout of packed 4/8-bit weights (:mod:`jaxpaged.layers.packed_linear`), host side.

Numpy only (the GGUF loader lays weights out with it while the host side stays free of
JAX); :func:`dequantize` also takes ``xp=jax.numpy`` inside a jitted step. The layout:

- ``blocks``: 4-bit weights as uint8 [N/16, K/2, 16] (byte ``[b, j, l]`` holds weights
  ``2j`` (low nibble) and ``2j + 1`` (high nibble) of output feature ``16 b + l``), 8-bit ones
  as int8 [N/16, K, 16];
- ``block_scale``, ``block_min``: [N/16, K/G, 16], so that
  ``W[n, k] = block_scale * q + block_min`` of feature n's group ``k // G``; float16 where
  every scale and offset of the weight is exact in it (Q4_0, Q4_1 and Q8_0 store half-precision
  scales: a decode step then reads 2 bytes a group for each instead of 4, a sizeable share of
  the packed bytes, ``docs/measurements.md``, "Packed linear"), else float32 (the K-quants' products of two scales).
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
        ``blocks``, ``block_scale`` and ``block_min`` as the module docstring lays them out
        (the scales in float16 when all are exact in it), N padded with zero features to a
        multiple of :data:`LANES`.

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
    scale, offset = scale.astype(np.float32), offset.astype(np.float32)
    with np.errstate(over="ignore"):
        half = all(np.array_equal(a.astype(np.float16).astype(np.float32), a)
                   for a in (scale, offset))
    dtype = np.float16 if half else np.float32
    return {"blocks": blocks, "block_scale": lanes(scale.astype(dtype)),
            "block_min": lanes(offset.astype(dtype))}


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




def split_activations(x: np.ndarray, group: int) -> np.ndarray:
    """The activations the packed kernel's int8 path multiplies (``csrc/packed_vnni.h``), as
    float64: each group of ``group`` inputs of a row, with step ``e = amax / (127 * 2^16)``
    (float32), rounded to ``e * T`` with T an integer of at most ``127 * 2^16`` (a 24-bit
    fixed-point number per group; error at most ``e / 2`` plus the float32 rounding of
    ``x / e``).

    Args:
        x: [M, K] float32, K a multiple of ``group``.

    Returns:
        [M, K] float64.
    """
    m, k = x.shape
    g = x.astype(np.float32).reshape(m, k // group, group)
    e = (np.abs(g).max(axis=-1, keepdims=True) / np.float32(127 * 65536)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(e > 0, np.float32(1) / e, np.float32(0)).astype(np.float32)
    t = np.clip(np.rint((g * inv).astype(np.float32)), -127 * 65536, 127 * 65536)
    return (e.astype(np.float64) * t).reshape(m, k)


def reference_product(x: np.ndarray, packed: dict[str, np.ndarray], din: int, dout: int,
                      split: bool) -> np.ndarray:
    """What the packed kernel computes, in float64: ``x . W^T`` for x [M, din] float32 and a
    packed weight (:func:`pack_weight`'s dict) of ``dout`` features -> [M, dout]. With
    ``split`` (the kernel's int8 path) the weight is ``scale * (q - c) + (min + c * scale)``
    (c = 8 for 4-bit q, 0 for 8-bit): the centred integer part meets
    :func:`split_activations` of x and the offset part x itself, as the kernel sums them;
    else the whole weight meets x."""
    blocks, scale, offset = packed["blocks"], packed["block_scale"], packed["block_min"]
    group = din // scale.shape[1]
    rows = lambda a: np.repeat(a.transpose(0, 2, 1).reshape(-1, a.shape[1])[:dout], group,
                               1).astype(np.float64)
    q = integers(blocks, din, np).transpose(0, 2, 1).reshape(-1, din)[:dout]
    x64 = x.astype(np.float64)
    if not split:
        return x64 @ (rows(scale) * q + rows(offset)).T
    c = 8.0 if blocks.dtype == np.uint8 else 0.0
    return (split_activations(x, group) @ (rows(scale) * (q - c)).T
            + x64 @ (rows(offset) + c * rows(scale)).T)
