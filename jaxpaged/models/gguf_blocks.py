"""ggml's block quantizations read as integers with a float32 scale and offset per group.

Every block type jaxpaged keeps packed (:data:`PACKABLE_TYPES`) stores, for each group of G
consecutive weights of a row (G = 32, or 16 for Q6_K), integers ``q`` and numbers from which
the weights are ``w = scale * q + min``:

| type | bits of q | G | scale | min | bytes per 256 weights (ggml) |
|---|---|---|---|---|---|
| Q4_0 | 4 (0..15) | 32 | d | -8 d | 144 |
| Q4_1 | 4 (0..15) | 32 | d | m | 160 |
| Q8_0 | 8 (-128..127) | 32 | d | 0 | 272 |
| Q4_K | 4 (0..15) | 32 | d * sc_j | -dmin * m_j | 144 |
| Q5_K | 5 (0..31), kept in 8 | 32 | d * sc_j | -dmin * m_j | 176 |
| Q6_K | 6 (-32..31), kept in 8 | 16 | d * sc_j | 0 | 210 |

(``d``, ``m``, ``dmin`` are float16; ``sc_j``, ``m_j`` the 6-bit or int8 sub-block scales.)
The layouts are ggml's (``ggml-common.h``, ``block_q4_0`` ... ``block_q6_K``) as the ``gguf``
package's reference dequantizers read them (``gguf.quants``); the scale/min unpacking of the
K-quants is that package's ``Q4_K.get_scale_min``.

Exactness: ``scale`` is a float16 times an integer of at most 8 bits (at most 19 significant
bits) and ``scale * q`` at most 24 significant bits, so both are exact in float32 and
``scale * q + min`` is rounded once, like the reference's ``d * q + m`` / ``d * q - dm``:
weights rebuilt from these parts equal ``gguf.quants.dequantize`` bit for bit (tested).
"""

from __future__ import annotations

import numpy as np

#: ggml types that decode into (q, scale, min), and each one's bits of q as stored by
#: :mod:`jaxpaged.layers.packed_linear` (4 or 8) and group size.
PACKABLE_TYPES = {"Q4_0": (4, 32), "Q4_1": (4, 32), "Q8_0": (8, 32), "Q4_K": (4, 32),
                  "Q5_K": (8, 32), "Q6_K": (8, 16)}
#: Bytes of one ggml block and the weights it holds.
_BLOCK = {"Q4_0": (18, 32), "Q4_1": (20, 32), "Q8_0": (34, 32), "Q4_K": (144, 256),
          "Q5_K": (176, 256), "Q6_K": (210, 256)}


def _f16(raw: np.ndarray) -> np.ndarray:
    """[..., 2] bytes -> [...] float32 (little-endian float16)."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(raw: np.ndarray, chunk: int) -> np.ndarray:
    """[..., n * chunk] bytes -> [..., 2n, chunk] (each chunk's low nibbles, then its high)."""
    r = raw.reshape(*raw.shape[:-1], -1, 1, chunk) >> np.array([0, 4], np.uint8)[:, None]
    return (r & 0x0F).reshape(*raw.shape[:-1], -1, chunk)


def decode_blocks(data: np.ndarray, type_name: str, cols: int
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split a quantized tensor into integers and per-group scales and offsets.

    Args:
        data: [rows, bytes per row] uint8, the tensor as ``jaxpaged.gguf_file`` maps it.
        type_name: one of :data:`PACKABLE_TYPES`.
        cols: weights per row (the input width).

    Returns:
        (q [rows, cols] uint8 for 4-bit types or int8, scale [rows, cols / G] float32,
        min [rows, cols / G] float32).

    Raises:
        ValueError: a type outside :data:`PACKABLE_TYPES`, or bytes that do not hold
            ``cols`` weights per row.
    """
    if type_name not in PACKABLE_TYPES:
        raise ValueError(f"ggml type {type_name} does not decode into blocks; packable: "
                         f"{list(PACKABLE_TYPES)}")
    size, per_block = _BLOCK[type_name]
    rows = data.shape[0]
    if cols % per_block or data.reshape(rows, -1).shape[1] != cols // per_block * size:
        raise ValueError(f"{type_name} tensor of {data.reshape(rows, -1).shape[1]} bytes a row "
                         f"does not hold {cols} weights a row")
    b = data.reshape(rows, cols // per_block, size)
    if type_name in ("Q4_0", "Q4_1"):
        d = _f16(b[..., 0:2])
        offset = -8.0 * d if type_name == "Q4_0" else _f16(b[..., 2:4])
        q = _nibbles(b[..., 2 if type_name == "Q4_0" else 4:], 16).reshape(rows, -1, 32)
        scale, mn = d[..., None], offset[..., None]
    elif type_name == "Q8_0":
        scale, mn = _f16(b[..., 0:2])[..., None], np.zeros((rows, b.shape[1], 1), np.float32)
        q = b[..., 2:].view(np.int8)
    elif type_name in ("Q4_K", "Q5_K"):
        import gguf

        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        sc, m = gguf.quants.Q4_K.get_scale_min(b[..., 4:16].reshape(-1, 12))
        scale = d[..., None] * sc.reshape(rows, -1, 8).astype(np.float32)
        mn = -(dmin[..., None] * m.reshape(rows, -1, 8).astype(np.float32))
        if type_name == "Q4_K":
            q = _nibbles(b[..., 16:], 32)                                  # [rows, nb, 8, 32]
        else:
            high = (b[..., 16:48, None] >> np.arange(8, dtype=np.uint8)) & 1  # [.., 32, 8]
            q = (_nibbles(b[..., 48:], 32) | (high.swapaxes(-1, -2) << 4)).view(np.int8)
    else:  # Q6_K
        low = _nibbles(b[..., :128], 64).reshape(rows, -1, 8, 32)
        high = (b[..., 128:192].reshape(rows, -1, 2, 1, 32)
                >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3
        q = ((low | (high.reshape(rows, -1, 8, 32) << 4)).view(np.int8) - np.int8(32))
        scale = _f16(b[..., 208:210])[..., None] * b[..., 192:208].view(np.int8).astype(
            np.float32)
        mn = np.zeros_like(scale)
    groups = cols // PACKABLE_TYPES[type_name][1]
    q = q.reshape(rows, cols)
    if PACKABLE_TYPES[type_name][0] == 4:
        q = q.astype(np.uint8)
    return (q, np.ascontiguousarray(scale, np.float32).reshape(rows, groups),
            np.ascontiguousarray(mn, np.float32).reshape(rows, groups))
