"""RMSNorm.

Reference: Zhang & Sennrich, "Root Mean Square Layer Normalization" (2019); computed as
Hugging Face transformers' ``LlamaRMSNorm`` does: statistics in float32, the result cast
back to the input dtype before the learned scale is applied.
"""

import jax.numpy as jnp
from flax import nnx


class RMSNorm(nnx.Module):
    """RMSNorm over the last axis.

    Args:
        dim: feature width H.
        eps: added to the mean square before the square root.
        dtype: dtype of the learned ``weight`` [H] (initialised to ones).
    """

    def __init__(self, dim: int, eps: float, dtype=jnp.float32):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        """x: [..., H] -> [..., H], same dtype."""
        xf = x.astype(jnp.float32)
        xf = xf * jnp.reciprocal(jnp.sqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps))
        return self.weight[...] * xf.astype(x.dtype)
