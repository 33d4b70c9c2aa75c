"""Linear projections of the decoder layers.

Every dense projection of every model family is built by :func:`linear`, so that checkpoint
naming (``nnx.Linear``'s ``kernel`` [in, out] is torch's ``weight`` [out, in] transposed) and
tensor-parallel sharding rules (keyed by the module's name) hold for all of them.
"""

from __future__ import annotations

from flax import nnx

from jaxpaged.layers.awq import DEFAULT_GROUP_SIZE, AWQLinear
from jaxpaged.layers.quantization import QuantizedLinear


def linear(din: int, dout: int, bias: bool, dtype, rngs: nnx.Rngs,
           quantization: str | None = None, group_size: int = DEFAULT_GROUP_SIZE
           ) -> nnx.Linear | QuantizedLinear | AWQLinear:
    """A [din] -> [dout] projection with ``kernel`` [din, dout] (and ``bias`` [dout]) of
    ``dtype``, initialised N(0, 0.02) (used only by ``--load-format dummy``).

    With ``quantization`` (``"int8"`` or ``"fp8"``) it is a :class:`QuantizedLinear` instead:
    an 8-bit ``kernel`` [din, dout] with a float32 ``scale`` [dout] (bias still of ``dtype``);
    with ``"awq"`` an :class:`AWQLinear` of ``group_size`` (packed 4-bit ``qweight``,
    ``qzeros`` and ``scales``).

    Raises:
        ValueError: unknown ``quantization``; AWQ widths that do not fit ``group_size``.
    """
    if quantization == "awq":
        return AWQLinear(din, dout, bias, dtype, group_size, rngs)
    if quantization is not None:
        return QuantizedLinear(din, dout, bias, dtype, quantization, rngs)
    return nnx.Linear(din, dout, use_bias=bias, dtype=dtype, param_dtype=dtype, rngs=rngs,
                      kernel_init=nnx.initializers.normal(0.02))
