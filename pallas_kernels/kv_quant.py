"""How K and V are stored in a pool of a given dtype: one rule, shared by kernels and references.

A pool holds ``K / k_scale`` (and ``V / v_scale``) rounded to its dtype; a reader recovers
``K ≈ stored * k_scale``. ``k_scale`` and ``v_scale`` are per-layer, per-tensor floats (vLLM's
``k_scale`` / ``v_scale``); with a scale of 1.0 a pool of the model's dtype holds K itself and
nothing is multiplied, so the 16/32-bit paths are unchanged bit for bit.

The fp8 KV cache stores ``float8_e4m3fn`` (vLLM's ``--kv-cache-dtype fp8`` / ``fp8_e4m3``):
1 sign, 4 exponent and 3 mantissa bits, exponent bias 7, no infinities, one NaN pattern per
sign (Micikevicius et al., "FP8 Formats for Deep Learning", 2022, section 3). Its largest
finite value is 448, its smallest normal 2**-6 and its smallest subnormal 2**-9. A normal value
is rounded to within 2**-4 of itself, relatively (half of its 3-bit mantissa's step);
subnormals keep an absolute error of at most 2**-10. Converting a value above 448 to e4m3fn
gives NaN, so quantization saturates to ±448 first: an overflowing key or value is clipped to
the largest representable one, never turned into NaN or infinity (vLLM's CUDA cache writes
convert with saturation to finite values the same way).

The scale trades range for resolution of small values: with ``k_scale = 1`` values below
2**-6 lose relative precision (subnormals) and values above 448 saturate. vLLM uses 1.0 unless
a quantized checkpoint ships scales or ``--calculate-kv-scales`` derives them from a first
batch (``jaxpaged.runner.kv_scales``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

#: The fp8 format of the fp8 KV cache.
FP8_DTYPE = jnp.float8_e4m3fn
#: Largest finite e4m3fn value; quantization saturates to ±FP8_E4M3_MAX.
FP8_E4M3_MAX = float(jnp.finfo(FP8_DTYPE).max)


def is_fp8(dtype) -> bool:
    """True for the fp8 KV-cache dtype (``float8_e4m3fn``)."""
    return jnp.dtype(dtype) == jnp.dtype(FP8_DTYPE)


def quantize_kv(x: jax.Array, scale: float, dtype) -> jax.Array:
    """Rows to store in a pool of ``dtype``: ``x / scale``, saturated to ±448 for fp8.

    Plain jnp, so the Pallas write kernel calls it on its tiles too (one rule for kernel and
    reference).

    Args:
        x: keys or values, any float dtype and shape.
        scale: the layer's per-tensor scale (> 0; static).
        dtype: the pool's dtype.

    Returns:
        ``x``'s shape in ``dtype``. Divides in float32 when scaling or converting to fp8
        (round to nearest even); with ``scale == 1`` and a non-fp8 dtype it is a plain cast.
    """
    if scale == 1.0 and not is_fp8(dtype):
        return x.astype(dtype)
    y = x.astype(jnp.float32)
    if scale != 1.0:
        y = y / scale
    if is_fp8(dtype):
        y = jnp.clip(y, -FP8_E4M3_MAX, FP8_E4M3_MAX)
    return y.astype(dtype)


def dequantize_kv(stored: jax.Array, scale: float, dtype) -> jax.Array:
    """``stored * scale`` in ``dtype`` (the compute dtype), multiplied in float32.

    The references use it to read a pool literally; the kernels instead convert a tile to the
    compute dtype (exact from e4m3) and fold ``k_scale`` into the softmax scale and
    ``v_scale`` into the normalised output, which is the same product up to float rounding
    and costs one multiply per score or output element instead of one per K/V element.
    """
    if scale == 1.0:
        return stored.astype(dtype)
    return (stored.astype(jnp.float32) * scale).astype(dtype)


def is_half_under_float32(q_dtype, pool_dtype) -> bool:
    """A float16 pool under float32 queries (``--kv-cache-dtype float16``): read exactly into
    float32, the one narrower float pool besides fp8."""
    return jnp.dtype(q_dtype) == jnp.float32 and jnp.dtype(pool_dtype) == jnp.float16


def check_pool_dtypes(q_dtype, k_dtype, v_dtype) -> None:
    """A pool must be in q's dtype, fp8, or float16 under float32 queries
    (:func:`is_half_under_float32`), K and V alike.

    Raises:
        ValueError: naming the three dtypes.
    """
    k_dtype, v_dtype, q_dtype = jnp.dtype(k_dtype), jnp.dtype(v_dtype), jnp.dtype(q_dtype)
    if k_dtype != v_dtype or not (k_dtype == q_dtype or is_fp8(k_dtype)
                                  or is_half_under_float32(q_dtype, k_dtype)):
        raise ValueError(f"k_pages and v_pages must share a dtype, q's, float8_e4m3fn (an fp8 "
                         f"KV cache) or float16 under float32 q; got q {q_dtype}, k_pages "
                         f"{k_dtype}, v_pages {v_dtype}")
