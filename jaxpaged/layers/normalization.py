"""RMSNorm.

Reference: Zhang & Sennrich, "Root Mean Square Layer Normalization" (2019); computed as
Hugging Face transformers' ``LlamaRMSNorm`` does (statistics in float32, the result cast back
to the input dtype before the learned scale is applied) or, with ``unit_offset``, as its
``Gemma2RMSNorm`` does (scale ``1 + weight``, applied in float32 before the cast).
"""

import jax.numpy as jnp
from flax import nnx


class RMSNorm(nnx.Module):
    """RMSNorm over the last axis.

    Args:
        dim: feature width H.
        eps: added to the mean square before the square root.
        dtype: dtype of the learned ``weight`` [H] (initialised to the identity scale).
        unit_offset: the scale is ``1 + weight`` (Gemma) instead of ``weight``.
    """

    def __init__(self, dim: int, eps: float, dtype=jnp.float32, unit_offset: bool = False):
        self.weight = nnx.Param((jnp.zeros if unit_offset else jnp.ones)((dim,), dtype))
        self.eps = eps
        self.unit_offset = unit_offset

    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        """x: [..., H] -> [..., H], same dtype."""
        xf = x.astype(jnp.float32)
        xf = xf * jnp.reciprocal(jnp.sqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps))
        if self.unit_offset:
            return (xf * (1.0 + self.weight[...].astype(jnp.float32))).astype(x.dtype)
        return self.weight[...] * xf.astype(x.dtype)
