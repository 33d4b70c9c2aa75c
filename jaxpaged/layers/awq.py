"""4-bit weights in AutoAWQ's layout (``--quantization awq``), dequantized inside the matmul.

AWQ (Lin et al., "AWQ: Activation-aware Weight Quantization for LLM Compression and
Acceleration", MLSys 2024) stores a kernel ``W`` [in, out] as unsigned 4-bit values ``q`` with,
for each group of ``group_size`` consecutive input rows and each output column, a float scale
``s`` and a 4-bit zero point ``z``: ``W[k, n] = (q[k, n] - z[k // G, n]) * s[k // G, n]``.
AutoAWQ's GEMM format (what vLLM's ``awq`` method reads) packs eight 4-bit values into one
int32 along the output axis, in the interleaved order :data:`AWQ_PACK_ORDER`: nibble ``i``
(bits ``4i .. 4i+3``) of packed column ``c`` holds output column ``8c + AWQ_PACK_ORDER[i]``.
The checkpoint tensors of a projection ``p`` are

- ``p.qweight``: int32 [in, out / 8], the packed ``q``;
- ``p.qzeros``: int32 [in / G, out / 8], the packed ``z``;
- ``p.scales``: float16 [in / G, out].

:class:`AWQLinear` keeps them packed on the device (0.5 byte per weight plus 1/G of a scale and
a zero) and unpacks and dequantizes them in the jitted step: on a GPU inside the Pallas kernel
``pallas_kernels.int4_matmul`` (one group of packed rows at a time, in registers), elsewhere
right before an XLA ``x @ W``; nothing but the packed form is stored.
A float checkpoint (or ``--load-format dummy``) loaded with ``--quantization awq`` is quantized
round-to-nearest into the same layout (AWQ's asymmetric min/max quantizer, without its
activation-aware scale search): ``s = (max - min) / 15``, ``z = round(-min / s)``,
``q = clip(round(W / s) + z, 0, 15)`` per group and column.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pallas_kernels.int4_matmul import int4_matmul

#: Output column (within eight) held by each nibble of a packed int32, lowest nibble first
#: (AutoAWQ's ``AWQ_ORDER``; vLLM's ``awq_triton.py`` undoes it the same way).
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
#: Right shift that brings output column j (within eight) to the low nibble.
_SHIFTS = tuple(4 * AWQ_PACK_ORDER.index(j) for j in range(8))
#: The group size of ``--quantization awq`` on a float checkpoint (AutoAWQ's default).
DEFAULT_GROUP_SIZE = 128


def unpack_int4(packed, xp=jnp):
    """[..., n / 8] int32 packed in :data:`AWQ_PACK_ORDER` -> [..., n] int32 in [0, 15]."""
    shifts = xp.asarray(_SHIFTS, dtype=xp.int32)
    values = (packed[..., None] >> shifts) & 0xF
    return values.reshape(*packed.shape[:-1], packed.shape[-1] * 8)


def pack_int4(values, xp=np):
    """[..., n] integers in [0, 15] -> [..., n / 8] int32 in :data:`AWQ_PACK_ORDER`."""
    v = values.astype(xp.uint32).reshape(*values.shape[:-1], values.shape[-1] // 8, 8)
    packed = sum(v[..., col] << (4 * i) for i, col in enumerate(AWQ_PACK_ORDER))
    if xp is np:
        return packed.astype(np.uint32).view(np.int32)
    return jax.lax.bitcast_convert_type(packed.astype(jnp.uint32), jnp.int32)


def dequantize_awq(qweight, qzeros, scales, xp=jnp):
    """``(q - z) * s`` as float32 [in, out] from the packed tensors (module docstring)."""
    group = qweight.shape[0] // qzeros.shape[0]
    q = unpack_int4(qweight, xp).astype(xp.float32)
    z = xp.repeat(unpack_int4(qzeros, xp).astype(xp.float32), group, axis=0)
    s = xp.repeat(scales.astype(xp.float32), group, axis=0)
    return (q - z) * s


def quantize_awq(weight, group_size: int, xp=np):
    """Round-to-nearest 4-bit AWQ quantization of a float kernel.

    Args:
        weight: [in, out] float (computed in float32); ``in`` a multiple of ``group_size``,
            ``out`` a multiple of 8.
        group_size: input rows sharing one scale and zero point.
        xp: ``numpy`` (the loader) or ``jax.numpy`` (dummy weights, inside jit).

    Returns:
        (qweight [in, out/8] int32, qzeros [in/G, out/8] int32, scales [in/G, out] float32);
        each weight is reproduced within half a step (``s / 2``) when 0 lies in its group's
        range, which min/max quantization guarantees unless all weights share a sign. A
        constant group gets scale 1.
    """
    din, dout = weight.shape
    w = weight.astype(xp.float32).reshape(din // group_size, group_size, dout)
    hi, lo = w.max(axis=1), w.min(axis=1)
    # A product, not a quotient: XLA turns division by a constant into it, so numpy (the
    # loader) and jit (dummy weights) agree bit for bit.
    scales = xp.where(hi > lo, (hi - lo) * (1.0 / 15.0), 1.0).astype(xp.float32)
    zeros = xp.clip(xp.round(-lo / scales), 0, 15)
    q = xp.clip(xp.round(w / scales[:, None]) + zeros[:, None], 0, 15).reshape(din, dout)
    return pack_int4(q, xp), pack_int4(zeros, xp), scales


def use_pallas_kernel(out_features: int, group_size: int) -> bool:
    """Whether :class:`AWQLinear` runs ``pallas_kernels.int4_matmul`` (on a GPU, for widths
    its tiles fit) rather than XLA's dequantize-then-matmul."""
    return (jax.default_backend() == "gpu" and out_features % 128 == 0
            and group_size >= 16 and group_size & (group_size - 1) == 0)


class AWQLinear(nnx.Module):
    """A [in] -> [out] projection with 4-bit AWQ weights, dequantized inside the matmul.

    Computes ``x @ dequantize_awq(qweight, qzeros, scales).astype(x.dtype) + bias`` in ``x``'s
    dtype (the dequantized weights are exact in float32; in bfloat16 they are rounded once).

    Attributes:
        qweight: [in, out / 8] int32; qzeros: [in / G, out / 8] int32; scales: [in / G, out]
            float32 (a checkpoint's float16 scales convert exactly).
        bias: [out] of the model dtype, or None.

    Args:
        din, dout: input and output widths (``din`` a multiple of ``group_size``, ``dout`` of 8).
        bias: whether the projection has a bias.
        dtype: the model dtype (of ``bias``).
        group_size: input rows per scale and zero point.
        rngs: draws N(0, 0.02) float weights, quantized by :func:`quantize_awq` (what
            ``--load-format dummy`` keeps; a checkpoint load replaces them).

    Raises:
        ValueError: widths the layout cannot hold.
    """

    def __init__(self, din: int, dout: int, bias: bool, dtype, group_size: int,
                 rngs: nnx.Rngs):
        if din % group_size or dout % 8:
            raise ValueError(f"AWQ needs in_features ({din}) divisible by the group size "
                             f"({group_size}) and out_features ({dout}) by 8")
        # Drawn as a float Linear's [out, in] weight, so dummy weights are its quantized ones.
        weight = nnx.initializers.normal(0.02)(rngs.params(), (dout, din), jnp.float32).T
        qweight, qzeros, scales = quantize_awq(weight, group_size, xp=jnp)
        self.qweight = nnx.Param(qweight)
        self.qzeros = nnx.Param(qzeros)
        self.scales = nnx.Param(scales)
        self.bias = nnx.Param(jnp.zeros((dout,), dtype)) if bias else nnx.data(None)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [..., in] -> [..., out] of x's dtype."""
        qweight, qzeros, scales = self.qweight[...], self.qzeros[...], self.scales[...]
        if use_pallas_kernel(scales.shape[1], qweight.shape[0] // qzeros.shape[0]):
            y = int4_matmul(x.reshape(-1, x.shape[-1]), qweight, qzeros, scales)
            y = y.reshape(*x.shape[:-1], -1)
        else:
            y = x @ dequantize_awq(qweight, qzeros, scales).astype(x.dtype)
        if self.bias is not None:
            y = y + self.bias[...]
        return y.astype(x.dtype)
