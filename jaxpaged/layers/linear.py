"""Linear projections of the decoder layers.

Every dense projection of every model family is built by :func:`linear`, so that checkpoint
naming and tensor-parallel sharding rules (keyed by the module's name and leaf) hold for all
of them. A float projection is a :class:`Linear`, whose ``weight`` keeps torch's ``[out, in]``
layout: checkpoints load without a transpose, and XLA:CPU's matmuls contract both operands
on their last, contiguous dimension (faster: :class:`Linear`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpaged.layers import cpu_matmul
from jaxpaged.layers.awq import DEFAULT_GROUP_SIZE, AWQLinear
from jaxpaged.layers.packed_linear import PackedLinear
from jaxpaged.layers.quantization import QuantizedLinear


class Linear(nnx.Module):
    """``y = x . weight^T + bias``: a [din] -> [dout] projection with ``weight`` [dout, din]
    (torch's ``nn.Linear`` layout and checkpoint name) and optional ``bias`` [dout], both of
    ``dtype``; inputs are cast to ``dtype`` and the matmul accumulates in it.

    Why not ``nnx.Linear`` (``kernel`` [din, dout]): XLA:CPU's YNNPACK dots ran faster with
    the weight as [dout, din], W1's decode and prefill steps included
    (``docs/measurements.md``, "Linear").

    Args:
        din, dout: input and output widths.
        bias: whether to add ``bias`` (initialised to zeros).
        dtype: parameter and compute dtype.
        rngs: draws ``weight`` from N(0, 0.02) (used only by ``--load-format dummy``).
    """

    def __init__(self, din: int, dout: int, bias: bool, dtype, rngs: nnx.Rngs):
        self.dtype = dtype
        self.weight = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (dout, din), dtype))
        self.bias = nnx.Param(jnp.zeros((dout,), dtype)) if bias else nnx.data(None)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [..., din] -> [..., dout] in ``dtype`` (few float32 rows inside
        :func:`~jaxpaged.layers.cpu_matmul.small_rows_matmuls` through the C++ kernel)."""
        x = x.astype(self.dtype)
        if cpu_matmul.applies(math.prod(x.shape[:-1]), self.dtype):
            y = cpu_matmul.small_rows_matmul(x, self.weight[...])
        else:
            y = jax.lax.dot_general(x, self.weight[...], (((x.ndim - 1,), (1,)), ((), ())))
        return y if self.bias is None else y + self.bias[...]


def linear(din: int, dout: int, bias: bool, dtype, rngs: nnx.Rngs,
           quantization: str | None = None, group_size: int = DEFAULT_GROUP_SIZE
           ) -> Linear | QuantizedLinear | AWQLinear | PackedLinear:
    """A [din] -> [dout] projection of ``dtype``: a :class:`Linear` (``weight`` [dout, din],
    ``bias`` [dout]).

    With ``quantization`` (``"int8"`` or ``"fp8"``) it is a :class:`QuantizedLinear` instead:
    an 8-bit ``kernel`` [din, dout] with a float32 ``scale`` [dout] (bias still of ``dtype``);
    with ``"awq"`` an :class:`AWQLinear` of ``group_size`` (packed 4-bit ``qweight``,
    ``qzeros`` and ``scales``); with ``"gguf"`` a
    :class:`~jaxpaged.layers.packed_linear.PackedLinear` (a GGUF tensor's blocks as stored).

    Raises:
        ValueError: unknown ``quantization``; AWQ widths that do not fit ``group_size``.
    """
    if quantization == "awq":
        return AWQLinear(din, dout, bias, dtype, group_size, rngs)
    if quantization == "gguf":
        return PackedLinear(din, dout, bias, dtype, rngs)
    if quantization is not None:
        return QuantizedLinear(din, dout, bias, dtype, quantization, rngs)
    return Linear(din, dout, bias, dtype, rngs)
