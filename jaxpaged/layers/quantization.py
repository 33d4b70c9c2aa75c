"""Weight-only 8-bit quantization of the dense projections (``--quantization int8|fp8``).

Each output channel j of a kernel ``W`` [in, out] is stored as ``q[:, j] = W[:, j] / s[j]`` in
8 bits, with one float32 scale ``s[j] = max_i |W[i, j]| / qmax`` (symmetric, per output
channel); the layer computes ``(x @ q) * s``, so activations keep the model's dtype and only
the weights shrink (4x against float32, 2x against bfloat16).

- ``int8``: ``qmax = 127``, round to nearest, clip to [-127, 127]. This is the absmax
  "vector-wise" weight quantization of LLM.int8() (Dettmers et al., "LLM.int8(): 8-bit Matrix
  Multiplication for Transformers at Scale", 2022, section 3), one scale per output column,
  here without its activation quantization and outlier decomposition.
- ``fp8``: the E4M3 format of Micikevicius et al., "FP8 Formats for Deep Learning" (2022)
  (``float8_e4m3fn``: 4 exponent and 3 mantissa bits, largest finite value 448, no infinities),
  ``qmax = 448``, cast with round-to-nearest-even. vLLM runs fp8 checkpoints the same way
  (weight-only, its FP8 Marlin path) on GPUs without fp8 tensor cores.

Quantization happens on the host at load time (numpy and ml_dtypes), one tensor at a time, so
the device never holds the float weights; ``--load-format dummy`` quantizes its random
weights on the device, in the same jitted initialisation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpaged.config import QUANTIZATION_METHODS

#: Storage dtype of each method's kernels (numpy dtypes; ml_dtypes' for fp8).
QUANTIZED_DTYPES = {"int8": np.dtype(jnp.int8), "fp8": np.dtype(jnp.float8_e4m3fn)}
#: Largest magnitude each storage dtype holds.
_QMAX = {"int8": 127.0, "fp8": 448.0}


def _check_method(method: str) -> None:
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"unknown quantization method {method!r}; "
                         f"choose from {list(QUANTIZATION_METHODS)}")


def quantize_weight(weight, method: str, xp=np):
    """Quantize a kernel per output channel (symmetric).

    Args:
        weight: [..., in, out] float kernel (any float dtype; computed in float32); leading
            axes (e.g. experts) are batch axes, each with its own scales.
        method: ``"int8"`` or ``"fp8"``.
        xp: ``numpy`` for host arrays (the loader) or ``jax.numpy`` inside jit (dummy weights).

    Returns:
        (kernel [..., in, out] of ``QUANTIZED_DTYPES[method]``, scale [..., out] float32), with
        ``kernel * scale`` approximating ``weight``: per channel, the error is at most half a
        step (``scale / 2``) for int8 and 2**-4 of the value (or 2**-10 of ``scale`` below
        E4M3's normal range) for fp8. An all-zero channel gets scale 1 and zero weights.

    Raises:
        ValueError: unknown ``method``.
    """
    _check_method(method)
    qmax = _QMAX[method]
    weight = weight.astype(xp.float32)
    amax = xp.max(xp.abs(weight), axis=-2)
    # A product, not a quotient: XLA turns division by a constant into this product, so
    # numpy (the loader) and jit (dummy weights) agree bit for bit.
    scale = xp.where(amax > 0, amax * (1.0 / qmax), 1.0).astype(xp.float32)
    q = xp.clip(weight / scale[..., None, :], -qmax, qmax)
    if method == "int8":
        q = xp.round(q)
    return q.astype(QUANTIZED_DTYPES[method]), scale


def per_channel_scale(weight_scale: np.ndarray, out_features: int) -> np.ndarray:
    """A pre-quantized checkpoint's ``weight_scale`` as one float32 scale per output channel.

    Args:
        weight_scale: one value (per-tensor: shape [], [1] or [1, 1]) or ``out_features``
            values (per-channel: [out] or [out, 1]).
        out_features: the layer's output width.

    Returns:
        [out_features] float32.

    Raises:
        ValueError: any other size (e.g. block-wise scales), or a value that is NaN,
            infinite or negative (a corrupt checkpoint; 0 is kept: an all-zero channel).
    """
    flat = np.asarray(weight_scale, np.float32).reshape(-1)
    if flat.size not in (1, out_features):
        raise ValueError(f"weight_scale of shape {list(np.shape(weight_scale))} is neither "
                         f"per-tensor nor per-channel for {out_features} output features")
    bad = ~(np.isfinite(flat) & (flat >= 0))
    if bad.any():
        raise ValueError(f"weight_scale holds {int(bad.sum())} value(s) that are NaN, infinite "
                         f"or negative (e.g. {flat[bad][0]}); the checkpoint is corrupt")
    return np.broadcast_to(flat, (out_features,)).copy()


class QuantizedLinear(nnx.Module):
    """A [in] -> [out] projection with 8-bit weights and per-output-channel float32 scales.

    Computes ``(x @ kernel.astype(x.dtype)) * scale + bias`` and returns it in ``x``'s dtype:
    weight-only quantization, activations stay in the model dtype. The cast is exact for
    float32 and bfloat16 (every int8 and E4M3 value is representable in both), so the result
    is, up to rounding, the float matmul with the dequantized weights ``kernel * scale``.

    Attributes:
        kernel: [in, out] int8 or float8_e4m3fn (``QUANTIZED_DTYPES[method]``).
        scale: [out] float32.
        bias: [out] of the model dtype, or None.

    Args:
        din, dout: input and output widths.
        bias: whether the projection has a bias (zeros until loaded).
        dtype: the model dtype (of ``bias``).
        method: ``"int8"`` or ``"fp8"``.
        rngs: draws the initial float weights, N(0, 0.02), which are then quantized (what
            ``--load-format dummy`` keeps; a checkpoint load replaces them).

    Raises:
        ValueError: unknown ``method``.
    """

    def __init__(self, din: int, dout: int, bias: bool, dtype, method: str, rngs: nnx.Rngs):
        # Drawn as a float Linear's [out, in] weight, so dummy weights are its quantized ones.
        weight = nnx.initializers.normal(0.02)(rngs.params(), (dout, din), jnp.float32).T
        kernel, scale = quantize_weight(weight, method, xp=jnp)
        self.kernel = nnx.Param(kernel)
        self.scale = nnx.Param(scale)
        self.bias = nnx.Param(jnp.zeros((dout,), dtype)) if bias else nnx.data(None)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [..., in] -> [..., out] of x's dtype."""
        y = (x @ self.kernel[...].astype(x.dtype)) * self.scale[...]
        if self.bias is not None:
            y = y + self.bias[...]
        return y.astype(x.dtype)
